"""`edgekv distill`: a cloud-distilled, edge-native KV export per system prompt (see distill.py).

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
from safetensors.torch import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_tensors_atomic, write_text_atomic
from edgekv.cluster import run_items
from edgekv.config import command_config, to_dict
from edgekv.kv.catalog import Catalog, export_key
from edgekv.kv.compress_job import encode_layer, model_info, same_model_layers
from edgekv.kv.distill import (
    RULES,
    Sample,
    Student,
    held_out_kl,
    initial_student,
    sample_loss,
    split_samples,
    synthesize,
    teacher_targets,
)
from edgekv.kv.export import token_ids_sha256, tokenizer_fingerprint, write_export
from edgekv.kv.train_loop import Trainee, example_index, train_loop
from edgekv.models.loading import DTYPES, LoadedModel, check_tokenizers, load_model
from edgekv.models.structure import context_limit
from edgekv.plots import loss_curve
from edgekv.progress import Steps
from edgekv.texts import jsonl_records, read_system_prompt

log = logging.getLogger("edgekv")

# Generic seed instructions (Cartridges' self-study seeds, in the plain-text form the edge's user prompts take):
# none names a dataset or copies a dataset's own user prompt.
INSTRUCTIONS = [
    "\nWrite a one-sentence summary of the text above.\nSummary:",
    "\nAsk a question about the text above, then answer it.\nQuestion:",
    "\nContinue the text above.\n",
    "\nExplain one part of the text above in plain words.\nExplanation:",
]


@command_config("distill")
@dataclass
class DistillConfig:
    """Everything `edgekv distill` needs; see configs/distill.yaml."""

    out: str = "runs/distill"
    cloud: str = "default-cloud"
    edge: str = "default-edge"
    dtype: str = "bfloat16"
    device: str = "cpu"  # cpu, cuda or auto (CUDA when torch sees one)
    system_prompt: str | None = None  # TEXT or @FILE (one prompt, folder `prompt`)
    prompts: str | None = None  # JSONL of {"name", "system_prompt"} (one folder per name)
    synthetic_dir: str | None = None  # a root kept apart (<root>/<name>/synthetic.*): runs of one teacher share it
    teacher: str = "cloud"  # cloud | self (the edge reading the whole prompt: Cartridges' self-study)
    length: int | None = None  # P' tokens of the student (None: the whole prompt)
    compress: int | None = None  # P' = ceil(P / compress) (instead of length)
    rule: str = "first"  # which prompt tokens the student starts from when P' < P: first | even
    param: str = "full"  # full (K, V trained outright) | lowrank (a rank-r delta per KV head)
    rank: int = 8
    instructions: list[str] = field(default_factory=lambda: list(INSTRUCTIONS))
    samples: int = 2  # sampled answers per instruction
    max_answer_tokens: int = 40
    temperature: float = 0.8
    top_k: int = 64  # the teacher's top-k (+ the tail's mass) each answer token is matched on
    held_out: float = 0.25  # share of the synthetic set held out for early stopping
    steps: int = 30
    lr: float = 5e-3
    eval_every: int = 5
    patience: int = 3  # held-out evaluations without improvement before stopping
    quant: str = "bf16"  # the export's codec (int8 on top: 2× fewer bytes)
    prune_ratio: float = 0.0  # ThinK on top of the trained KV
    window: int = 32
    seed: int = 0
    catalog: str | None = None  # also put each finished export in this catalog (a folder or fsspec URL)
    ray: str | None = None  # --prompts on Ray: "" a local cluster, "auto" or an address to join one
    workers: int = 2  # Ray actors (each loads the models once)

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
        if self.dtype not in DTYPES:
            raise EdgeKVError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        if not self.instructions or self.samples < 1 or self.max_answer_tokens < 2 or self.steps < 0:
            raise EdgeKVError("distill needs ≥ 1 instruction, samples ≥ 1, max_answer_tokens ≥ 2 and steps ≥ 0")
        if not 0 < self.held_out < 1 or self.top_k < 1 or self.eval_every < 1 or self.patience < 1:
            raise EdgeKVError("held_out must be in (0, 1); top_k, eval_every and patience ≥ 1")


def read_prompts(cfg: DistillConfig) -> list[tuple[str, str]]:
    """(name, system prompt) pairs: the one prompt, or each line of the JSONL (names unique, folder-safe)."""
    if cfg.system_prompt is not None:
        return [("prompt", read_system_prompt(cfg.system_prompt))]
    path = Path(cfg.prompts)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EdgeKVError(f"cannot read --prompts {path}: {exc.strerror or exc}") from exc
    out, seen = [], set()
    for n, row in jsonl_records(lines, path):
        try:
            name, text = str(row["name"]), str(row["system_prompt"])
        except (KeyError, TypeError) as exc:
            raise EdgeKVError(f"{path}:{n}: expected {{\"name\", \"system_prompt\"}} ({type(exc).__name__})") from exc
        if not name or "/" in name or name.startswith(".") or name in seen:
            raise EdgeKVError(f"{path}:{n}: name '{name}' is empty, repeated, hidden or has a '/'")
        seen.add(name)
        out.append((name, text))
    if not out:
        raise EdgeKVError(f"{path}: no prompts")
    return out


def student_length(cfg: DistillConfig, n: int) -> int:
    """P' for a prompt of n tokens."""
    if cfg.compress is not None:
        return max(1, -(-n // cfg.compress))
    return n if cfg.length is None else cfg.length


def _synthetic(cfg: DistillConfig, teacher: LoadedModel, ids: torch.Tensor, work: Path,
               steps: Steps) -> tuple[list[Sample], dict]:
    """The synthetic set with its targets: read back when this teacher made it before, else made and kept."""
    where = Path(cfg.synthetic_dir) / work.name if cfg.synthetic_dir else work
    where.mkdir(parents=True, exist_ok=True)
    meta_path, tensor_path = where / "synthetic.json", where / "synthetic.safetensors"
    key = {"teacher": teacher.fingerprint, "instructions": cfg.instructions, "samples": cfg.samples,
           "max_answer_tokens": cfg.max_answer_tokens, "temperature": cfg.temperature, "top_k": cfg.top_k,
           "seed": cfg.seed, "prompt_sha256": token_ids_sha256(ids.tolist())}
    if meta_path.exists() and tensor_path.exists():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta["key"] == key:
            t = load_file(str(tensor_path))
            return [Sample(k, t[f"{n}.user"], t[f"{n}.answer"], t[f"{n}.top_ids"], t[f"{n}.top_logp"])
                    for n, k in enumerate(meta["instruction"])], meta
    start = time.perf_counter()
    samples = synthesize(teacher, ids, cfg.instructions, cfg.samples, cfg.max_answer_tokens, cfg.temperature,
                         cfg.seed, steps.task("teacher answers", len(cfg.instructions) * cfg.samples))
    generate_s = time.perf_counter() - start
    if len(samples) < 2:
        raise EdgeKVError("the teacher answered fewer than 2 instructions (every answer was empty)")
    teacher_targets(teacher, ids, samples, cfg.top_k)
    tensors = {f"{n}.{name}": getattr(s, name).clone().contiguous() for n, s in enumerate(samples)
               for name in ("user", "answer", "top_ids", "top_logp")}
    write_tensors_atomic(tensor_path, tensors)
    meta = {"key": key, "instruction": [s.instruction for s in samples], "generate_s": generate_s,
            "targets_s": time.perf_counter() - start - generate_s}
    write_text_atomic(meta_path, json.dumps(meta))
    return samples, meta


def distill_one(cfg: DistillConfig, edge: LoadedModel, teacher: LoadedModel, name: str, prompt: str,
                steps: Steps) -> dict:
    """Distil one system prompt into `out/name/kv`; resumes; returns its report."""
    work = Path(cfg.out) / name
    if (work / "kv" / "manifest.json").exists() and (work / "report.json").exists():
        return json.loads((work / "report.json").read_text(encoding="utf-8"))
    ids = torch.tensor(edge.tokenizer(prompt, add_special_tokens=True)["input_ids"], dtype=torch.long)
    if not prompt.strip() or ids.numel() == 0:
        raise EdgeKVError(f"{name}: the system prompt is empty")
    need = ids.numel() + max(len(edge.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in cfg.instructions) \
        + cfg.max_answer_tokens
    for who in {id(edge): edge, id(teacher): teacher}.values():
        if need > context_limit(who.model.config):
            raise EdgeKVError(f"{name}: system prompt + instruction + answer = {need} tokens exceeds {who.spec}'s "
                              f"context of {context_limit(who.model.config)} tokens")
    keep = student_length(cfg, ids.numel())
    if keep > ids.numel():
        raise EdgeKVError(f"{name}: --length {keep} is beyond the system prompt's {ids.numel()} tokens")
    work.mkdir(parents=True, exist_ok=True)
    samples, meta = _synthetic(cfg, teacher, ids, work, steps)
    train, held = split_samples(samples, cfg.held_out, cfg.seed)
    start = time.perf_counter()
    student, index = initial_student(edge, ids, keep, cfg.rule, cfg.param, cfg.rank, cfg.seed)
    log_, best = _train(cfg, edge, student, train, held, work / "train", steps)
    train_s = time.perf_counter() - start  # this call's share: a resumed run counts only what it added
    report = _export(cfg, edge, teacher, student, ids, index, work, {
        "teacher": cfg.teacher, "teacher_fingerprint": teacher.fingerprint, "length": keep, "rule": cfg.rule,
        "param": cfg.param, "rank": cfg.rank if cfg.param == "lowrank" else None,
        "steps": log_[-1]["step"] if log_ else 0, "best_step": best["step"], "held_out_kl": best["kl"],
        "initial_held_out_kl": log_[0].get("held_out_kl") if log_ else None, "samples": len(samples),
        "train_samples": len(train), "held_out_samples": len(held),
        "answer_tokens": int(sum(s.answer.numel() for s in samples)), "seed": cfg.seed,
        "instructions": cfg.instructions})
    report.update(generate_s=meta.get("generate_s"), targets_s=meta.get("targets_s"), train_s=train_s, log=log_)
    if log_:
        loss_curve(log_, work / "loss_curve.png", f"{name}: distill (teacher {cfg.teacher}, P'={keep})")
    write_text_atomic(work / "report.json", json.dumps(report, indent=1))
    return report


def _train(cfg: DistillConfig, edge: LoadedModel, student: Student, train: list[Sample], held: list[Sample],
           checkpoint: Path, steps: Steps) -> tuple[list[dict], dict]:
    """train_loop on the student, held-out KL every `eval_every` steps; the best held-out state is kept (in the
    checkpoint, so a resumed run knows it) and restored at the end; stops after `patience` evaluations without
    improvement."""
    best_path = checkpoint / "best.safetensors"
    best = {"step": 0, "kl": float("inf")}
    if best_path.exists() and (checkpoint / "best.json").exists():
        best = json.loads((checkpoint / "best.json").read_text(encoding="utf-8"))
    snapshot: dict[str, torch.Tensor] = {}

    def evaluate(step: int) -> dict:
        kl = held_out_kl(edge, student, held)
        if kl < best["kl"]:
            best.update(step=step, kl=kl)
            snapshot.clear()
            snapshot.update({n: t.detach().clone() for n, t in student.tensors.items()})
        return {"kl": kl}

    def save(path: Path) -> None:
        if snapshot:
            write_tensors_atomic(best_path, snapshot)
            write_text_atomic(path / "best.json", json.dumps(best))

    def loss(step: int) -> torch.Tensor:
        return sample_loss(edge, student.prefix(), train[example_index(step, len(train), cfg.seed)])

    trainee = Trainee([{"params": student.parameters()}], loss, save=save, evaluate=evaluate, frozen=[edge.model])
    stop = lambda step: step - best["step"] >= cfg.patience * cfg.eval_every  # noqa: E731
    log_ = []
    if cfg.steps:
        log_ = train_loop(trainee, cfg.steps, cfg.lr, checkpoint, cfg.eval_every,
                          steps.task("train the student", cfg.steps), stop)
    if not snapshot and best_path.exists():
        snapshot.update(load_file(str(best_path)))
    with torch.no_grad():
        for n, t in snapshot.items():
            student.tensors[n].copy_(t)
    if best["kl"] == float("inf"):
        best["kl"] = held_out_kl(edge, student, held)
    return log_, best


def _export(cfg: DistillConfig, edge: LoadedModel, teacher: LoadedModel, student: Student, ids: torch.Tensor,
            index: torch.Tensor, work: Path, distilled: dict) -> dict:
    """The student as an EdgePrompt-format export (edge-shaped KV of every layer) + its report."""
    queries = same_model_layers(edge, ids, 0, cfg.window, cfg.seed)  # the edge's own queries score ThinK
    tensors, entries = {}, []
    for layer, (k, v) in zip(queries, student.kv()):
        layer.keys, layer.values = k.to(edge.model.dtype), v.to(edge.model.dtype)
        t, e, _ = encode_layer(layer, cfg.prune_ratio, cfg.quant, 0)
        tensors[layer.edge_layer] = t
        entries.append(e)
    info = model_info(edge)
    manifest = {
        "regime": "same-model", "splice": "replace", "cloud": info, "edge": info,
        "tokenizer_fingerprint": tokenizer_fingerprint(edge.tokenizer),
        "system_prompt": {"num_tokens": int(ids.numel()), "token_ids_sha256": token_ids_sha256(ids.tolist()),
                          "token_ids": ids.tolist()},
        "kv_tokens": student.tokens, "next_position": student.next_position, "kv_token_index": index.tolist(),
        "start_layer": 0, "mapping": "none", "map_location": "none", "local_sink_tokens": 0,
        "prune": {"method": "think", "ratio": cfg.prune_ratio, "window": cfg.window, "keep_recent": 0,
                  "queries": "own window"},
        "quant": cfg.quant, "layers": entries, "distilled": distilled,
    }
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
        self.cfg, self.steps = cfg, Steps(progress)
        if models is not None:
            cloud, self.edge = models
        else:
            self.edge = load_model(cfg.edge, cfg.dtype, device=cfg.device)
            cloud = load_model(cfg.cloud, cfg.dtype, device=cfg.device) if cfg.teacher == "cloud" else None
        self.teacher = self.edge if cfg.teacher == "self" else cloud
        check_tokenizers(self.teacher.tokenizer, self.edge.tokenizer)
        self.catalog = Catalog(cfg.catalog) if cfg.catalog else None

    def __call__(self, item: tuple[str, str]) -> dict:
        """{report, row, computed}: the prompt's report (its loss log left out) and, with a catalog, its index row
        and whether this call put the entry there."""
        name, prompt = item
        report = distill_one(self.cfg, self.edge, self.teacher, name, prompt, self.steps)
        row, computed = None, False
        if self.catalog is not None:  # keyed like compress's entries: everything that determines the bytes
            sha = token_ids_sha256(self.edge.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            settings = {k: v for k, v in to_dict(self.cfg).items() if k not in NOT_IDENTITY}
            key = export_key({"edge": self.edge.fingerprint, "teacher": self.teacher.fingerprint, "prompt": sha,
                              "settings": settings, "distill": True})
            row, computed = {"key": key, "name": name, "prompt_sha256": sha}, not self.catalog.has(key)
            if computed:
                row = self.catalog.put(key, name, report["out"], sha, index=False)
        return {"report": {k: v for k, v in report.items() if k != "log"}, "row": row, "computed": computed}


def run_distill(cfg: DistillConfig, progress=None, models: tuple[LoadedModel, LoadedModel] | None = None) -> dict:
    """Distil every prompt (skipping those already done), in this process or on Ray (`cfg.ray`: `cfg.workers`
    actors that each load the models once; the folders under `cfg.out` must then be one file system for all, or
    give `cfg.catalog`); a failed prompt is reported and skipped, never left as a half export. `models` = (cloud,
    edge) already loaded (in-process only); the cloud is never loaded for `--teacher self`."""
    cfg.validate()
    prompts = read_prompts(cfg)
    use_ray = cfg.ray is not None
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "config.json", json.dumps(to_dict(cfg), indent=1))
    advance = Steps(progress).task("distil system prompts", len(prompts))
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
