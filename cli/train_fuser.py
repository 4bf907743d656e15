"""`edgekv train-fuser`: train a fuser's gates (cloud KV beside the edge's own) and choose its hard gates."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.common import console, one_line_errors, progress_bar
from edgekv.config import load_config
from edgekv.kv.fuser_job import TrainFuserConfig, run_train_fuser


@one_line_errors
def train_fuser(
    out: Optional[Path] = typer.Option(None, help="Output directory (resumes from its checkpoint) [runs/fuser-m12]."),
    cloud: Optional[str] = typer.Option(None, help="Cloud model [default-cloud]."),
    edge: Optional[str] = typer.Option(None, help="Edge model [default-edge]."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    gate: Optional[str] = typer.Option(None, help="fuse-bias or fuse-residual [fuse-bias]."),
    self_fuse: Optional[bool] = typer.Option(None, "--self-fuse/--no-self-fuse",
                                             help="Train edge → edge (the adapter-only control) [no]."),
    mapping: Optional[Path] = typer.Option(None, help="mapping.json of `edgekv align` [strategy from start layer]."),
    strategy: Optional[str] = typer.Option(None, help="uniform or last-aligned when no mapping [last-aligned]."),
    start_layer: Optional[int] = typer.Option(None, help="First edge layer that may fuse [12]."),
    train_texts: Optional[int] = typer.Option(None, help="Training texts (ShareGPT from record 100) [120]."),
    xsum_texts: Optional[int] = typer.Option(None, help="XSum documents added to training (from record 107) [0]."),
    gate_texts: Optional[int] = typer.Option(None, help="Held-out texts that choose the hard gates [24]."),
    steps: Optional[int] = typer.Option(None, help="Most training steps (one text each) [2000]."),
    minutes: Optional[float] = typer.Option(None, help="Training time budget [10]."),
    lr: Optional[float] = typer.Option(None, help="Adam learning rate [0.05 bias, 1e-3 residual]."),
    map_lr: Optional[float] = typer.Option(None, help="Also train the hidden-state maps at this rate [fixed]."),
    ce_weight: Optional[float] = typer.Option(None, help="Weight of cross-entropy on the text beside the KL [0]."),
    cache: Optional[Path] = typer.Option(None, help="Feature cache (safetensors per text) [runs/fuser-cache]."),
    ship: Optional[Path] = typer.Option(None, help="Also write the compact fuser (open layers, fp16 maps) here."),
    max_open: Optional[int] = typer.Option(None, help="At most this many open layers, the most useful [no limit]."),
    seed: Optional[int] = typer.Option(None, help="Seed [0]."),
    config: Optional[Path] = typer.Option(None, help="YAML config, e.g. configs/train_fuser.yaml."),
) -> None:
    """Train a fuser on the cloud's next-token distributions and choose its per-layer hard gates."""
    overrides = dict(out=str(out) if out else None, cloud=cloud, edge=edge, dtype=dtype, device=device, gate=gate,
                     self_fuse=self_fuse,
                     mapping=str(mapping) if mapping else None, strategy=strategy, start_layer=start_layer,
                     train_texts=train_texts, xsum_texts=xsum_texts, gate_texts=gate_texts, steps=steps,
                     minutes=minutes, lr=lr, map_lr=map_lr,
                     ce_weight=ce_weight, cache=str(cache) if cache else None, seed=seed,
                     ship=str(ship) if ship else None, max_open=max_open)
    cfg = load_config(TrainFuserConfig, "train_fuser", config, overrides)
    with progress_bar() as progress:
        gates = run_train_fuser(cfg, progress)
    console.print(f"held-out NLL: every gate closed {gates['closed_nll']:.4f}, all open {gates['all_open_nll']:.4f},"
                  f" chosen {gates['chosen_nll']:.4f} with layers {gates['open'] or 'none'} open "
                  f"({gates['texts']} texts); {gates['steps']} steps → {cfg.out}/")
