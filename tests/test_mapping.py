"""Layer-mapping strategies."""

import itertools

import pytest
import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import MAPPINGS, MappingParams, build_mapping


def _matrices(n_cloud=7, n_edge=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    cka = torch.rand(n_cloud, n_edge, generator=g, dtype=torch.float64)
    return {"linear_cka": cka, "debiased_cka": cka - 0.05, "rsa": torch.rand(n_cloud, n_edge, generator=g,
                                                                             dtype=torch.float64)}


def _brute_force(m, p):
    n_cloud, n_edge = m["linear_cka"].shape
    best, best_seq = float("-inf"), None
    layers = range(p.start_layer, n_edge)
    for seq in itertools.combinations_with_replacement(range(n_cloud), len(layers)):  # non-decreasing
        if all(m["linear_cka"][j, i] >= p.tau_cka and m["rsa"][j, i] >= p.tau_rsa for i, j in zip(layers, seq)):
            total = sum(float(m[p.metric][j, i]) for i, j in zip(layers, seq))
            if total > best:
                best, best_seq = total, list(seq)
    return best, best_seq


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("taus", [(0.0, 0.0), (0.3, 0.2)])
def test_similarity_strategy_is_optimal_and_monotone(seed, taus):
    m = _matrices(seed=seed)
    p = MappingParams(start_layer=1, tau_cka=taus[0], tau_rsa=taus[1])
    best, _ = _brute_force(m, p)
    if best == float("-inf"):
        with pytest.raises(EdgeKVError):
            build_mapping("similarity", m, p)
        return
    out = build_mapping("similarity", m, p)
    chosen = [q["cloud_layer"] for q in out["pairs"]]
    assert chosen == sorted(chosen)
    assert sum(q["linear_cka"] for q in out["pairs"]) == pytest.approx(best, abs=1e-5)
    assert all(q["linear_cka"] >= taus[0] and q["rsa"] >= taus[1] for q in out["pairs"])
    assert [q["edge_layer"] for q in out["pairs"]] == list(range(1, 5))


def test_similarity_follows_a_planted_diagonal():
    n_cloud, n_edge = 12, 6
    m = {k: torch.full((n_cloud, n_edge), 0.1, dtype=torch.float64) for k in ("linear_cka", "debiased_cka", "rsa")}
    for i in range(n_edge):
        m["linear_cka"][2 * i, i] = 0.9
    out = build_mapping("similarity", m, MappingParams(start_layer=0))
    assert [q["cloud_layer"] for q in out["pairs"]] == [0, 2, 4, 6, 8, 10]


def test_threshold_failure_names_the_layer():
    m = _matrices()
    with pytest.raises(EdgeKVError, match="edge layer"):
        build_mapping("similarity", m, MappingParams(start_layer=0, tau_cka=1.5))


def test_fixed_strategies():
    m = _matrices(n_cloud=28, n_edge=24)
    uniform = [q["cloud_layer"] for q in build_mapping("uniform", m, MappingParams(0))["pairs"]]
    assert uniform[0] == 0 and uniform[-1] == 27 and uniform == sorted(uniform)
    last = [q["cloud_layer"] for q in build_mapping("last-aligned", m, MappingParams(20))["pairs"]]
    assert last == [24, 25, 26, 27]
    dis = build_mapping("dissimilar", m, MappingParams(10))["pairs"]
    assert all(q["linear_cka"] == pytest.approx(float(m["linear_cka"][:, q["edge_layer"]].min()), abs=1e-6)
               for q in dis)


def test_every_strategy_records_scores():
    m = _matrices()
    for name in MAPPINGS:
        out = build_mapping(name, m, MappingParams(2))
        assert len(out["pairs"]) == 3
        for q in out["pairs"]:
            assert set(q) == {"edge_layer", "cloud_layer", "linear_cka", "debiased_cka", "rsa"}


def test_bad_arguments():
    m = _matrices()
    with pytest.raises(EdgeKVError, match="unknown mapping strategy"):
        build_mapping("nope", m, MappingParams(0))
    with pytest.raises(EdgeKVError, match="out of range"):
        build_mapping("uniform", m, MappingParams(5))
