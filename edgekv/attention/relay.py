"""Relay attention for one engine step over many requests that share one system prompt (RelayAttention, Zhu et
al., ACL 2024), with the requests' new tokens packed into one sequence so the step is ONE forward.

The step's tokens — a chunk of a new request's user prompt, or one decode token of a running request — are
concatenated (batch 1, ΣT tokens, each with its own position). Attention per layer:

- the shared part: every packed query attends to the one copy of the system KV as a single product (no copy
  per request or per step); a fusion export's gated cloud segment joins it through its bias;
- the own part: each request's queries attend to that request's own tokens only (causal): decode rows of all
  requests together, padded and masked to each length; prefill chunks request by request;
- the two are merged exactly by log-sum-exp (EdgePrompt eq. 5; `merge_attention`).

`RelayLayer` is a cache layer that appends each request's new keys/values to that request's own KV (kept by the
engine); `RelayBatch` carries what the attention needs through the model's forward as the keyword `relay`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from edgekv.attention.merge import fast_segment_attention, merge_attention
from edgekv.models.structure import KVPair


@dataclass
class RelayBatch:
    """One engine step: the shared KV of each layer, each request's own KV and its number of new tokens."""

    shared: Callable[[int], KVPair]  # layer → (1, kv_heads, S, d) keys and values of the system prompt
    own: list[list[torch.Tensor]]  # own[b] = [k_0, v_0, k_1, v_1, …], each (1, kv_heads, L_b, d)
    q_lens: list[int]  # new tokens of request b in this step (packed in this order)
    segments: dict = field(default_factory=dict)  # layer → CloudSegment (fuse-bias exports)

    def __post_init__(self):
        self.starts = [0]  # where each request's rows start in the packed step
        for t in self.q_lens:
            self.starts.append(self.starts[-1] + t)
        self.decode = [b for b, t in enumerate(self.q_lens) if t == 1]  # requests decoding one token
        self._mask = None

    def decode_mask(self) -> torch.Tensor:
        """The decode rows' mask over their own KV padded to the longest, (B1, 1, 1, L): made at the first layer's
        attention (after its append) and the same at every layer, since each layer appends the same tokens."""
        if self._mask is None:
            device = self.own[self.decode[0]][0].device
            lengths = torch.tensor([self.own[b][0].shape[-2] for b in self.decode], device=device)
            self._mask = (torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None])[:, None, None, :]
            self.rows = torch.tensor([self.starts[b] for b in self.decode])
        return self._mask


def relay_attention(module: torch.nn.Module, query: torch.Tensor, batch: RelayBatch,
                    scaling: float | None = None) -> torch.Tensor:
    """(1, ΣT, heads, d) attention output of a packed step (query: (1, heads, ΣT, d))."""
    layer = module.layer_idx
    heads = query.shape[1]
    sys_k, sys_v = batch.shared(layer)
    o_sys, lse_sys = fast_segment_attention(query, sys_k, sys_v, None, scaling)
    seg = batch.segments.get(layer)
    if seg is not None:
        o_cloud, lse_cloud = fast_segment_attention(query, seg.keys, seg.values, None, scaling)
        lse_cloud = lse_cloud + seg.bias.to(lse_cloud.dtype).repeat_interleave(heads // seg.keys.shape[1])[
            None, :, None]
        o_sys, lse_sys = merge_attention(o_sys, lse_sys, o_cloud, lse_cloud), torch.logaddexp(lse_sys, lse_cloud)
    o_own = torch.empty_like(o_sys)
    lse_own = torch.empty_like(lse_sys)
    if batch.decode:  # one padded product for every single-token row
        valid = batch.decode_mask()
        pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, valid.shape[-1] - x.shape[-2]))  # noqa: E731
        keys = torch.cat([pad(batch.own[b][2 * layer]) for b in batch.decode])
        values = torch.cat([pad(batch.own[b][2 * layer + 1]) for b in batch.decode])
        q = query[0, :, batch.rows].transpose(0, 1)[:, :, None]  # (B1, heads, 1, d)
        o, lse = fast_segment_attention(q, keys, values, valid, scaling)
        o_own[0, :, batch.rows] = o[:, :, 0].transpose(0, 1).to(o_own.dtype)
        lse_own[0, :, batch.rows] = lse[:, :, 0].transpose(0, 1).to(lse_own.dtype)
    for b, t in enumerate(batch.q_lens):
        if t > 1:  # a prefill chunk: causal over the request's own tokens, its new ones last
            sl = slice(batch.starts[b], batch.starts[b + 1])
            o, lse = fast_segment_attention(query[:, :, sl], batch.own[b][2 * layer], batch.own[b][2 * layer + 1],
                                            None, scaling, causal=True)
            o_own[:, :, sl] = o.to(o_own.dtype)
            lse_own[:, :, sl] = lse.to(lse_own.dtype)
    out = merge_attention(o_sys, lse_sys, o_own, lse_own)
    return out.to(query.dtype).transpose(1, 2).contiguous()


class RelayLayer(DynamicLayer):
    """One layer of a step's cache: splits the packed new keys/values by request and appends them to each
    request's own KV (the attention reads them from the batch; the shared prefix is never touched)."""

    def __init__(self, batch: RelayBatch, layer: int, prefix_len: int):
        super().__init__()
        self.batch, self.layer, self.prefix_len = batch, layer, prefix_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KVPair:
        """Append each request's slice of the packed step; return the inputs (relay attention ignores them)."""
        start = 0
        for kv, t in zip(self.batch.own, self.batch.q_lens):
            i = 2 * self.layer
            kv[i] = torch.cat([kv[i], key_states[:, :, start:start + t]], dim=-2)
            kv[i + 1] = torch.cat([kv[i + 1], value_states[:, :, start:start + t]], dim=-2)
            start += t
        self.is_initialized = True
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Prefix + the longest own KV (only the unused mask's size reads it)."""
        return self.prefix_len + max(kv[2 * self.layer].shape[-2] for kv in self.batch.own)

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """(kv length, offset) for the mask the model builds and relay attention does not use."""
        return self.get_seq_length() + query_length, 0


def relay_cache(batch: RelayBatch, num_layers: int, prefix_len: int) -> DynamicCache:
    """A step's cache over the batch's own KV lists."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = None
    cache.layers = [RelayLayer(batch, i, prefix_len) for i in range(num_layers)]
    return cache
