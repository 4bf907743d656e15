"""Fusers (DESIGN.md §3, "fuse"; C2C, Fu et al. 2025): the edge keeps its own system-prompt KV at every layer,
and the translated cloud KV enters beside it through a gate that starts closed.

`bias` (registered as translator `fuse-bias`): `hidden`'s maps make the cloud segment's KV; one learned logit
bias per (layer, KV head) is added to every cloud key's score, so the edge's attention is one softmax over
[own keys; cloud keys + b] (`edgekv.attention.fuse`). A per-layer hard gate (`info[i]["open"]`) is chosen on
held-out text after training: a closed layer gets no cloud segment, so with every gate closed the edge computes
exactly what it computes alone. Saved and refused for another model pair like every translator.
"""

from __future__ import annotations

import torch

from edgekv.attention.fuse import CloudSegment
from edgekv.kv.translators import HiddenTranslator, KVPair, RidgeMap, register_translator
from edgekv.models.structure import attn_shape

INIT_BIAS = -6.0  # nearly closed (cloud weight ≈ e⁻⁶ of the own segment's) yet with a usable gradient


@register_translator("fuse-bias")
class BiasFuser(HiddenTranslator):
    """`hidden`'s translated cloud KV as a second attention segment behind a per-(layer, KV head) logit bias."""

    splice = "fuse"

    def __init__(self):
        super().__init__()
        self.gate_bias: dict[int, torch.Tensor] = {}

    @classmethod
    def from_hidden(cls, hidden: HiddenTranslator, edge_model, init: float = INIT_BIAS) -> "BiasFuser":
        """Start from a fitted hidden-state translator (maps copied), every gate at `init`, hard gates closed."""
        out = cls()
        out.maps = {i: RidgeMap(m.weight.clone(), m.bias.clone(), m.alpha) for i, m in hidden.maps.items()}
        out.info = {i: {**v, "open": False} for i, v in hidden.info.items()}
        _, kv_heads, _ = attn_shape(edge_model)
        out.gate_bias = {i: torch.full((kv_heads,), float(init)) for i in out.maps}
        return out

    def open_layers(self) -> list[int]:
        """Edge layers whose hard gate is open."""
        return [i for i in sorted(self.info) if self.info[i].get("open")]

    def set_open(self, layers) -> None:
        """Open exactly these layers' hard gates."""
        keep = set(layers)
        for i in self.info:
            self.info[i]["open"] = i in keep

    def segments(self, translated: dict[int, KVPair], layers=None) -> dict[int, CloudSegment]:
        """Cloud segments (batch 1) for `layers` (default: the open ones) from translated (kv_heads, S, d) KV."""
        layers = self.open_layers() if layers is None else layers
        return {i: CloudSegment(translated[i][0][None], translated[i][1][None], self.gate_bias[i])
                for i in layers if i in translated}

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors: one bias vector per layer, in layer order."""
        return [self.gate_bias[i] for i in sorted(self.gate_bias)]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Maps and gate biases as named plain tensors (safetensors)."""
        return {**super().tensors(), **{f"{i}.gate_bias": b for i, b in self.gate_bias.items()}}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors`."""
        super().load_tensors(tensors)
        self.gate_bias = {i: tensors[f"{i}.gate_bias"].clone() for i in self.info}
