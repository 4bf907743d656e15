"""Network conditions: the cold-TTFT model of each strategy on a link, a profile of the edge's costs it needs, and
the planner that picks how to ship a system prompt (split layer, ThinK ratio, codec) for a link and a quality
budget (EdgePrompt's adaptation; CE-LSLM eq. 20 for the pipelined load).

Pure functions at the core (`predict`, `plan`, `pareto`); `measure_profile` and `cold_ttft` run the edge.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from edgekv import EdgeKVError
from edgekv.models.structure import decoder_layers
from edgekv.serve.pipeline import Link, pipeline_ttft
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession


@dataclass
class Profile:
    """The edge's measured costs for one (system prompt, user prompt) shape, seconds. `overhead_s[strategy]` is
    what a cold session of that strategy costs beyond the modelled terms, measured once on an unthrottled
    link: a calibration constant, so predictions at every other link are out of sample."""

    system_tokens: int
    user_tokens: int
    system_layer_s: list[float]  # per layer: the system prompt's prefill through it
    user_layer_s: list[float]  # per layer: the user tokens through it (system KV in place)
    head_s: float  # embedding, final norm, LM head of the user forward
    edge_only_s: float  # cold TTFT of the edge alone (whole prompt prefilled)
    cloud_only_s: float  # cloud-only TTFT before the network: the cloud's prefill of the whole prompt
    user_bytes: int
    decode_s: dict[str, float] = field(default_factory=dict)  # codec → seconds to decode one layer file
    overhead_s: dict[str, float] = field(default_factory=dict)  # strategy → residual seconds of a cold session


@dataclass
class Candidate:
    """One way to get the system prompt's KV to the edge, with what it costs on the wire and in quality."""

    strategy: str  # edge-only | cloud-only | edgeprompt | ce-lslm | ce-lslm-fuse
    start_layer: int = 0  # first layer shipped (the split m)
    prune_ratio: float = 0.0
    quant: str = "fp16"
    layer_bytes: dict[int, int] = field(default_factory=dict)  # shipped layer → bytes of its file
    quality_loss: float = 0.0  # nats/token vs the edge's exact answer (edge-only); ≤ 0 is no loss
    source: str = ""  # the eval strategy whose export this is (e.g. edgeprompt@0/int8); "" = `strategy`
    kv_tokens: int | None = None  # a distilled export's trained tokens P' (None: the prompt's own KV)

    @property
    def label(self) -> str:
        """Short name, e.g. `edgeprompt m=12 λ=0.5 int8`; a distilled one by its eval name and P'."""
        if self.strategy in ("edge-only", "cloud-only"):
            return self.strategy
        if self.kv_tokens is not None:  # distill and distill@c8 share strategy, split, ratio and codec
            return f"{self.source or self.strategy} P'={self.kv_tokens} {self.quant}"
        return f"{self.strategy} m={self.start_layer} λ={self.prune_ratio:g} {self.quant}"

    @property
    def bytes(self) -> int:
        """Bytes on the wire."""
        return sum(self.layer_bytes.values())


def predict(c: Candidate, p: Profile, link: Link) -> float:
    """Predicted cold TTFT (s) of a candidate on a link (each layer file: latency + bytes·8/bandwidth)."""
    if c.strategy == "edge-only":
        return p.edge_only_s
    if c.strategy == "cloud-only":  # the prompt goes up, the first token comes down
        return p.cloud_only_s + link.seconds(p.user_bytes) + link.latency_ms / 1e3
    decode = p.decode_s.get(c.quant, 0.0)
    transfer = {i: link.seconds(b) + decode for i, b in sorted(c.layer_bytes.items())}
    if c.strategy == "ce-lslm-fuse":  # own prefill of every layer, overlapping the load; fusion waits for all
        arrive = sum(transfer.values())
        ready = max(sum(p.system_layer_s), arrive)
        return ready + sum(p.user_layer_s) + p.head_s + p.overhead_s.get(c.strategy, 0.0)
    shallow = sum(p.system_layer_s[: c.start_layer])
    return pipeline_ttft(shallow, p.user_layer_s, transfer, p.head_s)["predicted_s"] + \
        p.overhead_s.get(c.strategy, 0.0)


def plan(candidates: list[Candidate], p: Profile, link: Link, max_quality_loss: float) -> tuple[Candidate, list[dict]]:
    """The candidate with the lowest predicted TTFT among those within the quality budget (ties: fewer bytes),
    and every candidate's prediction. Raises when none is within the budget."""
    table = [{"label": c.label, "predicted_s": predict(c, p, link), "bytes": c.bytes,
              "quality_loss": c.quality_loss, "within_budget": c.quality_loss <= max_quality_loss} for c in candidates]
    ok = [(t["predicted_s"], t["bytes"], k) for k, t in enumerate(table) if t["within_budget"]]
    if not ok:
        raise EdgeKVError(f"no candidate loses at most {max_quality_loss} nats/token")
    return candidates[min(ok)[2]], table


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (bytes, loss) no other point beats on both (fewer or equal bytes and loss, one
    strictly), sorted by bytes."""
    keep = [k for k, (b, q) in enumerate(points)
            if not any((b2 <= b and q2 <= q) and (b2 < b or q2 < q) for b2, q2 in points)]
    return sorted(keep, key=lambda k: points[k])


# ------------------------------------------------------------------------------------------------ measuring


def layer_times(model: torch.nn.Module, fn: Callable[[], object]) -> tuple[list[float], float]:
    """Run `fn` and return each decoder layer's time in it (summed over calls) and the total."""
    layers = decoder_layers(model)
    spent = [0.0] * len(layers)
    marks: dict[int, float] = {}
    handles = []
    for i, layer in enumerate(layers):
        def before(module, args, i=i):  # returns None: a pre-hook's return value would replace the inputs
            marks[i] = time.perf_counter()

        def after(module, args, output, i=i):
            spent[i] += time.perf_counter() - marks[i]

        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
    start = time.perf_counter()
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return spent, time.perf_counter() - start


def made_under(manifest: dict) -> str | None:
    """The shared prefix an export was made under (its recorded path), None for a plain export. The prefix lives
    on the edge (shipped once per model pair), so a candidate's bytes are the prompt's alone."""
    return (manifest.get("under_shared") or {}).get("path")


def cold_ttft(edge, kv: str | None, system: str, user: torch.Tensor, link: Link, cache_dir) -> tuple[float, object]:
    """One cold request's TTFT as eval measures it: a fresh session (export loaded through the link, or the
    system prompt prefilled) plus the first token. An export made under a shared prefix is read under it, the
    prefix loaded before the clock starts (it lives on the edge). Returns (seconds, session)."""
    from edgekv.kv.export import KVExport
    from edgekv.kv.shared_prefix import SharedPrefix

    where = made_under(KVExport(kv).manifest) if kv else None
    shared = SharedPrefix(where, edge) if where else None
    start = time.perf_counter()
    session = EdgeSession(edge, kv, system_prompt=None if kv else system, link=link, cache_dir=cache_dir,
                          shared=shared)
    built = time.perf_counter() - start
    done = session.complete(user, SamplingParams(max_new_tokens=1))
    return built + done.ttft_s, session


def measure_profile(edge, cloud, system: str, user_text: str, exports: list[tuple[str, str]], cache_dir,
                    reps: int = 3) -> Profile:
    """Measure a Profile on the loaded models (medians of `reps`). `exports`: (strategy, export of this system
    prompt) pairs, loaded cold on an unthrottled link for the per-layer decode time of their codec and the
    strategy's overhead constant."""
    user = torch.tensor(edge.tokenizer(user_text, add_special_tokens=False)["input_ids"])
    sys_runs, user_runs, heads, edge_only = [], [], [], []
    for _ in range(reps):
        holder = {}
        sys_layers, _ = layer_times(edge.model, lambda: holder.setdefault(
            "s", EdgeSession(edge, None, system_prompt=system)))
        session = holder["s"]
        per, total = layer_times(edge.model, lambda: session.complete(user, SamplingParams(max_new_tokens=1)))
        sys_runs.append(sys_layers)
        user_runs.append(per)
        heads.append(total - sum(per))
        edge_only.append(cold_ttft(edge, None, system, user, Link(), cache_dir)[0])
    med = lambda runs: [statistics.median(x) for x in zip(*runs)]  # noqa: E731
    cloud_user = torch.tensor(cloud.tokenizer(user_text, add_special_tokens=False)["input_ids"])
    cloud_only = statistics.median(cold_ttft(cloud, None, system, cloud_user, Link(), cache_dir)[0]
                                   for _ in range(reps))
    p = Profile(len(edge.tokenizer(system)["input_ids"]), int(user.numel()), med(sys_runs), med(user_runs),
                statistics.median(heads), statistics.median(edge_only), cloud_only, len(user_text.encode()))
    for strategy, kv in exports:
        measured, decodes = [], []
        for _ in range(reps):
            ttft, session = cold_ttft(edge, kv, system, user, Link(), cache_dir)
            session.wait_loaded()
            measured.append(ttft)
            decodes += [e.decode_s for e in session.system.loader.events]
        c = candidate_from_export(kv, strategy)
        p.decode_s.setdefault(c.quant, statistics.median(decodes))
        p.overhead_s[strategy] = 0.0
        p.overhead_s[strategy] = statistics.median(measured) - predict(c, p, Link())
    return p


def candidate_from_export(kv: str, strategy: str, quality_loss: float = 0.0, source: str = "") -> Candidate:
    """A Candidate describing an existing export (its split, ThinK ratio, codec and per-layer bytes)."""
    from edgekv.kv.export import KVExport

    export = KVExport(kv)
    m = export.manifest
    sizes = {i: len(export.layer_bytes(i)) for i in export.layer_indices}
    return Candidate(strategy, min(sizes), m["prune"]["ratio"], m["quant"], sizes, quality_loss, source,
                     m["kv_tokens"] if m.get("distilled") else None)


def profile_dict(p: Profile) -> dict:
    """JSON-ready profile."""
    return asdict(p)
