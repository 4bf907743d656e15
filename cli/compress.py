"""`edgekv compress`: ThinK-pruned, quantized, mapped cloud KV of a system prompt, as a KV export."""

from __future__ import annotations

import sys

import typer
from rich.table import Table

from cli.common import config_command, console, progress_bar
from edgekv.kv.batch_compress import run_compress_batch
from edgekv.kv.compress_job import CompressConfig, run_compress


@config_command(CompressConfig, "compress")
def compress(cfg: CompressConfig) -> None:
    """Compress the cloud's system-prompt KV (ThinK pruning, quantization, cross-model maps) into a KV export."""
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
