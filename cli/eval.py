"""`edgekv eval`: strategies × datasets → results.jsonl, summary.csv, report.md (Table II), plots."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.common import console, one_line_errors, parse_floats, parse_list, progress_bar
from edgekv.config import load_config
from edgekv.eval.eval_job import EvalConfig, merge_runs, run_eval
from edgekv.eval.report import table_ii


@one_line_errors
def eval_(
    config: Optional[Path] = typer.Option(None, help="YAML config, e.g. configs/eval/default.yaml."),
    cloud: Optional[str] = typer.Option(None, help="Cloud model: alias, hub id, directory or .gguf [default-cloud]."),
    edge: Optional[str] = typer.Option(None, help="Edge model [default-edge]."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    weights: Optional[str] = typer.Option(None, help="The edge's linears: bf16, int8 or int4 (weight-only) [bf16]."),
    dataset: Optional[str] = typer.Option(None, help="xsum, mmlu, sharegpt (comma-separated) [all three]."),
    strategies: Optional[str] = typer.Option(
        None, help="cloud-only, edge-only, edge-naive, edgeprompt, ce-lslm[:mapping], ce-lslm-fuse, "
                   "ce-lslm-distill[:nosum], edgeprompt-selfdistill, edgeprompt-truncate; edgeprompt/ce-lslm take "
                   "@RATIO/CODEC (ce-lslm@0.25/int4), the distilled ones @c<N> (a student of P/N tokens) "
                   "and/or s<S> (S training steps): @c8s120."),
    limit: Optional[int] = typer.Option(None, help="Requests per dataset [20]."),
    out: Optional[Path] = typer.Option(None, help="Report directory (resumes from its results.jsonl)."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens generated per answer [32]."),
    bandwidth_mbps: Optional[float] = typer.Option(None, help="Emulated cloud→edge link [100]."),
    latency_ms: Optional[float] = typer.Option(None, help="Link latency per file [20]."),
    translator: Optional[str] = typer.Option(None, help="ce-lslm's translator: ridge, hidden, trained [hidden]."),
    translator_path: Optional[Path] = typer.Option(None, help="A saved translator for ce-lslm [fit one]."),
    fuser_path: Optional[Path] = typer.Option(None, help="A trained fuser for ce-lslm-fuse (`edgekv train-fuser`)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed of the requests [0]."),
    load_rates: Optional[str] = typer.Option(None, help="Poisson load runs at these requests/s, e.g. 0.1,0.25,0.5."),
    load_seconds: Optional[float] = typer.Option(None, help="Length of each load run [20]."),
    shard: Optional[str] = typer.Option(None, help="i/n: answer every n-th request from the i-th (merge the shards "
                                                   "with `edgekv report`)."),
    ray: Optional[str] = typer.Option(None, help="Run on Ray: 'local' starts one here, 'auto' or an address joins "
                                      "a cluster; the requests split into --workers shards [in-process]."),
    workers: Optional[int] = typer.Option(None, help="Ray actors (= shards), each loading the models once [2]."),
    context_budget: Optional[int] = typer.Option(None, help="edge-naive: system-prompt tokens kept [128]."),
    naive_keep: Optional[str] = typer.Option(None, help="edge-naive keeps the head, tail or head-tail [head]."),
) -> None:
    """Evaluate strategies on XSum / MMLU / ShareGPT: latency, memory, bytes, upload ratio and quality."""
    overrides = dict(cloud=cloud, edge=edge, dtype=dtype, device=device, weights=weights,
                     datasets=parse_list(dataset),
                     strategies=parse_list(strategies), limit=limit,
                     out=str(out) if out else None, max_new_tokens=max_new_tokens, bandwidth_mbps=bandwidth_mbps,
                     latency_ms=latency_ms, translator=translator,
                     translator_path=str(translator_path) if translator_path else None, seed=seed,
                     fuser_path=str(fuser_path) if fuser_path else None,
                     load_rates=parse_floats(load_rates), load_seconds=load_seconds, shard=shard,
                     context_budget=context_budget, naive_keep=naive_keep,
                     ray="" if ray == "local" else ray, workers=workers)
    cfg = load_config(EvalConfig, "eval", config, overrides)
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
