"""Relay attention for batched decoding over one shared system prompt (RelayAttention, Zhu et al., ACL 2024).

Every request in a decode batch shares the system prompt's KV. Instead of concatenating that KV onto each
request's own KV at every step, the queries of all requests attend to the one shared copy as a single matrix
product (the batch folded into the query-length axis), each request's own tokens are attended separately
(padded, masked to its own length), and the two partial attentions are merged exactly by log-sum-exp:

    O_b = merge(attn(q_b, K_sys, V_sys), attn(q_b, K_own,b, V_own,b))       (EdgePrompt eq. 5, exact)

Fusion exports add a gated cloud segment to the shared part (`CloudSegment`, merged with its bias first).
`RelayLayer` is the cache layer of one decode step: it appends each request's new key/value to that request's
own KV and hands attention the padded batch; `RelayBatch` carries what the attention needs (the shared KV per
layer, the own lengths) through the model's forward as the keyword `relay`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from edgekv.attention.merge import merge_attention, segment_attention

KVPair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RelayBatch:
    """One decode step's batch: the shared KV of each layer and each request's own length after this step."""

    shared: Callable[[int], KVPair]  # layer → (1, kv_heads, S, d) keys and values of the system prompt
    lengths: torch.Tensor  # (B,) own tokens per request, the step's new token included
    segments: dict = field(default_factory=dict)  # layer → CloudSegment (fuse-bias exports)


def relay_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    batch: RelayBatch, scaling: float | None = None) -> torch.Tensor:
    """(B, 1, heads, d) attention output of one decode step: the shared part once for all queries, each own
    part masked to its length, merged by log-sum-exp. `key`/`value`: the padded own KV (B, kv_heads, L, d)."""
    b, heads, t, d = query.shape
    sys_k, sys_v = batch.shared(module.layer_idx)
    folded = query.transpose(0, 2).reshape(1, heads, t * b, d) if t == 1 else None
    if folded is None:  # only single-token decode steps are batched through here
        raise ValueError("relay attention batches decode steps of one token per request")
    o_sys, lse_sys = segment_attention(folded, sys_k, sys_v, None, scaling)
    seg = batch.segments.get(module.layer_idx)
    if seg is not None:
        o_cloud, lse_cloud = segment_attention(folded, seg.keys, seg.values, None, scaling)
        bias = seg.bias.to(lse_cloud.dtype).repeat_interleave(heads // seg.keys.shape[1])[None, :, None]
        lse_cloud = lse_cloud + bias
        o_sys = merge_attention(o_sys, lse_sys, o_cloud, lse_cloud)
        lse_sys = torch.logaddexp(lse_sys, lse_cloud)
    o_sys = o_sys.reshape(heads, b, 1, d).transpose(0, 1)  # back to (B, heads, 1, d)
    lse_sys = lse_sys.reshape(heads, b, 1).transpose(0, 1)
    valid = torch.arange(key.shape[-2])[None, :] < batch.lengths[:, None]  # (B, L)
    o_own, lse_own = segment_attention(query, key, value, valid[:, None, None, :], scaling)
    out = merge_attention(o_sys, lse_sys, o_own, lse_own)
    return out.to(query.dtype).transpose(1, 2).contiguous()


class RelayLayer(DynamicLayer):
    """One layer of a decode batch's cache: appends each request's new key/value to its own KV (kept by the
    engine, never the shared prefix) and returns the batch's own KV padded to the longest."""

    def __init__(self, own: list[list[torch.Tensor]], layer: int, prefix_len: int):
        super().__init__()
        self.own, self.layer, self.prefix_len = own, layer, prefix_len  # own[b] = [k_0, v_0, k_1, v_1, …]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KVPair:
        """Append row b's new token to request b's own KV; return the padded own KV of the batch."""
        ks, vs = [], []
        for b, kv in enumerate(self.own):
            k = torch.cat([kv[2 * self.layer], key_states[b:b + 1]], dim=-2)
            v = torch.cat([kv[2 * self.layer + 1], value_states[b:b + 1]], dim=-2)
            kv[2 * self.layer], kv[2 * self.layer + 1] = k, v
            ks.append(k)
            vs.append(v)
        longest = max(k.shape[-2] for k in ks)
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[-2]))  # noqa: E731
        self.keys, self.values = torch.cat([pad(k) for k in ks]), torch.cat([pad(v) for v in vs])
        self.is_initialized = True
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Prefix + the longest own KV (only mask sizes read it; relay attention masks by length itself)."""
        return self.prefix_len + max(kv[2 * self.layer].shape[-2] for kv in self.own)

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """(kv length, offset) for the (unused) mask the model builds."""
        return self.get_seq_length() + query_length, 0


def relay_cache(own: list[list[torch.Tensor]], num_layers: int, prefix_len: int) -> DynamicCache:
    """A decode step's cache over the requests' own KV lists (own[b][2i], own[b][2i+1]: layer i keys, values)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [RelayLayer(own, i, prefix_len) for i in range(num_layers)]
    return cache
