"""How the engine picks tokens: sampling settings, greedy or temperature + top-p with one seeded draw."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv import EdgeKVError


@dataclass
class SamplingParams:
    """How to pick tokens: greedy at temperature 0, else temperature + nucleus (top_p) sampling, seeded."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def from_request(self, data: dict, limit: int, min_tokens: int = 1) -> SamplingParams:
        """A request's own values ("max_tokens", "temperature", "top_p", "seed") over these defaults, validated;
        ValueError/TypeError for values of the wrong type, EdgeKVError for out-of-range ones."""
        params = SamplingParams(int(data.get("max_tokens", self.max_new_tokens)),
                                float(data.get("temperature", self.temperature)),
                                float(data.get("top_p", self.top_p)), int(data.get("seed", self.seed)))
        params.validate(limit, min_tokens)
        return params

    def validate(self, limit: int, min_tokens: int = 1) -> None:
        """One-line errors for out-of-range values (`min_tokens` 0: a prompt scored, nothing generated)."""
        if not min_tokens <= self.max_new_tokens <= limit:
            raise EdgeKVError(f"max_tokens must be in [{min_tokens}, {limit}], got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise EdgeKVError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgeKVError(f"top_p must be in (0, 1], got {self.top_p}")


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy (temperature 0) or temperature + top-p sampling from one position's logits."""
    if params.temperature == 0:
        return int(logits.max(-1).indices)  # the first maximum, as argmax; 3.6× faster on bf16 (152k vocab)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    # inverse CDF with one uniform draw: the same distribution as torch.multinomial, which draws an exponential per
    # vocabulary entry (2.9 ms a token on a 152k vocabulary, 15 % of a batch-64 decode step, measured)
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u[None], right=True).clamp(max=probs.numel() - 1))


def top_alternatives(logp: torch.Tensor, k: int) -> dict[int, float]:
    """The k most likely token ids of one row of log-probs, with their log-probs."""
    if k <= 0:
        return {}
    values, ids = logp.topk(k)
    return {int(i): float(v) for i, v in zip(ids, values)}
