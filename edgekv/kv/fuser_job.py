"""`edgekv train-fuser`: fit `hidden`'s maps, train a fuser's gates towards the cloud, choose its hard gates.

Texts (ShareGPT, file order): calibration for the maps 0..calib_texts−1; training from `train_offset` (refused
if it would run into the gate texts); gate choice (held out) from `gate_offset`; all before the fidelity bench's
held-out texts (2000 on) and the eval's (5000 on). Optionally `xsum_texts` XSum documents from record
`xsum_offset` of data/xsum join the training texts: news articles like the eval's XSum system prompts; the default
offset 107 starts after the 64 documents the fidelity bench holds out (records 0..106, which also cover the eval's
XSum requests). `self_fuse` trains the same fuser edge → edge (the fused KV is the edge's own, the target still
the cloud's distribution): the adapter-only control. `shared` trains it under a shared prefix: the edge reads every
text after the prefix, as `ce-lslm-fuse-shared` serves it (the target stays the cloud reading the text alone).
The out directory
holds translator.safetensors + translator.json (the fuser, usable by `compress --splice fuse` and eval's
`fuser_path`), state.safetensors + progress.json (resume), log.json, gates.json and loss_curve.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import layer_pairs
from edgekv.atomic import write_text_atomic
from edgekv.config import (
    command_config,
    seed_setting,
    setting,
    to_dict,
)
from edgekv.kv.fuser_training import choose_gates, prepare, train
from edgekv.kv.registry import TRANSLATORS, save_translator
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.kv.translators import HiddenTranslator
from edgekv.models.capture import capture
from edgekv.models.loading import check_tokenizers, load_model
from edgekv.models.settings import ModelSettings
from edgekv.plots import loss_curve
from edgekv.progress import Tasks
from edgekv.texts import (
    DATA_DIR,
    iter_sharegpt,
    render_conversation,
    sharegpt_texts,
    split_texts,
    tokenize,
    xsum_documents,
)

GATES = ("fuse-bias", "fuse-residual")
DEFAULT_LR = {"fuse-bias": 0.05, "fuse-residual": 1e-3}


@command_config("train_fuser")
@dataclass
class TrainFuserConfig(ModelSettings):
    """Everything `edgekv train-fuser` needs; see configs/train_fuser.yaml."""

    out: str = setting("runs/fuser-m12", "Output directory (resumes from its checkpoint).")
    gate: str = setting("fuse-bias", "fuse-bias or fuse-residual.")
    self_fuse: bool = setting(
        False, "Train edge → edge (the adapter-only control).", toggle="--self-fuse/--no-self-fuse")
    mapping: str | None = setting(None, "mapping.json of `edgekv align`.", shown="strategy from start layer")
    strategy: str = setting("last-aligned", "uniform or last-aligned when no mapping.")
    start_layer: int = setting(12, "First edge layer that may fuse.")
    calib_texts: int = 32
    calib_tokens: int = 256
    train_texts: int = setting(120, "Training texts (ShareGPT from record 100).")
    train_offset: int = 100
    xsum_texts: int = setting(0, "XSum documents added to training (from record 107).")
    xsum_offset: int = 107  # after the fidelity bench's 64 held-out documents and the eval's requests
    gate_texts: int = setting(24, "Held-out texts that choose the hard gates.")
    gate_offset: int = 1500
    prefix_tokens: int = 256
    cont_tokens: int = 64
    top_k: int = 64
    lr: float | None = setting(None, "Adam learning rate.", shown="0.05 bias, 1e-3 residual")
    rank: int = 32  # fuse-residual's hidden width
    map_lr: float | None = setting(None, "Also train the hidden-state maps at this rate.", shown="fixed")
    ce_weight: float = setting(0.0, "Weight of cross-entropy on the text beside the KL.")
    steps: int = setting(2000, "Most training steps (one text each).")
    minutes: float = setting(10.0, "Training time budget.")
    eval_every: int = 25
    gate_margin: float = 0.0  # keep open gates only if they beat all-closed by this many nats/token
    max_open: int | None = setting(None, "At most this many open layers, the most useful.", shown="no limit")
    seed: int = seed_setting()
    cache: str = setting("runs/fuser-cache", "Feature cache (safetensors per text).")
    shared: str | None = setting(None, "Train under this shared prefix (distill --train-shared): the edge reads each "
                                 "text after it, as ce-lslm-fuse-shared serves.")
    ship: str | None = setting(None, "Also write the compact fuser (open layers, fp16 maps) here.")

    def validate(self) -> None:
        """One-line errors for out-of-range values, before any model is loaded."""
        if self.gate not in GATES:
            raise EdgeKVError(f"unknown --gate '{self.gate}' (choose from {', '.join(GATES)})")
        if self.strategy not in ("uniform", "last-aligned"):
            raise EdgeKVError(f"--strategy must be uniform or last-aligned, got '{self.strategy}'")
        self.check_models()
        if self.xsum_texts < 0 or self.xsum_offset < 0:
            raise EdgeKVError("xsum_texts and xsum_offset must be ≥ 0")
        if min(self.train_texts, self.gate_texts, self.steps, self.eval_every, self.top_k, self.rank) < 1:
            raise EdgeKVError("train_texts, gate_texts, steps, eval_every, top_k and rank must be ≥ 1")
        if self.calib_texts < 3 or self.prefix_tokens < 2 or self.cont_tokens < 2:
            raise EdgeKVError("calib_texts must be ≥ 3, prefix_tokens and cont_tokens ≥ 2")
        if self.minutes <= 0 or any(v is not None and v <= 0 for v in (self.lr, self.map_lr)):
            raise EdgeKVError("--minutes, --lr and --map-lr must be > 0")
        if self.max_open is not None and self.max_open < 1:
            raise EdgeKVError(f"--max-open must be ≥ 1, got {self.max_open}")
        if self.mapping is not None and not Path(self.mapping).is_file():
            raise EdgeKVError(f"mapping file not found: {self.mapping}")
        if self.shared is not None and not Path(self.shared).is_dir():
            raise EdgeKVError(f"shared prefix not found: {self.shared}")


def _sharegpt_split(tokenizer, offset: int, count: int, prefix: int, cont: int, end: int | None = None):
    """`count` ShareGPT conversations of ≥ prefix+cont tokens from record `offset`, all before record `end`."""
    records = (render_conversation(r) for k, r in enumerate(iter_sharegpt()) if offset <= k < (end or 1 << 62))
    texts = split_texts(tokenizer, records, "sharegpt", prefix, cont, count)
    if len(texts) < count:
        before = f" before record {end}" if end else ""
        raise EdgeKVError(f"only {len(texts)} ShareGPT conversations from record {offset}{before} have "
                          f"{prefix}+{cont} tokens (asked for {count})")
    return texts


def _xsum_split(tokenizer, offset: int, count: int, prefix: int, cont: int):
    """`count` XSum documents of ≥ prefix+cont tokens from record `offset` of data/xsum."""
    if not count:
        return []
    docs = xsum_documents(DATA_DIR / "xsum/xsum_sample.jsonl")[offset:]
    texts = split_texts(tokenizer, docs, "xsum", prefix, cont, count)
    if len(texts) < count:
        raise EdgeKVError(f"only {len(texts)} XSum documents from record {offset} have {prefix}+{cont} tokens "
                          f"(asked for {count})")
    return texts


def run_train_fuser(cfg: TrainFuserConfig, progress=None) -> dict:
    """Train (resuming from cfg.out), choose the hard gates, write the fuser and its evidence; return gates.json."""
    cfg.validate()
    out = Path(cfg.out)
    tasks = Tasks(progress)
    edge = load_model(cfg.edge, cfg.dtype, device=cfg.device)
    teacher = load_model(cfg.cloud, cfg.dtype, device=cfg.device)  # the target is always the cloud's distribution
    cloud = edge if cfg.self_fuse else teacher  # where the fused KV comes from
    check_tokenizers(teacher.tokenizer, edge.tokenizer)
    shared = SharedPrefix(cfg.shared, edge) if cfg.shared else None
    pairs, _ = layer_pairs(cfg.mapping, cfg.start_layer, cloud.num_layers, edge.num_layers, default=cfg.strategy)
    if not pairs:
        raise EdgeKVError("no layer pairs from --start-layer on")
    pair = (cloud.fingerprint, edge.fingerprint)
    seqs = tokenize(edge.tokenizer, sharegpt_texts(cfg.calib_texts).texts, cfg.calib_tokens, min_tokens=2)
    with torch.no_grad():
        hidden = HiddenTranslator().fit(
            capture(cloud.model, seqs, ("hidden_in",), on_text=tasks.task("calibration: cloud", len(seqs))),
            capture(edge.model, seqs, ("hidden_in",), on_text=tasks.task("calibration: edge", len(seqs))),
            pairs, edge.model)
    extra = {"rank": cfg.rank, "seed": cfg.seed} if cfg.gate == "fuse-residual" else {}
    fuser = TRANSLATORS[cfg.gate].from_hidden(hidden, edge.model, source="edge" if cfg.self_fuse else "cloud",
                                              **extra)
    end = cfg.gate_offset if cfg.train_offset < cfg.gate_offset else None  # training never reaches gate texts
    train_texts = _sharegpt_split(edge.tokenizer, cfg.train_offset, cfg.train_texts, cfg.prefix_tokens,
                                  cfg.cont_tokens, end)
    train_texts += _xsum_split(edge.tokenizer, cfg.xsum_offset, cfg.xsum_texts, cfg.prefix_tokens, cfg.cont_tokens)
    gate_texts = _sharegpt_split(edge.tokenizer, cfg.gate_offset, cfg.gate_texts, cfg.prefix_tokens, cfg.cont_tokens)
    start = time.perf_counter()
    raw = cfg.map_lr is not None  # the maps train: cache the cloud's hidden states, map them at every step
    examples = prepare(edge, cloud, train_texts, fuser, pair, cfg.top_k, cfg.cache,
                       on_text=tasks.task("features: training texts", len(train_texts)), teacher=teacher, raw=raw,
                       shared=shared)
    held = prepare(edge, cloud, gate_texts, fuser, pair, cfg.top_k, cfg.cache,
                   on_text=tasks.task("features: gate-choice texts", len(gate_texts)), teacher=teacher, raw=raw,
                   shared=shared)
    prepared_s = time.perf_counter() - start
    del teacher, cloud  # training needs the edge alone (raw features are large: free the cloud's memory first)
    deadline = time.perf_counter() + 60 * cfg.minutes
    log = train(edge, fuser, examples, held, cfg.steps, lr=cfg.lr or DEFAULT_LR[cfg.gate], ce_weight=cfg.ce_weight,
                seed=cfg.seed, checkpoint=out, every=cfg.eval_every, on_step=tasks.task("train", cfg.steps),
                stop=lambda s: time.perf_counter() > deadline, pair=pair, map_lr=cfg.map_lr)
    trained_s = time.perf_counter() - start - prepared_s
    gates = choose_gates(edge, fuser, held, cfg.gate_margin, cfg.max_open)
    save_translator(fuser, out, *pair)  # now with its hard gates
    if cfg.ship and fuser.open_layers():
        save_translator(fuser.compact(), cfg.ship, *pair)
    tail = [e["held_out_kl"] for e in log if "held_out_kl" in e]
    gates.update({"gate": cfg.gate, "pairs": pairs, "self_fuse": cfg.self_fuse, "maps_trained": raw,
                  "shared_prefix": shared.describe() if shared is not None else None,
                  "train_texts": len(examples),
                  "train_sources": {s: sum(t.source == s for t in train_texts) for s in ("sharegpt", "xsum")},
                  "gate_texts": len(held), "train_tokens": sum(e.continuation.numel() - 1 for e in examples),
                  "prepare_s": prepared_s, "train_s": trained_s, "steps": log[-1]["step"],
                  "held_out_kl_first_last": [tail[0], tail[-1]] if tail else None,
                  "held_out_kl_slope_per_100_steps": _end_slope(log), "config": to_dict(cfg)})
    write_text_atomic(out / "gates.json", json.dumps(gates, indent=1))
    write_text_atomic(out / "log.json", json.dumps(log))
    loss_curve(log, out / "loss_curve.png", f"{cfg.gate} {'edge→edge' if cfg.self_fuse else 'cloud→edge'}, "
                                            f"from layer {cfg.start_layer}, {len(examples)} texts")
    return gates


def _end_slope(log: list[dict]) -> float | None:
    """Least-squares slope of the held-out KL over the last half of its measurements, per 100 steps."""
    pts = [(e["step"], e["held_out_kl"]) for e in log if "held_out_kl" in e]
    pts = pts[len(pts) // 2:]
    if len(pts) < 2:
        return None
    x = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    y = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum() * 100)
