"""`edgekv distill`: a cloud-distilled, edge-native KV export per system prompt (EdgePrompt's format)."""

from __future__ import annotations

from rich.table import Table

from cli.common import config_command, console, progress_bar
from edgekv.distill.distill_job import DistillConfig, run_distill


@config_command(DistillConfig, "distill", "YAML config (flags override it) [configs/distill.yaml].")
def distill(cfg: DistillConfig) -> None:
    """Train an edge-shaped system-prompt KV so the edge predicts what the teacher predicts reading the prompt."""
    with progress_bar() as progress:
        summary = run_distill(cfg, progress)
    if "shared" in summary:
        s = summary["shared"]["shared_prefix"]
        start = "–" if s["initial_held_out_kl"] is None else f"{s['initial_held_out_kl']:.4f}"
        console.print(f"shared prefix of {cfg.shared_tokens} tokens → {summary['shared']['out']}: "
                      f"{s['prompts']} prompts ({len(s['held_out_prompts'])} held out), held-out KL {start} → "
                      f"{s['held_out_kl']:.4f} (best step {s['best_step']} of {s['steps']})")
        return
    table = Table(title=f"distilled {summary['done']} of {summary['prompts']} system prompts")
    for column in ("prompt", "P → P'", "held-out KL (step 0 → best)", "best step", "bytes", "× vs full fp16"):
        table.add_column(column, justify="right")
    for name, r in summary["reports"].items():
        d = r["distilled"]
        start = "–" if d["initial_held_out_kl"] is None else f"{d['initial_held_out_kl']:.4f}"
        table.add_row(name, f"{r['system_prompt_tokens']} → {r['kv_tokens']}", f"{start} → {d['held_out_kl']:.4f}",
                      str(d["best_step"]), f"{r['bytes_written']:,}", f"{r['ratio_vs_full_fp16']:.1f}")
    console.print(table)
    for name, why in summary["failed"].items():
        console.print(f"[red]{name}: {why}[/red]")
