"""`edgekv compress`: the cloud's system-prompt KV, mapped, ThinK-pruned and quantized, as a KV export.

Two regimes (DESIGN.md §1). Same model: the export holds the model's own KV of layers m..L-1, exact up to
pruning/quantization. Heterogeneous: each edge layer i ≥ m takes the KV of its matched cloud layer j through a
translator (ridge, hidden or trained, fitted on calibration texts or loaded; `kv/cloud_kv.py`), applied on the
cloud (ship edge-shaped KV) or on the edge (ship what it reads + the translator); with `--splice fuse` a trained
fuser's open layers ship beside the edge's own KV. Each layer is then encoded (`kv/encode.py`) and written with
its manifest (`kv/export.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import layer_pairs
from edgekv.atomic import write_text_atomic
from edgekv.config import (
    command_config,
    device_map_setting,
    ray_setting,
    seed_setting,
    setting,
    to_dict,
    weights_setting,
    workers_setting,
)
from edgekv.kv.cloud_kv import cloud_side
from edgekv.kv.codecs import check_scheme
from edgekv.kv.encode import encode_layer, raw_fp16_bytes
from edgekv.kv.export import export_manifest, model_info, sha256_bytes, write_export
from edgekv.kv.pruning import check_ratio
from edgekv.kv.registry import (
    TRANSLATOR_CONFIG,
    TRANSLATOR_TENSORS,
    TRANSLATORS,
    is_fuser,
)
from edgekv.kv.shared_prefix import SharedPrefix, gate
from edgekv.models.capture import check_kv_reconstruction
from edgekv.models.loading import LoadedModel, check_tokenizers, load_model, load_pair, same_model
from edgekv.models.settings import ModelSettings
from edgekv.models.structure import (
    check_context,
)
from edgekv.progress import Tasks
from edgekv.summary import mean
from edgekv.texts import read_system_prompt


@command_config("compress")
@dataclass
class CompressConfig(ModelSettings):
    """Everything `edgekv compress` needs; see configs/default.yaml."""

    out: str | None = setting(None, "Export directory (or .tar with --tar), written atomically.")
    weights: str = weights_setting()
    device_map: str | None = device_map_setting()
    system_prompt: str | None = setting(None, "The system prompt: TEXT or @FILE.")
    mapping: str | None = setting(None, "mapping.json of `edgekv align`.", shown="uniform / identity")
    start_layer: int | None = setting(None, "First edge layer taken from the cloud (m).")
    prune_ratio: float = setting(0.0, "ThinK key-channel pruning ratio λ in [0, 1).")
    window: int = setting(32, "ThinK observation window: last w prompt positions.")
    keep_recent: int = setting(0, "Last r tokens keep every key channel.")
    quant: str = setting("fp16", "fp16, bf16, int8, int4 or int2.")
    map_on: str = setting("cloud", "Apply the cross-model map on the cloud or the edge.")
    translator: str | None = setting(
        None, "Cross-model translator: ridge, hidden, trained, fuse-bias, fuse-residual.",
        shown="ridge, or the shipped fuser with --splice auto")
    translator_path: str | None = setting(None, "A saved translator (needed for trained).", shown="fit one")
    local_sink_tokens: int = setting(1, "First s prompt tokens the edge computes itself.")
    splice: str = setting(
        "auto",
        "replace (cloud KV instead of the edge's), fuse (beside it, through a trained fuser's gates), or auto: fuse"
        " with the shipped fuser of this exact pair when no --translator is given, else replace.")
    # auto: fuse with the project's shipped fuser of this exact pair (fusers/) when --translator and
    # --translator-path are not given, else replace
    calib: str | None = setting(None, "Calibration texts for the maps (.jsonl/.txt).", shown="ShareGPT")
    calib_texts: int = setting(16, "Calibration texts.")
    calib_tokens: int = setting(256, "Tokens per calibration text.")
    calib_offset: int = 0
    tar: bool = setting(False, "Write one .tar instead of a directory.", toggle="--tar/--no-tar")
    seed: int = seed_setting()
    shared: str | None = setting(None, "A shared prefix (distill --train-shared) the prompt is read after (same "
                                       "model on both sides, or --splice fuse: the edge's own KV).")
    shared_gate: str | None = setting(
        None, "With --shared: a teacher (the cloud) the prefix is checked against on this prompt; the export "
              "reads the prefix only when it brings the edge closer to the teacher on the prompt (else none).")
    prompts: str | None = setting(None, "JSONL of {name, system_prompt}: one export each (--catalog).")
    catalog: str | None = setting(None, "Catalog of exports: a folder or fsspec URL (with --prompts).")
    ray: str | None = ray_setting()
    workers: int = workers_setting()

    def validate(self) -> None:
        """One-line errors for out-of-range values, before any model is loaded."""
        if (self.prompts is None) != (self.catalog is None):
            raise EdgeKVError("--prompts and --catalog go together (a batch of system prompts into a catalog)")
        if self.prompts is not None and (self.system_prompt is not None or self.tar):
            raise EdgeKVError("--prompts takes its system prompts from the file (no --system-prompt or --tar)")
        if self.ray is not None and self.prompts is None:
            raise EdgeKVError("--ray runs --prompts batches (one export per prompt)")
        if self.workers < 1:
            raise EdgeKVError(f"--workers must be ≥ 1, got {self.workers}")
        if self.prompts is None and not self.out:
            raise EdgeKVError("--out is required")
        if self.prompts is None and self.system_prompt is None:
            raise EdgeKVError("--system-prompt is required (TEXT or @FILE)")
        check_ratio(self.prune_ratio)
        if self.window < 1:
            raise EdgeKVError(f"--window must be ≥ 1, got {self.window}")
        if self.keep_recent < 0:
            raise EdgeKVError(f"--keep-recent must be ≥ 0, got {self.keep_recent}")
        check_scheme(self.quant)
        if self.map_on not in ("cloud", "edge"):
            raise EdgeKVError(f"--map-on must be 'cloud' or 'edge', got '{self.map_on}'")
        if self.translator is not None and self.translator not in TRANSLATORS:
            raise EdgeKVError(f"unknown --translator '{self.translator}' (choose from {', '.join(TRANSLATORS)})")
        if self.translator == "trained" and not self.translator_path:
            raise EdgeKVError("--translator trained needs --translator-path (a checkpoint of "
                              "`python -m bench.train_translator`)")
        if self.splice not in ("auto", "replace", "fuse"):
            raise EdgeKVError(f"--splice must be 'auto', 'replace' or 'fuse', got '{self.splice}'")
        if self.translator_path and self.translator is None:
            raise EdgeKVError("--translator-path needs --translator (the kind of translator it holds)")
        fuser = is_fuser(self.translator)
        if self.splice == "fuse" and not (fuser and self.translator_path):
            raise EdgeKVError("--splice fuse needs a trained fuser: --translator fuse-bias|fuse-residual "
                              "--translator-path DIR (from `edgekv train-fuser`)")
        if self.splice == "replace" and fuser:
            raise EdgeKVError(f"--translator {self.translator} is a fuser: use it with --splice fuse")
        if self.local_sink_tokens < 0:
            raise EdgeKVError(f"--local-sink-tokens must be ≥ 0, got {self.local_sink_tokens}")
        self.check_models()
        if self.calib_texts < 3 or self.calib_tokens < 2:
            raise EdgeKVError("--calib-texts must be ≥ 3 and --calib-tokens ≥ 2 (maps need train/validation/test)")
        if self.start_layer is not None and self.start_layer < 0:
            raise EdgeKVError(f"--start-layer must be ≥ 0, got {self.start_layer}")
        if self.shared_gate and not self.shared:
            raise EdgeKVError("--shared-gate checks a shared prefix: give it with --shared")


# ---------------------------------------------------------------------------------------------- command


SHIPPED_FUSERS = Path(__file__).resolve().parents[2] / "fusers"


def shipped_fuser(cloud_fingerprint: str, edge_fingerprint: str, root: Path | None = None) -> Path | None:
    """The project's trained fuser for exactly this model pair (fusers/*/translator.json), if one ships."""
    for config in sorted((root or SHIPPED_FUSERS).glob("*/translator.json")):
        try:
            info = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if (info.get("cloud_fingerprint"), info.get("edge_fingerprint")) == (cloud_fingerprint, edge_fingerprint):
            return config.parent
    return None


def resolve_splice(cfg: CompressConfig, cloud: LoadedModel, edge: LoadedModel, same: bool) -> CompressConfig:
    """`--splice auto` and an unset translator made concrete: the shipped fuser of this pair (fuse) when one
    exists and no translator was asked for, else replace with the asked-for translator (ridge if none)."""
    cfg = replace(cfg)
    if same:
        cfg.splice = "replace"
    elif cfg.splice == "auto":
        fuser = shipped_fuser(cloud.fingerprint, edge.fingerprint) if cfg.translator is None else None
        if fuser is not None:
            name = json.loads((fuser / "translator.json").read_text(encoding="utf-8"))["name"]
            cfg.translator, cfg.translator_path, cfg.splice = name, str(fuser), "fuse"
        else:
            cfg.splice = "fuse" if is_fuser(cfg.translator) else "replace"
    if cfg.translator is None:
        cfg.translator = "ridge"
    cfg.validate()
    return cfg


# Settings that act only after the cloud-side KV is made (encoding, packaging): exports differing only in these
# can share it.
ENCODING_KEYS = {"out", "prune_ratio", "quant", "keep_recent", "tar"}


def under(shared: SharedPrefix | None, check: dict | None) -> dict:
    """The manifest's record of the prefix an export is read under (`under_shared`, with the gate's `check` when
    gated), or of the one the gate declined (`shared_declined`); {} for a plain export."""
    if shared is None:
        return {}
    record = {**shared.describe(), **({"gate": check} if check else {})}
    return {"shared_declined" if check and not check["reads_prefix"] else "under_shared": record}


def run_compress(cfg: CompressConfig, progress=None, models: tuple[LoadedModel, LoadedModel] | None = None,
                 layers_cache: dict | None = None, teacher: LoadedModel | None = None) -> dict:
    """Build the KV export in cfg.out (atomically) and return the report (also written as report.json).
    `models` = (cloud, edge) already loaded (as cfg names them) saves loading them again. `layers_cache` (a dict
    the caller keeps) reuses the cloud-side KV of an earlier call that differed only in ENCODING_KEYS: a sweep
    over ThinK ratios and codecs computes the cloud's KV once; `timings.cached_cloud_kv_s` then says what that
    computation cost. `teacher`: the `shared_gate` model already loaded."""
    cfg.validate()
    prompt = read_system_prompt(cfg.system_prompt)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    cloud, edge = models if models is not None else load_pair(cfg.cloud, cfg.edge, cfg.dtype, cfg.device_map,
                                                              cfg.device, cfg.weights)
    same = same_model(cloud, edge)  # the same model under two names is still the exact same-model path
    check_tokenizers(cloud.tokenizer, edge.tokenizer)
    cfg = resolve_splice(cfg, cloud, edge, same)
    shared = SharedPrefix(cfg.shared, edge) if cfg.shared else None
    if shared is not None and not same and cfg.splice != "fuse":  # the cloud cannot read an edge-shaped prefix
        raise EdgeKVError("--shared needs the same model on both sides (EdgePrompt) or --splice fuse (the edge "
                          "reads its own KV after the prefix); a cloud KV that replaces the edge's has no prefix")
    timings["load_s"] = time.perf_counter() - start
    ids = torch.tensor(edge.tokenizer(prompt, add_special_tokens=True)["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise EdgeKVError("the system prompt encodes to no tokens")
    for m in {id(cloud): cloud, id(edge): edge}.values():
        check_context(m.model.config, int(ids.numel()) + (shared.tokens if shared else 0), "the system prompt")
    reconstruction = None
    if not same and "hidden_in" in TRANSLATORS[cfg.translator].features:  # KV rebuilt by the edge's own block
        reconstruction = check_kv_reconstruction(edge.model, ids[:64])
    pairs, mapping_source = layer_pairs(cfg.mapping, cfg.start_layer, cloud.num_layers, edge.num_layers, same=same)
    if not pairs:
        raise EdgeKVError("no layer pairs to export (check --start-layer against the mapping)")

    tasks = Tasks(progress)
    key = json.dumps({k: v for k, v in to_dict(cfg).items() if k not in ENCODING_KEYS} | {"prompt": prompt},
                     sort_keys=True)
    if layers_cache is not None and key in layers_cache:  # the gate's verdict too: it depends on no encoding key
        side, check, gate_s = layers_cache[key]
        timings["cached_cloud_kv_s"] = sum(side.timings.values()) + gate_s
    else:
        check, read, gate_s = None, shared, 0.0  # `read`: the prefix the export is made and read under (None: declined)
        if cfg.shared_gate:  # the cloud side checks the prefix on this prompt (kv/shared_prefix.py, the gate)
            start = time.perf_counter()
            teacher = teacher or load_model(cfg.shared_gate, cfg.dtype, cfg.device_map, cfg.device)
            check_tokenizers(teacher.tokenizer, edge.tokenizer)
            check = gate(shared, edge, teacher, ids)
            timings["gate_s"] = gate_s = time.perf_counter() - start
            if not check["reads_prefix"]:
                read = None
        side = cloud_side(cfg, cloud, edge, ids, pairs, mapping_source, same, tasks, read)
        timings.update(side.timings)
        if layers_cache is not None:
            layers_cache[key] = side, check, gate_s
    translator, pairs, layers, extra, files = side.translator, side.pairs, side.layers, side.extra, side.files

    start = time.perf_counter()
    advance = tasks.task("encode layers (ThinK + quantize)", len(layers))
    tensors, entries, rows = {}, [], []
    for kv in layers:
        t, e, r = encode_layer(kv, cfg.prune_ratio, cfg.quant, cfg.keep_recent)
        tensors[kv.edge_layer] = t
        entries.append(e)
        rows.append(r)
        advance()
    timings["encode_s"] = time.perf_counter() - start

    cinfo = model_info(cloud)
    n = int(ids.numel())
    manifest = export_manifest(
        cinfo, edge, ids, entries, regime="same-model" if same else "heterogeneous",
        splice="replace" if same else cfg.splice, start_layer=pairs[0][0], mapping=side.mapping_source,
        map_location="none" if same else cfg.map_on,
        local_sink_tokens=0 if same or cfg.splice == "fuse" else min(cfg.local_sink_tokens, n),
        prune={"method": "think", "ratio": cfg.prune_ratio, "window": cfg.window, "keep_recent": cfg.keep_recent,
               "queries": "own window" if same or cfg.map_on == "edge" else "edge calibration windows"},
        quant=cfg.quant, **under(shared, check))
    if translator is not None:
        manifest["translator"] = {
            "name": translator.name, "applied_on": cfg.map_on, "source": cfg.translator_path or "fitted",
            "tensors_sha256": sha256_bytes(files[TRANSLATOR_TENSORS]),
            "config_sha256": sha256_bytes(files[TRANSLATOR_CONFIG]),
            "shipped": bool(extra), "bytes": sum(map(len, files.values()))}
    start = time.perf_counter()
    write_export(cfg.out, manifest, tensors, as_tar=cfg.tar, extra=extra)
    timings["write_s"] = time.perf_counter() - start

    written = sum(e["bytes"] for e in entries) + sum(map(len, extra.values()))
    raw_cloud = sum(raw_fp16_bytes(n, cinfo["num_kv_heads"], cinfo["head_dim"]) for _ in pairs)
    raw_shipped = sum(raw_fp16_bytes(n, kv.keys.shape[0], kv.keys.shape[2]) if kv.keys is not None
                      else 2 * kv.hidden.numel() for kv in layers)
    report = {
        "out": str(cfg.out), "regime": manifest["regime"], "system_prompt_tokens": n, "layers": rows,
        "raw_fp16_cloud_bytes": raw_cloud, "raw_fp16_shipped_bytes": raw_shipped, "bytes_written": written,
        "ratio_vs_cloud_fp16": raw_cloud / written, "ratio_vs_shipped_fp16": raw_shipped / written,
        "mean_attn_error_prune": sum(r["attn_error_prune"] for r in rows) / len(rows),
        "mean_attn_error_total": mean([r["attn_error_total"] for r in rows]),
        "timings": timings, "config": to_dict(cfg),
    }
    if check is not None:
        report["shared_gate"] = check
    if reconstruction is not None:  # the edge's KV rebuilt from its own hidden states: the structure check
        report["kv_reconstruction_max_rel_error"] = reconstruction
    if not same:
        report["translator"] = manifest["translator"]
        for key in ("r2_k", "r2_v", "r2_hidden"):
            if all(key in r for r in rows):
                report[f"mean_{key}"] = sum(r[key] for r in rows) / len(rows)
    report_path = (Path(cfg.out).with_suffix(".report.json") if cfg.tar else Path(cfg.out) / "report.json")
    write_text_atomic(report_path, json.dumps(report, indent=1))
    return report

