"""One engine step through the edge without the framework around it (issue: the edge decodes as fast as
llama.cpp). At batch 1 a step of the 0.5B edge spent ~9 ms of ~33 (int4) outside any op (bench.decode_profile):
transformers' per-call machinery (output capturing, config-default merging, keyword deprecation shims, mask
construction, cache dispatch) around 24 layers. `DecodeStep` calls the same submodules (norms, projections, MLP,
rotary embedding, head: the prepacked or quantized linears included) and the same attention kernel as
`fused_attention`'s decode path, in the same order, so its logits are the model's own bit for bit (tested), for
the layouts whose block is exactly `h += attn(norm(h)); h += mlp(norm(h))` with rotary q/k and nothing else
(Llama, Qwen2, Mistral). Every relay step (decode tokens and prompt chunks of many requests: relay attention masks
each request itself) and every one-request step over its own cache (a decode token, or a prompt block with the
causal mask the model's forward builds: one bool mask for all layers, as sdpa_mask gives) take it; anything else
(other layouts, a step with cloud segments) goes through the model's forward as before. On a GGUF edge the rotary
embedding is the compiled kernel's (one call per q and k, the model's arithmetic bit for bit) and the norms are the
fused ones the whole model uses (models/fused_norm.py).
"""

from __future__ import annotations

import sys

import torch

from edgekv.attention.merge import can_flash, causal_visible, fast_segment_attention
from edgekv.attention.relay import relay_attention
from edgekv.models.gguf_linear import GGUFLinear, kernels
from edgekv.models.quantized import Int4Linear

# model families whose decoder block is the plain pre-LN rotary block this step reproduces
FAMILIES = ("llama", "qwen2", "mistral")


def _join(parts: list) -> torch.nn.Module | None:
    """One product for linears that read the same input (int4 or GGUF blocks of one kind), or None."""
    if all(isinstance(m, Int4Linear) for m in parts):
        return Int4Linear.concat(parts)
    if all(isinstance(m, GGUFLinear) for m in parts):
        return GGUFLinear.concat(parts)
    return None


def _groups(parts: list) -> list[tuple[torch.nn.Module, list[int]]]:
    """`parts` (same input) as few products as join, in order: (module, its parts' output sizes)."""
    for cut in (len(parts), len(parts) - 1):
        joined = _join(parts[:cut]) if cut > 1 else None
        if joined is not None:
            return [(joined, [m.out_features for m in parts[:cut]])] + [(m, [m.out_features]) for m in parts[cut:]]
    return [(m, [m.out_features]) for m in parts]


class DecodeStep:
    """`step(ids, positions, cache, keep, relay)` → logits, the model's forward without its wrapper."""

    def __init__(self, model: torch.nn.Module):
        base = model.model
        self.embed, self.norm, self.rotary, self.head = base.embed_tokens, base.norm, base.rotary_emb, model.lm_head
        self.layers = list(base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        # the rotary function the model's attention applies (its own module's, so the arithmetic is the same)
        self.rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        # a GGUF edge has the compiled kernels: its rotary is one call per q and k, the same arithmetic bit for bit
        self.kernels = kernels() if any(isinstance(m, GGUFLinear) for m in model.modules()) else None
        # int4 / gguf q/k/v (and gate/up) as one product per layer where they join (a copy of their bytes: int4
        # q/k/v ~0.7 ms a token fewer, measured); a layer whose v is another GGUF type joins q/k only
        self.qkv = [_groups([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in self.layers]
        self.gate_up = [_join([layer.mlp.gate_proj, layer.mlp.up_proj])
                        if all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
                        else None for layer in self.layers]

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

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary function on q and k; where k's heads follow q's in one product's output (a joined
        q/k/v), on both as one tensor: the same elementwise arithmetic, half the op calls."""
        heads = q.shape[1]
        if q.shape[0] == 1 and q.stride() == k.stride() \
                and k.data_ptr() == q.data_ptr() + q.stride(1) * heads * q.element_size():
            both = q.as_strided((1, heads + k.shape[1], *q.shape[2:]), q.stride())
            both, _ = self.rotate(both, both[:, :0], cos, sin)
            return both[:, :heads], both[:, heads:]
        return self.rotate(q, k, cos, sin)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, keep: torch.Tensor | None = None,
                 relay=None) -> torch.Tensor:
        """Logits (rows, vocab) after the step's tokens `ids` (1, T) at `positions` (1, T), of the rows `keep`
        (default: the last); appends their KV to `cache`. Without `relay` (a `RelayBatch`, whose attention masks
        each request itself) the step's tokens are one request's next T, over its own cache, causally masked."""
        t = ids.shape[1]
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        if self.kernels is not None:
            cos_t, sin_t = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        d = self.head_dim
        # one request's block: query i sees the cache and the block's first i + 1 tokens (one mask object for
        # every layer, so the additive form is made once, as for the model's own sdpa_mask)
        visible = None if relay is not None or t == 1 else \
            causal_visible(t, cache.get_seq_length() + t, h.device)[None, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = (y.view(t, -1, d) for linear, sizes in self.qkv[i] for y in linear(x).split(sizes, -1))
            if self.kernels is not None:  # in place on the products' own rows (t, heads, d)
                self.kernels.rotary_(q, cos_t, sin_t)
                self.kernels.rotary_(k, cos_t, sin_t)
            q, k, v = (y[None].transpose(1, 2) for y in (q, k, v))
            if self.kernels is None:
                q, k = self._rotate(q, k, cos, sin)
            keys, values = cache.layers[i].update(k, v)
            if relay is not None:
                out = relay_attention(attn, q, relay, attn.scaling)
            else:
                out = fast_segment_attention(q, keys, values, visible, attn.scaling)[0].transpose(1, 2)
            h = h + attn.o_proj(out.reshape(1, t, -1))
            x = layer.post_attention_layernorm(h)
            if self.gate_up[i] is not None:  # the MLP's own formula, down(act(gate(x)) · up(x)), on the joined product
                mlp = layer.mlp
                gate, up = self.gate_up[i](x).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], -1)
                h = h + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                h = h + layer.mlp(x)
        h = self.norm(h)
        return self.head(h[:, -1:] if keep is None else h[:, keep])[0]
