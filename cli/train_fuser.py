"""`edgekv train-fuser`: train a fuser's gates (cloud KV beside the edge's own) and choose its hard gates."""

from __future__ import annotations

from cli.common import config_command, console, progress_bar
from edgekv.kv.fuser_job import TrainFuserConfig, run_train_fuser


@config_command(TrainFuserConfig, "train_fuser", "YAML config, e.g. configs/train_fuser.yaml.")
def train_fuser(cfg: TrainFuserConfig) -> None:
    """Train a fuser on the cloud's next-token distributions and choose its per-layer hard gates."""
    with progress_bar() as progress:
        gates = run_train_fuser(cfg, progress)
    console.print(f"held-out NLL: every gate closed {gates['closed_nll']:.4f}, all open {gates['all_open_nll']:.4f},"
                  f" chosen {gates['chosen_nll']:.4f} with layers {gates['open'] or 'none'} open "
                  f"({gates['texts']} texts); {gates['steps']} steps → {cfg.out}/")
