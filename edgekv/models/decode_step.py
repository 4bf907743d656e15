"""One decode token through the edge without the framework around it (issue: the edge decodes as fast as
llama.cpp). At batch 1 a step of the 0.5B edge spent ~9 ms of ~33 (int4) outside any op (bench.decode_profile):
transformers' per-call machinery (output capturing, config-default merging, keyword deprecation shims, mask
construction, cache dispatch) around 24 layers. `DecodeStep` calls the same submodules (norms, projections, MLP,
rotary embedding, head: the prepacked or quantized linears included) and the same attention kernel as
`fused_attention`'s decode path, in the same order, so its logits are the model's own bit for bit (tested), for
the layouts whose block is exactly `h += attn(norm(h)); h += mlp(norm(h))` with rotary q/k and nothing else
(Llama, Qwen2, Mistral). Anything else, a step with cloud segments, or more than one token goes through the
model's forward as before.
"""

from __future__ import annotations

import sys

import torch

from edgekv.attention.merge import can_flash, fast_segment_attention

# model families whose decoder block is the plain pre-LN rotary block this step reproduces
FAMILIES = ("llama", "qwen2", "mistral")


class DecodeStep:
    """`step(token, position, cache)` → the next-token logits (vocab,), the model's forward without its wrapper."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        base = model.model
        self.embed, self.norm, self.rotary, self.head = base.embed_tokens, base.norm, base.rotary_emb, model.lm_head
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        # the rotary function the model's attention applies (its own module's, so the arithmetic is the same)
        self.rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> DecodeStep | None:
        """A step for `model`, or None where its layout is not the plain block this step reproduces."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in FAMILIES or not hasattr(model, "lm_head"):
            return None
        if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "sliding_window", None) and \
                "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            return None
        with torch.no_grad():  # fused_attention's decode path is the CPU flash kernel; elsewhere the model's forward
            probe = torch.empty(0, dtype=model.dtype, device=model.device)
            if not can_flash(probe, probe):
                return None
        attn = model.model.layers[0].self_attn
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")) or getattr(cfg, "pretraining_tp", 1) != 1:
            return None
        return cls(model)

    @torch.no_grad()
    def __call__(self, token: torch.Tensor, position: int, cache) -> torch.Tensor:
        """Logits (vocab,) of the token after `token` (a (1,) id) at `position`; appends its KV to `cache`."""
        h = self.embed(token.view(1, 1))
        cos, sin = self.rotary(h, torch.tensor([[position]], device=h.device))
        d = self.head_dim
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, 1, -1, d).transpose(1, 2)
            k = attn.k_proj(x).view(1, 1, -1, d).transpose(1, 2)
            v = attn.v_proj(x).view(1, 1, -1, d).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            keys, values = cache.layers[i].update(k, v)
            out, _ = fast_segment_attention(q, keys, values, None, attn.scaling)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.head(self.norm(h))[0, -1]
