"""Strategies with no KV from the cloud side: each model prefills the whole prompt itself (timed from the start,
so TTFT includes the system prompt), or (`*-nosys`, references) reads the user prompt alone."""

from __future__ import annotations

import time

from edgekv.eval.datasets import truncate_prompt
from edgekv.eval.strategies.base import Answering, Strategy, register_strategy
from edgekv.serve.session import EdgeSession


@register_strategy
class CloudOnly(Strategy):
    """The cloud answers: the whole prompt goes up, tokens come down (modelled link time added)."""

    base = "cloud-only"

    def model(self, a):
        return a.cloud

    def answering(self, a, req):
        start = time.perf_counter()
        session = EdgeSession(a.cloud, None, system_prompt=req.system)
        built = time.perf_counter() - start
        network_s = a.link.seconds(len(req.user.encode())) + a.cfg.latency_ms / 1e3
        return Answering(session, a.cloud, built, [("system", req.system), ("user", req.user)],
                         network_s=network_s, answer_down=True)


@register_strategy
class EdgeOnly(Strategy):
    """The edge alone on the whole prompt."""

    base = "edge-only"

    def answering(self, a, req):
        start = time.perf_counter()
        session = EdgeSession(a.edge, None, system_prompt=req.system)
        return Answering(session, a.edge, time.perf_counter() - start)


@register_strategy
class EdgeNaive(Strategy):
    """CE-LSLM's naive edge-only baseline: the edge alone on what of the system prompt fits `context_budget`."""

    base = "edge-naive"

    def answering(self, a, req):
        system = truncate_prompt(a.edge.tokenizer, req.system, a.cfg.context_budget, a.cfg.naive_keep)
        start = time.perf_counter()
        session = EdgeSession(a.edge, None, system_prompt=system)
        return Answering(session, a.edge, time.perf_counter() - start)


@register_strategy
class CloudNoSystem(Strategy):
    """The cloud reading the user prompt alone (no system prompt): one end of the decomposition of the cloud's lead
    into what it reads in the prompt and what it knows anyway (a reference, never shipped)."""

    base = "cloud-nosys"

    def model(self, a):
        return a.cloud

    def answering(self, a, req):
        start = time.perf_counter()
        session = EdgeSession(a.cloud, None, system_prompt="")
        return Answering(session, a.cloud, time.perf_counter() - start, [("user", req.user)])


@register_strategy
class EdgeNoSystem(Strategy):
    """The edge reading the user prompt alone (no system prompt): the decomposition's edge end."""

    base = "edge-nosys"

    def answering(self, a, req):
        start = time.perf_counter()
        session = EdgeSession(a.edge, None, system_prompt="")
        return Answering(session, a.edge, time.perf_counter() - start)
