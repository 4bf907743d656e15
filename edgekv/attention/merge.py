"""Exact merge of partial attentions over disjoint key segments (the log-sum-exp merge every splice uses)."""

from __future__ import annotations

import torch


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Exact merge of two partial attentions over disjoint key sets (RelayAttention; EdgePrompt eq. 5, exact).

    o_*: (…, t, d) softmax-attention outputs over each part; lse_*: (…, t) log-sum-exp of that part's scores.
    O = a·O_a + (1−a)·O_b with a = exp(lse_a) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_a − lse_b), computed
    in float32 or wider (float64 inputs stay float64). A part with no keys has lse = −inf and weight 0.
    """
    dtype = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    a = torch.sigmoid(lse_a.to(dtype) - lse_b.to(dtype))[..., None]
    return a * o_a.to(dtype) + (1 - a) * o_b.to(dtype)
