"""The student of a distillation: an edge-shaped prefix KV of P' tokens that the edge reads, trained so the edge
predicts what the teacher predicts (Cartridges, Eyuboglu et al. 2025). It starts at the edge's own prefill (of the
whole prompt when P' = P, else of P' tokens chosen by `select_tokens`), learns by the exact top-k + tail KL of
`models.targets.topk_kl` with every model weight frozen, and ships as an ordinary EdgePrompt-format export
(`distill_job.py`). At step 0 with P' = P the student *is* the edge's own prefill: EdgePrompt exactly. The first
`freeze_first` tokens (the attention sink) can be kept at their initial KV, as Cartridges does. With a `codec`
the student is read as it will ship (ThinK-pruned and quantized, `kv.encode.coded`) and trained through it
straight-through (Bengio et al. 2013): the loss sees the shipped KV, the gradient updates the float KV beneath it.
A step's sequences are read after the student packed into one forward (relay attention), not one forward each:
a training step 1.8× faster on the default edge (`bench/student_pack.py`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_tensors_atomic, write_text_atomic
from edgekv.attention.prefix_kv import PrefixKV, joined, packed_continuation_logits, prefill_after, prefix_kv
from edgekv.distill.teacher import Sample
from edgekv.kv.train_loop import Trainee, cosine, example_index, train_loop
from edgekv.models.loading import LoadedModel
from edgekv.models.targets import topk_kl
from edgekv.progress import Tasks

RULES = ("first", "even", "all")


def select_tokens(n: int, keep: int, rule: str) -> tuple[torch.Tensor, int]:
    """(indices of the P' prompt tokens the student starts from, the position a request continues at).
    `first`: the first P' tokens, read as a prompt of their own (requests continue at P'); `even`: P' tokens
    evenly spaced over the prompt, the first and the last included, keeping their KV and positions from the
    full prefill (requests continue at P); `all`: every token (P' = P)."""
    if rule not in RULES:
        raise EdgeKVError(f"unknown token rule '{rule}' (choose from {', '.join(RULES)})")
    if not 1 <= keep <= n:
        raise EdgeKVError(f"--length must be in [1, {n}] (the system prompt's tokens), got {keep}")
    if rule == "all" or keep == n:
        return torch.arange(n), n
    if rule == "first":
        return torch.arange(keep), keep
    return torch.linspace(0, n - 1, keep).round().long().unique(), n


class Student:
    """The trainable prefix KV: per layer, keys and values initialised at the edge's own KV of the chosen tokens,
    trained outright (`full`) or as a low-rank delta per KV head (`lowrank`: K₀ + U·V with U zero at the start,
    so step 0 is the initial KV exactly). Tensors are float32; the prefix is cast to the model's dtype."""

    def __init__(self, init: list[tuple[torch.Tensor, torch.Tensor]], next_position: int, param: str = "full",
                 rank: int = 8, seed: int = 0, dtype: torch.dtype | None = None, freeze_first: int = 0,
                 front: PrefixKV | None = None, codec: Callable | None = None):
        """`front`: a fixed prefix the student is read after (a shared prefix, issue 37); `next_position` then
        counts from its end. `codec(i, keys, values)`: layer i's (kv_heads, P', d) KV as the edge reads it back
        from the export (None: as trained)."""
        if param not in ("full", "lowrank"):
            raise EdgeKVError(f"--param must be 'full' or 'lowrank', got '{param}'")
        self.param, self.next_position, self.freeze_first, self.front = param, next_position, freeze_first, front
        self.codec = codec
        self.dtype = dtype or init[0][0].dtype
        self.base = [(k.detach().float().clone(), v.detach().float().clone()) for k, v in init]
        g = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}
        for i, (k, _) in enumerate(self.base):
            _, h, p, d = k.shape
            for kv in "kv":
                if param == "full":
                    self.tensors[f"{i}.{kv}"] = self.base[i]["kv".index(kv)].clone()
                else:
                    self.tensors[f"{i}.{kv}.u"] = torch.zeros(h, p, rank)
                    self.tensors[f"{i}.{kv}.v"] = torch.randn(h, rank, d, generator=g) / d ** 0.5

    @property
    def tokens(self) -> int:
        """P': tokens of the student prefix."""
        return self.base[0][0].shape[2]

    def parameters(self) -> list[torch.Tensor]:
        """The trained tensors, in a fixed order."""
        return [self.tensors[n] for n in sorted(self.tensors)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (1, kv_heads, P', d) keys and values (float32, differentiable); the first `freeze_first`
        tokens are the initial KV itself (no gradient reaches them)."""
        if self.param == "full":
            k, v = self.tensors[f"{i}.k"], self.tensors[f"{i}.v"]
        else:
            k0, v0 = self.base[i]
            k = k0 + (self.tensors[f"{i}.k.u"] @ self.tensors[f"{i}.k.v"])[None]
            v = v0 + (self.tensors[f"{i}.v.u"] @ self.tensors[f"{i}.v.v"])[None]
        f = self.freeze_first
        if f:
            k0, v0 = self.base[i]
            k, v = torch.cat([k0[:, :, :f], k[:, :, f:]], 2), torch.cat([v0[:, :, :f], v[:, :, f:]], 2)
        return k, v

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's KV as the edge reads it: through the codec when there is one, its value what the export's
        codes decode to and its gradient the float KV's (straight-through)."""
        k, v = self.layer(i)
        if self.codec is None:
            return k, v
        with torch.no_grad():  # the export is encoded from the model's dtype
            k_hat, v_hat = self.codec(i, k[0].to(self.dtype), v[0].to(self.dtype))
        return k_hat[None] + (k - k.detach()), v_hat[None] + (v - v.detach())  # + 0: the codes' value exactly

    def prefix(self) -> PrefixKV:
        """The student as a prefix the edge reads (in the model's dtype), after its `front` when it has one."""
        layers = [tuple(t.to(self.dtype) for t in self.read(i)) for i in range(len(self.base))]
        if self.front is not None:
            return joined(self.front, layers, self.front.prefix_len + self.next_position)
        return PrefixKV(layers, self.tokens, next_position=self.next_position)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (kv_heads, P', d) keys and values as trained, detached (what an export ships)."""
        with torch.no_grad():
            return [tuple(t[0].detach().clone() for t in self.layer(i)) for i in range(len(self.base))]


def initial_student(edge: LoadedModel, system_ids: torch.Tensor, keep: int, rule: str, param: str = "full",
                    rank: int = 8, seed: int = 0, freeze_first: int = 0, front: PrefixKV | None = None,
                    codec: Callable | None = None) -> tuple[Student, torch.Tensor]:
    """The student at step 0 and the prompt token indices it holds: the edge's own prefill of the whole prompt,
    kept at the chosen tokens (`even`, `all`), or the edge's prefill of the first P' tokens alone (`first`); read
    after `front` (a shared prefix) when given."""
    index, next_position = select_tokens(system_ids.numel(), keep, rule)
    fill = (lambda ids: prefix_kv(edge.model, ids)) if front is None else (  # noqa: E731
        lambda ids: prefill_after(edge.model, front, ids))
    with torch.no_grad():
        if rule == "first" and index.numel() < system_ids.numel():
            init = fill(system_ids[index])
        else:
            full = fill(system_ids)
            init = [(k[:, :, index], v[:, :, index]) for k, v in full]
    return Student(init, next_position, param, rank, seed, dtype=init[0][0].dtype, freeze_first=freeze_first,
                   front=front, codec=codec), index


PACK_TOKENS = 1024  # tokens of one packed forward: bounds its logits (tokens × vocab) and activations


def _packs(samples: list[Sample]) -> Iterator[list[Sample]]:
    """Consecutive runs of samples of at most `PACK_TOKENS` tokens read (a longer sample is a pack alone)."""
    pack: list[Sample] = []
    size = 0
    for s in samples:
        n = s.user.numel() + s.answer.numel() - 1
        if pack and size + n > PACK_TOKENS:
            yield pack
            pack, size = [], 0
        pack.append(s)
        size += n
    if pack:
        yield pack


def sample_losses(edge: LoadedModel, prefix: PrefixKV, samples: list[Sample], query_loss: bool = False
                  ) -> list[torch.Tensor]:
    """Each sample's KL(teacher ‖ edge-on-prefix) over the teacher's top-k and the tail, mean over the answer's
    tokens (and the query's own tokens after its first, with `query_loss`); the samples are read after the prefix
    packed, up to `PACK_TOKENS` a forward."""
    losses: list[torch.Tensor] = []
    for pack in _packs(samples):
        seqs = [torch.cat([s.user, s.answer[:-1]]) for s in pack]
        for s, logits in zip(pack, packed_continuation_logits(edge.model, prefix, seqs)):
            first = 0 if query_loss else s.answer_from
            losses.append(topk_kl(logits[first:], s.top_ids[first:], s.top_logp[first:]))
    return losses


def sample_loss(edge: LoadedModel, prefix: PrefixKV, s: Sample, query_loss: bool = False) -> torch.Tensor:
    """`sample_losses` of one sample."""
    return sample_losses(edge, prefix, [s], query_loss)[0]


@torch.no_grad()
def held_out_kl(edge: LoadedModel, student: Student, samples: list[Sample]) -> float:
    """Mean KL to the teacher over held-out samples, on their answers (the same measure whatever the loss)."""
    return float(sum(float(x) for x in sample_losses(edge, student.prefix(), samples)) / max(1, len(samples)))


def split_samples(samples: list[Sample], held_out: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out) by a seeded shuffle; at least one of each when there are two or more samples."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = min(max(1, round(held_out * len(samples))), len(samples) - 1) if len(samples) > 1 else 0
    held = sorted(order[:n_held])
    return [samples[i] for i in sorted(order[n_held:])], [samples[i] for i in held]


def train_student(cfg: Any, edge: LoadedModel, student: Student, train: list[Sample], held: list[Sample],
                  checkpoint: Path, tasks: Tasks) -> tuple[list[dict], dict]:
    """train_loop on the student (`cfg`: a DistillConfig), `cfg.batch` sequences a step, held-out KL every
    `eval_every` steps (see `train_prefix`)."""

    def loss(step: int) -> torch.Tensor:
        prefix = student.prefix()
        picks = [train[example_index(step * cfg.batch + j, len(train), cfg.seed)] for j in range(cfg.batch)]
        return sum(sample_losses(edge, prefix, picks, cfg.query_loss)) / cfg.batch

    return train_prefix(cfg, edge, student, loss, lambda: held_out_kl(edge, student, held), checkpoint, tasks,
                        "train the student")


def train_prefix(cfg: Any, edge: LoadedModel, student: Student, loss: Callable[[int], torch.Tensor],
                 held_kl: Callable[[], float], checkpoint: Path, tasks: Tasks, title: str) -> tuple[list[dict], dict]:
    """train_loop on a trainable prefix (`cfg`: lr, lr_schedule, lr_decay_from, steps, eval_every, patience) with
    the step's `loss`; the held-out KL every `eval_every` steps; the best held-out state is kept (in the checkpoint,
    so a resumed run knows it) and restored at the end (`keep: last`: the state training ended on, with its held-out
    KL, is kept instead); stops after `patience` evaluations without improvement."""
    if cfg.steps > 0 and edge.quantization and edge.quantization.get("quantized"):
        raise EdgeKVError("training a KV (per prompt or shared) needs the gradient through the edge, and its "
                          "quantized linears have no backward: load the edge with --weights bf16")
    best_path = checkpoint / "best.safetensors"
    best = {"step": 0, "kl": float("inf")}
    if best_path.exists() and (checkpoint / "best.json").exists():
        best = json.loads((checkpoint / "best.json").read_text(encoding="utf-8"))
    snapshot: dict[str, torch.Tensor] = {}

    def evaluate(step: int) -> dict:
        kl = held_kl()
        if kl < best["kl"]:
            best.update(step=step, kl=kl)
            snapshot.clear()
            snapshot.update({n: t.detach().clone() for n, t in student.tensors.items()})
        return {"kl": kl}

    def save(path: Path) -> None:
        if snapshot:
            write_tensors_atomic(best_path, snapshot)
            write_text_atomic(path / "best.json", json.dumps(best))

    trainee = Trainee([{"params": student.parameters()}], loss, save=save, evaluate=evaluate, frozen=[edge.model])
    stop = lambda step: step - best["step"] >= cfg.patience * cfg.eval_every  # noqa: E731
    log_ = []
    if cfg.steps:
        schedule = cosine(cfg.steps, cfg.lr_decay_from) if cfg.lr_schedule == "cosine" else None
        log_ = train_loop(trainee, cfg.steps, cfg.lr, checkpoint, cfg.eval_every, tasks.task(title, cfg.steps), stop,
                          schedule)
    if cfg.keep == "last":  # a finished run's checkpoint holds its last state: resumed, no step trains again
        kl = log_[-1].get("held_out_kl") if log_ else None  # the loop evaluates the step it ends on
        return log_, {"step": log_[-1]["step"] if log_ else 0, "kl": kl if kl is not None else held_kl()}
    if not snapshot and best_path.exists():
        snapshot.update(load_file(str(best_path)))
    with torch.no_grad():
        for n, t in snapshot.items():
            student.tensors[n].copy_(t)
    if best["kl"] == float("inf"):
        best["kl"] = held_kl()
    return log_, best
