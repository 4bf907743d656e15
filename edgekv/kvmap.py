"""Cross-model KV maps (DESIGN.md §3): per mapped layer pair, K_edge ≈ K_cloud·W + b and V_edge ≈ V_cloud·W + b.

Closed-form ridge regression in float64 on calibration tokens both models saw. The ridge strength is chosen on
a validation split of texts and the reported R² comes from a separate test split, so it is held out twice over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv import EdgeKVError

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
        return cls(tensors[f"{prefix}.weight"], tensors[f"{prefix}.bias"], alpha)


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
