"""Read one layer of a KV export back into tensors the edge attends with (dequantized, translated, rotated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv.kv.codecs import Quantized, dequantize
from edgekv.kv.export import KVExport, KVStoreError
from edgekv.kv.pruning import PrunedKeys
from edgekv.models.structure import merge_heads, model_device

SPACES = ("edge", "cloud-unrotated", "cloud-hidden")


@dataclass
class DecodedLayer:
    """One edge layer's system-prompt data as stored: edge-shaped or cloud-space pruned keys + values, or the
    cloud's input hidden states (space "cloud-hidden") that the edge's translator turns into KV."""

    edge_layer: int
    cloud_layer: int
    space: str
    keys: PrunedKeys | None = None
    values: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


def _quantized(tensors: dict, prefix: str, params: dict) -> Quantized:
    return Quantized(params["scheme"], tensors[f"{prefix}.data"], tensors.get(f"{prefix}.scale"),
                     tuple(params["shape"]), params["axis"])


def decode_layer(export: KVExport, edge_layer: int) -> DecodedLayer:
    """Verify, parse and dequantize one layer (float32)."""
    return decode_tensors(export.entries.get(edge_layer, {}), export.layer(edge_layer), str(export.path))


def decode_tensors(entry: dict, tensors: dict, where: str) -> DecodedLayer:
    """Parse and dequantize one layer's verified tensors against its manifest entry."""
    where = f"{where}/{entry.get('file')}"
    try:
        space = entry["space"]
        if space not in SPACES:
            raise ValueError(f"unknown space {space!r}")
        out = DecodedLayer(int(entry["edge_layer"]), int(entry["cloud_layer"]), space)
        if space == "cloud-hidden":
            out.hidden = dequantize(_quantized(tensors, "hidden", entry["hidden"]))
            return out
        k = entry["key"]
        kept = dequantize(_quantized(tensors, "key", k))
        index = torch.tensor(k["kept_channels"], dtype=torch.long)
        if "key_recent" in entry:
            recent = dequantize(_quantized(tensors, "key_recent", entry["key_recent"]))
        else:
            recent = kept.new_zeros(kept.shape[0], 0, k["head_dim"])
        if index.shape != (kept.shape[0], kept.shape[2]):
            raise KVStoreError(f"{where}: kept channel indices {tuple(index.shape)} do not fit keys "
                               f"{tuple(kept.shape)}")
        out.keys = PrunedKeys(kept, index, recent, k["head_dim"])
        out.values = dequantize(_quantized(tensors, "value", entry["value"]))
        return out
    except KVStoreError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise KVStoreError(f"{where}: layer does not match its manifest entry ({type(exc).__name__}: {exc})") from exc


def edge_kv(layer: DecodedLayer, edge_model: torch.nn.Module, translator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width edge-space (keys, values), each (kv_heads, tokens, head_dim), rotated at positions 0..: pruned
    channels zero-filled; for exports whose translator runs on the edge, translated by the same `layer_kv` code
    that `edgekv compress` runs on the cloud."""
    device = model_device(edge_model)  # the export is read on the CPU; the edge may run elsewhere
    if layer.space == "edge":
        return layer.keys.zero_filled().to(device), layer.values.to(device)
    if translator is None:
        raise KVStoreError(f"layer {layer.edge_layer} holds cloud-space data ({layer.space}) but no translator "
                           "was given")
    if layer.space == "cloud-hidden":
        features = {"hidden_in": layer.hidden}
    else:
        features = {"k_unrot": merge_heads(layer.keys.zero_filled()), "v": merge_heads(layer.values)}
    with torch.no_grad():
        keys, values = translator.layer_kv(edge_model, layer.edge_layer, features)
    return keys.to(device), values.to(device)
