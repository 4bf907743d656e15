"""`edgekv distill`: a cloud-distilled, edge-native KV export per system prompt (see student.py and teacher.py).

For one system prompt (`--system-prompt TEXT|@FILE`) or a JSONL of them (`--prompts`, one {"name",
"system_prompt"} per line), each in its own folder under `--out`, resumable per prompt and within one: the
synthetic set with the teacher's targets (`synthetic.safetensors` + `synthetic.json`), the training checkpoint
(`train/`), then the export (`kv/`, written last and atomically: a folder with `kv/manifest.json` is done),
`report.json` and `loss_curve.png`. The export is EdgePrompt's format (every edge layer, edge-shaped KV) with a
`distilled` manifest entry, so `serve-edge` loads it with no translator and refuses it for another edge.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.cluster import run_items
from edgekv.config import (
    changed,
    command_config,
    ray_setting,
    seed_setting,
    setting,
    to_dict,
    workers_setting,
)
from edgekv.distill.shared import run_shared
from edgekv.distill.student import (
    RULES,
    Student,
    initial_student,
    split_samples,
    train_student,
)
from edgekv.distill.synthetic import synthetic_set
from edgekv.distill.teacher import (
    INSTRUCTION,
    RECALL,
    RECALL_FORMAT,
    RECALL_HEAD,
    SEED_PROMPTS,
    UNWRITTEN,
    WRITER,
)
from edgekv.kv.catalog import Catalog, export_key
from edgekv.kv.cloud_kv import same_model_layers
from edgekv.kv.codecs import check_scheme
from edgekv.kv.encode import coded, encode_layer
from edgekv.kv.export import export_manifest, model_info, token_ids_sha256, write_export
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.models.loading import LoadedModel, check_tokenizers, load_model
from edgekv.models.settings import ModelSettings
from edgekv.models.structure import context_limit
from edgekv.plots import loss_curve
from edgekv.progress import Tasks
from edgekv.texts import read_prompts, read_system_prompt

log = logging.getLogger("edgekv")

# Generic seed instructions (Cartridges' self-study seeds, in the plain-text form the edge's user prompts take):
# none names a dataset or copies a dataset's own user prompt.
INSTRUCTIONS = [
    "\nWrite a one-sentence summary of the text above.\nSummary:",
    "\nAsk a question about the text above, then answer it.\nQuestion:",
    "\nContinue the text above.\n",
    "\nExplain one part of the text above in plain words.\nExplanation:",
]


# the recipe `edgekv distill` shipped before issue 34 (the eval's `distill-v1`): 8 sampled answers to the fixed
# instructions, 40 tokens each, 30 single-sequence steps at lr 5e-3, nothing frozen, the loss on answers only
V1_RECIPE = dict(queries=8, seeds=["instruction"], max_answer_tokens=40, temperature=0.8, on_policy=0.0, top_k=64,
                 held_out=0.25, query_loss=False, freeze_first=0, batch=1, steps=30, lr=5e-3, eval_every=5, patience=3)


@command_config("distill")
@dataclass
class DistillConfig(ModelSettings):
    """Everything `edgekv distill` needs; see configs/distill.yaml."""

    out: str = setting("runs/distill", "Output folder, a subfolder per prompt (resumable).")
    system_prompt: str | None = setting(None, "One system prompt: TEXT or @FILE.")
    prompts: str | None = setting(None, "JSONL of {\"name\", \"system_prompt\"}, one export each.")
    synthetic_dir: str | None = None  # a root kept apart (<root>/<name>/synthetic.*): runs of one teacher share it
    teacher: str = setting("cloud", "cloud, or self (the edge reading the whole prompt, after "
                                          "--shared's prefix when one is given).")
    length: int | None = setting(None, "Student tokens P'.", shown="the whole prompt")
    compress: int | None = setting(None, "Student tokens P' = ceil(P / N), instead of --length.")
    rule: str = setting("first", "Which tokens a shorter student starts from: first or even.")
    param: str = setting("full", "full (K, V trained) or lowrank (a rank-r delta).")
    rank: int = setting(8, "Rank of the lowrank delta per KV head.")
    # the synthetic set (teacher.py): `queries` exchanges, their seed types drawn round robin from `seeds`
    queries: int = setting(8, "Synthetic exchanges per prompt.")
    seeds: list[str] = setting(
        help="Seed types, comma-separated: structuring, summarization, question, use-case, creative, instruction, "
             "recall.",
        factory=lambda: [INSTRUCTION])
    seed_prompts: dict[str, str] = field(default_factory=lambda: dict(SEED_PROMPTS))
    instructions: list[str] = field(default_factory=lambda: list(INSTRUCTIONS))  # the `instruction` seed type
    answer_format: str = "\n{query}\nAnswer:"  # how a written query is put to the teacher (and the student)
    window_tokens: int = 48  # the part of the prompt the query writer reads
    max_query_tokens: int = 32
    query_temperature: float = 1.0
    max_answer_tokens: int = 40
    temperature: float = 0.8  # answers: 0 greedy, else sampled (seeded per query)
    on_policy: float = setting(0.0, "Share of answers the student samples, the teacher scores.")
    top_k: int = 64  # the teacher's top-k (+ the tail's mass) each token is matched on
    teacher_batch: int = 64  # requests decoded together by the teacher (and the student)
    # training
    held_out: float = 0.25  # share of the synthetic set held out for early stopping
    query_loss: bool = setting(False, "Loss on the query's tokens too.", toggle="--query-loss/--answer-loss")
    freeze_first: int = setting(0, "First tokens kept at their initial KV.")
    batch: int = setting(1, "Sequences per training step.")
    steps: int = setting(30, "Most training steps.")
    lr: float = setting(5e-3, "Adam learning rate.")
    lr_schedule: str = setting("constant", "The learning rate over the steps: constant, or cosine (to 0 at --steps).")
    lr_decay_from: int = setting(0, "Cosine: the step its decay starts from (the rate is constant before it).")
    eval_every: int = 5
    patience: int = 3  # held-out evaluations without improvement before stopping
    keep: str = setting("best", "The trained state exported: best (the lowest held-out KL) or last (where "
                                "training ended).")
    quant: str = setting("bf16", "Export codec: fp32, fp16, bf16, int8, int4, int2.")
    prune_ratio: float = 0.0  # ThinK on top of the trained KV
    train_codec: bool = setting(False, "Train the student through the export codec (--quant, ThinK's prune ratio), "
                                       "straight-through: the loss sees the KV as it ships.",
                                toggle="--train-codec/--train-float")
    window: int = 32
    seed: int = seed_setting()
    shared: str | None = setting(None, "A shared prefix (--train-shared) the student is read after: per-prompt "
                                       "distillation on top of it.")
    # a shared prefix trained once across --prompts (issue 37, distill/shared.py) instead of an export per prompt
    train_shared: bool = setting(False, "Train one shared prefix across --prompts (written to OUT/prefix).",
                                 toggle="--train-shared/--per-prompt")
    shared_tokens: int = setting(32, "K: tokens of the shared prefix.")
    shared_start: str | None = setting(None, "--train-shared: start from this trained shared prefix (its K tokens' "
                                             "KV) instead of the edge's prefill of shared_init.",
                                       shown="the edge's prefill of shared_init")
    shared_init: str = "The text below is a document. A question or an instruction about it follows, then a " \
                       "careful answer that uses the document. "  # the prefix's first K tokens (repeated to K)
    held_prompts: int = setting(2, "Training prompts held out for the shared prefix's early stopping.")
    held_samples: int = 8  # exchanges per held-out prompt the held-out KL is measured on
    grad_through_prompt: bool = setting(True, "Shared prefix: the gradient runs through the prompt's prefill after "
                                              "the prefix.", toggle="--grad-through-prompt/--prompt-kv-constant")
    shared_targets: str = setting("teacher", "The shared prefix learns the cloud's top-k on synthetic exchanges "
                                             "(teacher), on the prompts' own second halves (text), or the prompts' "
                                             "own labels (labels: prefix-sft).")
    label_tokens: int = 64  # prefix-sft and replies: reference tokens trained on (the eval scores the first 64)
    reply_sources: list[str] = setting(
        help="Shared prefix, text targets: training prompts of these sources (name prefix SOURCE-) whose labels are "
             "a conversation's next turns also learn the teacher on each reply, read after the whole prompt.",
        factory=list)
    reply_weight: float | None = setting(
        None, "Shared prefix, replies: a conversation's step is (1 - w) x its text loss + w x its replies' mean "
              "(1: the replies alone).", shown="every sample weighted alike")
    reply_step_weight: float | None = setting(
        None, "Shared prefix, replies: a conversation's whole step loss times this (115/400: 400 conversations "
              "weigh in the gradient as 115 do).", shown="1")
    catalog: str | None = setting(None, "Also put each export in this catalog (folder or fsspec URL).")
    ray: str | None = ray_setting()
    workers: int = workers_setting()

    def validate(self) -> None:
        """One-line errors before any model is loaded."""
        if (self.system_prompt is None) == (self.prompts is None):
            raise EdgeKVError("give exactly one of --system-prompt and --prompts")
        if self.ray is not None and self.prompts is None:
            raise EdgeKVError("--ray runs --prompts batches (one export per prompt)")
        if self.workers < 1:
            raise EdgeKVError(f"--workers must be ≥ 1, got {self.workers}")
        if self.teacher not in ("cloud", "self"):
            raise EdgeKVError(f"--teacher must be 'cloud' or 'self', got '{self.teacher}'")
        if self.rule not in RULES:
            raise EdgeKVError(f"--rule must be one of {', '.join(RULES)}, got '{self.rule}'")
        if self.length is not None and self.compress is not None:
            raise EdgeKVError("give --length or --compress, not both")
        if (self.length is not None and self.length < 1) or (self.compress is not None and self.compress < 1):
            raise EdgeKVError("--length and --compress must be ≥ 1")
        self.check_models()
        if self.queries < 2 or self.max_answer_tokens < 2 or self.max_query_tokens < 1 or self.steps < 0:
            raise EdgeKVError("distill needs queries ≥ 2, max_answer_tokens ≥ 2, max_query_tokens ≥ 1 and "
                              "steps ≥ 0")
        unknown = [s for s in self.seeds if s not in UNWRITTEN and s not in self.seed_prompts]
        if not self.seeds or unknown:
            raise EdgeKVError(f"unknown seed type(s) {unknown} (choose from "
                              f"{', '.join([*self.seed_prompts, *UNWRITTEN])})" if unknown else "give ≥ 1 seed type")
        if INSTRUCTION in self.seeds and not self.instructions:
            raise EdgeKVError("the 'instruction' seed type needs ≥ 1 instruction")
        if "{query}" not in self.answer_format:
            raise EdgeKVError("answer_format must contain {query}")
        if not 0 <= self.on_policy <= 1 or self.window_tokens < 1 or self.teacher_batch < 1:
            raise EdgeKVError("on_policy must be in [0, 1]; window_tokens and teacher_batch ≥ 1")
        if not 0 < self.held_out < 1 or self.top_k < 1 or self.eval_every < 1 or self.patience < 1:
            raise EdgeKVError("held_out must be in (0, 1); top_k, eval_every and patience ≥ 1")
        check_scheme(self.quant)
        if self.keep not in ("best", "last"):
            raise EdgeKVError(f"--keep must be best or last, got '{self.keep}'")
        if self.lr_schedule not in ("constant", "cosine"):
            raise EdgeKVError(f"--lr-schedule must be constant or cosine, got '{self.lr_schedule}'")
        if self.lr_decay_from and (self.lr_schedule != "cosine" or not 0 < self.lr_decay_from < self.steps):
            raise EdgeKVError(f"--lr-decay-from needs --lr-schedule cosine and 0 < it < --steps ({self.steps}), got "
                              f"{self.lr_decay_from}")
        if self.batch < 1 or self.freeze_first < 0:
            raise EdgeKVError("batch must be ≥ 1 and freeze_first ≥ 0")
        if self.shared_start and not self.train_shared:
            raise EdgeKVError("--shared-start is where --train-shared starts from; give --train-shared")
        if self.train_shared and self.shared:
            raise EdgeKVError("--train-shared trains a shared prefix; --shared reads a trained one (give one of them)")
        if self.train_shared:
            if self.prompts is None or self.ray is not None or self.catalog is not None:
                raise EdgeKVError("--train-shared trains on --prompts (a JSONL of training prompts), in this process, "
                                  "without --catalog")
            if self.on_policy:
                raise EdgeKVError("--train-shared uses teacher answers only (--on-policy 0): on-policy samples are "
                                  "drawn from a per-prompt student")
            if self.shared_targets not in ("teacher", "labels", "text"):
                raise EdgeKVError(f"--shared-targets must be teacher, labels or text, got '{self.shared_targets}'")
            if self.reply_sources and self.shared_targets != "text":
                raise EdgeKVError("--reply-sources adds replies to text targets (--shared-targets text)")
            if self.reply_weight is not None and (not self.reply_sources or not 0 <= self.reply_weight <= 1):
                raise EdgeKVError("--reply-weight weighs --reply-sources' replies: give both, the weight in [0, 1]")
            if self.reply_step_weight is not None and (not self.reply_sources or not self.reply_step_weight > 0):
                raise EdgeKVError("--reply-step-weight scales --reply-sources' steps: give both, the weight > 0")
            if self.shared_tokens < 0 or self.held_prompts < 1 or self.held_samples < 1:
                raise EdgeKVError("--shared-tokens must be ≥ 0, --held-prompts and held_samples ≥ 1")


def prompts_of(cfg: DistillConfig) -> list[tuple[str, str]]:
    """(name, system prompt) pairs: the one prompt (`prompt`), or each line of the `--prompts` JSONL."""
    if cfg.system_prompt is not None:
        return [("prompt", read_system_prompt(cfg.system_prompt))]
    return read_prompts(cfg.prompts)


def student_length(cfg: DistillConfig, n: int) -> int:
    """P' for a prompt of n tokens."""
    if cfg.compress is not None:
        return max(1, -(-n // cfg.compress))
    return n if cfg.length is None else cfg.length


def distill_one(cfg: DistillConfig, edge: LoadedModel, teacher: LoadedModel, name: str, prompt: str,
                tasks: Tasks) -> dict:
    """Distil one system prompt into `out/name/kv`; resumes; returns its report."""
    work = Path(cfg.out) / name
    if (work / "kv" / "manifest.json").exists() and (work / "report.json").exists():
        return json.loads((work / "report.json").read_text(encoding="utf-8"))
    ids = torch.tensor(edge.tokenizer(prompt, add_special_tokens=True)["input_ids"], dtype=torch.long)
    if not prompt.strip() or ids.numel() == 0:
        raise EdgeKVError(f"{name}: the system prompt is empty")
    seeds = [cfg.seed_prompts[k] for k in cfg.seeds if k not in UNWRITTEN]
    longest_writer = max((len(edge.tokenizer(WRITER.format(window="", seed=p), add_special_tokens=False)["input_ids"])
                          for p in seeds), default=0) + cfg.window_tokens + 8 + cfg.max_query_tokens  # a re-encoded
    # window may take a few more tokens than it had
    longest_user = max([len(edge.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in cfg.instructions]
                       + [cfg.max_query_tokens + 8])
    if RECALL in cfg.seeds:  # a re-encoded head may take a few more tokens than it had
        longest_user = max(longest_user, RECALL_HEAD + 8 + len(
            edge.tokenizer(RECALL_FORMAT.format(head=""), add_special_tokens=False)["input_ids"]))
    need = ids.numel() + max(longest_writer, longest_user + cfg.max_answer_tokens)
    for who in {id(edge): edge, id(teacher): teacher}.values():
        if need > context_limit(who.model.config):
            raise EdgeKVError(f"{name}: system prompt + instruction + answer = {need} tokens exceeds {who.spec}'s "
                              f"context of {context_limit(who.model.config)} tokens")
    keep = student_length(cfg, ids.numel())
    if keep > ids.numel():
        raise EdgeKVError(f"{name}: --length {keep} is beyond the system prompt's {ids.numel()} tokens")
    work.mkdir(parents=True, exist_ok=True)
    shared = SharedPrefix(cfg.shared, edge) if cfg.shared else None
    queries = same_model_layers(edge, ids, 0, cfg.window, cfg.seed, shared=shared)  # the edge's queries score ThinK
    codec = (lambda i, k, v: coded(k, v, queries[i].q_obs, cfg.prune_ratio, cfg.quant)) if cfg.train_codec else None
    student, index = initial_student(edge, ids, keep, cfg.rule, cfg.param, cfg.rank, cfg.seed, cfg.freeze_first,
                                     shared.prefix if shared else None, codec)
    samples, meta = synthetic_set(cfg, teacher, edge, student, ids, work, tasks, shared)
    train, held = split_samples(samples, cfg.held_out, cfg.seed)
    start = time.perf_counter()
    log_, best = train_student(cfg, edge, student, train, held, work / "train", tasks)
    train_s = time.perf_counter() - start  # this call's share: a resumed run counts only what it added
    report = student_export(cfg, edge, teacher, student, ids, index, work, shared, {
        "teacher": cfg.teacher, "teacher_fingerprint": teacher.fingerprint, "length": keep, "rule": cfg.rule,
        "param": cfg.param, "rank": cfg.rank if cfg.param == "lowrank" else None,
        "steps": log_[-1]["step"] if log_ else 0, "best_step": best["step"], "held_out_kl": best["kl"],
        "initial_held_out_kl": log_[0].get("held_out_kl") if log_ else None, "samples": len(samples),
        "train_samples": len(train), "held_out_samples": len(held),
        "answer_tokens": int(sum(s.answer.numel() for s in samples)),
        "supervised_tokens": int(sum(s.answer.numel() + (s.user.numel() - 1) * cfg.query_loss for s in train)),
        "on_policy_samples": sum(s.policy == "student" for s in samples), "seed": cfg.seed, "seeds": cfg.seeds,
        "freeze_first": cfg.freeze_first, "query_loss": cfg.query_loss, "batch": cfg.batch, "lr": cfg.lr,
        **changed(cfg, "lr_schedule", "lr_decay_from", "keep", "train_codec")}, queries)
    report.update({k: meta.get(k) for k in ("generate_s", "targets_s", "prefill_s", "teach_s", "student_s",
                                            "score_s")}, train_s=train_s, log=log_)
    if log_:
        loss_curve(log_, work / "loss_curve.png", f"{name}: distill (teacher {cfg.teacher}, P'={keep})")
    write_text_atomic(work / "report.json", json.dumps(report, indent=1))
    return report


def student_export(cfg: DistillConfig, edge: LoadedModel, teacher: LoadedModel, student: Student,
                   ids: torch.Tensor, index: torch.Tensor, work: Path, shared: SharedPrefix | None,
                   distilled: dict, queries: list | None = None) -> dict:
    """The student as an EdgePrompt-format export (edge-shaped KV of every layer) + its report; under a shared
    prefix, the student's own tokens (positions relative to the prefix's end) and the prefix's fingerprint.
    `queries`: the edge's `same_model_layers` of the prompt, when the caller has them."""
    if queries is None:  # the edge's queries score ThinK
        queries = same_model_layers(edge, ids, 0, cfg.window, cfg.seed, shared=shared)
    tensors, entries = {}, []
    for layer, (k, v) in zip(queries, student.kv()):
        # the student lives on the model's device, the captured queries on the CPU (where exports are encoded)
        layer.keys, layer.values = k.detach().to("cpu", edge.model.dtype), v.detach().to("cpu", edge.model.dtype)
        t, e, _ = encode_layer(layer, cfg.prune_ratio, cfg.quant, 0)
        tensors[layer.edge_layer] = t
        entries.append(e)
    info = model_info(edge)
    manifest = export_manifest(
        info, edge, ids, entries, regime="same-model", splice="replace", start_layer=0, mapping="none",
        map_location="none", local_sink_tokens=0,
        prune={"method": "think", "ratio": cfg.prune_ratio, "window": cfg.window, "keep_recent": 0,
               "queries": "own window"},
        quant=cfg.quant, kv_tokens=student.tokens, next_position=student.next_position,
        kv_token_index=index.tolist(), distilled=distilled,
        **({"under_shared": shared.describe()} if shared is not None else {}))
    write_export(work / "kv", manifest, tensors)
    written = sum(e["bytes"] for e in entries)
    full_fp16 = 2 * int(ids.numel()) * info["num_kv_heads"] * info["head_dim"] * 2 * info["num_layers"]
    return {"out": str(work / "kv"), "system_prompt_tokens": int(ids.numel()), "kv_tokens": student.tokens,
            "bytes_written": written, "full_fp16_bytes": full_fp16, "ratio_vs_full_fp16": full_fp16 / written,
            "distilled": distilled}


# settings that never change an export's bytes (where things go, where the prompts came from, what runs them)
NOT_IDENTITY = {"out", "system_prompt", "prompts", "synthetic_dir", "catalog", "ray", "workers"}


class DistillWorker:
    """Distils one (name, prompt) under `cfg.out` (and into `cfg.catalog`); built once per process (it loads the
    edge, and the cloud only for the cloud teacher)."""

    def __init__(self, cfg: DistillConfig, models: tuple[LoadedModel | None, LoadedModel] | None = None,
                 progress=None):
        self.cfg, self.tasks = cfg, Tasks(progress)
        if models is not None:
            cloud, self.edge = models
        else:
            self.edge = load_model(cfg.edge, cfg.dtype, device=cfg.device)
            cloud = load_model(cfg.cloud, cfg.dtype, device=cfg.device) if self.needs_cloud(cfg) else None
        self.teacher = self.edge if cfg.teacher == "self" else cloud
        if self.teacher is not None:
            check_tokenizers(self.teacher.tokenizer, self.edge.tokenizer)
        self.catalog = Catalog(cfg.catalog) if cfg.catalog else None

    @staticmethod
    def needs_cloud(cfg: DistillConfig) -> bool:
        """The cloud teaches (not --teacher self, not a prefix trained on labels)."""
        return cfg.teacher == "cloud" and not (cfg.train_shared and cfg.shared_targets == "labels")

    def __call__(self, item: tuple[str, str]) -> dict:
        """{report, row, computed}: the prompt's report (its loss log left out) and, with a catalog, its index row
        and whether this call put the entry there."""
        name, prompt = item
        report = distill_one(self.cfg, self.edge, self.teacher, name, prompt, self.tasks)
        row, computed = None, False
        if self.catalog is not None:  # keyed like compress's entries: everything that determines the bytes
            sha = token_ids_sha256(self.edge.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            settings = {k: v for k, v in to_dict(self.cfg).items() if k not in NOT_IDENTITY}
            key = export_key({"edge": self.edge.fingerprint, "teacher": self.teacher.fingerprint, "prompt": sha,
                              "settings": settings, "distill": True})
            row, computed = {"key": key, "name": name, "prompt_sha256": sha}, self.catalog.status(key) != "ok"
            if computed:  # missing, or damaged (then written again whole)
                row = self.catalog.put(key, name, report["out"], sha, index=False)
        return {"report": {k: v for k, v in report.items() if k != "log"}, "row": row, "computed": computed}


def run_distill(cfg: DistillConfig, progress=None, models: tuple[LoadedModel, LoadedModel] | None = None) -> dict:
    """Distil every prompt (skipping those already done), in this process or on Ray (`cfg.ray`: `cfg.workers`
    actors that each load the models once; the folders under `cfg.out` must then be one file system for all, or
    give `cfg.catalog`); a failed prompt is reported and skipped, never left as a half export. `models` = (cloud,
    edge) already loaded (in-process only); the cloud is never loaded for `--teacher self`."""
    cfg.validate()
    prompts = prompts_of(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.json", json.dumps(to_dict(cfg), indent=1))
    if cfg.train_shared:
        worker = DistillWorker(cfg, models, progress)
        return {"shared": run_shared(cfg, worker.edge, worker.teacher, prompts, worker.tasks)}
    use_ray = cfg.ray is not None
    advance = Tasks(progress).task("distil system prompts", len(prompts))
    results = run_items(lambda: DistillWorker(cfg, None if use_ray else models, None if use_ray else progress),
                        prompts, address=cfg.ray or None, workers=cfg.workers, on_done=lambda r: advance(),
                        use_ray=use_ray)
    reports, failed, written = {}, {}, []
    for r in results:
        name = r["item"][0]
        if "error" in r:
            if len(prompts) == 1:
                raise EdgeKVError(r["error"])
            failed[name] = r["error"]
            log.warning("%s: %s (skipped)", name, r["error"])
            continue
        reports[name] = r["report"]
        if r["row"] is not None:
            written.append((r["row"], r["computed"]))
    if cfg.catalog:
        Catalog(cfg.catalog).list_written(written)
    summary = {"prompts": len(prompts), "done": len(reports), "failed": failed, "reports": reports}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    return summary
