"""PNG figures a person would rather look at than a table."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from edgekv.atomic import write_bytes_atomic  # noqa: E402


def similarity_heatmap(
    matrix: torch.Tensor,
    path: str | Path,
    title: str,
    cloud_label: str,
    edge_label: str,
    pairs: list[dict] | None = None,
) -> None:
    """Heatmap with rows = cloud layers (y), columns = edge layers (x), a colour bar, and the chosen pairs."""
    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(1.2 + 0.32 * cols, 1.0 + 0.3 * rows), dpi=110)
    image = ax.imshow(matrix.float().numpy(), origin="lower", aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).set_label(title)
    if pairs:
        ax.scatter([p["edge_layer"] for p in pairs], [p["cloud_layer"] for p in pairs],
                   marker="o", s=22, facecolors="none", edgecolors="red", linewidths=1.2, label="chosen mapping")
        ax.legend(loc="upper left", fontsize=7, framealpha=0.8)
    ax.set_xlabel(f"edge layer ({edge_label})")
    ax.set_ylabel(f"cloud layer ({cloud_label})")
    ax.set_xticks(range(0, cols, max(1, cols // 12)))
    ax.set_yticks(range(0, rows, max(1, rows // 14)))
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def loss_curve(log: list[dict], path: str | Path, title: str) -> None:
    """Left: training loss per step and its running mean; right: held-out KL and NLL as the change since step 0
    (the scale on which a fuser's gain shows), one PNG."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    train = [(e["step"], e["train_loss"]) for e in log if "train_loss" in e]
    if train:
        steps, values = zip(*train)
        left.plot(steps, values, color="0.75", lw=0.7, label="one text per step")
        window = max(1, len(values) // 20)
        smooth = torch.tensor(values).unfold(0, window, 1).mean(1) if len(values) >= window else torch.tensor([])
        left.plot(steps[window - 1:], smooth.tolist(), color="C3", label=f"running mean ({window} steps)")
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats/token)")
    left.legend()
    for key, colour in (("held_out_kl", "C0"), ("held_out_nll", "C1")):
        pts = [(e["step"], e[key]) for e in log if key in e]
        if pts:
            base = pts[0][1]
            right.plot([p[0] for p in pts], [p[1] - base for p in pts], "o-", color=colour, ms=3,
                       label=f"{key.replace('_', ' ')} − step {pts[0][0]} ({base:.3f})")
    right.axhline(0, color="0.5", lw=0.8)
    right.set_xlabel("step")
    right.set_ylabel("change on held-out texts (nats/token)")
    right.legend()
    suptitle(fig, title)
    save_figure(fig, path)


def interval_plot(ci: dict[str, dict[str, dict]], path: str | Path, title: str,
                  xlabel: str = "Δ NLL (nats/token)") -> None:
    """Forest plot: per source a panel, per condition its mean and 95 % interval, zero marked."""
    sources = list(ci)
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 0.45 * max(map(len, ci.values())) + 1.4),
                             squeeze=False)
    for ax, source in zip(axes[0], sources):
        names = [n for n in ci[source] if "of" not in ci[source][n]]  # aliases are drawn once, under their name
        means = [ci[source][n]["delta_mean"] for n in names]
        lo = [m - ci[source][n]["delta_ci95"][0] for m, n in zip(means, names)]
        hi = [ci[source][n]["delta_ci95"][1] - m for m, n in zip(means, names)]
        ax.errorbar(means, range(len(names)), xerr=[lo, hi], fmt="o", capsize=3)
        ax.axvline(0, color="0.5", lw=0.8)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_title(f"{source} (n = {ci[source][names[0]]['n']})")
        ax.set_xlabel(xlabel)
    suptitle(fig, title)
    save_figure(fig, path)


def suptitle(fig, title: str):
    """Set a figure's title, wrapped to the figure's width: a one-panel forest plot is narrower than its title."""
    chars = max(20, int(fig.get_figwidth() * 8))  # about 8 characters an inch at the title's 12 pt
    return fig.suptitle(textwrap.fill(title, chars))


def save_figure(fig, path: str | Path) -> None:
    """Write a figure as PNG all-or-nothing (`write_bytes_atomic`) and close it."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_bytes_atomic(path, png.getvalue())
