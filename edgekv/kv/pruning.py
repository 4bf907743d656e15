"""ThinK key-channel pruning (Xu et al. 2024, arXiv 2407.21018; DESIGN.md §3).

Shapes follow the cache: keys `(kv_heads, tokens, head_dim)`, queries `(q_heads, tokens, head_dim)`, with
`q_heads = kv_heads · group` (GQA). Pruned keys keep only their kept channels plus the channel indices, so
the bytes saved are real; at attention time the query is gathered to the same channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgekv import EdgeKVError


def _group(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(q_heads, w, d) → (kv_heads, group·w, d): the query heads sharing a KV head, pooled as rows."""
    q_heads, w, d = q.shape
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not divide into {kv_heads} KV heads")
    return q.reshape(kv_heads, (q_heads // kv_heads) * w, d)


def think_scores(q_obs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Channel scores `(kv_heads, head_dim)`: ||Q_obs[:, c]|| · ||K[:, c]||, which is ||Q_obs[:, c] K[:, c]ᵀ||_F.

    q_obs are the queries of the observation window (the last w prompt positions); for GQA the query heads
    of a group are pooled (their rows stacked) before the norm.
    """
    q = _group(q_obs.to(torch.float32), k.shape[0])
    return q.norm(dim=1) * k.to(torch.float32).norm(dim=1)


def kept_count(head_dim: int, ratio: float) -> int:
    """Channels kept at pruning ratio λ: d − floor(d·λ)."""
    return head_dim - math.floor(head_dim * ratio)


def check_ratio(ratio: float) -> None:
    """λ must leave at least one channel: 0 ≤ λ < 1."""
    if not 0.0 <= ratio < 1.0:
        raise EdgeKVError(f"prune ratio must be in [0, 1) (1.0 would drop every key channel), got {ratio}")


def think_select(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices `(kv_heads, d − floor(d·λ))` of the top-scoring channels, ascending; ties go to the lower channel."""
    check_ratio(ratio)
    keep = kept_count(scores.shape[-1], ratio)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :keep]
    return order.sort(dim=-1).values


@dataclass
class PrunedKeys:
    """Keys reduced to their kept channels; the last `recent` tokens may stay whole (as the official ThinK)."""

    kept: torch.Tensor  # (kv_heads, tokens − recent, kept)
    index: torch.Tensor  # (kv_heads, kept), ascending
    recent: torch.Tensor  # (kv_heads, recent, head_dim); recent may be 0
    head_dim: int

    def zero_filled(self) -> torch.Tensor:
        """The full-width keys with pruned channels set to 0 (for checks; never stored)."""
        h, s, _ = self.kept.shape
        full = self.kept.new_zeros(h, s, self.head_dim)
        full.scatter_(2, self.index[:, None, :].expand(h, s, -1), self.kept)
        return torch.cat([full, self.recent], dim=1)


def prune_keys(k: torch.Tensor, index: torch.Tensor, keep_recent: int = 0) -> PrunedKeys:
    """Gather the kept channels of `k` (kv_heads, tokens, d); the last keep_recent tokens stay unpruned."""
    split = k.shape[1] - keep_recent
    body, recent = k[:, :split], k[:, split:]
    kept = torch.gather(body, 2, index[:, None, :].expand(-1, body.shape[1], -1))
    return PrunedKeys(kept.contiguous(), index, recent.contiguous(), k.shape[-1])


def gather_query(q: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Query heads `(q_heads, t, d)` gathered to their KV head's kept channels → `(q_heads, t, kept)`."""
    group = q.shape[0] // index.shape[0]
    per_head = index.repeat_interleave(group, dim=0)
    return torch.gather(q, 2, per_head[:, None, :].expand(-1, q.shape[1], -1))


def pruned_scores(q: torch.Tensor, keys: PrunedKeys) -> torch.Tensor:
    """Attention logits `(q_heads, t, tokens)` of full queries against pruned keys, scaled by the full head_dim."""
    group = q.shape[0] // keys.kept.shape[0]
    scale = 1.0 / math.sqrt(keys.head_dim)
    body = gather_query(q, keys.index) @ keys.kept.repeat_interleave(group, dim=0).transpose(1, 2)
    recent = q @ keys.recent.repeat_interleave(group, dim=0).transpose(1, 2)
    return torch.cat([body, recent], dim=-1) * scale


def attention_error(q: torch.Tensor, k: torch.Tensor, index: torch.Tensor) -> float:
    """ThinK's quality measure ||QKᵀ − Q S Kᵀ||_F / ||QKᵀ||_F (S selects the kept channels), GQA-aware."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    group = q.shape[0] // k.shape[0]
    k_full = k.repeat_interleave(group, dim=0)
    full = q @ k_full.transpose(1, 2)
    mask = torch.zeros(k.shape[0], k.shape[-1], dtype=torch.float64).scatter_(1, index, 1.0)
    kept = (q * mask.repeat_interleave(group, dim=0)[:, None, :]) @ k_full.transpose(1, 2)
    return float((full - kept).norm() / full.norm().clamp_min(1e-300))
