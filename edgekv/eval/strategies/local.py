"""Strategies with no KV from the cloud side: each model prefills the whole prompt itself (timed from the start,
so TTFT includes the system prompt)."""

from __future__ import annotations

import time

from edgekv.eval.datasets import truncate_prompt
from edgekv.eval.strategies.base import Answering, Strategy, register_strategy
from edgekv.serve.session import EdgeSession


@register_strategy
class CloudOnly(Strategy):
    """The cloud answers: the whole prompt goes up, tokens come down (modelled link time added)."""

    base = "cloud-only"

    def model(self, runner):
        return runner.cloud

    def answering(self, runner, req):
        start = time.perf_counter()
        session = EdgeSession(runner.cloud, None, system_prompt=req.system)
        built = time.perf_counter() - start
        network_s = runner.link.seconds(len(req.user.encode())) + runner.cfg.latency_ms / 1e3
        return Answering(session, runner.cloud, built, [("system", req.system), ("user", req.user)],
                         network_s=network_s, answer_down=True)


@register_strategy
class EdgeOnly(Strategy):
    """The edge alone on the whole prompt."""

    base = "edge-only"

    def answering(self, runner, req):
        start = time.perf_counter()
        session = EdgeSession(runner.edge, None, system_prompt=req.system)
        return Answering(session, runner.edge, time.perf_counter() - start)


@register_strategy
class EdgeNaive(Strategy):
    """CE-LSLM's naive edge-only baseline: the edge alone on what of the system prompt fits `context_budget`."""

    base = "edge-naive"

    def answering(self, runner, req):
        system = truncate_prompt(runner.edge.tokenizer, req.system, runner.cfg.context_budget, runner.cfg.naive_keep)
        start = time.perf_counter()
        session = EdgeSession(runner.edge, None, system_prompt=system)
        return Answering(session, runner.edge, time.perf_counter() - start)
