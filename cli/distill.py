"""`edgekv distill`: a cloud-distilled, edge-native KV export per system prompt (EdgePrompt's format)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cli.common import console, one_line_errors, progress_bar
from edgekv.config import load_config
from edgekv.distill.distill_job import DistillConfig, run_distill


@one_line_errors
def distill(
    system_prompt: Optional[str] = typer.Option(None, help="One system prompt: TEXT or @FILE."),
    prompts: Optional[Path] = typer.Option(None, help="JSONL of {\"name\", \"system_prompt\"}, one export each."),
    out: Optional[Path] = typer.Option(None, help="Output folder, a subfolder per prompt (resumable) [runs/distill]."),
    cloud: Optional[str] = typer.Option(None, help="Cloud model (the teacher) [default-cloud]."),
    edge: Optional[str] = typer.Option(None, help="Edge model (the student's) [default-edge]."),
    teacher: Optional[str] = typer.Option(None, help="cloud, or self (the edge reading the whole prompt) [cloud]."),
    length: Optional[int] = typer.Option(None, help="Student tokens P' [the whole prompt]."),
    compress: Optional[int] = typer.Option(None, help="Student tokens P' = ceil(P / N), instead of --length."),
    rule: Optional[str] = typer.Option(None, help="Which tokens a shorter student starts from: first or even [first]."),
    param: Optional[str] = typer.Option(None, help="full (K, V trained) or lowrank (a rank-r delta) [full]."),
    rank: Optional[int] = typer.Option(None, help="Rank of the lowrank delta per KV head [8]."),
    queries: Optional[int] = typer.Option(None, help="Synthetic exchanges per prompt [8]."),
    seeds: Optional[str] = typer.Option(None, help="Seed types, comma-separated: structuring, summarization, "
                                        "question, use-case, creative, instruction [instruction]."),
    on_policy: Optional[float] = typer.Option(None, help="Share of answers the student samples, the teacher "
                                              "scores [0]."),
    freeze_first: Optional[int] = typer.Option(None, help="First tokens kept at their initial KV [0]."),
    query_loss: Optional[bool] = typer.Option(None, "--query-loss/--answer-loss",
                                              help="Loss on the query's tokens too [answer only]."),
    batch: Optional[int] = typer.Option(None, help="Sequences per training step [1]."),
    steps: Optional[int] = typer.Option(None, help="Most training steps [30]."),
    lr: Optional[float] = typer.Option(None, help="Adam learning rate [5e-3]."),
    quant: Optional[str] = typer.Option(None, help="Export codec: fp32, fp16, bf16, int8, int4 [bf16]."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    seed: Optional[int] = typer.Option(None, help="Seed [0]."),
    catalog: Optional[str] = typer.Option(None, help="Also put each export in this catalog (folder or fsspec URL)."),
    ray: Optional[str] = typer.Option(None, help="Run --prompts on Ray: 'local' starts one here, 'auto' or an "
                                      "address joins a cluster [in-process]."),
    workers: Optional[int] = typer.Option(None, help="Ray actors, each loading the models once [2]."),
    config: Optional[Path] = typer.Option(None, help="YAML config (flags override it) [configs/distill.yaml]."),
) -> None:
    """Train an edge-shaped system-prompt KV so the edge predicts what the teacher predicts reading the prompt."""
    overrides = dict(system_prompt=system_prompt, prompts=str(prompts) if prompts else None,
                     out=str(out) if out else None, cloud=cloud, edge=edge, teacher=teacher, length=length,
                     compress=compress, rule=rule, param=param, rank=rank, queries=queries,
                     seeds=[t.strip() for t in seeds.split(",") if t.strip()] if seeds else None, on_policy=on_policy,
                     freeze_first=freeze_first, query_loss=query_loss, batch=batch, steps=steps, lr=lr,
                     quant=quant, dtype=dtype, device=device, seed=seed, catalog=catalog,
                     ray="" if ray == "local" else ray, workers=workers)
    cfg = load_config(DistillConfig, "distill", config, overrides)
    with progress_bar() as progress:
        summary = run_distill(cfg, progress)
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
