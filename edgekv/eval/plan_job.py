"""`edgekv plan`: pick how to ship a system prompt for a link and a quality budget, and check the pick.

Inputs: an eval run with the quality-per-byte variants (`family@λ/codec`, plus edge-only and optionally
ce-lslm-fuse): its paired Δ reference NLL vs edge-only is each candidate's quality loss on `dataset`. The edge's
costs are profiled on one request of that dataset (unthrottled, `network.measure_profile`); each candidate's bytes
come from its export of that request's system prompt. For every link the planner predicts each candidate's cold
TTFT (`network.predict`) and picks the fastest within the budget; with `measure`, it also loads the pick through
the link emulator and reports measured against predicted, and sweeps the fixed strategies over bandwidth
(measured points, predicted lines: `ttft_vs_bandwidth.png`).
"""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.config import command_config, load_config, setting, to_dict
from edgekv.eval.artefacts import Artefacts
from edgekv.eval.eval_config import EvalConfig, eval_requests
from edgekv.eval.network import (
    Candidate,
    Profile,
    candidate_from_export,
    cold_ttft,
    measure_profile,
    plan,
    predict,
    profile_dict,
)
from edgekv.eval.quality_per_byte import qpb_table, quality_per_byte
from edgekv.eval.runs import RECIPE_KEY, read_results, rewrite_report
from edgekv.eval.stats import paired_to_edge
from edgekv.eval.strategies import parse_strategy
from edgekv.plots import plt, save_figure
from edgekv.progress import Tasks
from edgekv.serve.pipeline import Link


@command_config("plan")
@dataclass
class PlanConfig:
    """Everything `edgekv plan` needs; see configs/plan.yaml."""

    qpb: str = setting("reports/eval-qpb", "Eval run with the quality-per-byte variants.")
    out: str = setting("runs/plan", "Output directory.")
    dataset: str = setting("xsum", "Dataset whose quality losses and request are used.")
    request: int | None = None  # which request of the run's sample is profiled and measured; None: the one with
    # the longest system prompt (the shared-prompt case the splice is for)
    sweep: list[str] = field(default_factory=lambda: ["edgeprompt@0/fp16", "ce-lslm@0.5/int8", "ce-lslm-fuse"])
    # the splice strategies swept over bandwidth (beside edge-only and cloud-only): EdgePrompt's lossless split,
    # CE-LSLM's default compression, fusion
    links: list[str] = setting(
        help="MBPS[,MS] (repeatable).",
        factory=lambda: ["1,20", "5,20", "20,20", "100,20", "1000,20", "5,5", "100,50"], flag="link",
        repeat=True)
    max_quality_loss: float = setting(0.02, "Nats/token the answer may lose vs the edge's own exact prefill.")
    splits: list[int] = field(default_factory=lambda: [0, 6, 12, 18])  # edgeprompt's split candidates
    measure: bool = setting(
        True, "Load each pick through the link emulator; sweep bandwidths.", toggle="--measure/--no-measure")
    sweep_mbps: list[float] = setting(help="Bandwidths of the measured sweep.", factory=lambda: [1, 5, 20, 100, 1000])
    sweep_latency_ms: float = 20.0
    reps: int = setting(3, "Cold requests per measurement (median).")

    def validate(self) -> None:
        """One-line errors before any model is loaded."""
        for link in self.links:
            parse_link(link)
        if self.reps < 1 or (self.request is not None and self.request < 0):
            raise EdgeKVError("reps must be ≥ 1 and request ≥ 0")
        if not (Path(self.qpb) / "results.jsonl").exists():
            raise EdgeKVError(f"{self.qpb}: no results.jsonl (run `edgekv eval` with the quality-per-byte "
                              "strategies first, e.g. --config configs/eval/qpb.yaml)")


def parse_link(text: str) -> Link:
    """"MBPS[,MS]" → Link."""
    try:
        parts = [float(x) for x in str(text).split(",")]
    except ValueError:
        raise EdgeKVError(f"a link is MBPS[,MS] (e.g. 20,30), got '{text}'") from None
    if len(parts) not in (1, 2):
        raise EdgeKVError(f"a link is MBPS[,MS] (e.g. 20,30), got '{text}'")
    return Link(parts[0], parts[1] if len(parts) == 2 else 0.0)


def quality_losses(rows: list[dict], dataset: str, seed: int = 0) -> dict[str, dict]:
    """Strategy → paired Δ reference NLL vs edge-only on `dataset` (edge-only itself: 0). The planner counts a
    candidate's loss as the upper end of this 95 % interval: within the budget means within it with 95 %
    confidence, not by a lucky point estimate on a few requests."""
    here = [r for r in rows if r["dataset"] == dataset]
    out = {"edge-only": {"delta_mean": 0.0, "ci95_lo": 0.0, "ci95_hi": 0.0, "n": 0}}
    for p in paired_to_edge(here, "ref_nll", seed=seed):
        out[p["strategy"]] = p
    return out


def build_candidates(a: Artefacts, system: str, losses: dict[str, dict], splits: list[int]) -> list[Candidate]:
    """Every strategy of the quality run as a candidate with its bytes for this system prompt; edgeprompt
    variants also at each split m (layers m.. shipped, with the loss measured shipping all of them: an upper
    bound, since fewer layers are compressed)."""
    out = [Candidate("edge-only")]
    for name, loss in losses.items():
        st = parse_strategy(name)
        if not st.ships_kv:
            continue
        kv, _ = a.export(parse_strategy(name), system)
        c = candidate_from_export(str(kv), st.base, loss["ci95_hi"] if loss["ci95_hi"] is not None
                                  else loss["delta_mean"], source=name)
        if st.base == "edgeprompt":
            out += [replace(c, start_layer=m, layer_bytes={i: b for i, b in c.layer_bytes.items() if i >= m})
                    for m in splits if m < a.edge.num_layers]
        else:
            out.append(c)
    return out


def export_for(a: Artefacts, c: Candidate, system: str) -> str:
    """An export of the system prompt for a candidate (edgeprompt at its split made on demand)."""
    st = parse_strategy(c.source or c.strategy)
    if c.strategy != "edgeprompt" or c.start_layer == 0:
        return str(a.export(st, system)[0])
    return str(a.export_at_split(st, system, c.start_layer))


def run_plan(cfg: PlanConfig, progress=None) -> dict:
    """Profile, plan at every link, measure the picks and the sweep; write plan.json/.csv/.md and the plot."""
    cfg.validate()
    qpb = Path(cfg.qpb)
    settings = json.loads((qpb / "config.json").read_text(encoding="utf-8"))
    settings.pop(RECIPE_KEY, None)
    ecfg = load_config(EvalConfig, "eval", None, settings)
    fitted = qpb / "work" / f"translator-{ecfg.translator}-similarity"
    if ecfg.translator_path is None and (fitted / "translator.json").exists():
        ecfg.translator_path = str(fitted)  # the quality run's translator, not a refit
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = Tasks(progress)
    a = Artefacts(ecfg, out, tasks)
    requests = eval_requests(ecfg, cfg.dataset, a.edge.tokenizer)
    if cfg.request is not None and cfg.request >= len(requests):
        raise EdgeKVError(f"request {cfg.request} is beyond the run's {len(requests)} {cfg.dataset} requests")
    longest = max(range(len(requests)), key=lambda k: len(a.edge.tokenizer(requests[k].system)["input_ids"]))
    req = requests[longest if cfg.request is None else cfg.request]
    rows = read_results(qpb / "results.jsonl")
    losses = quality_losses(rows, cfg.dataset, ecfg.seed)
    fixed = [s for s in cfg.sweep if s in ecfg.strategies]
    candidates = build_candidates(a, req.system, losses, cfg.splits)
    profile_exports = [(st.base, str(a.export(st, req.system)[0])) for st in map(parse_strategy, fixed)]
    profile = measure_profile(a.edge, a.cloud, req.system, req.user, profile_exports,
                              out / "work" / "kvcache", cfg.reps)
    for c in candidates:  # a codec the profile did not load decodes about as fast as the closest one measured
        profile.decode_s.setdefault(c.quant, statistics.median(profile.decode_s.values()) if profile.decode_s
                                    else 0.0)
    user = torch.tensor(a.edge.tokenizer(req.user, add_special_tokens=False)["input_ids"])
    picks = []
    advance = tasks.task("plan + measure picks", len(cfg.links))
    for text in cfg.links:
        link = parse_link(text)
        best, table = plan(candidates, profile, link, cfg.max_quality_loss)
        pick = {"link": text, "mbps": link.bandwidth_mbps, "latency_ms": link.latency_ms, "pick": best.label,
                "strategy": best.strategy, "start_layer": best.start_layer, "prune_ratio": best.prune_ratio,
                "quant": best.quant, "mb": best.bytes / 2**20, "quality_loss": best.quality_loss,
                "predicted_s": predict(best, profile, link), "measured_s": None}
        if cfg.measure:
            pick["measured_s"] = statistics.median(_measure(a, best, req, user, link, out, cfg.reps))
            pick["error"] = pick["measured_s"] / pick["predicted_s"] - 1
        picks.append(pick)
        advance()
    sweep, swept = _sweep(a, cfg, profile, req, user, fixed, out, tasks) if cfg.measure else ([], {})
    result = {"config": to_dict(cfg), "profile": profile_dict(profile), "request": req.id,
              "candidates": [{"label": c.label, "mb": c.bytes / 2**20, "quality_loss": c.quality_loss}
                             for c in candidates], "picks": picks, "sweep": sweep}
    write_text_atomic(out / "plan.json", json.dumps(result, indent=1))
    md = plan_markdown(result)
    table = quality_per_byte(rows, ecfg.seed)  # the trade-off the planner chose from, beside its picks
    if table and (qpb / "quality_per_byte.png").exists():
        shutil.copyfile(qpb / "quality_per_byte.png", out / "quality_per_byte.png")
        md += (f"\n## Quality per byte ({cfg.qpb})\n\n" + qpb_table(table) +
               "\n\n![quality per byte](quality_per_byte.png)\n")
    write_text_atomic(out / "plan.md", md)
    if sweep:
        plot_sweep(sweep, profile, swept, cfg, out / "ttft_vs_bandwidth.png")
    if (out / "results.jsonl").exists() and (out / "config.json").exists():  # an eval report: add the sections
        rewrite_report(out)
    return result


def _measure(a: Artefacts, c: Candidate, req, user, link: Link, out: Path, reps: int) -> list[float]:
    kv = None if c.strategy in ("edge-only", "cloud-only") else export_for(a, c, req.system)
    model = a.cloud if c.strategy == "cloud-only" else a.edge
    if c.strategy == "cloud-only":
        user = torch.tensor(model.tokenizer(req.user, add_special_tokens=False)["input_ids"])
    extra = link.seconds(len(req.user.encode())) + link.latency_ms / 1e3 if c.strategy == "cloud-only" else 0.0
    return [cold_ttft(model, kv, req.system, user, link, out / "work" / "kvcache")[0] + extra for _ in range(reps)]


def _sweep(a: Artefacts, cfg: PlanConfig, profile: Profile, req, user, fixed: list[str], out: Path,
           tasks: Tasks) -> tuple[list[dict], dict[str, Candidate]]:
    """Measured and predicted cold TTFT of the fixed strategies at each bandwidth of the sweep (and the
    strategies as candidates, for the predicted lines)."""
    strategies = ["edge-only", "cloud-only", *fixed]
    rows, cands = [], {}
    advance = tasks.task("bandwidth sweep", len(strategies) * len(cfg.sweep_mbps))
    for mbps in cfg.sweep_mbps:
        link = Link(mbps, cfg.sweep_latency_ms)
        for s in strategies:
            if s in ("edge-only", "cloud-only"):
                c = cands[s] = Candidate(s)
            else:
                st = parse_strategy(s)
                c = cands[s] = candidate_from_export(str(a.export(st, req.system)[0]), st.base, source=s)
            times = _measure(a, c, req, user, link, out, cfg.reps)
            rows.append({"strategy": s, "mbps": mbps, "latency_ms": cfg.sweep_latency_ms, "mb": c.bytes / 2**20,
                         "measured_s": statistics.median(times), "predicted_s": predict(c, profile, link),
                         "samples": times})
            advance()
    return rows, cands


def plan_markdown(result: dict) -> str:
    """The planner's picks and the sweep as markdown."""
    cfg = result["config"]
    lines = [f"## Planner: picks per link (quality budget {cfg['max_quality_loss']} nats/token vs edge-only, "
             f"{cfg['dataset']})", "",
             "| link Mbit/s, ms | pick | MB | Δ NLL | predicted TTFT s | measured TTFT s (median) | error |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for p in result["picks"]:
        measured = "–" if p["measured_s"] is None else f"{p['measured_s']:.3f}"
        err = "–" if p.get("error") is None else f"{p['error'] * 100:+.1f} %"
        lines.append(f"| {p['mbps']:g}, {p['latency_ms']:g} | {p['pick']} | {p['mb']:.3f} | "
                     f"{p['quality_loss']:+.3f} | {p['predicted_s']:.3f} | {measured} | {err} |")
    if result["sweep"]:
        lines += ["", "## Cold TTFT vs bandwidth (fixed strategies)", "",
                  "| strategy | MB | " + " | ".join(f"{m:g} Mbit/s" for m in cfg["sweep_mbps"]) + " |",
                  "|---|---:|" + "---:|" * len(cfg["sweep_mbps"])]
        for s in dict.fromkeys(r["strategy"] for r in result["sweep"]):
            rs = [r for r in result["sweep"] if r["strategy"] == s]
            lines.append(f"| {s} | {rs[0]['mb']:.3f} | " + " | ".join(
                f"{r['measured_s']:.2f} ({r['predicted_s']:.2f})" for r in rs) + " |")
        lines += ["", "Measured median (predicted) seconds; latency "
                  f"{cfg['sweep_latency_ms']:g} ms per file. ![TTFT vs bandwidth](ttft_vs_bandwidth.png)"]
    return "\n".join(lines) + "\n"


def plot_sweep(sweep: list[dict], profile: Profile, strategies: dict[str, Candidate], cfg: PlanConfig,
               path: Path) -> None:
    """Measured points and predicted lines of cold TTFT against bandwidth, one colour per strategy."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.5))
    grid = np.logspace(np.log10(min(cfg.sweep_mbps)), np.log10(max(cfg.sweep_mbps)), 60)
    for s, c in strategies.items():
        rs = [r for r in sweep if r["strategy"] == s]
        dots = ax.plot([r["mbps"] for r in rs], [r["measured_s"] for r in rs], "o", label=f"{s} (measured)")
        ax.plot(grid, [predict(c, profile, Link(m, cfg.sweep_latency_ms)) for m in grid], "-",
                color=dots[0].get_color(), alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="bandwidth (Mbit/s, log)", ylabel="cold TTFT (s, log)",
           title=f"cold TTFT vs bandwidth ({cfg.sweep_latency_ms:g} ms per file): points measured, lines predicted")
    ax.legend(fontsize=7)
    save_figure(fig, path)
