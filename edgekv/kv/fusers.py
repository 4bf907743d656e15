"""Fusers (DESIGN.md §3, "fuse"; C2C, Fu et al. 2025): the edge keeps its own system-prompt KV at every layer,
and the translated cloud KV (made by `hidden`'s maps) enters beside it through a gate that starts closed.

Two gate forms, one small class each in the translator registry:
- `fuse-bias`: a second attention segment of cloud KV with one learned logit bias per (layer, KV head) added to
  every cloud key's score: one softmax over [own keys; cloud keys + b] (`edgekv.attention.fuse`).
- `fuse-residual`: C2C-style `K = K_own + up(silu(down([K_own; K_cloud])))` per KV head on un-rotated keys (the
  same for V), `up` zero-initialised: at initialisation the edge's own KV, exactly.
Each mapped layer also has a hard gate (`info[i]["open"]`), chosen on held-out text after training: a closed
layer gets nothing from the cloud, so with every gate closed the edge computes exactly what it computes alone.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from edgekv.attention.fuse import CloudSegment
from edgekv.kv.translators import HiddenTranslator, RidgeMap, register_translator
from edgekv.models.structure import KVPair, attn_shape, rotary_cos_sin, rotate_keys, unrotate_keys

INIT_BIAS = -6.0  # nearly closed (cloud weight ≈ e⁻⁶ of the own segment's) yet with a usable gradient


class Fuser(HiddenTranslator):
    """Base of the fusers: `hidden`'s maps make the cloud KV; subclasses say how it joins the edge's own (the
    gates: `init_gates`, `fuse`, `gate_tensors`, `load_gates`, `drop_gates`)."""

    @classmethod
    def from_hidden(cls, hidden: HiddenTranslator, edge_model, **kwargs) -> "Fuser":
        """Start from a fitted hidden-state translator (maps copied), gates at their closed start, hard gates
        closed; `source="edge"` marks a self-fusion control (the "cloud" features are the edge's own)."""
        out = cls()
        out.maps = {i: RidgeMap(m.weight.clone(), m.bias.clone(), m.alpha) for i, m in hidden.maps.items()}
        source = kwargs.pop("source", "cloud")
        out.info = {i: {**v, "open": False, "source": source} for i, v in hidden.info.items()}
        out.init_gates(edge_model, **kwargs)
        return out

    @abstractmethod
    def init_gates(self, edge_model, **kwargs) -> None:
        """Create the gate parameters of every mapped layer."""

    @property
    def self_fuse(self) -> bool:
        """True for the edge → edge control."""
        return any(v.get("source") == "edge" for v in self.info.values())

    def open_layers(self) -> list[int]:
        """Edge layers whose hard gate is open."""
        return [i for i in sorted(self.info) if self.info[i].get("open")]

    def set_open(self, layers) -> None:
        """Open exactly these layers' hard gates."""
        keep = set(layers)
        for i in self.info:
            self.info[i]["open"] = i in keep

    def keep_layers(self, layers) -> None:
        """Drop every edge layer but `layers`, gates included."""
        keep = set(layers)
        super().keep_layers(keep)
        self.drop_gates(keep)

    @abstractmethod
    def drop_gates(self, keep: set[int]) -> None:
        """Drop the gate parameters of layers not in `keep`."""

    def compact(self) -> "Fuser":
        """The fuser for shipping: its open layers only, the maps stored in float16 (applied in float32)."""
        out = type(self)()
        out.info = {i: dict(self.info[i]) for i in self.open_layers()}
        out.maps = {i: RidgeMap(self.maps[i].weight.half(), self.maps[i].bias.half(), self.maps[i].alpha)
                    for i in out.info}
        out.load_gates({k: v.clone() for k, v in self.gate_tensors().items()})
        out.drop_gates(set(out.info))
        return out

    def gates_only(self) -> "Fuser":
        """What the edge needs when the cloud applies the maps (`map_on cloud`): gates and hard gates, no maps."""
        out = type(self)()
        out.info = {i: {**v, "maps": "cloud"} for i, v in self.info.items()}
        out.maps = {}
        out.load_gates({k: v.clone() for k, v in self.gate_tensors().items()})
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The maps of the layers that carry them (none in a `gates_only` fuser); subclasses add the gates."""
        self.maps = {i: RidgeMap.from_tensors(tensors, str(i), self.info[i].get("alpha", 0.0))
                     for i in self.info if self.info[i].get("maps") != "cloud"}

    @abstractmethod
    def load_gates(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the gate parameters from named tensors (as `gate_tensors` names them)."""

    @abstractmethod
    def fuse(self, edge_model, own: dict[int, KVPair], cloud: dict[int, KVPair],
             layers: list[int] | None = None, offset: int = 0) -> tuple[dict[int, KVPair], dict[int, CloudSegment]]:
        """(replacement own KV, cloud segments) for `layers` (default: the open ones); KV is (kv_heads, S, d). The
        cloud's keys come rotated at positions 0..S−1; the own KV sits at `offset`.. (after a shared prefix's
        tokens), and what the fuser returns sits there too."""

    @abstractmethod
    def gate_tensors(self) -> dict[str, torch.Tensor]:
        """The gate parameters as named tensors."""

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors (the gates; the maps stay as fitted), in a fixed order."""
        return [t for _, t in sorted(self.gate_tensors().items())]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Maps and gates as named plain tensors (safetensors)."""
        return {**super().tensors(), **self.gate_tensors()}


@register_translator("fuse-bias")
class BiasFuser(Fuser):
    """Cloud KV as a second attention segment behind a per-(layer, KV head) logit bias."""

    def init_gates(self, edge_model, init: float = INIT_BIAS) -> None:
        """One bias per KV head and layer, at `init`."""
        _, kv_heads, _ = attn_shape(edge_model)
        self.gate_bias = {i: torch.full((kv_heads,), float(init)) for i in self.maps}

    def fuse(self, edge_model, own, cloud, layers=None, offset=0):
        """No change to the own KV; one cloud segment per layer (its keys moved to the own KV's positions)."""
        layers = self.open_layers() if layers is None else layers
        return {}, {i: CloudSegment(shift_keys(edge_model, cloud[i][0], offset)[None], cloud[i][1][None],
                                    self.gate_bias[i]) for i in layers if i in cloud}

    def segments(self, cloud: dict[int, KVPair], layers=None) -> dict[int, CloudSegment]:
        """The cloud segments alone (this fuser never changes the own KV)."""
        return self.fuse(None, {}, cloud, layers)[1]

    def gate_tensors(self):
        return {f"{i}.gate_bias": b for i, b in self.gate_bias.items()}

    def drop_gates(self, keep: set[int]) -> None:
        self.gate_bias = {i: b for i, b in self.gate_bias.items() if i in keep}

    def load_gates(self, tensors: dict[str, torch.Tensor]) -> None:
        self.gate_bias = {int(k.split(".")[0]): v.float().clone() for k, v in tensors.items()
                          if k.endswith(".gate_bias")}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors`."""
        super().load_tensors(tensors)
        self.load_gates({f"{i}.gate_bias": tensors[f"{i}.gate_bias"] for i in self.info})


def shift_keys(edge_model, keys: torch.Tensor, offset: int) -> torch.Tensor:
    """(kv_heads, S, d) keys rotated at positions 0..S−1, rotated at `offset`..`offset`+S−1 instead (unchanged at
    offset 0 or without rotary)."""
    if not offset:
        return keys
    at = [rotary_cos_sin(edge_model, torch.arange(o, o + keys.shape[1])[None], keys[None].float()) for o in (0, offset)]
    if at[0] is None:
        return keys
    return rotate_keys(unrotate_keys(keys[None].float(), *at[0]), *at[1])[0].to(keys.dtype)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


@register_translator("fuse-residual")
class ResidualFuser(Fuser):
    """C2C-style residual fuser per KV head: own KV + a zero-initialised projection of [own; cloud]."""

    PARTS = ("k_down", "k_down_b", "k_up", "k_up_b", "v_down", "v_down_b", "v_up", "v_up_b")

    def init_gates(self, edge_model, rank: int = 32, seed: int = 0) -> None:
        """Seeded down projections, zero up projections (the edge's own KV at the start)."""
        _, _, d = attn_shape(edge_model)
        g = torch.Generator().manual_seed(seed)
        self.res = {}
        for i in sorted(self.maps):
            for kv in "kv":
                self.res[f"{i}.{kv}_down"] = torch.randn(2 * d, rank, generator=g) / (2 * d) ** 0.5
                self.res[f"{i}.{kv}_down_b"] = torch.zeros(rank)
                self.res[f"{i}.{kv}_up"] = torch.zeros(rank, d)
                self.res[f"{i}.{kv}_up_b"] = torch.zeros(d)

    def _delta(self, i: int, kv: str, own: torch.Tensor, cloud: torch.Tensor) -> torch.Tensor:
        x = torch.cat([_rms(own.float()), _rms(cloud.float())], -1)
        h = torch.nn.functional.silu(x @ self.res[f"{i}.{kv}_down"] + self.res[f"{i}.{kv}_down_b"])
        return h @ self.res[f"{i}.{kv}_up"] + self.res[f"{i}.{kv}_up_b"]

    def fuse(self, edge_model, own, cloud, layers=None, offset=0):
        """Own KV + the fuser's correction at each layer (keys fused un-rotated, then rotated back)."""
        layers = self.open_layers() if layers is None else layers
        out = {}
        for i in layers:
            if i not in cloud:
                continue
            (ko, vo), (kc, vc) = own[i], cloud[i]
            at_own, at_cloud = (rotary_cos_sin(edge_model, torch.arange(o, o + ko.shape[1])[None], ko[None].float())
                                for o in (offset, 0))

            def unrot(k, cs):
                return k.float() if cs is None else unrotate_keys(k[None].float(), *cs)[0]

            dk = self._delta(i, "k", unrot(ko, at_own), unrot(kc, at_cloud))
            dk = dk if at_own is None else rotate_keys(dk[None], *at_own)[0]  # rotary is linear: own + rotated delta
            out[i] = ((ko.float() + dk).to(ko.dtype), (vo.float() + self._delta(i, "v", vo, vc)).to(vo.dtype))
        return out, {}

    def gate_tensors(self):
        return dict(self.res)

    def drop_gates(self, keep: set[int]) -> None:
        self.res = {k: v for k, v in self.res.items() if int(k.split(".")[0]) in keep}

    def load_gates(self, tensors: dict[str, torch.Tensor]) -> None:
        self.res = {k: v.float().clone() for k, v in tensors.items() if k.split(".", 1)[1] in self.PARTS}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors`."""
        super().load_tensors(tensors)
        self.load_gates({f"{i}.{p}": tensors[f"{i}.{p}"] for i in self.info for p in self.PARTS})
