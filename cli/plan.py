"""`edgekv plan`: for a link and a quality budget, the split layer, ThinK ratio and codec to ship (and a check)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.common import console, one_line_errors, parse_floats, progress_bar
from edgekv.config import load_config
from edgekv.eval.plan_job import PlanConfig, run_plan


@one_line_errors
def plan(
    config: Optional[Path] = typer.Option(None, help="YAML config, e.g. configs/plan.yaml."),
    qpb: Optional[Path] = typer.Option(None, help="Eval run with the quality-per-byte variants [reports/eval-qpb]."),
    link: Optional[list[str]] = typer.Option(None, help="MBPS[,MS] (repeatable) [a sweep of seven links]."),
    max_quality_loss: Optional[float] = typer.Option(None, help="Nats/token the answer may lose vs the edge's own "
                                                               "exact prefill [0.02]."),
    dataset: Optional[str] = typer.Option(None, help="Dataset whose quality losses and request are used [xsum]."),
    measure: Optional[bool] = typer.Option(None, "--measure/--no-measure",
                                           help="Load each pick through the link emulator; sweep bandwidths [yes]."),
    sweep_mbps: Optional[str] = typer.Option(None, help="Bandwidths of the measured sweep [1,5,20,100,1000]."),
    reps: Optional[int] = typer.Option(None, help="Cold requests per measurement (median) [3]."),
    out: Optional[Path] = typer.Option(None, help="Output directory [runs/plan]."),
) -> None:
    """Pick how to ship a system prompt for each link within a quality budget; measure the picks."""
    overrides = dict(qpb=str(qpb) if qpb else None, links=list(link) if link else None,
                     max_quality_loss=max_quality_loss, dataset=dataset, measure=measure,
                     sweep_mbps=parse_floats(sweep_mbps), reps=reps, out=str(out) if out else None)
    cfg = load_config(PlanConfig, "plan", config, overrides)
    with progress_bar() as progress:
        result = run_plan(cfg, progress)
    for p in result["picks"]:
        measured = "" if p["measured_s"] is None else f", measured {p['measured_s']:.3f} s ({p['error'] * 100:+.1f} %)"
        console.print(f"{p['mbps']:g} Mbit/s, {p['latency_ms']:g} ms → {p['pick']}: {p['mb']:.3f} MB, "
                      f"Δ NLL {p['quality_loss']:+.3f}, predicted {p['predicted_s']:.3f} s{measured}")
    console.print(f"→ {cfg.out}/plan.json, plan.md" + (", ttft_vs_bandwidth.png" if result["sweep"] else ""))
