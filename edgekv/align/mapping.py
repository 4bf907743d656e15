"""Layer-mapping strategies: which cloud layer supplies the system-prompt KV of each deep edge layer.

Every strategy takes the similarity matrices (rows = cloud layers, columns = edge layers) and returns one
cloud layer per edge layer from `start_layer` on; `build_mapping` records each chosen pair with its scores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError


@dataclass(frozen=True)
class MappingParams:
    """What a strategy may use besides the matrices."""

    start_layer: int
    metric: str = "linear_cka"
    tau_cka: float = 0.0
    tau_rsa: float = 0.0


Strategy = Callable[[dict[str, torch.Tensor], MappingParams], list[int]]
MAPPINGS: dict[str, Strategy] = {}


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Register a strategy under `name`; a duplicate name is a programming error."""

    def deco(fn: Strategy) -> Strategy:
        if name in MAPPINGS:
            raise ValueError(f"mapping strategy '{name}' is registered twice")
        MAPPINGS[name] = fn
        return fn

    return deco


def _shape(matrices: dict[str, torch.Tensor]) -> tuple[int, int]:
    return tuple(next(iter(matrices.values())).shape)  # (cloud layers, edge layers)


@register("similarity")
def similarity_strategy(matrices: dict[str, torch.Tensor], p: MappingParams) -> list[int]:
    """Max total similarity, each pair with CKA ≥ τ_cka and RSA ≥ τ_rsa, cloud layer non-decreasing in depth.

    Solved exactly by dynamic programming over (edge layer, cloud layer): best[i][j] is the best total for
    edge layers start..i with edge layer i on cloud layer j, so best[i][j] = S[j, i] + max_{j' ≤ j} best[i-1][j'].
    """
    score = matrices[p.metric].T.to(torch.float64)  # (edge, cloud)
    feasible = (matrices["linear_cka"].T >= p.tau_cka) & (matrices["rsa"].T >= p.tau_rsa)
    n_edge, n_cloud = score.shape
    for i in range(p.start_layer, n_edge):
        if not feasible[i].any():
            best = int(matrices["linear_cka"][:, i].argmax())
            raise EdgeKVError(
                f"no cloud layer meets τ_cka={p.tau_cka} and τ_rsa={p.tau_rsa} for edge layer {i} "
                f"(its best: cloud layer {best}, CKA {float(matrices['linear_cka'][best, i]):.3f}, "
                f"RSA {float(matrices['rsa'][best, i]):.3f}); lower the thresholds or raise --start-layer"
            )
    neg = torch.tensor(float("-inf"), dtype=torch.float64)
    rows = list(range(p.start_layer, n_edge))
    best = torch.where(feasible[rows[0]], score[rows[0]], neg)
    back: list[torch.Tensor] = []
    for i in rows[1:]:
        prefix, arg = torch.cummax(best, dim=0)  # max over j' ≤ j and where it was
        back.append(arg)
        best = torch.where(feasible[i], score[i] + prefix, neg)
        if torch.isinf(best).all():
            raise EdgeKVError(
                f"no depth-monotone mapping meets τ_cka={p.tau_cka}, τ_rsa={p.tau_rsa} up to edge layer {i}"
            )
    j = int(best.argmax())
    chosen = [j]
    for arg in reversed(back):
        j = int(arg[j])
        chosen.append(j)
    return chosen[::-1]


@register("uniform")
def uniform_strategy(matrices: dict[str, torch.Tensor], p: MappingParams) -> list[int]:
    """Same relative depth: edge layer i ← cloud layer round(i·(Lc−1)/(Le−1))."""
    n_cloud, n_edge = _shape(matrices)
    scale = (n_cloud - 1) / max(n_edge - 1, 1)
    return [min(n_cloud - 1, round(i * scale)) for i in range(p.start_layer, n_edge)]


@register("last-aligned")
def last_aligned_strategy(matrices: dict[str, torch.Tensor], p: MappingParams) -> list[int]:
    """Align the last layers and count back one by one: edge layer i ← cloud layer i + (Lc − Le)."""
    n_cloud, n_edge = _shape(matrices)
    return [max(0, i + n_cloud - n_edge) for i in range(p.start_layer, n_edge)]


@register("dissimilar")
def dissimilar_strategy(matrices: dict[str, torch.Tensor], p: MappingParams) -> list[int]:
    """KVSharer-style baseline: the least similar cloud layer for each edge layer (no monotonicity)."""
    score = matrices[p.metric]
    return [int(score[:, i].argmin()) for i in range(p.start_layer, score.shape[1])]


def build_mapping(name: str, matrices: dict[str, torch.Tensor], params: MappingParams) -> dict:
    """Run a strategy and return the JSON-ready mapping: chosen pairs with every metric's score."""
    if name not in MAPPINGS:
        raise EdgeKVError(f"unknown mapping strategy '{name}' (choose from {', '.join(MAPPINGS)})")
    if params.metric not in matrices:
        raise EdgeKVError(f"unknown similarity metric '{params.metric}' (choose from {', '.join(matrices)})")
    n_cloud, n_edge = _shape(matrices)
    if not 0 <= params.start_layer < n_edge:
        raise EdgeKVError(f"start layer {params.start_layer} is out of range for an edge model of {n_edge} layers")
    chosen = MAPPINGS[name](matrices, params)
    pairs = [
        {"edge_layer": i, "cloud_layer": j, **{m: round(float(t[j, i]), 6) for m, t in matrices.items()}}
        for i, j in zip(range(params.start_layer, n_edge), chosen)
    ]
    return {
        "strategy": name,
        "metric": params.metric,
        "start_layer": params.start_layer,
        "tau_cka": params.tau_cka,
        "tau_rsa": params.tau_rsa,
        "num_cloud_layers": n_cloud,
        "num_edge_layers": n_edge,
        "pairs": pairs,
        "mean_score": round(sum(p[params.metric] for p in pairs) / len(pairs), 6),
    }


def layer_pairs(mapping: str | None, start_layer: int | None, cloud_layers: int, edge_layers: int, *,
                same: bool = False, default: str = "uniform") -> tuple[list[tuple[int, int]], str]:
    """(edge layer, cloud layer) pairs and where they came from: an align mapping.json made for these layer counts
    (its pairs from `start_layer` on), else identity (the same model) or the `default` strategy from `start_layer`
    (None: 0 for the same model, half the edge's depth otherwise)."""
    if mapping:
        path = Path(mapping)
        try:
            data = json.loads(path.read_text())
            pairs = [(int(p["edge_layer"]), int(p["cloud_layer"])) for p in data["pairs"]]
            dims = (int(data["num_cloud_layers"]), int(data["num_edge_layers"]))
        except FileNotFoundError as exc:
            raise EdgeKVError(f"mapping file not found: {path}") from exc
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EdgeKVError(f"{path}: not a mapping.json of edgekv align ({exc})") from exc
        if dims != (cloud_layers, edge_layers):
            raise EdgeKVError(f"{path}: made for {dims[0]}→{dims[1]} layers, these models have "
                              f"{cloud_layers}→{edge_layers}")
        return [p for p in pairs if start_layer is None or p[0] >= start_layer], f"{path}"
    start = start_layer if start_layer is not None else (0 if same else edge_layers // 2)
    if not 0 <= start < edge_layers:
        raise EdgeKVError(f"--start-layer {start} is out of range: the edge model has {edge_layers} layers")
    if same:
        return [(i, i) for i in range(start, edge_layers)], "identity (same model)"
    zeros = {k: torch.zeros(cloud_layers, edge_layers) for k in ("linear_cka", "debiased_cka", "rsa")}
    built = build_mapping(default, zeros, MappingParams(start))
    return [(p["edge_layer"], p["cloud_layer"]) for p in built["pairs"]], f"{default} (no --mapping given)"
