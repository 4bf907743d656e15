"""Cross-model KV translators (DESIGN.md §3), one class each behind the `Translator` interface: `ridge` (per
mapped layer pair, K_edge ≈ K_cloud·W + b on un-rotated keys and V likewise), `hidden` (a ridge map of the cloud
layer's input hidden state, then the edge's own projections and rotary make K and V) and `trained` (hidden's maps
tuned end to end by `bench/translator_training.py`).

The ridge maps are closed-form in float64 on calibration tokens both models saw. The ridge strength is chosen on a
validation split of texts and the reported R² comes from a separate test split, so it is held out twice over.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from edgekv import EdgeKVError
from edgekv.models.structure import KVPair, apply_rotary, attn_shape, kv_from_hidden, split_heads

ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # relative to the mean eigenvalue of XᵀX


@dataclass
class RidgeMap:
    """y ≈ x @ weight + bias, float32."""

    weight: torch.Tensor  # (d_in, d_out)
    bias: torch.Tensor  # (d_out,)
    alpha: float

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Map rows of x (…, d_in) to (…, d_out)."""
        return (x.to(torch.float32) @ self.weight + self.bias).to(x.dtype if x.is_floating_point() else torch.float32)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Named plain tensors for safetensors."""
        return {f"{prefix}.weight": self.weight.contiguous(), f"{prefix}.bias": self.bias.contiguous()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, alpha: float) -> "RidgeMap":
        """Inverse of `tensors`."""
        return cls(tensors[f"{prefix}.weight"].float(), tensors[f"{prefix}.bias"].float(), alpha)


def r2_score(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Pooled coefficient of determination 1 − SS_res / SS_tot over all outputs (variance-weighted)."""
    y, y_hat = y.to(torch.float64), y_hat.to(torch.float64)
    ss_tot = (y - y.mean(dim=0, keepdim=True)).square().sum()
    return float(1.0 - (y - y_hat).square().sum() / ss_tot.clamp_min(1e-300))


def _solve(x: torch.Tensor, y: torch.Tensor, alpha: float) -> RidgeMap:
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc
    lam = alpha * float(gram.diagonal().mean().clamp_min(1e-12))
    weight = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc)
    bias = y_mean - x_mean @ weight
    return RidgeMap(weight.to(torch.float32), bias.to(torch.float32), alpha)


def split_by_text(text_index: torch.Tensor, fractions=(0.6, 0.2)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Boolean row masks (train, validation, test), whole texts at a time, in text order."""
    texts = torch.unique(text_index)
    if texts.numel() < 3:
        raise EdgeKVError(f"fitting a KV map needs at least 3 calibration texts (train/validation/test), got "
                          f"{texts.numel()}")
    n_train = max(1, int(round(fractions[0] * texts.numel())))
    n_val = max(1, int(round(fractions[1] * texts.numel())))
    n_train = min(n_train, texts.numel() - 2)
    n_val = min(n_val, texts.numel() - n_train - 1)
    train_t, val_t = texts[:n_train], texts[n_train:n_train + n_val]
    train = torch.isin(text_index, train_t)
    val = torch.isin(text_index, val_t)
    return train, val, ~(train | val)


def fit_ridge(x: torch.Tensor, y: torch.Tensor, text_index: torch.Tensor,
              alphas: tuple[float, ...] = ALPHAS) -> tuple[RidgeMap, dict[str, float]]:
    """Fit y ≈ xW + b: α chosen on validation texts, refit on train+validation, R² on unseen test texts."""
    x, y = x.to(torch.float64), y.to(torch.float64)
    train, val, test = split_by_text(text_index)
    scores = {a: r2_score(y[val], _solve(x[train], y[train], a).apply(x[val].float()).double()) for a in alphas}
    alpha = max(scores, key=scores.get)
    fitted = _solve(x[train | val], y[train | val], alpha)
    info = {"alpha": alpha, "r2_val": scores[alpha],
            "r2_test": r2_score(y[test], fitted.apply(x[test].float()).double()),
            "train_tokens": int((train | val).sum()), "test_tokens": int(test.sum())}
    return fitted, info


# ------------------------------------------------------------------------------------------- translators
# A translator turns the cloud's activations over a prompt into edge-space KV for each mapped edge layer:
# (kv_heads, tokens, head_dim) keys rotated at positions 0.. by the edge's own rotary, and values.

TRANSLATORS: dict[str, type] = {}


def register_translator(name: str):
    """Register a translator (or fuser) class under `name`; `edgekv.kv.registry` imports every kind."""

    def deco(cls: type) -> type:
        if name in TRANSLATORS:
            raise ValueError(f"translator '{name}' is registered twice")
        cls.name = name
        TRANSLATORS[name] = cls
        return cls

    return deco


class Translator(ABC):
    """What every translator (and fuser) is: `info[edge_layer]` holds the matched `cloud_layer` and fit
    statistics, `maps` the per-layer parameters; `features` names the cloud activations it reads."""

    name = "?"
    features: tuple[str, ...] = ()

    def __init__(self):
        self.maps: dict = {}
        self.info: dict[int, dict] = {}

    @abstractmethod
    def fit(self, cloud_cal, edge_cal, pairs: list[tuple[int, int]], edge_model) -> Translator:
        """Fit the maps of each (edge layer, cloud layer) pair on captured calibration activations."""

    @abstractmethod
    def layer_kv(self, edge_model, edge_layer: int, features: dict[str, torch.Tensor], start: int = 0) -> KVPair:
        """Edge-space KV of one layer from the matched cloud layer's features; rotated at positions start.."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter as named plain tensors (safetensors)."""

    @abstractmethod
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors` (the layer pairing comes from `info`)."""

    def translate(self, cloud_acts, edge_model, edge_layers: list[int]) -> dict[int, KVPair]:
        """Edge-space KV (positions from 0) of each edge layer, from captured cloud activations over the prompt."""
        out = {}
        for i in edge_layers:
            j = self.info[i]["cloud_layer"]
            out[i] = self.layer_kv(edge_model, i, {f: cloud_acts.layers[f][j] for f in self.features})
        return out

    def pairs(self) -> list[tuple[int, int]]:
        """(edge layer, cloud layer) pairs, ascending."""
        return [(i, int(self.info[i]["cloud_layer"])) for i in sorted(self.info)]

    def keep_layers(self, layers) -> None:
        """Drop every edge layer but `layers` (what an export does not use, it need not ship)."""
        keep = set(layers)
        self.info = {i: v for i, v in self.info.items() if i in keep}
        self.maps = {i: v for i, v in self.maps.items() if i in keep}


@register_translator("ridge")
class RidgeTranslator(Translator):
    """Per-layer closed-form maps on un-rotated K and on V (the compress baseline)."""

    features = ("k_unrot", "v")

    def fit(self, cloud_cal, edge_cal, pairs: list[tuple[int, int]], edge_model) -> "RidgeTranslator":
        """Fit one K map and one V map per (edge layer, cloud layer) pair."""
        for i, j in pairs:
            mk, ik = fit_ridge(cloud_cal.layers["k_unrot"][j], edge_cal.layers["k_unrot"][i], edge_cal.text_index)
            mv, iv = fit_ridge(cloud_cal.layers["v"][j], edge_cal.layers["v"][i], edge_cal.text_index)
            self.maps[i] = (mk, mv)
            self.info[i] = {"cloud_layer": j, "r2_k": ik["r2_test"], "r2_v": iv["r2_test"], "alpha_k": ik["alpha"],
                            "alpha_v": iv["alpha"]}
        return self

    def layer_kv(self, edge_model, edge_layer: int, features: dict[str, torch.Tensor], start: int = 0) -> KVPair:
        """Edge-space KV of one layer from the matched cloud layer's features (tokens, d_cloud), rotated at
        positions start..; the single code path used on the cloud (compress) and on the edge (serve-edge)."""
        _, kv_heads, _ = attn_shape(edge_model)
        mk, mv = self.maps[edge_layer]
        keys = split_heads(mk.apply(features["k_unrot"]), kv_heads)
        return apply_rotary(edge_model, keys, start), split_heads(mv.apply(features["v"]), kv_heads)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every map as named plain tensors (safetensors)."""
        return {k: v for i, (mk, mv) in self.maps.items() for k, v in {**mk.tensors(f"{i}.k"),
                                                                       **mv.tensors(f"{i}.v")}.items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors` (the layer pairing comes from `info`)."""
        self.maps = {i: (RidgeMap.from_tensors(tensors, f"{i}.k", self.info[i].get("alpha_k", 0.0)),
                         RidgeMap.from_tensors(tensors, f"{i}.v", self.info[i].get("alpha_v", 0.0)))
                     for i in self.info}


@register_translator("hidden")
class HiddenTranslator(Translator):
    """Map the cloud's input hidden state of the matched layer into the edge's (ridge), then let the edge's own
    pre-attention norm, k_proj, v_proj and rotary make K and V: structurally consistent KV by construction."""

    features = ("hidden_in",)

    def fit(self, cloud_cal, edge_cal, pairs: list[tuple[int, int]], edge_model) -> "HiddenTranslator":
        """Fit one hidden-state map per pair; R² is reported on the K and V it produces for held-out texts."""
        for i, j in pairs:
            m, info = fit_ridge(cloud_cal.layers["hidden_in"][j], edge_cal.layers["hidden_in"][i], edge_cal.text_index)
            self.maps[i] = m
            self.info[i] = {"cloud_layer": j, "r2_hidden": info["r2_test"], "alpha": info["alpha"]}
        return self

    def layer_kv(self, edge_model, edge_layer: int, features: dict[str, torch.Tensor], start: int = 0) -> KVPair:
        """Edge-space KV of one layer from the matched cloud layer's input hidden states (tokens, d_cloud)."""
        return kv_from_hidden(edge_model, edge_layer, self.maps[edge_layer].apply(features["hidden_in"]), start)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every map as named plain tensors (safetensors)."""
        return {k: v for i, m in self.maps.items() for k, v in m.tensors(str(i)).items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors` (the layer pairing comes from `info`)."""
        self.maps = {i: RidgeMap.from_tensors(tensors, str(i), self.info[i].get("alpha", 0.0)) for i in self.info}

    def map_parameters(self) -> list[torch.Tensor]:
        """Every map's weight and bias in layer order: what end-to-end training moves."""
        return [t for i in sorted(self.maps) for t in (self.maps[i].weight, self.maps[i].bias)]


@register_translator("trained")
class TrainedTranslator(HiddenTranslator):
    """The `hidden` translator's maps, trained end to end through the frozen edge model (bench/translator_training.py):
    the same forward as `hidden`, with weights that minimise the KL of the edge's next-token distribution."""

    @classmethod
    def from_hidden(cls, hidden: HiddenTranslator) -> "TrainedTranslator":
        """Start from a fitted hidden-state translator (copies its maps)."""
        out = cls()
        out.maps = {i: RidgeMap(m.weight.clone(), m.bias.clone(), m.alpha) for i, m in hidden.maps.items()}
        out.info = {i: dict(v) for i, v in hidden.info.items()}
        return out

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors (every map's weight and bias), in layer order."""
        return self.map_parameters()
