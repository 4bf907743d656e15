"""A cloud-distilled shared prefix (issue 37): K trainable edge-shaped KV tokens of every layer, placed before every
system prompt and trained ONCE across many training prompts, so that the edge reading [prefix | prompt] predicts
what the teacher predicts reading the prompt alone. Per-prompt distillation can only relearn the cloud's general
lead (how it writes) from a few dozen answers of each prompt; a prefix trained across prompts keeps it once
(prefix tuning, Li & Liang 2021, with Cartridges' frozen model and a teacher's targets instead of labels).

Each training prompt's synthetic set is `edgekv distill`'s own (`synthetic.py`: the same teacher, queries and
top-k targets, kept per prompt, so a later per-prompt run reuses them). A step takes one training prompt (a
seeded order) and `batch` of its exchanges: the edge prefills the prompt *after* the current prefix (the gradient
runs through that prefill too, unless `grad_through_prompt` is off: then the prompt's KV under the current prefix
is a constant of the step) and the loss is the top-k KL of `student.sample_losses`. Whole training prompts are held
out for early stopping. The result is a `shared-prefix` export (`edgekv.kv.shared_prefix`).

`shared_targets: text` needs no generation at all: the teacher reads each training prompt once (its targets kept
beside the prompt's synthetic set, so a later run on the same prompts needs no teacher), and the edge,
reading the prompt's first half after the prefix, learns the teacher's top-k on every token of the second half (one
sample a prompt, so `batch: 1`). It is the cheapest teacher data there is, a prompt's worth of targets for one
forward pass; the gate (`kv/shared_prefix.py`) checks much the same KL, on the same half of a prompt. With
`reply_sources`, a conversation's prompt also carries its next turns (the JSONL's `labels`: the user turn and the
reply, as the eval lays a request out) and its step averages the text's loss and each reply's (or, with
`reply_weight` w, takes (1 - w) of the text's and w of the replies' mean), toward the teacher reading the whole
conversation: the eval scores replies, and the text targets only reach them by chance. `reply_step_weight` scales
such a step's whole loss, so more conversations can keep the gradient share fewer had.

`shared_targets: labels` is `prefix-sft`, the reference a reviewer asks for: the same K tokens trained by
next-token loss on the training prompts' own (user, reference) pairs (the JSONL's `labels`), labels the cloud path
never needs; a one-hot target through the same top-k KL is exactly that cross-entropy.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.attention.prefix_kv import PrefixKV, joined, prefill_after, prefix_kv, read_after
from edgekv.config import changed
from edgekv.distill.student import Student, sample_losses, train_prefix
from edgekv.distill.synthetic import keep_set, kept_set, synthetic_set
from edgekv.distill.teacher import Sample
from edgekv.kv.export import token_ids_sha256
from edgekv.kv.shared_prefix import SharedPrefix, write_shared_prefix
from edgekv.kv.train_loop import example_index
from edgekv.models.loading import LoadedModel
from edgekv.models.mixed import float32_scoring
from edgekv.models.structure import attn_shape, model_device
from edgekv.models.targets import top_targets
from edgekv.plots import loss_curve
from edgekv.progress import Tasks
from edgekv.texts import jsonl_records, read_text, reference_ids


def init_ids(edge: LoadedModel, text: str, tokens: int) -> torch.Tensor:
    """The K token ids the prefix starts from: `text` tokenized (with the model's special tokens), repeated to
    length K and cut there."""
    ids = edge.tokenizer(text, add_special_tokens=True)["input_ids"]
    more = edge.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not more:
        raise EdgeKVError("shared_init must be a non-empty text")
    while len(ids) < tokens:
        ids += more
    return torch.tensor(ids[:tokens], dtype=torch.long)


def initial_prefix(edge: LoadedModel, ids: torch.Tensor, freeze_first: int) -> Student:
    """The trainable prefix at step 0: the edge's own prefill of `ids` (K tokens at positions 0..K−1)."""
    if ids.numel():
        init = prefix_kv(edge.model, ids)
    else:
        _, kv_heads, head_dim = attn_shape(edge.model)
        empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=next(edge.model.parameters()).dtype,
                            device=model_device(edge.model))
        init = [(empty, empty)] * edge.num_layers
    return Student(init, ids.numel(), freeze_first=min(freeze_first, ids.numel()))


def warm_prefix(start_from: SharedPrefix, freeze_first: int) -> tuple[torch.Tensor, Student]:
    """(its K token ids, the trainable prefix at step 0) of a warm start: a trained prefix's KV as it ships, so
    a run on other prompts goes on from where that one ended."""
    ids = torch.tensor(start_from.manifest["system_prompt"]["token_ids"], dtype=torch.long)
    layers = [start_from.prefix.layer(i) for i in range(start_from.prefix.num_layers)]
    return ids, Student(layers, start_from.tokens, freeze_first=min(freeze_first, start_from.tokens))


def prompts_hash(prompts: list[tuple[str, str]]) -> str:
    """sha256 of the training prompts (names and texts, in order)."""
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()


def split_prompts(n: int, held: int, seed: int) -> tuple[list[int], list[int]]:
    """(training prompt indices, held-out prompt indices): `held` whole prompts out by a seeded shuffle."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[held:]), sorted(order[:held])


def reading(edge: LoadedModel, student: Student, ids: torch.Tensor, grad: bool = True) -> PrefixKV:
    """What the edge reads for a prompt under the current prefix (`read_after`); without `grad`, the prompt's KV
    is a constant of the step."""
    prefix = student.prefix()
    if grad:
        return read_after(edge.model, prefix, ids)
    with torch.no_grad():
        own = prefill_after(edge.model, prefix, ids)
    return joined(prefix, own)


def label_ids(edge: LoadedModel, labels: list[dict], tokens: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(index, user ids, reference ids) of each (user, reference) pair whose both parts are non-empty, the reference
    cut to its first `tokens` tokens, as the eval scores it."""
    out = []
    for j, pair in enumerate(labels):
        user = torch.tensor(edge.tokenizer(pair["user"], add_special_tokens=False)["input_ids"], dtype=torch.long)
        ref = reference_ids(edge.tokenizer, pair["reference"], tokens)
        if user.numel() and ref.numel():  # a one-token reference (MMLU's gold letter) counts
            out.append((j, user, ref))
    return out


def label_samples(edge: LoadedModel, labels: list[dict], tokens: int) -> list[Sample]:
    """(user, reference) pairs as samples whose one target per row is the next token (log-prob 0: one-hot)."""
    out = []
    for _, user, ref in label_ids(edge, labels, tokens):
        seq = torch.cat([user, ref])
        out.append(Sample("label", user, ref, seq[1:, None], torch.zeros(seq.numel() - 1, 1)))
    return out


TEXT = "text"  # .json + .safetensors beside a prompt's synthetic set: its text targets


def _teacher_rows(teacher: LoadedModel, seq: torch.Tensor, h: int, top_k: int, where: Path | None, stem: str
                  ) -> tuple[torch.Tensor, torch.Tensor, float | None, bool]:
    """The teacher's top-k (ids, log-probs) on the rows predicting tokens h+1.. of `seq`, read alone in one forward;
    its seconds (None when read back from a keep that predates their record); whether it was read back from
    `where`, where they are kept per teacher and sequence under `stem`."""
    key = {"teacher": teacher.fingerprint, "top_k": top_k, "prompt_sha256": token_ids_sha256(seq.tolist()),
           "targets_from": h}
    kept = kept_set(where, stem, key) if where is not None else None
    if kept is not None:
        return kept[1]["top_ids"], kept[1]["top_logp"], kept[0].get("teach_s"), True
    start = time.perf_counter()
    with torch.no_grad(), float32_scoring():  # targets are scores: under mixed a head of few rows stays float32
        logits = teacher.model(input_ids=seq[None].to(model_device(teacher.model)), logits_to_keep=seq.numel() - h)
    top_logp, top_ids = (t.cpu().contiguous() for t in top_targets(logits.logits[0, :-1], top_k))
    seconds = time.perf_counter() - start
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
        keep_set(where, stem, {"top_ids": top_ids, "top_logp": top_logp}, {"key": key, "teach_s": seconds})
    return top_ids, top_logp, seconds, False


def text_sample(teacher: LoadedModel, ids: torch.Tensor, top_k: int, where: Path | None = None
                ) -> tuple[torch.Tensor, Sample, float | None, bool]:
    """`shared_targets: text`: (the prompt's first half, which the edge reads after the prefix; its second half as
    one sample whose targets are the teacher's top-k reading the whole prompt alone; the teacher's seconds; whether
    they were read back from `where`). One teacher forward, no generation: every token of the second half is a
    target."""
    h = ids.numel() // 2
    top_ids, top_logp, seconds, kept = _teacher_rows(teacher, ids, h, top_k, where, TEXT)
    return ids[:h], Sample("text", ids[h:h + 1], ids[h + 1:], top_ids, top_logp), seconds, kept


def reply_samples(teacher: LoadedModel, edge: LoadedModel, ids: torch.Tensor, labels: list[dict], tokens: int,
                  top_k: int, where: Path | None = None) -> tuple[list[Sample], float, int]:
    """`reply_sources`: one sample per (user turn, reply) of a conversation's labels, laid out as the eval asks it
    (the whole prompt, the user turn, the reply's first `tokens`). The edge reads the prompt's first half after the
    prefix, as its text sample does, so one prefill serves both; the loss is on the reply alone, toward the teacher
    reading prompt + turn + reply in one forward (a conversation's next turn is its own text, not an annotation).
    Returns (samples, the recorded teacher seconds of those read back, how many were read back)."""
    h, out, seconds, read_back = ids.numel() // 2, [], 0.0, 0
    for j, user, ref in label_ids(edge, labels, tokens):
        top_ids, top_logp, s, kept = _teacher_rows(teacher, torch.cat([ids, user, ref]), h, top_k, where,
                                                   f"reply{j}")
        out.append(Sample("reply", torch.cat([ids[h:], user]), ref, top_ids, top_logp))
        seconds += (s or 0.0) if kept else 0.0  # new ones count in the caller's wall time
        read_back += kept
    return out, seconds, read_back


def prompt_labels(path: str, required: bool = True) -> dict[str, list[dict]]:
    """name → the (user, reference) pairs of a training prompts JSONL (its `labels`); with `required`, every record
    must have them."""
    out = {}
    for n, data in jsonl_records(read_text(path, "--prompts").splitlines(), path):
        labels = data.get("labels") if isinstance(data, dict) else None
        if not labels and not required:  # none, or an empty list
            continue
        if not isinstance(labels, list) or not labels or not all(
                isinstance(x, dict) and isinstance(x.get("user"), str) and isinstance(x.get("reference"), str)
                for x in labels):
            who = "shared_targets labels" if required else "reply_sources"
            raise EdgeKVError(f"{path}:{n}: {who} needs 'labels': [{{\"user\", \"reference\"}}, …]")
        out[data["name"]] = labels
    return out


def run_shared(cfg, edge: LoadedModel, teacher: LoadedModel | None, prompts: list[tuple[str, str]],
               tasks: Tasks) -> dict:
    """Train the shared prefix on `prompts` under `cfg.out` (resumable: synthetic sets per prompt, the training
    checkpoint) and write it to `cfg.out/prefix`; returns the report (also `report.json`)."""
    out = Path(cfg.out)
    if (out / "prefix" / "manifest.json").exists() and (out / "report.json").exists():
        return json.loads((out / "report.json").read_text(encoding="utf-8"))
    if len(prompts) < cfg.held_prompts + 1:
        raise EdgeKVError(f"--train-shared needs more than --held-prompts ({cfg.held_prompts}) training prompts, "
                          f"got {len(prompts)}")
    start_from = SharedPrefix(cfg.shared_start, edge) if cfg.shared_start else None  # checked before any teacher work
    if start_from is not None and start_from.tokens != cfg.shared_tokens:
        raise EdgeKVError(f"--shared-start {start_from.path} holds K = {start_from.tokens} tokens, --shared-tokens "
                          f"says {cfg.shared_tokens}")
    ids = []
    for name, text in prompts:
        t = torch.tensor(edge.tokenizer(text, add_special_tokens=True)["input_ids"], dtype=torch.long)
        if not text.strip() or t.numel() == 0:
            raise EdgeKVError(f"{name}: the system prompt is empty")
        ids.append(t)
    sets: list[list[Sample]] = []
    read_back, unrecorded, kept_s = 0, 0, 0.0  # text targets an earlier run of this teacher kept, and their seconds
    replies: dict[int, list[Sample]] = {}  # training prompt → its conversation's replies (reply_sources)
    train_idx, held_idx = split_prompts(len(prompts), cfg.held_prompts, cfg.seed)
    start = time.perf_counter()
    if cfg.shared_targets == "labels":  # prefix-sft: no teacher at all
        labels = prompt_labels(cfg.prompts)
        sets = [label_samples(edge, labels[name], cfg.label_tokens) for name, _ in prompts]
    elif cfg.shared_targets == "text":  # the edge reads a prompt's first half and learns the teacher on the rest
        labels = prompt_labels(cfg.prompts, required=False) if cfg.reply_sources else {}
        advance = tasks.task("teacher reads the prompts", len(prompts))
        for k, ((name, _), t) in enumerate(zip(prompts, ids)):
            if t.numel() < 4:
                raise EdgeKVError(f"{name}: shared_targets text needs a system prompt of at least 4 tokens")
            where = Path(cfg.synthetic_dir or out / "synthetic") / name
            ids[k], sample, seconds, kept = text_sample(teacher, t, cfg.top_k, where)
            read_back += kept
            unrecorded += kept and seconds is None
            kept_s += seconds if kept and seconds is not None else 0.0
            sets.append([sample])
            # training prompts only: the held-out KL stays the text targets' measure
            if name.split("-", 1)[0] in cfg.reply_sources and name in labels and k not in held_idx:
                replies[k], s, n = reply_samples(teacher, edge, t, labels[name], cfg.label_tokens, cfg.top_k, where)
                read_back, kept_s = read_back + n, kept_s + s
            advance()
    else:
        for (name, _), t in zip(prompts, ids):  # the teacher reads each prompt alone: no prefix on its side
            samples, _ = synthetic_set(cfg, teacher, edge, None, t, out / "synthetic" / name, tasks, None)
            sets.append(samples)
    teach_s = time.perf_counter() - start + kept_s  # the kept targets' seconds, measured when they were made
    for (name, _), samples in zip(prompts, sets):
        if not samples:
            raise EdgeKVError(f"{name}: no usable exchanges to train the shared prefix on")
    for p, more in replies.items():
        sets[p] += more
    if start_from is None:
        first = init_ids(edge, cfg.shared_init, cfg.shared_tokens)
        student = initial_prefix(edge, first, cfg.freeze_first)
    else:
        first, student = warm_prefix(start_from, cfg.freeze_first)

    def loss(step: int) -> torch.Tensor:
        p = train_idx[example_index(step, len(train_idx), cfg.seed)]
        if p in replies and cfg.reply_step_weight is not None:  # a conversation's share of the gradient
            return cfg.reply_step_weight * step_loss(step, p)
        return step_loss(step, p)

    def step_loss(step: int, p: int) -> torch.Tensor:
        prefix = reading(edge, student, ids[p], cfg.grad_through_prompt)
        if cfg.shared_targets == "text":  # the prompt's text and its replies, all on one prefill of its first half
            picks = sets[p]
            w = cfg.reply_weight
            if w is not None and p in replies:  # sets[p] is [text, *replies]
                text, more = ([] if w == 1 else picks[:1]), (picks[1:] if w else [])
                losses = sample_losses(edge, prefix, text + more, cfg.query_loss)  # one packed forward
                return ((1 - w) * losses[0] if text else 0.0) + w * sum(losses[len(text):]) / max(len(more), 1)
        else:
            picks = [sets[p][example_index(step * cfg.batch + j, len(sets[p]), cfg.seed + 1)]
                     for j in range(cfg.batch)]
        return sum(sample_losses(edge, prefix, picks, cfg.query_loss)) / len(picks)

    @torch.no_grad()
    def held_kl(prefixed: bool = True) -> float:
        kls = []
        for p in held_idx:
            prefix = reading(edge, student, ids[p], grad=False) if prefixed else PrefixKV.of_model(edge.model, ids[p])
            kls += [float(x) for x in sample_losses(edge, prefix, sets[p][:cfg.held_samples])]
        return sum(kls) / len(kls)

    start = time.perf_counter()
    log_, best = train_prefix(cfg, edge, student, loss, held_kl, out / "train", tasks, "train the shared prefix")
    # every process's training seconds (the checkpoint keeps them), not only this call's: a run finished by a resume
    total = next((e["seconds"] for e in reversed(log_) if "seconds" in e), None)
    train_s = total if total is not None else time.perf_counter() - start
    labels = cfg.shared_targets == "labels"
    info = {"targets": cfg.shared_targets, "teacher": None if labels else cfg.teacher,
            "teacher_fingerprint": None if labels else teacher.fingerprint, "prompts": len(prompts),
            "prompts_sha256": prompts_hash(prompts), "train_prompts": [prompts[i][0] for i in train_idx],
            "held_out_prompts": [prompts[i][0] for i in held_idx], "steps": log_[-1]["step"] if log_ else 0,
            "best_step": best["step"], "held_out_kl": best["kl"],
            "initial_held_out_kl": log_[0].get("held_out_kl") if log_ else None,
            "no_prefix_held_out_kl": held_kl(prefixed=False),  # EdgePrompt: the edge reading the prompt alone
            "lr": cfg.lr, **changed(cfg, "lr_schedule", "lr_decay_from"), "batch": cfg.batch,
            "freeze_first": student.freeze_first, "query_loss": cfg.query_loss,
            "grad_through_prompt": cfg.grad_through_prompt, "init_text": cfg.shared_init, "seed": cfg.seed,
            "reply_sources": cfg.reply_sources, "reply_weight": cfg.reply_weight,
            "reply_step_weight": cfg.reply_step_weight,
            **changed(cfg, "keep", "label_tokens"), **({"started_from": start_from.describe()} if start_from else {}),
            "reply_samples": sum(map(len, replies.values()))}
    path = write_shared_prefix(out / "prefix", edge, student.kv(), first, info, cfg.quant)
    report = {"out": str(path), "shared_prefix": info, "teach_s": teach_s, "train_s": train_s,
              "train_s_all_processes": total is not None,
              "targets_read_back": read_back, "targets_read_back_without_seconds": unrecorded,
              "synthetic_samples": sum(map(len, sets)), "log": log_}
    if log_:
        loss_curve(log_, out / "loss_curve.png", f"shared prefix: K={cfg.shared_tokens}, {len(train_idx)} prompts")
    write_text_atomic(out / "report.json", json.dumps(report, indent=1))
    return report
