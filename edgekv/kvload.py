"""Read one layer of a KV export back into tensors the edge attends with (dequantized, mapped, rotated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv.capture import apply_rotary, attn_shape, merge_heads, split_heads
from edgekv.kvmap import RidgeMap
from edgekv.kvstore import KVExport, KVStoreError
from edgekv.pruning import PrunedKeys
from edgekv.quant import Quantized, dequantize


@dataclass
class DecodedLayer:
    """One edge layer's system-prompt KV as stored: pruned keys (kept channels + indices) and values."""

    edge_layer: int
    space: str
    keys: PrunedKeys
    values: torch.Tensor
    maps: tuple[RidgeMap, RidgeMap] | None


def _quantized(tensors: dict, prefix: str, params: dict) -> Quantized:
    return Quantized(params["scheme"], tensors[f"{prefix}.data"], tensors.get(f"{prefix}.scale"),
                     tuple(params["shape"]), params["axis"])


def decode_layer(export: KVExport, edge_layer: int) -> DecodedLayer:
    """Verify, parse and dequantize one layer (float32)."""
    tensors = export.layer(edge_layer)
    entry = export.entries[edge_layer]
    where = f"{export.path}/{entry.get('file')}"
    try:
        k = entry["key"]
        kept = dequantize(_quantized(tensors, "key", k))
        index = torch.tensor(k["kept_channels"], dtype=torch.long)
        if "key_recent" in entry:
            recent = dequantize(_quantized(tensors, "key_recent", entry["key_recent"]))
        else:
            recent = kept.new_zeros(kept.shape[0], 0, k["head_dim"])
        values = dequantize(_quantized(tensors, "value", entry["value"]))
        maps = None
        if "map" in entry:
            maps = (RidgeMap.from_tensors(tensors, "map.k", entry["map"]["alpha_k"]),
                    RidgeMap.from_tensors(tensors, "map.v", entry["map"]["alpha_v"]))
        if index.shape != (kept.shape[0], kept.shape[2]):
            raise KVStoreError(f"{where}: kept channel indices {tuple(index.shape)} do not fit keys "
                               f"{tuple(kept.shape)}")
        return DecodedLayer(edge_layer, entry["space"], PrunedKeys(kept, index, recent, k["head_dim"]), values, maps)
    except KVStoreError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise KVStoreError(f"{where}: layer does not match its manifest entry ({type(exc).__name__}: {exc})") from exc


def edge_kv(layer: DecodedLayer, edge_model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width edge-space (keys, values), each (kv_heads, tokens, head_dim): channels zero-filled, and for
    exports whose map runs on the edge, mapped from cloud space and rotated with the edge's own rotary."""
    keys = layer.keys.zero_filled()
    if layer.maps is None:
        return keys, layer.values
    _, kv_heads, _ = attn_shape(edge_model)
    mapped_k = split_heads(layer.maps[0].apply(merge_heads(keys)), kv_heads)
    mapped_v = split_heads(layer.maps[1].apply(merge_heads(layer.values)), kv_heads)
    return apply_rotary(edge_model, mapped_k), mapped_v
