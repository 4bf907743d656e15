"""`edgekv align`: layer-similarity maps between a cloud and an edge model, and the chosen mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cli.common import console, one_line_errors, parse_list, progress_bar
from edgekv.align.align_job import AlignConfig, run_align
from edgekv.config import load_config


@one_line_errors
def align(
    cloud: Optional[str] = typer.Option(None, help="Cloud model: alias (default-cloud), hub id, directory or .gguf."),
    edge: Optional[str] = typer.Option(None, help="Edge model: alias (default-edge), hub id, directory or .gguf."),
    out: Optional[Path] = typer.Option(None, help="Output directory (replaced whole, atomically)."),
    texts: Optional[Path] = typer.Option(None, help="Calibration texts (.jsonl or .txt); default: ShareGPT."),
    num_texts: Optional[int] = typer.Option(None, help="Number of calibration texts [32]."),
    max_tokens: Optional[int] = typer.Option(None, help="Tokens per text (truncation) [256]."),
    strategy: Optional[str] = typer.Option(None, help="Mapping: similarity, uniform, last-aligned, dissimilar."),
    start_layer: Optional[int] = typer.Option(None, help="First edge layer fed from the cloud (m) [half depth]."),
    metric: Optional[str] = typer.Option(None, help="Score the mapping maximizes: linear_cka, debiased_cka, rsa."),
    tau_cka: Optional[float] = typer.Option(None, help="Minimum linear CKA of a mapped pair [0]."),
    tau_rsa: Optional[float] = typer.Option(None, help="Minimum RSA of a mapped pair [0]."),
    skip_first: Optional[int] = typer.Option(None, help="Leading tokens per text left out (attention sink) [1]."),
    outlier_ratio: Optional[float] = typer.Option(
        None, help="Drop tokens whose hidden norm exceeds this × the layer median; 0 keeps all [10]."),
    sample_tokens: Optional[int] = typer.Option(None, help="Seeded subsample of tokens for CKA [all]."),
    rsa_tokens: Optional[int] = typer.Option(None, help="Seeded subsample of tokens for RSA [2048]."),
    features: Optional[str] = typer.Option(None, help="Comma list of hidden, k, v, k_unrot [hidden]."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    device_map: Optional[str] = typer.Option(None, help="accelerate device map for large models, e.g. auto."),
    seed: Optional[int] = typer.Option(None, help="Seed for every subsample [0]."),
    config: Optional[Path] = typer.Option(None, help="YAML config (flags override it)."),
) -> None:
    """Compare every cloud×edge layer pair (linear CKA, debiased CKA, RSA) and choose a layer mapping."""
    overrides = dict(cloud=cloud, edge=edge, out=str(out) if out else None, texts=str(texts) if texts else None,
                     num_texts=num_texts, max_tokens=max_tokens, strategy=strategy, start_layer=start_layer,
                     metric=metric, tau_cka=tau_cka, tau_rsa=tau_rsa, skip_first=skip_first,
                     outlier_ratio=outlier_ratio,
                     sample_tokens=sample_tokens, rsa_tokens=rsa_tokens, features=parse_list(features),
                     dtype=dtype, device=device, device_map=device_map, seed=seed)
    cfg = load_config(AlignConfig, "align", config, overrides)
    with progress_bar() as progress:
        result = run_align(cfg, progress)

    sim, mapping = result.similarity, result.mapping
    console.print(f"[bold]{sim['text_source']}[/]; {sim['num_texts']} texts, {sim['num_tokens']} tokens "
                  f"({len(sim['dropped_tokens'])} massive-activation tokens left out)")
    table = Table(title=f"mapping: {mapping['strategy']} (max {mapping['metric']}, from edge layer "
                        f"{mapping['start_layer']})")
    for column in ("edge layer", "← cloud layer", "linear CKA", "debiased CKA", "RSA"):
        table.add_column(column, justify="right")
    for p in mapping["pairs"]:
        table.add_row(str(p["edge_layer"]), str(p["cloud_layer"]), f"{p['linear_cka']:.3f}",
                      f"{p['debiased_cka']:.3f}", f"{p['rsa']:.3f}")
    console.print(table)
    t = result.timings
    console.print(f"forward: cloud {t['cloud_forward_s']:.1f} s, edge {t['edge_forward_s']:.1f} s; "
                  f"similarity {t['similarity_s']:.1f} s → wrote {result.out}/")
