"""Spliced caches: a transformers `DynamicCache` whose deep layers hold KV from elsewhere (DESIGN.md §1, §3).

The cache stays the library's own class; only the tensors of chosen layers are swapped, so every model that
decodes on a `DynamicCache` decodes on a spliced one unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def splice_layers(cache: DynamicCache, replacements: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  keep_first: int = 0) -> DynamicCache:
    """Replace layer i's keys/values (batch 1) with `replacements[i]`, each `(kv_heads, tokens, head_dim)`.

    The first `keep_first` positions keep their local KV (attention-sink tokens computed on the edge).
    Shapes must match the cache's layer exactly; dtype and device follow the cache. Works in place.
    """
    for i, (keys, values) in replacements.items():
        layer = cache.layers[i]
        if tuple(keys.shape) != tuple(layer.keys.shape[1:]) or tuple(values.shape) != tuple(layer.values.shape[1:]):
            raise ValueError(f"layer {i}: replacement {tuple(keys.shape)}/{tuple(values.shape)} does not fit the "
                             f"cache's {tuple(layer.keys.shape[1:])}/{tuple(layer.values.shape[1:])}")
        new_k = keys.to(layer.keys.dtype, copy=True)[None]
        new_v = values.to(layer.values.dtype, copy=True)[None]
        if keep_first:
            new_k[:, :, :keep_first] = layer.keys[:, :, :keep_first]
            new_v[:, :, :keep_first] = layer.values[:, :, :keep_first]
        layer.keys, layer.values = new_k.to(layer.keys.device), new_v.to(layer.values.device)
    return cache


