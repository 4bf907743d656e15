"""Properties of the similarity measures, driven by what each declares in PROPERTIES."""

import numpy as np
import pytest
import torch

from edgekv.align.similarity import PROPERTIES, cka_matrices, debiased_cka, linear_cka, massive_rows, rsa, rsa_matrix

MEASURES = {"linear_cka": linear_cka, "debiased_cka": debiased_cka, "rsa": rsa}


def _data(n=80, d1=12, d2=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d1, generator=g, dtype=torch.float64)
    y = x[:, :d2] @ torch.randn(d2, d2, generator=g, dtype=torch.float64) + 0.7 * torch.randn(
        n, d2, generator=g, dtype=torch.float64)
    return x, y, g


def _orthogonal(d, g):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q


def test_kornblith_demo_values():
    # Kornblith et al.'s CKA demo notebook: these inputs give 0.55761 (linear) and 0.51346 (debiased)
    np.random.seed(1337)
    x = np.random.randn(100, 10)
    y = np.random.randn(100, 10) + x
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    assert round(linear_cka(x, y), 4) == round(0.55761, 4)
    assert round(debiased_cka(x, y), 4) == round(0.51346, 4)


@pytest.mark.parametrize("name", MEASURES)
@pytest.mark.parametrize("n", [7, 80])  # n < d takes the Gram route, n > d the feature-space route
def test_self_similarity_is_one(name, n):
    x, _, _ = _data(n=n)
    assert MEASURES[name](x, x) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("name", MEASURES)
def test_declared_invariances_hold(name):
    fn, props = MEASURES[name], PROPERTIES[name]
    x, y, g = _data()
    base = fn(x, y)
    checks = {
        "symmetric": lambda: fn(y, x),
        "isotropic_scaling": lambda: fn(3.7 * x, 0.2 * y),
        "orthogonal": lambda: fn(x @ _orthogonal(x.shape[1], g), y @ _orthogonal(y.shape[1], g)),
        "translation": lambda: fn(x + 5.0, y - 2.0),
        "permutation": lambda: fn(x[:, torch.randperm(x.shape[1], generator=g)], y),
    }
    assert props <= set(checks), f"{name} declares an invariance no test checks"
    for prop in props:
        assert checks[prop]() == pytest.approx(base, abs=1e-10), prop


@pytest.mark.parametrize("name", MEASURES)
def test_not_invariant_to_general_linear_map(name):
    x, y, g = _data()
    a = torch.diag(torch.tensor([30.0] + [1.0] * (x.shape[1] - 1), dtype=torch.float64))
    a = a @ torch.randn(x.shape[1], x.shape[1], generator=g, dtype=torch.float64)
    assert torch.linalg.matrix_rank(a) == x.shape[1]  # invertible
    assert abs(MEASURES[name](x @ a, y) - MEASURES[name](x, y)) > 1e-3


def test_rsa_is_not_translation_invariant():
    # cosine similarity depends on the origin; RSA does not declare translation invariance, and must not have it
    x, y, _ = _data()
    assert "translation" not in PROPERTIES["rsa"]
    assert abs(rsa(x + 3.0, y) - rsa(x, y)) > 1e-3


def test_debiased_needs_four_tokens():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        debiased_cka(x, x)


def test_unrelated_inputs_score_low_and_debiased_corrects_bias():
    # with d large relative to n, plain CKA of independent data is biased well above 0; debiased is near 0
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, 200, generator=g), torch.randn(60, 200, generator=g)
    assert linear_cka(x, y) > 0.5
    assert abs(debiased_cka(x, y)) < 0.1


def test_shape_errors():
    with pytest.raises(ValueError, match="row counts differ"):
        linear_cka(torch.randn(5, 2), torch.randn(6, 2))
    with pytest.raises(ValueError, match="2-D"):
        rsa(torch.randn(5), torch.randn(5))


@pytest.mark.parametrize("n", [9, 120])
def test_matrices_equal_pairwise(n):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, 20, generator=g) + i for i in range(3)]
    ys = [torch.randn(n, 11, generator=g), xs[0] @ torch.randn(20, 6, generator=g), xs[2][:, :15]]
    m = cka_matrices(xs, ys)
    for r, x in enumerate(xs):
        for c, y in enumerate(ys):
            assert m["linear_cka"][r, c] == pytest.approx(linear_cka(x, y), abs=1e-12)
            assert m["debiased_cka"][r, c] == pytest.approx(debiased_cka(x, y), abs=1e-12)
    r = rsa_matrix(xs, ys, max_tokens=50, seed=4)
    assert r[1, 2] == pytest.approx(rsa(xs[1], ys[2], max_tokens=50, seed=4), abs=1e-12)


def test_rsa_subsample_is_seeded():
    x, y, _ = _data(n=300)
    assert rsa(x, y, max_tokens=40, seed=1) == rsa(x, y, max_tokens=40, seed=1)
    assert rsa(x, y, max_tokens=40, seed=1) != rsa(x, y, max_tokens=40, seed=2)


def test_massive_rows_flags_planted_outliers_and_they_dominate_cka():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(400, 16, generator=g, dtype=torch.float64)
    y = torch.randn(400, 12, generator=g, dtype=torch.float64)  # unrelated to x
    x[7] *= 60.0
    y[7] *= 60.0  # one shared massive token
    mask = massive_rows([[x], [y]], 10.0)
    assert mask.nonzero().flatten().tolist() == [7]
    assert linear_cka(x, y) > 0.5  # a single token makes unrelated layers look alike
    assert linear_cka(x[~mask], y[~mask]) < 0.1
