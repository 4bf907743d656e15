"""`edgekv compress`: the cloud's system-prompt KV, mapped, ThinK-pruned and quantized, as a KV export.

Two regimes (DESIGN.md §1). Same model: the export holds the model's own KV of layers m..L-1, exact up to
pruning/quantization. Heterogeneous: each edge layer i ≥ m takes the KV of its matched cloud layer j, through
ridge maps fitted on calibration texts (un-rotated keys; the edge's rotary re-applied at the target positions),
applied on the cloud (ship edge-shaped KV) or on the edge (ship pruned cloud KV + the maps).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import MappingParams, build_mapping
from edgekv.atomic import write_text_atomic
from edgekv.config import command_config, to_dict
from edgekv.kv.codecs import SCHEMES, Quantized, dequantize, quantize
from edgekv.kv.export import sha256_bytes, token_ids_sha256, tokenizer_fingerprint, write_export
from edgekv.kv.pruning import attention_error, check_ratio, prune_keys, think_scores, think_select
from edgekv.kv.registry import (
    TRANSLATOR_CONFIG,
    TRANSLATOR_TENSORS,
    TRANSLATORS,
    is_fuser,
    load_translator,
    translator_files,
)
from edgekv.kv.translators import Translator, split_by_text
from edgekv.models.capture import capture, check_kv_reconstruction
from edgekv.models.loading import DTYPES, LoadedModel, check_tokenizers, load_pair, same_model
from edgekv.models.structure import (
    attn_shape,
    check_context,
    rotary_cos_sin,
    split_heads,
)
from edgekv.progress import Steps
from edgekv.summary import mean
from edgekv.texts import load_text_file, read_system_prompt, sharegpt_texts


@command_config("compress")
@dataclass
class CompressConfig:
    """Everything `edgekv compress` needs; see configs/default.yaml."""

    out: str | None = None
    cloud: str = "default-cloud"
    edge: str = "default-edge"
    dtype: str = "bfloat16"
    device: str = "cpu"  # cpu, cuda or auto (CUDA when torch sees one)
    weights: str = "bf16"  # the edge's linears: bf16, int8 or int4 (weight-only, torch's CPU kernels)
    device_map: str | None = None
    system_prompt: str | None = None  # the text, or @path of a UTF-8 file
    mapping: str | None = None  # mapping.json of `edgekv align`; None: uniform (heterogeneous) / identity (same)
    start_layer: int | None = None  # None: the mapping's, or 0 for the same model
    prune_ratio: float = 0.0
    window: int = 32
    keep_recent: int = 0
    quant: str = "fp16"
    map_on: str = "cloud"
    translator: str | None = None  # ridge | hidden | trained | fuse-*; None: ridge, or the shipped fuser (auto)
    translator_path: str | None = None  # a saved translator (required for trained); None: fit on calibration
    local_sink_tokens: int = 1  # the edge computes the first s system-prompt tokens' deep KV itself
    splice: str = "auto"  # replace: cloud KV instead of the edge's own; fuse: beside it, through a fuser's gates;
    # auto: fuse with the project's shipped fuser of this exact pair (fusers/) when --translator and
    # --translator-path are not given, else replace
    calib: str | None = None  # calibration texts for the maps; None: ShareGPT
    calib_texts: int = 16
    calib_tokens: int = 256
    calib_offset: int = 0
    tar: bool = False
    seed: int = 0
    prompts: str | None = None  # JSONL of {"name", "system_prompt"}: one export each, into --catalog
    catalog: str | None = None  # a catalog URL or folder (edgekv.kv.catalog) for --prompts
    ray: str | None = None  # --prompts on Ray: "" a local cluster, "auto" or an address to join one
    workers: int = 2  # Ray actors (each loads the models once)

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
        if self.quant not in SCHEMES:
            raise EdgeKVError(f"unknown --quant '{self.quant}' (choose from {', '.join(SCHEMES)})")
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
        if self.dtype not in DTYPES:
            raise EdgeKVError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        if self.calib_texts < 3 or self.calib_tokens < 2:
            raise EdgeKVError("--calib-texts must be ≥ 3 and --calib-tokens ≥ 2 (maps need train/validation/test)")
        if self.start_layer is not None and self.start_layer < 0:
            raise EdgeKVError(f"--start-layer must be ≥ 0, got {self.start_layer}")


# ---------------------------------------------------------------------------------------------- encoding


@dataclass
class LayerKV:
    """What is shipped for one edge layer before encoding: keys/values (heads, tokens, d) and the queries that
    score key channels (observation window) and measure the pruning error (held out)."""

    edge_layer: int
    cloud_layer: int
    keys: torch.Tensor | None
    values: torch.Tensor | None
    q_obs: torch.Tensor | None
    q_heldout: torch.Tensor | None
    space: str  # "edge" (edge-shaped, rotated), "cloud-unrotated" or "cloud-hidden" (translator on the edge)
    map_info: dict | None = None
    hidden: torch.Tensor | None = None  # (tokens, d_cloud) for "cloud-hidden"


def _quant_tensors(prefix: str, q: Quantized) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.data": q.data}
    if q.scale is not None:
        out[f"{prefix}.scale"] = q.scale
    return out


def encode_layer(kv: LayerKV, prune_ratio: float, quant: str, keep_recent: int) -> tuple[dict, dict, dict]:
    """ThinK-prune and quantize one layer → (safetensors tensors, manifest entry, report row)."""
    if kv.space == "cloud-hidden":
        return _encode_hidden(kv, quant)
    keep_recent = min(keep_recent, kv.keys.shape[1])
    index = think_select(think_scores(kv.q_obs, kv.keys), prune_ratio)
    pruned = prune_keys(kv.keys.float(), index, keep_recent)
    kq = quantize(pruned.kept, quant, axis="channel")
    vq = quantize(kv.values.float(), quant, axis="token")
    tensors = {**_quant_tensors("key", kq), **_quant_tensors("value", vq)}
    entry = {
        "edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer, "space": kv.space,
        "key": {**kq.params(), "head_dim": pruned.head_dim, "kept_channels": index.tolist(), "recent": keep_recent},
        "value": vq.params(),
    }
    if keep_recent:
        rq = quantize(pruned.recent, quant, axis="channel")
        tensors.update(_quant_tensors("key_recent", rq))
        entry["key_recent"] = rq.params()
    # errors on held-out queries: channel pruning alone, then pruning + quantization of the keys
    k_hat = dequantize(kq)
    restored = type(pruned)(k_hat, index, dequantize(rq) if keep_recent else pruned.recent, pruned.head_dim)
    full = kv.keys.float()
    group = kv.q_heldout.shape[0] // full.shape[0]
    logits = kv.q_heldout.double() @ full.double().repeat_interleave(group, 0).transpose(1, 2)
    logits_hat = kv.q_heldout.double() @ restored.zero_filled().double().repeat_interleave(group, 0).transpose(1, 2)
    row = {
        "edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer,
        "kept_channels": int(index.shape[1]), "head_dim": pruned.head_dim,
        "attn_error_prune": attention_error(kv.q_heldout, full[:, : full.shape[1] - keep_recent], index),
        "attn_error_total": float((logits - logits_hat).norm() / logits.norm().clamp_min(1e-300)),
        "value_error": float((dequantize(vq) - kv.values.float()).norm() / kv.values.float().norm().clamp_min(1e-30)),
        "bytes": kq.nbytes + vq.nbytes + (rq.nbytes if keep_recent else 0),
        **(kv.map_info or {}),
    }
    return tensors, entry, row


def _encode_hidden(kv: LayerKV, quant: str) -> tuple[dict, dict, dict]:
    """Quantize the cloud's hidden states (one scale per token); nothing to prune: there are no keys yet."""
    hq = quantize(kv.hidden.float(), quant, axis="token")
    entry = {"edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer, "space": kv.space, "hidden": hq.params()}
    err = float((dequantize(hq) - kv.hidden.float()).norm() / kv.hidden.float().norm().clamp_min(1e-30))
    row = {"edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer, "kept_channels": int(kv.hidden.shape[1]),
           "head_dim": int(kv.hidden.shape[1]), "attn_error_prune": 0.0, "attn_error_total": None,
           "value_error": err, "bytes": hq.nbytes, **(kv.map_info or {})}
    return _quant_tensors("hidden", hq), entry, row


# ---------------------------------------------------------------------------------------------- sources


def _window_and_heldout(q: torch.Tensor, window: int, max_heldout: int = 256, seed: int = 0):
    """Split (heads, tokens, d) queries into the observation window (last w) and held-out earlier positions."""
    w = min(window, q.shape[1])
    heldout = q[:, : q.shape[1] - w]
    if heldout.shape[1] == 0:  # a prompt no longer than the window: measure on the window itself
        heldout = q[:, -w:]
    if heldout.shape[1] > max_heldout:
        keep = torch.randperm(heldout.shape[1], generator=torch.Generator().manual_seed(seed))[:max_heldout]
        heldout = heldout[:, keep.sort().values]
    return q[:, -w:], heldout


def same_model_layers(model: LoadedModel, ids: torch.Tensor, start: int, window: int, seed: int,
                      steps: Steps | None = None) -> list[LayerKV]:
    """The model's own KV of layers start..L-1 (rotated, as in its cache) and its own queries."""
    acts = capture(model.model, [ids], ("k", "v", "q"), on_text=(steps or Steps()).task("system prompt forward", 1))
    heads, kv_heads, _ = attn_shape(model.model)
    layers = []
    for i in range(start, model.num_layers):
        q_obs, q_held = _window_and_heldout(split_heads(acts.layers["q"][i], heads), window, seed=seed)
        layers.append(LayerKV(i, i, split_heads(acts.layers["k"][i], kv_heads),
                              split_heads(acts.layers["v"][i], kv_heads), q_obs, q_held, "edge"))
    return layers


def _calibration(cfg: CompressConfig, tokenizer) -> list[torch.Tensor]:
    from edgekv.align.align_job import tokenize

    source = (load_text_file(cfg.calib) if cfg.calib else
              sharegpt_texts(cfg.calib_texts, offset=cfg.calib_offset))
    seqs = tokenize(tokenizer, source.texts[: cfg.calib_texts], cfg.calib_tokens, min_tokens=2)
    if len(seqs) < 3:
        raise EdgeKVError(f"{source.description}: fewer than 3 usable calibration texts")
    return seqs


_QUERY_CACHE: dict[tuple, object] = {}


def _edge_queries(edge: LoadedModel, calib: list[torch.Tensor], steps: Steps):
    """The edge's calibration queries (ThinK scoring for edge-shaped exports), captured once per process for the
    same model and texts: a process that compresses many prompts (edgekv eval) pays for them once."""
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in calib)).hexdigest()
    key = (edge.fingerprint, digest)
    if key not in _QUERY_CACHE:
        _QUERY_CACHE.clear()  # keep one entry: the captures are tens of MB
        _QUERY_CACHE[key] = capture(edge.model, calib, ("q",), on_text=steps.task("calibration: edge", len(calib)))
    return _QUERY_CACHE[key]


def get_translator(cfg: CompressConfig, cloud: LoadedModel, edge: LoadedModel, pairs: list[tuple[int, int]],
                   calib: list[torch.Tensor], steps: Steps) -> tuple[Translator, dict]:
    """The translator: loaded from --translator-path (checked against this model pair), or fitted on the
    calibration texts for `pairs`. Also returns the edge's calibration captures (for ThinK scoring queries)."""
    if cfg.translator_path:  # loaded (and checked) before any forward pass: a wrong one fails fast
        translator = load_translator(cfg.translator_path, cloud.fingerprint, edge.fingerprint)
        if translator.name != cfg.translator:
            raise EdgeKVError(f"{cfg.translator_path}: a '{translator.name}' translator, not '{cfg.translator}'")
        return translator, _edge_queries(edge, calib, steps)
    edge_cal = capture(edge.model, calib, ("q", *TRANSLATORS[cfg.translator].features),
                       on_text=steps.task("calibration: edge", len(calib)))
    cloud_cal = capture(cloud.model, calib, TRANSLATORS[cfg.translator].features,
                        on_text=steps.task("calibration: cloud", len(calib)))
    return TRANSLATORS[cfg.translator]().fit(cloud_cal, edge_cal, pairs, edge.model), edge_cal


def heterogeneous_layers(cloud: LoadedModel, edge: LoadedModel, ids: torch.Tensor, translator: Translator,
                         edge_cal, cfg: CompressConfig, steps: Steps | None = None) -> list[LayerKV]:
    """What is shipped for each of the translator's pairs: edge-shaped KV (map on the cloud) or the cloud-space
    features the edge's translator needs (map on the edge), with the queries that score key channels."""
    steps = steps or Steps()
    features = (*translator.features, "q_unrot")
    cloud_prompt = capture(cloud.model, [ids], features, on_text=steps.task("system prompt: cloud forward", 1))
    c_heads, c_kv, _ = attn_shape(cloud.model)
    e_heads, _, _ = attn_shape(edge.model)
    # edge-space scoring queries come from calibration (the cloud never runs the edge on the prompt):
    # the last w positions of each train/validation text observe, the test texts are held out
    _, _, test = split_by_text(edge_cal.text_index)
    last = torch.zeros_like(test)
    for t in torch.unique(edge_cal.text_index):
        rows = (edge_cal.text_index == t).nonzero().flatten()
        last[rows[-cfg.window:]] = True
    layers = []
    for i, j in translator.pairs():
        info = {k: v for k, v in translator.info[i].items() if k != "cloud_layer"}
        feats = {f: cloud_prompt.layers[f][j] for f in translator.features}
        if cfg.map_on == "cloud":
            with torch.no_grad():
                keys, values = translator.layer_kv(edge.model, i, feats)
            q_all = edge_cal.layers["q"][i]
            q_obs, q_held = split_heads(q_all[last & ~test], e_heads), split_heads(q_all[test], e_heads)
            layers.append(LayerKV(i, j, keys, values, q_obs, q_held, "edge", info))
        elif "hidden_in" in feats:
            layers.append(LayerKV(i, j, None, None, None, None, "cloud-hidden", info, hidden=feats["hidden_in"]))
        else:
            q_obs, q_held = _window_and_heldout(split_heads(cloud_prompt.layers["q_unrot"][j], c_heads), cfg.window,
                                                seed=cfg.seed)
            layers.append(LayerKV(i, j, split_heads(feats["k_unrot"], c_kv), split_heads(feats["v"], c_kv), q_obs,
                                  q_held, "cloud-unrotated", info))
    return layers


def resolve_pairs(cfg: CompressConfig, cloud_layers: int, edge_layers: int, same: bool) -> tuple[list, str]:
    """(edge layer, cloud layer) pairs from mapping.json, or identity (same model) / uniform (heterogeneous)."""
    if cfg.mapping:
        path = Path(cfg.mapping)
        try:
            mapping = json.loads(path.read_text())
            pairs = [(int(p["edge_layer"]), int(p["cloud_layer"])) for p in mapping["pairs"]]
            dims = (int(mapping["num_cloud_layers"]), int(mapping["num_edge_layers"]))
        except FileNotFoundError as exc:
            raise EdgeKVError(f"mapping file not found: {path}") from exc
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EdgeKVError(f"{path}: not a mapping.json of edgekv align ({exc})") from exc
        if dims != (cloud_layers, edge_layers):
            raise EdgeKVError(f"{path}: made for {dims[0]}→{dims[1]} layers, these models have "
                              f"{cloud_layers}→{edge_layers}")
        if cfg.start_layer is not None:
            pairs = [p for p in pairs if p[0] >= cfg.start_layer]
        return pairs, f"{path}"
    start = cfg.start_layer if cfg.start_layer is not None else (0 if same else edge_layers // 2)
    if start >= edge_layers:
        raise EdgeKVError(f"--start-layer {start} is out of range: the edge model has {edge_layers} layers")
    if same:
        return [(i, i) for i in range(start, edge_layers)], "identity (same model)"
    dummy = {k: torch.zeros(cloud_layers, edge_layers) for k in ("linear_cka", "debiased_cka", "rsa")}
    uniform = build_mapping("uniform", dummy, MappingParams(start))
    return [(p["edge_layer"], p["cloud_layer"]) for p in uniform["pairs"]], "uniform (no --mapping given)"


# ---------------------------------------------------------------------------------------------- command


def model_info(m: LoadedModel) -> dict:
    """Identity and attention shape of a model, for the manifest."""
    heads, kv_heads, head_dim = attn_shape(m.model)
    return {"model": m.spec, "source": m.source, "fingerprint": m.fingerprint, "num_layers": m.num_layers,
            "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "rotary": rotary_cos_sin(m.model, torch.zeros(1, 1, dtype=torch.long),
                                     torch.zeros(1, 1, 1, head_dim)) is not None}


def raw_fp16_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's K and V in fp16."""
    return 2 * tokens * kv_heads * head_dim * 2


def _cloud_side(cfg: CompressConfig, cloud: LoadedModel, edge: LoadedModel, ids: torch.Tensor, pairs: list,
                mapping_source: str, same: bool, steps: Steps) -> tuple:
    """The cloud-side KV of the prompt, before encoding: (translator, pairs, mapping source, layers, extra files
    shipped, translator files, timings)."""
    timings: dict[str, float] = {}
    files: dict = {}
    start = time.perf_counter()
    translator, extra = None, {}
    if same:
        layers = same_model_layers(edge, ids, pairs[0][0], cfg.window, cfg.seed, steps)
    else:
        translator, edge_cal = get_translator(cfg, cloud, edge, pairs, _calibration(cfg, edge.tokenizer), steps)
        if cfg.translator_path:  # the saved translator's pairing wins over --mapping
            pairs = [p for p in translator.pairs() if cfg.start_layer is None or p[0] >= cfg.start_layer]
            if cfg.splice == "fuse":  # a closed gate takes nothing from the cloud: ship only the open layers
                pairs = [p for p in pairs if p[0] in translator.open_layers()]
                if not pairs:
                    raise EdgeKVError(f"{cfg.translator_path}: every gate of this fuser is closed (fusion did not "
                                      "help on its held-out texts); the edge alone is the same, with no export")
            translator.keep_layers(i for i, _ in pairs)
            mapping_source = f"pairs of translator {cfg.translator_path}"
        timings["calibration_s"] = time.perf_counter() - start
        layers = heterogeneous_layers(cloud, edge, ids, translator, edge_cal, cfg, steps)
        # a fuser's gates run on the edge either way; its maps only where the edge applies them
        shipped = translator.gates_only() if cfg.splice == "fuse" and cfg.map_on == "cloud" else translator
        files = translator_files(shipped, cloud.fingerprint, edge.fingerprint)
        if cfg.map_on == "edge" or cfg.splice == "fuse":
            extra = files
    timings["cloud_kv_s"] = time.perf_counter() - start - timings.get("calibration_s", 0.0)

    return translator, pairs, mapping_source, layers, extra, files, timings


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


def run_compress(cfg: CompressConfig, progress=None, models: tuple[LoadedModel, LoadedModel] | None = None,
                 layers_cache: dict | None = None) -> dict:
    """Build the KV export in cfg.out (atomically) and return the report (also written as report.json).
    `models` = (cloud, edge) already loaded (as cfg names them) saves loading them again. `layers_cache` (a dict
    the caller keeps) reuses the cloud-side KV of an earlier call that differed only in ENCODING_KEYS: a sweep
    over ThinK ratios and codecs computes the cloud's KV once; `timings.cached_cloud_kv_s` then says what that
    computation cost."""
    cfg.validate()
    prompt = read_system_prompt(cfg.system_prompt)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    cloud, edge = models if models is not None else load_pair(cfg.cloud, cfg.edge, cfg.dtype, cfg.device_map,
                                                              cfg.device, cfg.weights)
    same = same_model(cloud, edge)  # the same model under two names is still the exact same-model path
    check_tokenizers(cloud.tokenizer, edge.tokenizer)
    cfg = resolve_splice(cfg, cloud, edge, same)
    timings["load_s"] = time.perf_counter() - start
    ids = torch.tensor(edge.tokenizer(prompt, add_special_tokens=True)["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise EdgeKVError("the system prompt encodes to no tokens")
    for m in {id(cloud): cloud, id(edge): edge}.values():
        check_context(m.model.config, int(ids.numel()), "the system prompt")
    reconstruction = None
    if not same and "hidden_in" in TRANSLATORS[cfg.translator].features:  # KV rebuilt by the edge's own block
        reconstruction = check_kv_reconstruction(edge.model, ids[:64])
    pairs, mapping_source = resolve_pairs(cfg, cloud.num_layers, edge.num_layers, same)
    if not pairs:
        raise EdgeKVError("no layer pairs to export (check --start-layer against the mapping)")

    steps = Steps(progress)
    key = json.dumps({k: v for k, v in to_dict(cfg).items() if k not in ENCODING_KEYS} | {"prompt": prompt},
                     sort_keys=True)
    if layers_cache is not None and key in layers_cache:
        translator, pairs, mapping_source, layers, extra, files, cloud_timings = layers_cache[key]
        timings["cached_cloud_kv_s"] = sum(cloud_timings.values())
    else:
        translator, pairs, mapping_source, layers, extra, files, cloud_timings = _cloud_side(
            cfg, cloud, edge, ids, pairs, mapping_source, same, steps)
        timings.update(cloud_timings)
        if layers_cache is not None:
            layers_cache[key] = (translator, pairs, mapping_source, layers, extra, files, cloud_timings)

    start = time.perf_counter()
    advance = steps.task("encode layers (ThinK + quantize)", len(layers))
    tensors, entries, rows = {}, [], []
    for kv in layers:
        t, e, r = encode_layer(kv, cfg.prune_ratio, cfg.quant, cfg.keep_recent)
        tensors[kv.edge_layer] = t
        entries.append(e)
        rows.append(r)
        advance()
    timings["encode_s"] = time.perf_counter() - start

    cinfo, einfo = model_info(cloud), model_info(edge)
    n = int(ids.numel())
    manifest = {
        "regime": "same-model" if same else "heterogeneous",
        "splice": "replace" if same else cfg.splice,
        "cloud": cinfo, "edge": einfo,
        "tokenizer_fingerprint": tokenizer_fingerprint(edge.tokenizer),
        "system_prompt": {"num_tokens": n, "token_ids_sha256": token_ids_sha256(ids.tolist()),
                          "token_ids": ids.tolist()},
        "start_layer": pairs[0][0], "mapping": mapping_source,
        "map_location": "none" if same else cfg.map_on,
        "local_sink_tokens": 0 if same or cfg.splice == "fuse" else min(cfg.local_sink_tokens, n),
        "prune": {"method": "think", "ratio": cfg.prune_ratio, "window": cfg.window, "keep_recent": cfg.keep_recent,
                  "queries": "own window" if same or cfg.map_on == "edge" else "edge calibration windows"},
        "quant": cfg.quant,
        "layers": entries,
    }
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

