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


def causal_visible(t: int, s: int, device: torch.device) -> torch.Tensor:
    """(t, s) bool: query i (the last t of s positions) sees keys 0..s − t + i."""
    at = torch.arange(s, device=device)
    return at[None, :] <= at[s - t:, None]


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
        scores = scores.masked_fill(~causal_visible(t, s, scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def can_flash(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether torch's CPU flash kernel serves these tensors here (inference on CPU, one float dtype)."""
    return (query.dtype in _FLASH_DTYPES and query.device.type == "cpu" and not torch.is_grad_enabled()
            and keys.dtype == query.dtype)


_LAST_MASK: tuple = (None, None, None)  # (bool mask, (dtype, groups), additive mask): every layer shares one


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype, groups: int, reuse: bool) -> torch.Tensor:
    """The additive form of a bool mask (b, 1, t, s), its rows tiled `groups` times when the grouped-query heads
    are folded into the query axis (folded row r is query r mod t). `reuse`: the caller passes the same mask
    object to every layer of a forward, so the last one made is kept and served again."""
    global _LAST_MASK
    last = _LAST_MASK  # one read: another thread may replace it meanwhile
    if reuse and last[0] is visible and last[1] == (dtype, groups):
        return last[2]
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    if groups > 1 and mask.shape[-2] > 1:
        mask = mask.repeat(1, 1, groups, 1)
    if reuse:
        _LAST_MASK = (visible, (dtype, groups), mask)
    return mask


def fast_segment_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           valid: torch.Tensor | None = None, scaling: float | None = None,
                           causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_attention` through torch's CPU flash kernel, which also returns the log-sum-exp (float32).

    Grouped-query heads are folded into the query axis, (b, h, t, d) → (b, kv_heads, groups·t, d), so the keys
    are never copied per head (transformers' SDPA path repeats them whenever a mask is given); a per-query mask is
    tiled to match. `valid` (bool, True = attend, (b, 1, t, s) or broadcastable) and `causal` (queries aligned
    with the segment's last t keys) become one additive mask. Inference only; float64, GPU tensors and autograd go
    to `segment_attention`. Returns (out (b, h, t, d) in the query's dtype, lse (b, h, t) float32)."""
    if not can_flash(query, keys):
        return segment_attention(query, keys, values, valid, scaling, causal)
    b, h, t, d = query.shape
    kv_heads, s = keys.shape[1], keys.shape[-2]
    if s == 0 or t == 0:  # no keys (an empty system prompt): weight 0 in the merge; the kernel would trap
        return query.new_zeros(b, h, t, values.shape[-1]), query.new_full((b, h, t), float("-inf"), dtype=torch.float32)
    groups = h // kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    visible, reuse = valid, valid is not None and valid.dim() == 4
    if visible is not None and visible.dim() < 4:
        visible = visible[(None,) * (4 - visible.dim())]
    if causal and t > 1:
        tri = causal_visible(t, s, query.device)
        visible, reuse = (tri[None, None] if visible is None else visible & tri), False
    if visible is not None and visible.dim() == 4 and visible.shape[1] != 1:  # a mask per head: no folding
        mask = _additive_mask(visible, query.dtype, 1, False)
        k, v = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        return flash(query, k, v, 0.0, False, attn_mask=mask, scale=scaling)
    mask = None if visible is None else _additive_mask(visible, query.dtype, groups, reuse)
    q = query.reshape(b, kv_heads, groups * t, d)
    out, lse = flash(q, keys, values, 0.0, False, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, t, d), lse.reshape(b, h, t)
