"""Representational similarity measures: linear CKA, debiased CKA, RSA (DESIGN.md §3).

Pure functions on tensors. Inputs are `(n, d)` matrices whose rows are the same n tokens; all arithmetic is
float64. Each measure lists its invariances in `PROPERTIES`, and the property tests check exactly those.
"""

from __future__ import annotations

import torch

PROPERTIES: dict[str, frozenset[str]] = {
    "linear_cka": frozenset({"symmetric", "isotropic_scaling", "orthogonal", "translation", "permutation"}),
    "debiased_cka": frozenset({"symmetric", "isotropic_scaling", "orthogonal", "translation", "permutation"}),
    "rsa": frozenset({"symmetric", "isotropic_scaling", "orthogonal", "permutation"}),
}


def _as_pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"expected 2-D (tokens, features) inputs, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"row counts differ: {x.shape[0]} vs {y.shape[0]} (rows must be the same tokens)")
    return x.detach().to(torch.float64), y.detach().to(torch.float64)


def _center(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=0, keepdim=True)


def _ratio(num: float, den: float) -> float:
    return float("nan") if den <= 0 else num / den


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019): ||Yᵀ X||²_F / (||Xᵀ X||_F ||Yᵀ Y||_F) on centred columns."""
    x, y = _as_pair(x, y)
    x, y = _center(x), _center(y)
    n, d = x.shape[0], max(x.shape[1], y.shape[1])
    if n > d:  # feature-space form: O(n d²), no n×n Gram
        cross = (y.T @ x).square().sum()
        norm_x = torch.linalg.matrix_norm(x.T @ x)
        norm_y = torch.linalg.matrix_norm(y.T @ y)
    else:  # the Gram form is cheaper when there are fewer tokens than features
        gx, gy = x @ x.T, y @ y.T
        cross = (gx * gy).sum()
        norm_x, norm_y = torch.linalg.matrix_norm(gx), torch.linalg.matrix_norm(gy)
    return _ratio(float(cross), float(norm_x * norm_y))


def _unbiased_hsic(cross_sq: torch.Tensor, rx: torch.Tensor, ry: torch.Tensor, n: int) -> torch.Tensor:
    """n(n-3)·HSIC_u for linear kernels of centred x, y (Song et al. 2012, U-statistic), in feature space.

    cross_sq = ||xᵀy||²_F and r = row sums of squares. With K = xxᵀ, zero-diagonal K̃ and centred columns
    (so K1 = 0): tr(K̃L̃) = ||xᵀy||² − r_x·r_y,  1ᵀK̃1 = −Σr_x,  1ᵀK̃L̃1 = r_x·r_y.
    """
    return cross_sq - n / (n - 2) * (rx @ ry) + rx.sum() * ry.sum() / ((n - 1) * (n - 2))


def debiased_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Debiased linear CKA: CKA with the unbiased HSIC estimator (Nguyen et al. 2021); needs n ≥ 4."""
    x, y = _as_pair(x, y)
    n = x.shape[0]
    if n < 4:
        raise ValueError(f"debiased CKA needs at least 4 tokens (the unbiased HSIC divides by n-3), got {n}")
    x, y = _center(x), _center(y)
    if n > max(x.shape[1], y.shape[1]):
        xy, xx, yy = (y.T @ x).square().sum(), (x.T @ x).square().sum(), (y.T @ y).square().sum()
    else:
        gx, gy = x @ x.T, y @ y.T
        xy, xx, yy = (gx * gy).sum(), gx.square().sum(), gy.square().sum()
    rx, ry = x.square().sum(dim=1), y.square().sum(dim=1)
    hxy, hxx, hyy = _unbiased_hsic(xy, rx, ry, n), _unbiased_hsic(xx, rx, rx, n), _unbiased_hsic(yy, ry, ry, n)
    return _debiased_ratio(hxy, hxx, hyy)


def _debiased_ratio(hxy: torch.Tensor, hxx: torch.Tensor, hyy: torch.Tensor) -> float:
    # the unbiased self-HSIC can be ≤ 0 for degenerate inputs: CKA is then undefined (nan)
    return _ratio(float(hxy), float((hxx * hyy).sqrt()) if hxx > 0 and hyy > 0 else 0.0)


def _lower_triangle_rsm(x: torch.Tensor) -> torch.Tensor:
    """Strict lower triangle of the token×token cosine-similarity matrix (CE-LSLM eq. 14)."""
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    rsm = unit @ unit.T
    rows, cols = torch.tril_indices(rsm.shape[0], rsm.shape[0], offset=-1)
    return rsm[rows, cols]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return _ratio(float(a @ b), float(a.norm() * b.norm()))


def subsample_rows(n: int, max_rows: int | None, seed: int) -> torch.Tensor | None:
    """Seeded sorted row indices to keep when n exceeds max_rows, else None (keep all)."""
    if max_rows is None or n <= max_rows:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:max_rows].sort().values


def rsa(x: torch.Tensor, y: torch.Tensor, max_tokens: int | None = None, seed: int = 0) -> float:
    """RSA (CE-LSLM eqs. 14–15): Pearson correlation of the strict lower triangles of the cosine RSMs."""
    x, y = _as_pair(x, y)
    if x.shape[0] < 3:
        raise ValueError(f"RSA needs at least 3 tokens (one off-diagonal pair is not a correlation), got {x.shape[0]}")
    keep = subsample_rows(x.shape[0], max_tokens, seed)
    if keep is not None:
        x, y = x[keep], y[keep]
    return _pearson(_lower_triangle_rsm(x), _lower_triangle_rsm(y))


GRAM_BUDGET_BYTES = 2 << 30  # the n×n route keeps one Gram per column layer in float64


def _layer_stats(x: torch.Tensor, gram: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(centred x or its Gram, row sums of squares, ||xᵀx||²_F, n(n-3)·HSIC_u(x, x)), float64."""
    x = _center(x.detach().to(torch.float64))
    rows = x.square().sum(dim=1)
    if gram:
        g = x @ x.T
        self_sq = g.square().sum()
        return g, rows, self_sq, _unbiased_hsic(self_sq, rows, rows, x.shape[0])
    self_sq = (x.T @ x).square().sum()
    return x, rows, self_sq, _unbiased_hsic(self_sq, rows, rows, x.shape[0])


def cka_matrices(xs: list[torch.Tensor], ys: list[torch.Tensor], on_row=None) -> dict[str, torch.Tensor]:
    """Linear and debiased CKA for every pair (rows = xs, columns = ys), sharing the per-layer work.

    The same numbers as the pairwise functions, by whichever route costs fewer flops: feature space
    (one GEMM per row layer against all column layers at once, n·Σd_x·Σd_y) or n×n Grams
    (n²·(Σd_x + Σd_y), when there are few tokens and the Grams fit in memory).
    """
    n = xs[0].shape[0]
    if any(t.shape[0] != n for t in (*xs, *ys)):
        raise ValueError("all layers must hold the same tokens (equal row counts)")
    if n < 4:
        raise ValueError(f"debiased CKA needs at least 4 tokens (the unbiased HSIC divides by n-3), got {n}")
    dx, dy = sum(x.shape[1] for x in xs), sum(y.shape[1] for y in ys)
    gram = n * n * (dx + dy + len(xs) * len(ys)) < n * dx * dy and n * n * 8 * len(ys) <= GRAM_BUDGET_BYTES
    col_stats = [_layer_stats(y, gram) for y in ys]
    if gram:
        y_all = torch.stack([s[0].reshape(-1) for s in col_stats], dim=1)  # (n², layers)
    else:
        y_all = torch.cat([s[0] for s in col_stats], dim=1)
        widths = [s[0].shape[1] for s in col_stats]
    linear = torch.empty(len(xs), len(ys), dtype=torch.float64)
    debiased = torch.empty_like(linear)
    for r, x in enumerate(xs):
        xc, rx, xx, hxx = _layer_stats(x, gram)
        if gram:
            crosses = xc.reshape(-1) @ y_all  # <Gx, Gy>_F = ||xᵀy||²_F
        else:
            crosses = torch.stack([t.sum() for t in (xc.T @ y_all).square().sum(dim=0).split(widths)])
        for c, (_, ry, yy, hyy) in enumerate(col_stats):
            linear[r, c] = _ratio(float(crosses[c]), float((xx * yy).sqrt()))
            debiased[r, c] = _debiased_ratio(_unbiased_hsic(crosses[c], rx, ry, n), hxx, hyy)
        if on_row:
            on_row(r)
    return {"linear_cka": linear, "debiased_cka": debiased}


def rsa_matrix(
    xs: list[torch.Tensor], ys: list[torch.Tensor], max_tokens: int | None = None, seed: int = 0, on_layer=None
) -> torch.Tensor:
    """RSA for every pair (rows = xs, columns = ys), each layer's RSM triangle computed once, same token subset."""
    n = xs[0].shape[0]
    keep = subsample_rows(n, max_tokens, seed)

    def standardized(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().to(torch.float64)
        tri = _lower_triangle_rsm(t if keep is None else t[keep])
        tri = tri - tri.mean()
        result = tri / tri.norm().clamp_min(torch.finfo(tri.dtype).tiny)
        if on_layer:
            on_layer()
        return result

    cols = torch.stack([standardized(y) for y in ys])
    out = torch.empty(len(xs), len(ys), dtype=torch.float64)
    for r, x in enumerate(xs):
        out[r] = cols @ standardized(x)
    return out


def massive_rows(layer_groups: list[list[torch.Tensor]], max_ratio: float) -> torch.Tensor:
    """Rows (tokens) whose norm exceeds max_ratio × its layer's median norm in any layer of any group.

    Such 'massive activations' (Sun et al. 2024: the first delimiter, attention sinks) are a handful of tokens
    whose squared norms are hundreds of times the rest; left in, they decide linear CKA on their own.
    """
    n = layer_groups[0][0].shape[0]
    worst = torch.zeros(n, dtype=torch.float64)
    for layers in layer_groups:
        for h in layers:
            norms = h.to(torch.float64).norm(dim=1)
            worst = torch.maximum(worst, norms / norms.median().clamp_min(1e-30))
    return worst > max_ratio
