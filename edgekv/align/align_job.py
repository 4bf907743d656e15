"""`edgekv align`: capture both models on the same texts, compare every layer pair, choose a layer mapping."""

from __future__ import annotations

import csv
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import MAPPINGS, MappingParams, build_mapping
from edgekv.align.similarity import cka_matrices, massive_rows, rsa_matrix, subsample_rows
from edgekv.atomic import staged_dir
from edgekv.config import (
    command_config,
    device_map_setting,
    seed_setting,
    setting,
    to_dict,
)
from edgekv.models.capture import FEATURES, capture
from edgekv.models.loading import check_tokenizers, load_model, load_tokenizer, num_layers
from edgekv.models.settings import ModelSettings
from edgekv.plots import similarity_heatmap
from edgekv.progress import Tasks
from edgekv.texts import TextSource, load_text_file, sharegpt_texts, tokenize

METRICS = ("linear_cka", "debiased_cka", "rsa")


@command_config("align")
@dataclass
class AlignConfig(ModelSettings):
    """Everything `edgekv align` needs; see configs/default.yaml."""

    out: str | None = setting(None, "Output directory (replaced whole, atomically).")
    device_map: str | None = device_map_setting()
    texts: str | None = setting(None, "Calibration texts (.jsonl or .txt); default: ShareGPT.")
    text_field: str = "text"
    num_texts: int = setting(32, "Number of calibration texts.")
    text_offset: int = 0
    max_tokens: int = setting(256, "Tokens per text (truncation).")
    skip_first: int = setting(1, "Leading tokens per text left out (attention sink).")
    outlier_ratio: float | None = setting(
        10.0, "Drop tokens whose hidden norm exceeds this × the layer median; 0 keeps all.")
    sample_tokens: int | None = setting(None, "Seeded subsample of tokens for CKA.", shown="all")
    rsa_tokens: int = setting(2048, "Seeded subsample of tokens for RSA.")
    features: list[str] = setting(help="Comma list of hidden, k, v, k_unrot.", factory=lambda: ["hidden"])
    strategy: str = setting("similarity", "Mapping: similarity, uniform, last-aligned, dissimilar.")
    metric: str = setting("linear_cka", "Score the mapping maximizes: linear_cka, debiased_cka, rsa.")
    start_layer: int | None = setting(None, "First edge layer fed from the cloud (m).", shown="half depth")
    tau_cka: float = setting(0.0, "Minimum linear CKA of a mapped pair.")
    tau_rsa: float = setting(0.0, "Minimum RSA of a mapped pair.")
    seed: int = seed_setting("Seed for every subsample.")

    def validate(self) -> None:
        """One-line errors for out-of-range values, before any model is loaded."""
        if not self.out:
            raise EdgeKVError("--out is required")
        for name in ("num_texts", "max_tokens"):
            if getattr(self, name) < 1:
                raise EdgeKVError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(self, name)}")
        if self.skip_first < 0 or self.skip_first >= self.max_tokens:
            raise EdgeKVError(f"--skip-first must be in [0, max_tokens), got {self.skip_first}")
        if self.text_offset < 0:
            raise EdgeKVError(f"--text-offset must be ≥ 0, got {self.text_offset}")
        if self.sample_tokens is not None and self.sample_tokens < 4:
            raise EdgeKVError(f"--sample-tokens must be ≥ 4 (debiased CKA needs 4 tokens), got {self.sample_tokens}")
        if self.outlier_ratio == 0:
            self.outlier_ratio = None  # 0 on the command line: keep every token
        if self.outlier_ratio is not None and self.outlier_ratio <= 1.0:
            raise EdgeKVError(f"--outlier-ratio must be > 1, or 0 to keep every token; got {self.outlier_ratio}")
        if self.rsa_tokens < 3:
            raise EdgeKVError(f"--rsa-tokens must be ≥ 3, got {self.rsa_tokens}")
        if self.start_layer is not None and self.start_layer < 0:
            raise EdgeKVError(f"--start-layer must be ≥ 0, got {self.start_layer}")
        if self.strategy not in MAPPINGS:
            raise EdgeKVError(f"unknown strategy '{self.strategy}' (choose from {', '.join(MAPPINGS)})")
        if self.metric not in METRICS:
            raise EdgeKVError(f"unknown metric '{self.metric}' (choose from {', '.join(METRICS)})")
        self.check_models()
        bad = [f for f in self.features if f not in FEATURES]
        if bad or "hidden" not in self.features:
            raise EdgeKVError(f"--features must include 'hidden' and only {', '.join(FEATURES)}; got {self.features}")
        for name in ("tau_cka", "tau_rsa"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise EdgeKVError(f"--{name.replace('_', '-')} must be in [-1, 1], got {getattr(self, name)}")


@dataclass
class AlignResult:
    """What align produced, for the CLI's summary."""

    out: Path
    similarity: dict
    mapping: dict
    timings: dict[str, float]


def calibration_source(cfg: AlignConfig) -> TextSource:
    """The calibration texts named by the config (a file, else ShareGPT)."""
    if cfg.texts:
        source = load_text_file(cfg.texts, cfg.text_field)
        source.texts = source.texts[cfg.text_offset: cfg.text_offset + cfg.num_texts]
        if not source.texts:
            raise EdgeKVError(f"{cfg.texts}: no texts after offset {cfg.text_offset}")
        return source
    return sharegpt_texts(cfg.num_texts, offset=cfg.text_offset)


def _capture_model(spec: str, cfg: AlignConfig, seqs, features, select, tasks: Tasks, label: str):
    loaded = load_model(spec, cfg.dtype, cfg.device_map, cfg.device)
    advance = tasks.task(f"{label} forward ({loaded.num_layers} layers)", len(seqs))
    start = time.perf_counter()
    acts = capture(loaded.model, seqs, features, select=select, on_text=advance)
    elapsed = time.perf_counter() - start
    info = {"model": spec, "source": loaded.source_shown, "fingerprint": loaded.fingerprint,
            "num_layers": loaded.num_layers, "hidden_size": loaded.model.config.hidden_size}
    del loaded
    gc.collect()
    return acts, info, elapsed


def similarity_all(cloud_layers, edge_layers, cfg: AlignConfig, tasks: Tasks, label: str) -> dict[str, torch.Tensor]:
    """linear CKA, debiased CKA and RSA matrices (rows = cloud layers, columns = edge layers)."""
    advance = tasks.task(f"similarity {label} (CKA rows, RSA layers)", 2 * len(cloud_layers) + len(edge_layers))
    matrices = cka_matrices(cloud_layers, edge_layers, on_row=advance)
    matrices["rsa"] = rsa_matrix(cloud_layers, edge_layers, cfg.rsa_tokens, cfg.seed, on_layer=advance)
    return matrices


def drop_massive_tokens(cloud_acts, edge_acts, max_ratio: float | None, tokenizer) -> list[dict]:
    """Remove massive-activation tokens from both models' activations (same rows); return what was dropped."""
    if max_ratio is None:
        return []
    mask = massive_rows([cloud_acts.layers["hidden"], edge_acts.layers["hidden"]], max_ratio)
    if int(mask.sum()) > edge_acts.num_tokens - 4:
        raise EdgeKVError(f"--outlier-ratio {max_ratio} would leave fewer than 4 tokens")
    dropped = [{"text": int(edge_acts.text_index[i]), "position": int(edge_acts.positions[i]),
                "token": tokenizer.decode([int(edge_acts.token_ids[i])])} for i in mask.nonzero().flatten()]
    keep = ~mask
    for acts in (cloud_acts, edge_acts):
        acts.layers = {f: [t[keep] for t in layers] for f, layers in acts.layers.items()}
        acts.token_ids, acts.positions = acts.token_ids[keep], acts.positions[keep]
        acts.text_index = acts.text_index[keep]
    return dropped


def _write_csv(path: Path, matrix: torch.Tensor) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["cloud_layer"] + [f"edge_{j}" for j in range(matrix.shape[1])])
        for i, row in enumerate(matrix.tolist()):
            writer.writerow([i] + [f"{v:.6f}" for v in row])


def run_align(cfg: AlignConfig, progress=None) -> AlignResult:
    """Capture, compare and map; write similarity.json, CSVs, PNG heatmaps and mapping.json into cfg.out."""
    cfg.validate()
    tasks = Tasks(progress)
    timings: dict[str, float] = {}
    with staged_dir(cfg.out) as staging:
        source = calibration_source(cfg)
        check_tokenizers(load_tokenizer(cfg.cloud), tok := load_tokenizer(cfg.edge))
        edge_depth = num_layers(cfg.edge)
        if cfg.start_layer is not None and cfg.start_layer >= edge_depth:
            raise EdgeKVError(f"--start-layer {cfg.start_layer} is out of range: "
                              f"the edge model has {edge_depth} layers")
        seqs = tokenize(tok, source.texts, cfg.max_tokens, min_tokens=cfg.skip_first + 2)
        if not seqs:
            raise EdgeKVError(f"no calibration text has more than {cfg.skip_first + 1} tokens")
        total = sum(len(s) - cfg.skip_first for s in seqs)
        if total < 4:
            raise EdgeKVError(f"only {total} calibration tokens; at least 4 are needed")
        # the same token subset for both models: rows must be the same tokens
        keep_global = subsample_rows(total, cfg.sample_tokens, cfg.seed)
        offsets = torch.tensor([0] + [len(s) - cfg.skip_first for s in seqs]).cumsum(0)

        def select(t: int, length: int) -> torch.Tensor:
            positions = torch.arange(cfg.skip_first, length)
            if keep_global is None:
                return positions
            mine = keep_global[(keep_global >= offsets[t]) & (keep_global < offsets[t + 1])] - offsets[t]
            return positions[mine]

        features = list(dict.fromkeys(cfg.features))
        cloud_acts, cloud_info, timings["cloud_forward_s"] = _capture_model(
            cfg.cloud, cfg, seqs, features, select, tasks, "cloud")
        edge_acts, edge_info, timings["edge_forward_s"] = _capture_model(
            cfg.edge, cfg, seqs, features, select, tasks, "edge")
        dropped = drop_massive_tokens(cloud_acts, edge_acts, cfg.outlier_ratio, tok)
        start = time.perf_counter()
        matrices: dict[str, torch.Tensor] = {}
        for feature in features:
            found = similarity_all(cloud_acts.layers[feature], edge_acts.layers[feature], cfg, tasks, feature)
            prefix = "" if feature == "hidden" else f"{feature}."
            matrices.update({prefix + k: v for k, v in found.items()})
        timings["similarity_s"] = time.perf_counter() - start
        del cloud_acts.layers, edge_acts.layers

        start_layer = cfg.start_layer if cfg.start_layer is not None else edge_info["num_layers"] // 2
        params = MappingParams(start_layer, cfg.metric, cfg.tau_cka, cfg.tau_rsa)
        mapping = build_mapping(cfg.strategy, {m: matrices[m] for m in METRICS}, params)
        mapping.update({"cloud": cloud_info, "edge": edge_info})

        similarity = {
            "layout": "rows = cloud layers, columns = edge layers; layer i = output of decoder block i",
            "cloud": cloud_info,
            "edge": edge_info,
            "num_texts": len(seqs),
            "num_tokens": edge_acts.num_tokens,
            "text_source": source.description,
            "max_tokens": cfg.max_tokens,
            "skip_first": cfg.skip_first,
            "outlier_ratio": cfg.outlier_ratio,
            "dropped_tokens": dropped,
            "rsa_tokens": min(cfg.rsa_tokens, edge_acts.num_tokens),
            "seed": cfg.seed,
            "timings": timings,
            "metrics": {k: [[round(v, 6) for v in row] for row in m.tolist()] for k, m in matrices.items()},
        }
        (staging / "similarity.json").write_text(json.dumps(similarity, indent=1))
        (staging / "mapping.json").write_text(json.dumps(mapping, indent=2))
        (staging / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        for name, matrix in matrices.items():
            _write_csv(staging / f"{name}.csv", matrix)
            similarity_heatmap(matrix, staging / f"{name}.png", name,
                               f"{cfg.cloud}, {cloud_info['num_layers']}", f"{cfg.edge}, {edge_info['num_layers']}",
                               mapping["pairs"] if name in METRICS else None)
    return AlignResult(Path(cfg.out), similarity, mapping, timings)
