"""`edgekv plan`: for a link and a quality budget, the split layer, ThinK ratio and codec to ship (and a check)."""

from __future__ import annotations

from cli.common import config_command, console, progress_bar
from edgekv.eval.plan_job import PlanConfig, run_plan


@config_command(PlanConfig, "plan", "YAML config, e.g. configs/plan.yaml.")
def plan(cfg: PlanConfig) -> None:
    """Pick how to ship a system prompt for each link within a quality budget; measure the picks."""
    with progress_bar() as progress:
        result = run_plan(cfg, progress)
    for p in result["picks"]:
        measured = "" if p["measured_s"] is None else f", measured {p['measured_s']:.3f} s ({p['error'] * 100:+.1f} %)"
        console.print(f"{p['mbps']:g} Mbit/s, {p['latency_ms']:g} ms → {p['pick']}: {p['mb']:.3f} MB, "
                      f"Δ NLL {p['quality_loss']:+.3f}, predicted {p['predicted_s']:.3f} s{measured}")
    console.print(f"→ {cfg.out}/plan.json, plan.md" + (", ttft_vs_bandwidth.png" if result["sweep"] else ""))
