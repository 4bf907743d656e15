"""A system prompt's synthetic set, made once per teacher and settings and kept (safetensors + JSON): the
teacher writes and answers queries over one prefill, the student answers its on-policy share, the teacher scores
those; every sample carries the teacher's top-k targets."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_tensors_atomic, write_text_atomic
from edgekv.distill.student import Student
from edgekv.distill.teacher import UNWRITTEN, BatchedTeacher, Sample, plan_seeds, student_answers, synthesize
from edgekv.kv.export import token_ids_sha256
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.models.loading import LoadedModel
from edgekv.progress import Tasks

SYNTHETIC_KEYS = ("queries", "seeds", "seed_prompts", "instructions", "answer_format", "window_tokens",
                  "max_query_tokens", "query_temperature", "max_answer_tokens", "temperature", "on_policy", "top_k",
                  "seed")
STUDENT_KEYS = ("student", "length", "rule", "shared")  # what an on-policy set's key adds for its student
SYNTHETIC = "synthetic"  # .json + .safetensors: the set with its targets
TEACHER_PART = "teacher-part"  # .json + .safetensors beside the set: the teacher's share of an on-policy set


def synthetic_set(cfg: Any, teacher: LoadedModel, edge: LoadedModel, student: Student, ids: torch.Tensor,
               work: Path, tasks: Tasks, shared: SharedPrefix | None) -> tuple[list[Sample], dict]:
    """The synthetic set with its targets (`cfg`: a DistillConfig; `shared`: the prefix the student reads, already
    loaded): read back when this teacher made it before, else made and kept (an on-policy set also keeps the
    teacher's share on its own, for students of other lengths). Its seconds: the teacher's prefill, writing the
    queries, answering, the student's on-policy answers, the teacher scoring them."""
    where = Path(cfg.synthetic_dir) / work.name if cfg.synthetic_dir else work
    where.mkdir(parents=True, exist_ok=True)
    key = {"teacher": teacher.fingerprint, **{k: getattr(cfg, k) for k in SYNTHETIC_KEYS},
           "prompt_sha256": token_ids_sha256(ids.tolist()), "format": 2}
    if cfg.on_policy:  # the student's samples depend on where it starts
        key.update(student=edge.fingerprint, length=student.tokens, rule=cfg.rule)
        if shared is not None:  # the student read after a shared prefix samples other answers; by content, so a
            key["shared"] = shared.fingerprint  # prefix retrained in place is not read as the old one
    teacher_reads = self_under_shared(cfg, shared)
    if teacher_reads is not None:  # the teacher's prefill differs, so its answers do (kept apart from the plain set)
        key["teacher_under_shared"] = teacher_reads.fingerprint
    if (kept := kept_set(where, SYNTHETIC, key)) is not None:
        meta, t = kept
        return _samples(t, meta["seed"], meta["policy"]), meta
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    model = BatchedTeacher.of_prompt(teacher, ids, teacher_reads.prefix if teacher_reads else None,
                                     max_batch=cfg.teacher_batch)
    lap("prefill_s")
    plan = plan_seeds(cfg.seeds, cfg.queries)
    written = sum(p not in UNWRITTEN for p in plan)
    # the teacher's share does not depend on the student: students of other lengths (ce-lslm-distill and its @c8)
    # read it back and sample only their own answers
    part_key = {k: v for k, v in key.items() if k not in STUDENT_KEYS}
    part = _read_teacher_part(where, part_key) if cfg.on_policy else None
    if part is None:
        order = torch.randperm(len(plan), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        theirs = set(order[:round(cfg.on_policy * len(plan))])  # the exchanges whose answer the student samples
        samples, left = synthesize(model, ids, plan, [n in theirs for n in range(len(plan))], cfg.seed_prompts,
                                   cfg.instructions, cfg.answer_format, cfg.window_tokens, cfg.max_query_tokens,
                                   cfg.query_temperature, cfg.max_answer_tokens, cfg.temperature, cfg.top_k,
                                   cfg.seed, tasks.task("teacher writes and answers", len(plan)))
        lap("teach_s")
        if cfg.on_policy:
            _write_teacher_part(where, part_key, samples, left, seconds["teach_s"])
    else:  # its seconds are the ones it took: a set's cost stays what it costs on its own
        samples, left, seconds["teach_s"] = part
        clock = time.perf_counter()
    if left:
        with torch.no_grad():
            on = BatchedTeacher(edge, student.prefix(), max_batch=cfg.teacher_batch)
            drawn = student_answers(on, left, cfg.max_answer_tokens, cfg.temperature, cfg.seed + 1,
                                    tasks.task("student answers", len(left)))
        lap("student_s")
        model.score(drawn, cfg.top_k, tasks.task("teacher scores", len(drawn)))
        lap("score_s")
        samples += drawn
    if len(samples) < 2:
        raise EdgeKVError("the teacher answered fewer than 2 queries (every answer was empty)")
    meta = {"key": key, "seed": [s.seed for s in samples], "policy": [s.policy for s in samples],
            "teacher_part_read_back": part is not None, "planned": cfg.queries, "written": written, **seconds,
            "generate_s": sum(seconds.values()) - seconds.get("score_s", 0.0), "targets_s": seconds.get("score_s", 0.0),
            "supervised_tokens": int(sum(s.answer.numel() for s in samples)),
            "query_tokens": int(sum(s.user.numel() for s in samples))}
    keep_set(where, SYNTHETIC, _tensors(samples), meta)
    return samples, meta


def self_under_shared(cfg: Any, shared: SharedPrefix | None) -> SharedPrefix | None:
    """The shared prefix a self teacher reads before the prompt (None for a cloud teacher or no prefix): the edge as
    it is deployed, so an uncompressed student of every token starts at the teacher and only its codec is learnt."""
    return shared if cfg.teacher == "self" else None


def _write_teacher_part(where: Path, key: dict, samples: list[Sample], left: list[tuple[str, torch.Tensor]],
                        teach_s: float) -> None:
    """Keep the teacher's answered samples and the queries it left to the student."""
    tensors = _tensors(samples) | {f"left{n}.user": user.clone().contiguous() for n, (_, user) in enumerate(left)}
    keep_set(where, TEACHER_PART, tensors,
          {"key": key, "seed": [s.seed for s in samples], "left": [kind for kind, _ in left], "teach_s": teach_s})


def _read_teacher_part(where: Path, key: dict) -> tuple[list[Sample], list[tuple[str, torch.Tensor]], float] | None:
    """The teacher's share kept under this key, or None."""
    if (kept := kept_set(where, TEACHER_PART, key)) is None:
        return None
    meta, t = kept
    samples = _samples(t, meta["seed"], ["teacher"] * len(meta["seed"]))
    return samples, [(kind, t[f"left{n}.user"]) for n, kind in enumerate(meta["left"])], meta["teach_s"]


def keep_set(where: Path, stem: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write `stem`'s tensors, then its JSON (with the key), each atomically: the JSON last marks the pair whole."""
    write_tensors_atomic(where / f"{stem}.safetensors", tensors)
    write_text_atomic(where / f"{stem}.json", json.dumps(meta))


def kept_set(where: Path, stem: str, key: dict) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """`stem`'s JSON and tensors kept in `where` under this key, or None."""
    meta_path, tensor_path = where / f"{stem}.json", where / f"{stem}.safetensors"
    if not (meta_path.exists() and tensor_path.exists()):
        return None
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta["key"] != key:
        return None
    return meta, load_file(str(tensor_path))


def clear_synthetic(where: Path) -> None:
    """Forget a set and its teacher's share kept in `where`, so the next `synthetic_set` makes them afresh."""
    for stem in (SYNTHETIC, TEACHER_PART):
        for ext in (".json", ".safetensors"):
            (where / f"{stem}{ext}").unlink(missing_ok=True)


def _tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """The samples' tensors as safetensors keys `<n>.<field>`."""
    return {f"{n}.{name}": getattr(s, name).clone().contiguous() for n, s in enumerate(samples)
            for name in ("user", "answer", "top_ids", "top_logp")}


def _samples(t: dict[str, torch.Tensor], seeds: list[str], policies: list[str]) -> list[Sample]:
    """Samples read back from `_tensors`' keys."""
    return [Sample(kind, t[f"{n}.user"], t[f"{n}.answer"], t[f"{n}.top_ids"], t[f"{n}.top_logp"], policy)
            for n, (kind, policy) in enumerate(zip(seeds, policies))]
