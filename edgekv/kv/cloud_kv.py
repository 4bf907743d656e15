"""The cloud's side of an export: the system prompt's KV for each shipped edge layer, from the model itself (same
model) or through a translator fitted on calibration texts (heterogeneous), with the queries that score ThinK."""

from __future__ import annotations

import hashlib
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from edgekv import EdgeKVError
from edgekv.kv.encode import LayerKV
from edgekv.kv.registry import TRANSLATORS, load_translator, translator_files
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.kv.translators import Translator, split_by_text
from edgekv.models.capture import capture
from edgekv.models.loading import LoadedModel
from edgekv.models.structure import attn_shape, split_heads
from edgekv.progress import Tasks
from edgekv.texts import load_text_file, sharegpt_texts, tokenize


@dataclass
class CloudSide:
    """What the cloud computed for an export, before encoding."""

    translator: Translator | None
    pairs: list[tuple[int, int]]
    mapping_source: str
    layers: list[LayerKV]
    extra: dict = field(default_factory=dict)  # translator files shipped with the export
    files: dict = field(default_factory=dict)  # the translator's files (hashed into the manifest)
    timings: dict = field(default_factory=dict)


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
                      tasks: Tasks | None = None, shared: SharedPrefix | None = None) -> list[LayerKV]:
    """The model's own KV of layers start..L-1 (rotated, as in its cache) and its own queries; under a `shared`
    prefix, the prompt's own tokens read after it (positions from K)."""
    after = (shared.prefix.request_cache, shared.tokens) if shared is not None and shared.tokens else None
    acts = capture(model.model, [ids], ("k", "v", "q"), on_text=(tasks or Tasks()).task("system prompt forward", 1),
                   after=after)
    heads, kv_heads, _ = attn_shape(model.model)
    layers = []
    for i in range(start, model.num_layers):
        q_obs, q_held = _window_and_heldout(split_heads(acts.layers["q"][i], heads), window, seed=seed)
        layers.append(LayerKV(i, i, split_heads(acts.layers["k"][i], kv_heads),
                              split_heads(acts.layers["v"][i], kv_heads), q_obs, q_held, "edge"))
    return layers


def calibration(cfg: Any, tokenizer) -> list[torch.Tensor]:
    """The calibration texts of an export's settings (`cfg`: a CompressConfig), tokenized."""
    source = (load_text_file(cfg.calib) if cfg.calib else
              sharegpt_texts(cfg.calib_texts, offset=cfg.calib_offset))
    seqs = tokenize(tokenizer, source.texts[: cfg.calib_texts], cfg.calib_tokens, min_tokens=2)
    if len(seqs) < 3:
        raise EdgeKVError(f"{source.description}: fewer than 3 usable calibration texts")
    return seqs


_QUERY_CACHE: dict[tuple, object] = {}


def _edge_queries(edge: LoadedModel, calib: list[torch.Tensor], tasks: Tasks, captured=None):
    """The edge's calibration queries (ThinK scoring for edge-shaped exports), captured once per process for the
    same model and texts: a process that compresses many prompts (edgekv eval) pays for them once. `captured`:
    a capture of these texts that holds "q" already (a translator's fit), kept instead of a second forward."""
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in calib)).hexdigest()
    key = (edge.fingerprint, digest)
    if key not in _QUERY_CACHE:
        _QUERY_CACHE.clear()  # keep one entry: the captures are tens of MB
        _QUERY_CACHE[key] = (replace(captured, layers={"q": captured.layers["q"]}) if captured is not None else
                             capture(edge.model, calib, ("q",), on_text=tasks.task("calibration: edge", len(calib))))
    return _QUERY_CACHE[key]


def get_translator(cfg: Any, cloud: LoadedModel, edge: LoadedModel, pairs: list[tuple[int, int]],
                   calib: list[torch.Tensor], tasks: Tasks) -> tuple[Translator, dict]:
    """The translator: loaded from --translator-path (checked against this model pair), or fitted on the
    calibration texts for `pairs`. Also returns the edge's calibration captures (for ThinK scoring queries)."""
    if cfg.translator_path:  # loaded (and checked) before any forward pass: a wrong one fails fast
        translator = load_translator(cfg.translator_path, cloud.fingerprint, edge.fingerprint)
        if translator.name != cfg.translator:
            raise EdgeKVError(f"{cfg.translator_path}: a '{translator.name}' translator, not '{cfg.translator}'")
        return translator, _edge_queries(edge, calib, tasks)
    edge_cal = capture(edge.model, calib, ("q", *TRANSLATORS[cfg.translator].features),
                       on_text=tasks.task("calibration: edge", len(calib)))
    _edge_queries(edge, calib, tasks, edge_cal)  # later exports with the saved translator score with these
    cloud_cal = capture(cloud.model, calib, TRANSLATORS[cfg.translator].features,
                        on_text=tasks.task("calibration: cloud", len(calib)))
    return TRANSLATORS[cfg.translator]().fit(cloud_cal, edge_cal, pairs, edge.model), edge_cal


_PROMPT_CACHE: dict[tuple, tuple] = {}


def _cloud_prompt(cloud: LoadedModel, ids: torch.Tensor, features: tuple[str, ...], tasks: Tasks):
    """The cloud's capture of a system prompt and the seconds it took, kept for the last prompt: strategies whose
    translators read the same features of the same prompt (ce-lslm and ce-lslm-fuse both read `hidden_in`)
    share one forward. Returns (activations, seconds, cached)."""
    key = (hashlib.sha256(ids.numpy().tobytes()).hexdigest(), features)
    hit = _PROMPT_CACHE.get(key)
    if hit is not None and hit[0]() is cloud.model:  # the same live model object
        return hit[1], hit[2], True
    start = time.perf_counter()
    acts = capture(cloud.model, [ids], features, on_text=tasks.task("system prompt: cloud forward", 1))
    seconds = time.perf_counter() - start
    _PROMPT_CACHE.clear()  # keep one prompt: the eval makes a prompt's exports one after another
    _PROMPT_CACHE[key] = weakref.ref(cloud.model), acts, seconds
    return acts, seconds, False


def heterogeneous_layers(cloud: LoadedModel, edge: LoadedModel, ids: torch.Tensor, translator: Translator,
                         edge_cal, cfg: Any, tasks: Tasks | None = None,
                         timings: dict | None = None) -> list[LayerKV]:
    """What is shipped for each of the translator's pairs: edge-shaped KV (map on the cloud) or the cloud-space
    features the edge's translator needs (map on the edge), with the queries that score key channels. A forward
    reused from an earlier export of the same prompt puts its seconds in `timings["cached_cloud_forward_s"]`."""
    tasks = tasks or Tasks()
    features = (*translator.features, "q_unrot")
    cloud_prompt, seconds, cached = _cloud_prompt(cloud, ids, features, tasks)
    if cached and timings is not None:
        timings["cached_cloud_forward_s"] = seconds
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


def cloud_side(cfg: Any, cloud: LoadedModel, edge: LoadedModel, ids: torch.Tensor, pairs: list,
                mapping_source: str, same: bool, tasks: Tasks, shared: SharedPrefix | None = None) -> tuple:
    """The cloud-side KV of the prompt, before encoding (`cfg`: a CompressConfig with its splice resolved), read
    after a `shared` prefix (same model only)."""
    timings: dict[str, float] = {}
    files: dict = {}
    start = time.perf_counter()
    translator, extra = None, {}
    if same:
        layers = same_model_layers(edge, ids, pairs[0][0], cfg.window, cfg.seed, tasks, shared)
    else:
        translator, edge_cal = get_translator(cfg, cloud, edge, pairs, calibration(cfg, edge.tokenizer), tasks)
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
        layers = heterogeneous_layers(cloud, edge, ids, translator, edge_cal, cfg, tasks, timings)
        # a fuser's gates run on the edge either way; its maps only where the edge applies them
        shipped = translator.gates_only() if cfg.splice == "fuse" and cfg.map_on == "cloud" else translator
        files = translator_files(shipped, cloud.fingerprint, edge.fingerprint)
        if cfg.map_on == "edge" or cfg.splice == "fuse":
            extra = files
    timings["cloud_kv_s"] = time.perf_counter() - start - timings.get("calibration_s", 0.0)

    return CloudSide(translator, pairs, mapping_source, layers, extra, files, timings)
