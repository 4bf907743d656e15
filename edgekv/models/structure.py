"""Model structure helpers: where the decoder blocks are, attention head shapes, rotary embeddings.

Translators, the KV decoder and the capture code all need to know how a model lays out its attention; this is
the one place that knows it (Llama/Qwen rotate-half rotary; OPT has none).
"""

from __future__ import annotations

import torch

KVPair = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, (…, kv_heads, tokens, head_dim)


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
        raise ValueError(f"partial rotary (rotary dim {cos.shape[-1]} < head_dim {head_dim}) is not supported")
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
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


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
    positions = torch.arange(start, start + keys.shape[1])[None]
    cs = rotary_cos_sin(model, positions, keys[None].float())
    return keys if cs is None else rotate_keys(keys[None].float(), *cs)[0]
