"""One layer of an export encoded: ThinK-pruned keys, quantized keys and values (or the cloud's hidden states),
with the attention and value errors that encoding costs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from edgekv.kv.codecs import Quantized, dequantize, quantize
from edgekv.kv.pruning import PrunedKeys, attention_error, prune_keys, think_scores, think_select


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


def _codes(keys: torch.Tensor, values: torch.Tensor, q_obs: torch.Tensor, prune_ratio: float, quant: str,
           keep_recent: int) -> tuple[PrunedKeys, Quantized, Quantized]:
    """The keys pruned to ThinK's channels, and the quantized kept keys and values: what an export stores
    (`encode_layer`) and what a student trained through the codec reads (`coded`)."""
    pruned = prune_keys(keys.float(), think_select(think_scores(q_obs, keys), prune_ratio), keep_recent)
    return pruned, quantize(pruned.kept, quant, axis="channel"), quantize(values.float(), quant, axis="token")


def encode_layer(kv: LayerKV, prune_ratio: float, quant: str, keep_recent: int) -> tuple[dict, dict, dict]:
    """ThinK-prune and quantize one layer → (safetensors tensors, manifest entry, report row)."""
    if kv.space == "cloud-hidden":
        return _encode_hidden(kv, quant)
    keep_recent = min(keep_recent, kv.keys.shape[1])
    pruned, kq, vq = _codes(kv.keys, kv.values, kv.q_obs, prune_ratio, quant, keep_recent)
    index = pruned.index
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
    restored = replace(pruned, kept=dequantize(kq), recent=dequantize(rq) if keep_recent else pruned.recent)
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


def coded(keys: torch.Tensor, values: torch.Tensor, q_obs: torch.Tensor, prune_ratio: float,
          quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """What the edge reads back of edge-shaped `keys`/`values` (kv_heads, tokens, d) after `encode_layer` (no
    recent tokens) and decoding: the same ThinK channels zero-filled, the same codes dequantized (float32)."""
    pruned, kq, vq = _codes(keys, values, q_obs, prune_ratio, quant, 0)
    return replace(pruned, kept=dequantize(kq)).zero_filled(), dequantize(vq)


def _encode_hidden(kv: LayerKV, quant: str) -> tuple[dict, dict, dict]:
    """Quantize the cloud's hidden states (one scale per token); nothing to prune: there are no keys yet."""
    hq = quantize(kv.hidden.float(), quant, axis="token")
    entry = {"edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer, "space": kv.space, "hidden": hq.params()}
    err = float((dequantize(hq) - kv.hidden.float()).norm() / kv.hidden.float().norm().clamp_min(1e-30))
    row = {"edge_layer": kv.edge_layer, "cloud_layer": kv.cloud_layer, "kept_channels": int(kv.hidden.shape[1]),
           "head_dim": int(kv.hidden.shape[1]), "attn_error_prune": 0.0, "attn_error_total": None,
           "value_error": err, "bytes": hq.nbytes, **(kv.map_info or {})}
    return _quant_tensors("hidden", hq), entry, row


def raw_fp16_bytes(tokens: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's K and V in fp16."""
    return 2 * tokens * kv_heads * head_dim * 2
