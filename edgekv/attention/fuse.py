"""Fused attention (DESIGN.md §3, "fuse"): the edge attends over its own KV and, at chosen layers, over a
second segment of translated cloud KV for the same system-prompt tokens, with a logit-bias gate per KV head:

    O = softmax([q·K_ownᵀ ; q·K_cloudᵀ + b]) · [V_own ; V_cloud]     (one softmax, two segments)

computed as two segment attentions merged exactly by log-sum-exp (`merge_attention` with `bias_b = b`).
A layer without a cloud segment (a closed hard gate) computes what stock SDPA computes, so with every gate closed
the model computes exactly what it computes alone (a block of queries over a cache takes the same flash kernel
with the grouped-query heads folded into the query axis instead of the keys copied per head: same numbers,
less memory traffic).

The same attention function serves the engine's batched decode steps (`edgekv.attention.relay`).

Use: `enable_fusion(model)` once (registers and selects the `edgekv_fuse` attention), then pass
`cloud_segments={layer: CloudSegment}` as a keyword of the model's forward; transformers hands forward keywords
down to every attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from edgekv.attention.merge import can_flash, fast_segment_attention, merge_attention, segment_attention
from edgekv.attention.relay import relay_attention

FUSE_ATTENTION = "edgekv_fuse"


@dataclass
class CloudSegment:
    """Translated cloud KV of the system prompt for one edge layer, and its gate."""

    keys: torch.Tensor  # (1, kv_heads, S, d), rotated at the system prompt's positions
    values: torch.Tensor  # (1, kv_heads, S, d)
    bias: torch.Tensor  # (kv_heads,) logit bias added to every cloud key's score


def fused_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """The `edgekv_fuse` attention function: stock SDPA, plus the gated cloud segment where one is given; a
    batched decode step (keyword `relay`) goes to relay attention over the shared system KV."""
    relay = kwargs.pop("relay", None)
    if relay is not None:
        return relay_attention(module, query, relay, scaling), None
    segments = kwargs.pop("cloud_segments", None)
    seg = None if segments is None else segments.get(module.layer_idx)
    if seg is None:
        if (dropout == 0.0 and can_flash(query, key) and (attention_mask is None and query.shape[2] == 1 or
                attention_mask is not None and attention_mask.dtype == torch.bool)):
            # a decode step or a query block over a cache (a splice, a chunk): grouped heads folded into the
            # query axis, keys never repeated (stock SDPA repeats them per head: ~1 ms a layer at decode); the
            # same kernel as stock SDPA (bit-identical for blocks, tested)
            out, _ = fast_segment_attention(query, key, value, attention_mask, scaling)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    o_own, lse_own = segment_attention(query, key, value, attention_mask, scaling, causal=True)
    o_cloud, lse_cloud = segment_attention(query, seg.keys, seg.values, None, scaling)
    groups = query.shape[1] // seg.keys.shape[1]
    bias = seg.bias.to(lse_cloud.dtype).repeat_interleave(groups)[None, :, None]  # (1, heads, 1)
    out = merge_attention(o_own, lse_own, o_cloud, lse_cloud, bias)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def enable_fusion(model: torch.nn.Module) -> None:
    """Register `edgekv_fuse` (attention + SDPA's mask) and select it for `model`; idempotent."""
    AttentionInterface.register(FUSE_ATTENTION, fused_attention)
    AttentionMaskInterface.register(FUSE_ATTENTION, sdpa_mask)
    if model.config._attn_implementation != FUSE_ATTENTION:
        model.set_attn_implementation(FUSE_ATTENTION)
