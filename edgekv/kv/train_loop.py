"""The one training loop of the project: Adam on a list of tensors through frozen models, one example per step in
a seeded order, resumable bit-exactly from a safetensors + JSON checkpoint. What is trained (translator maps,
fuser gates, a distilled prefix KV) and its loss are the caller's; the loop, its checkpoint and its log are here.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_tensors_atomic, write_text_atomic


def example_index(step: int, n: int, seed: int) -> int:
    """A fresh seeded permutation per epoch: the order of step s never depends on how many steps are asked for."""
    epoch = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + step // n))
    return int(epoch[step % n])


def cosine(steps: int, start: int = 0) -> Callable[[int], float]:
    """The learning rate's factor at step s (0-based): 1 until `start`, then half a cosine from 1 to 0 at `steps`
    (a constant run's last stretch decayed, so the steps before `start` are that run's steps exactly)."""
    return lambda step: 0.5 * (1 + math.cos(math.pi * min(max(step - start, 0), steps - start) / max(steps - start, 1)))


def optimizer_tensors(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as named tensors (`opt.<n>.<key>`), for a safetensors checkpoint."""
    return {f"opt.{n}.{k}": v.detach().reshape(v.shape).contiguous().clone()
            for n, p in enumerate(params) for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}


def restore_optimizer(params: list[torch.Tensor], opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `optimizer_tensors` (resume is bit-exact)."""
    for n, p in enumerate(params):
        state = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{n}.")}
        if state:
            opt.state[p] = {k: (v if k != "step" else v.reshape(())) for k, v in state.items()}


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(state tensors, progress) of a checkpoint directory, or None when there is none."""
    if not (path / "progress.json").exists():
        return None
    return load_file(str(path / "state.safetensors")), json.loads((path / "progress.json").read_text())


@dataclass
class Trainee:
    """What a run trains and how: Adam parameter groups, the loss of one step's example, and optionally a
    held-out evaluation and the usable artefact written beside each checkpoint."""

    groups: list[dict]  # torch.optim param groups: {"params": [...], optional "lr": ...}
    loss: Callable[[int], torch.Tensor]  # step (0-based) → the loss of that step's example
    save: Callable[[Path], None] | None = None  # write the trained thing into the checkpoint directory
    evaluate: Callable[[int], dict[str, float]] | None = None  # step → held-out numbers, logged as held_out_<key>
    clip: float | None = None  # max gradient norm
    loss_key: str = "train_loss"  # the log's name for the step's loss
    frozen: list[torch.nn.Module] = field(default_factory=list)  # models whose weights never learn

    @property
    def params(self) -> list[torch.Tensor]:
        """Every trained tensor, in group order (the checkpoint's order)."""
        return [p for g in self.groups for p in g["params"]]


def _save(path: Path, trainee: Trainee, opt: torch.optim.Optimizer, step: int, log: list,
          seconds: float | None) -> None:
    params = trainee.params
    tensors = {f"param.{n}": p.detach().clone().contiguous() for n, p in enumerate(params)}
    tensors.update(optimizer_tensors(params, opt))
    write_tensors_atomic(path / "state.safetensors", tensors)
    if trainee.save is not None:
        trainee.save(path)
    write_text_atomic(path / "progress.json", json.dumps({"step": step, "log": log, "seconds": seconds}))  # last


def _load(path: Path, trainee: Trainee, opt: torch.optim.Optimizer) -> tuple[int, list, float | None]:
    found = read_checkpoint(path)
    if found is None:
        return 0, [], 0.0
    tensors, progress = found
    params = trainee.params
    shapes = [tuple(tensors[f"param.{n}"].shape) if f"param.{n}" in tensors else None for n in range(len(params))]
    if sum(k.startswith("param.") for k in tensors) != len(params) or shapes != [tuple(p.shape) for p in params]:
        raise EdgeKVError(f"{path}: the checkpoint trained other tensors; use a new output directory")
    with torch.no_grad():
        for n, p in enumerate(params):
            p.copy_(tensors[f"param.{n}"])
    restore_optimizer(params, opt, tensors)
    return progress["step"], progress["log"], progress.get("seconds")  # None: saved before seconds were kept


def train_loop(trainee: Trainee, steps: int, lr: float, checkpoint: str | Path | None = None, every: int = 50,
               on_step: Callable[[int, dict], None] | None = None,
               stop: Callable[[int], bool] | None = None,
               schedule: Callable[[int], float] | None = None) -> list[dict]:
    """Run `steps` steps of Adam (resuming from `checkpoint` when it holds a state); held-out numbers at step 0
    of a fresh run, every `every` steps and at the end; a checkpoint every `every` steps and at the end;
    `stop(step)` may end early (a time budget); `schedule(step)` scales each group's learning rate (a function of
    the step alone, so a resumed run takes the same rates). Returns the log, one entry per step; each checkpointed
    entry has `seconds`, the loop's wall seconds to that step over every process that ran it (None when the
    checkpoint predates them)."""
    for model in trainee.frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    params = trainee.params
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(trainee.groups, lr=lr)
    base_lrs = [g["lr"] for g in opt.param_groups]
    start, log, before = _load(Path(checkpoint), trainee, opt) if checkpoint else (0, [], 0.0)
    began = time.perf_counter()
    held = lambda step: {f"held_out_{k}": v for k, v in trainee.evaluate(step).items()}  # noqa: E731
    if start == 0 and trainee.evaluate is not None:
        log.append({"step": 0, **held(0)})
    try:
        for step in range(start, steps):
            value = trainee.loss(step)
            opt.zero_grad()
            value.backward()
            if schedule is not None:
                for g, base in zip(opt.param_groups, base_lrs):
                    g["lr"] = base * schedule(step)
            if trainee.clip is not None:
                torch.nn.utils.clip_grad_norm_(params, trainee.clip)
            opt.step()
            entry = {"step": step + 1, trainee.loss_key: float(value.detach())}
            due = (step + 1) % every == 0
            if trainee.evaluate is not None and due:  # before `stop`: an early stop asks how the last evaluation went
                entry.update(held(step + 1))
            done = step + 1 == steps or (stop is not None and stop(step + 1))
            if trainee.evaluate is not None and done and not due:
                entry.update(held(step + 1))
            log.append(entry)
            if on_step:
                on_step(step + 1, entry)
            if checkpoint and (due or done):
                entry["seconds"] = None if before is None else before + time.perf_counter() - began
                _save(Path(checkpoint), trainee, opt, step + 1, log, entry["seconds"])
            if done:
                break
    finally:
        for p in params:
            p.requires_grad_(False)
    return log
