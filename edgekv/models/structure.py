"""Model structure helpers: where the decoder blocks are, attention head shapes, rotary embeddings.

Translators, the KV decoder and the capture code all need to know how a model lays out its attention; this is
the one place that knows it (Llama/Qwen/Gemma rotate-half rotary; OPT has none; OPT-350m's blocks normalise
after attention). A block this module does not know how to read is refused by name, never approximated:
`capture.check_kv_reconstruction` compares what it rebuilds with the model's own KV.
"""

from __future__ import annotations

import torch

from edgekv import EdgeKVError

KVPair = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, (…, kv_heads, tokens, head_dim)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's weights (its first parameter) live: inputs go there, nothing moves per step."""
    return next(model.parameters()).device


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotate-half convention of Llama/Qwen rotary embeddings."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unrotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo rotary on `(b, h, s, d)` keys: the inverse of a rotation by θ is the rotation by −θ."""
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos - rotate_half(keys) * sin


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary to `(b, h, s, d)` keys (the rotate-half convention)."""
    cos, sin = cos.unsqueeze(1).to(keys.dtype), sin.unsqueeze(1).to(keys.dtype)
    return keys * cos + rotate_half(keys) * sin


def rotary_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's rotary-embedding module, or None for models with learned/absolute positions (OPT)."""
    base = getattr(model, "model", model)
    return getattr(base, "rotary_emb", None)


def rotary_cos_sin(model: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor):
    """cos, sin of the model's own rotary at the given positions `(b, s)`, or None if it has none."""
    rotary = rotary_of(model)
    if rotary is None:
        return None
    cos, sin = rotary(like, positions)
    head_dim = like.shape[-1]
    if cos.shape[-1] != head_dim:
        raise EdgeKVError(f"partial rotary (rotary dim {cos.shape[-1]} < head_dim {head_dim}) is not supported")
    return cos, sin


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The list of decoder blocks (Llama/Qwen: model.model.layers; OPT: model.model.decoder.layers)."""
    base = getattr(model, "model", model)
    for path in ("layers", "decoder.layers"):
        found = base
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList):
            return found
    raise EdgeKVError(f"cannot find the decoder layers of {type(model).__name__} (model.layers or "
                      "model.decoder.layers): this family is not supported")


def attn_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a model's attention."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(c, "head_dim", None) or c.hidden_size // heads


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(tokens, heads·d) → (heads, tokens, d)."""
    return x.reshape(x.shape[0], heads, -1).transpose(0, 1).contiguous()


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(heads, tokens, d) → (tokens, heads·d)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def apply_rotary(model: torch.nn.Module, keys: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rotate (heads, tokens, d) un-rotated keys with `model`'s rotary at positions start.. (identity without)."""
    positions = torch.arange(start, start + keys.shape[1], device=keys.device)[None]
    cs = rotary_cos_sin(model, positions, keys[None].float())
    return keys if cs is None else rotate_keys(keys[None].float(), *cs)[0]


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, in one line naming what is missing, a model whose attention this module cannot read: fused QKV
    projections (GPT-2, Falcon, Phi-3) or partial rotary (Phi-2, GPT-NeoX)."""
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0
    if float(factor) < 1.0:
        raise EdgeKVError(f"{type(model).__name__}: partial rotary (partial_rotary_factor = {factor}) is not "
                          "supported")
    _require_projections(decoder_layers(model)[0].self_attn, ("q_proj", "k_proj", "v_proj"))


def _require_projections(attn: torch.nn.Module, names: tuple[str, ...]) -> None:
    """One line naming the projections an attention module lacks (fused QKV is not supported)."""
    missing = [n for n in names if not hasattr(attn, n)]
    if missing:
        raise EdgeKVError(f"{type(attn).__name__} has no {'/'.join(missing)} (fused QKV projections are not "
                          "supported); refused rather than approximated")


def attention_input_norm(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The norm a block applies to its input before attention, or None when it applies none: OPT-350m-style
    post-LN blocks (`do_layer_norm_before=False`) feed the raw residual stream to k_proj/v_proj."""
    if getattr(layer, "do_layer_norm_before", True) is False:
        return None
    for name in ("input_layernorm", "self_attn_layer_norm"):
        if hasattr(layer, name):
            return getattr(layer, name)
    raise EdgeKVError(f"edgekv does not know how a {type(layer).__name__} block makes its KV (no pre-attention "
                      "norm it recognises); refused rather than approximated")


def kv_from_hidden(model: torch.nn.Module, layer_index: int, hidden: torch.Tensor, start: int = 0) -> KVPair:
    """The K (rotated at positions start..) and V a model's layer makes from its input hidden states (tokens, d).

    Differentiable in `hidden` (the trained translator learns through it); callers choose no_grad."""
    layer = decoder_layers(model)[layer_index]
    attn = layer.self_attn
    _require_projections(attn, ("k_proj", "v_proj"))
    # the projection's float tensor gives the device, and the dtype unless the module says it computes in
    # another (a quantized linear holds int buffers and its scales; a MixedLinear holds bf16, computes in float32)
    weight = next(t for t in (*attn.k_proj.parameters(), *attn.k_proj.buffers()) if t.is_floating_point())
    dtype = getattr(attn.k_proj, "compute_dtype", weight.dtype)
    norm = attention_input_norm(layer)
    h = hidden.to(device=weight.device, dtype=dtype)
    h = h if norm is None else norm(h[None])[0]
    _, kv_heads, _ = attn_shape(model)
    keys = split_heads(attn.k_proj(h).float(), kv_heads)
    if hasattr(attn, "k_norm"):  # Qwen3/Gemma3-style per-head key norm, before rotary
        keys = attn.k_norm(keys.to(dtype)).float()
    values = split_heads(attn.v_proj(h).float(), kv_heads)
    return apply_rotary(model, keys, start), values


def context_limit(config) -> int:
    """Tokens the model can attend over: `max_position_embeddings`, or a smaller sliding window when one is on
    (spliced prefixes assume every token sees the whole prompt)."""
    limit = int(getattr(config, "max_position_embeddings", None) or 2048)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        limit = min(limit, int(window))
    return limit


def check_context(config, tokens: int, what: str) -> None:
    """One-line error when `tokens` exceed the model's context limit, naming both numbers."""
    limit = context_limit(config)
    if tokens > limit:
        raise EdgeKVError(f"{what} = {tokens} tokens exceeds the model's context of {limit} tokens")
