"""`edgekv compress`: ThinK-pruned, quantized, mapped cloud KV of a system prompt, as a KV export."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from cli.common import console, one_line_errors, progress_bar
from edgekv.config import load_config
from edgekv.kv.batch_compress import run_compress_batch
from edgekv.kv.compress_job import CompressConfig, run_compress


@one_line_errors
def compress(
    cloud: Optional[str] = typer.Option(None, help="Cloud model: alias, hub id, directory or .gguf."),
    edge: Optional[str] = typer.Option(None, help="Edge model; equal to --cloud gives an exact same-model export."),
    system_prompt: Optional[str] = typer.Option(None, help="The system prompt: TEXT or @FILE."),
    out: Optional[Path] = typer.Option(None, help="Export directory (or .tar with --tar), written atomically."),
    mapping: Optional[Path] = typer.Option(None, help="mapping.json of `edgekv align` [uniform / identity]."),
    start_layer: Optional[int] = typer.Option(None, help="First edge layer taken from the cloud (m)."),
    prune_ratio: Optional[float] = typer.Option(None, help="ThinK key-channel pruning ratio λ in [0, 1) [0]."),
    window: Optional[int] = typer.Option(None, help="ThinK observation window: last w prompt positions [32]."),
    keep_recent: Optional[int] = typer.Option(None, help="Last r tokens keep every key channel [0]."),
    quant: Optional[str] = typer.Option(None, help="fp16, bf16, int8 or int4 [fp16]."),
    map_on: Optional[str] = typer.Option(None, help="Apply the cross-model map on the cloud or the edge [cloud]."),
    translator: Optional[str] = typer.Option(
        None, help="Cross-model translator: ridge, hidden, trained, fuse-bias, fuse-residual [ridge, or the "
                   "shipped fuser with --splice auto]."),
    translator_path: Optional[Path] = typer.Option(None, help="A saved translator (needed for trained) [fit one]."),
    local_sink_tokens: Optional[int] = typer.Option(None, help="First s prompt tokens the edge computes itself [1]."),
    splice: Optional[str] = typer.Option(None, help="replace (cloud KV instead of the edge's), fuse (beside it, "
                                         "through a trained fuser's gates), or auto: fuse with the shipped fuser of "
                                         "this exact pair when no --translator is given, else replace [auto]."),
    calib: Optional[Path] = typer.Option(None, help="Calibration texts for the maps (.jsonl/.txt) [ShareGPT]."),
    calib_texts: Optional[int] = typer.Option(None, help="Calibration texts [16]."),
    calib_tokens: Optional[int] = typer.Option(None, help="Tokens per calibration text [256]."),
    tar: Optional[bool] = typer.Option(None, "--tar/--no-tar", help="Write one .tar instead of a directory."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    weights: Optional[str] = typer.Option(None, help="The edge's linears: bf16, int8 or int4 (weight-only) [bf16]."),
    device_map: Optional[str] = typer.Option(None, help="accelerate device map for large models, e.g. auto."),
    seed: Optional[int] = typer.Option(None, help="Seed [0]."),
    prompts: Optional[Path] = typer.Option(None, help="JSONL of {name, system_prompt}: one export each (--catalog)."),
    catalog: Optional[str] = typer.Option(None, help="Catalog of exports: a folder or fsspec URL (with --prompts)."),
    ray: Optional[str] = typer.Option(None, help="Run --prompts on Ray: 'local' starts one here, 'auto' or an "
                                      "address joins a cluster [in-process]."),
    workers: Optional[int] = typer.Option(None, help="Ray actors, each loading the models once [2]."),
    config: Optional[Path] = typer.Option(None, help="YAML config (flags override it)."),
) -> None:
    """Compress the cloud's system-prompt KV (ThinK pruning, quantization, cross-model maps) into a KV export."""
    overrides = dict(cloud=cloud, edge=edge, system_prompt=system_prompt, out=str(out) if out else None,
                     mapping=str(mapping) if mapping else None, start_layer=start_layer, prune_ratio=prune_ratio,
                     window=window, keep_recent=keep_recent, quant=quant, map_on=map_on, translator=translator,
                     translator_path=str(translator_path) if translator_path else None,
                     local_sink_tokens=local_sink_tokens, splice=splice,
                     calib=str(calib) if calib else None, calib_texts=calib_texts, calib_tokens=calib_tokens,
                     prompts=str(prompts) if prompts else None, catalog=catalog,
                     ray="" if ray == "local" else ray, workers=workers, tar=tar, dtype=dtype, device=device,
                     weights=weights, device_map=device_map, seed=seed)
    cfg = load_config(CompressConfig, "compress", config, overrides)
    if cfg.prompts:
        with progress_bar() as progress:
            done = run_compress_batch(cfg, progress)
        console.print(f"{done['computed']} computed, {done['repaired']} repaired, {done['skipped']} already in "
                      f"{cfg.catalog} (verified), {len(done['failed'])} failed")
        for f in done["failed"]:
            print(f"error: {f['name']}: {f['error']}", file=sys.stderr)
        if done["failed"]:
            raise typer.Exit(1)
        return
    with progress_bar() as progress:
        report = run_compress(cfg, progress)
    table = Table(title=f"{report['regime']} export: {report['system_prompt_tokens']} system-prompt tokens")
    columns = ["edge ← cloud", "kept ch.", "attn err (prune)", "attn err (total)", "value err", "bytes"]
    r2_keys = [k for k in ("r2_k", "r2_v", "r2_hidden") if report["layers"] and k in report["layers"][0]]
    columns += [f"R² {k[3:]}" for k in r2_keys]
    for column in columns:
        table.add_column(column, justify="right")
    for r in report["layers"]:
        total = "–" if r["attn_error_total"] is None else f"{r['attn_error_total']:.4f}"
        cells = [f"{r['edge_layer']} ← {r['cloud_layer']}", f"{r['kept_channels']}/{r['head_dim']}",
                 f"{r['attn_error_prune']:.4f}", total,
                 f"{r['value_error']:.4f}", f"{r['bytes']:,}"]
        cells += [f"{r[k]:.3f}" for k in r2_keys]
        table.add_row(*cells)
    console.print(table)
    console.print(f"bytes: {report['bytes_written']:,} written vs {report['raw_fp16_cloud_bytes']:,} raw fp16 cloud KV "
                  f"({report['ratio_vs_cloud_fp16']:.2f}×; {report['ratio_vs_shipped_fp16']:.2f}× vs the shipped "
                  f"tensors in fp16) → {report['out']}")
