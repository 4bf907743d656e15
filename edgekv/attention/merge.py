"""Exact merge of partial attentions over disjoint key segments (the log-sum-exp merge every splice uses)."""

from __future__ import annotations

import torch


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                    bias_b: torch.Tensor | float | None = None) -> torch.Tensor:
    """Exact merge of two partial attentions over disjoint key sets (RelayAttention; EdgePrompt eq. 5, exact).

    o_*: (…, t, d) softmax-attention outputs over each part; lse_*: (…, t) log-sum-exp of that part's scores.
    O = a·O_a + (1−a)·O_b with a = exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a − lse_b), computed
    in float32 or wider (float64 inputs stay float64). A part with no keys has lse = −inf and weight 0.
    `bias_b` (broadcast against lse_b) adds a logit bias to every key of part b: one softmax over both parts
    with b added to part b's scores (the fusion gate; −inf shuts part b out exactly).
    """
    dtype = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    lse_b = lse_b.to(dtype)
    if bias_b is not None:
        lse_b = lse_b + (bias_b.to(dtype) if isinstance(bias_b, torch.Tensor) else bias_b)
    a = torch.sigmoid(lse_a.to(dtype) - lse_b)[..., None]
    return a * o_a.to(dtype) + (1 - a) * o_b.to(dtype)


def segment_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None = None, scaling: float | None = None,
                      causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of (b, h, t, d) queries over one key segment (b, kv_heads, s, d), with its log-sum-exp.

    Grouped-query heads are expanded here. `mask`: bool (True = attend) or additive, broadcast to (b, h, t, s);
    `causal` without a mask aligns the queries with the segment's last t keys. Returns (out (b, h, t, d),
    lse (b, h, t)) in float32 or wider; differentiable (the fusion gates are trained through it).
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    groups = query.shape[1] // keys.shape[1]
    k = keys.to(dtype).repeat_interleave(groups, 1)
    v = values.to(dtype).repeat_interleave(groups, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = (query.to(dtype) @ k.transpose(-1, -2)) * scale
    if mask is not None:
        mask = mask[..., -k.shape[-2]:]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(dtype)
    elif causal and query.shape[-2] > 1:
        t, s = query.shape[-2], k.shape[-2]
        visible = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse
