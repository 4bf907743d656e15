"""`edgekv eval`: strategies × datasets → results.jsonl, summary.csv, report.md (Table II), plots."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.common import config_command, console, one_line_errors, progress_bar
from edgekv.eval.eval_config import EvalConfig
from edgekv.eval.eval_job import run_eval
from edgekv.eval.report import table_ii
from edgekv.eval.runs import merge_runs


@config_command(EvalConfig, "eval", "YAML config, e.g. configs/eval/default.yaml.")
def eval_(cfg: EvalConfig) -> None:
    """Evaluate strategies on XSum / MMLU / ShareGPT: latency, memory, bytes, upload ratio and quality."""
    with progress_bar() as progress:
        result = run_eval(cfg, progress)
    console.print(table_ii(result["summary"]))
    console.print(f"{result['rows']} rows → {cfg.out}/results.jsonl, summary.csv, report.md, ttft.png")


@one_line_errors
def report(
    runs: list[Path] = typer.Argument(..., help="Eval run directories: the shards of one report (--shard i/n) "
                                                   "or runs of disjoint --dataset lists."),
    out: Path = typer.Option(..., help="Directory of the merged report."),
) -> None:
    """Merge the shards or per-dataset runs of an eval into one report (refuses runs made with other settings)."""
    result = merge_runs(runs, out)
    console.print(table_ii(result["summary"]))
    console.print(f"{result['rows']} rows → {out}/results.jsonl, summary.csv, paired.csv, report.md")
