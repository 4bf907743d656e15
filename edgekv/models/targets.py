"""A teacher's targets and the distillation loss on them, defined once: the top-k log-probs of each position, and
the exact KL over the outcomes {each of the top-k ids, the rest} (fuser training, translator training, the
distilled student, the batched teacher's scoring), and the full-vocabulary KL between two logit tensors (the shared
prefix's gate)."""

from __future__ import annotations

import torch


def top_targets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, ids) of the k most likely tokens of each row (float32 log-softmax)."""
    return torch.log_softmax(logits.float(), -1).topk(k, dim=-1)


def topk_kl(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student) over the outcomes {each of the teacher's top-k ids, the rest}."""
    logq = torch.log_softmax(logits.float(), -1)
    q_top = logq.gather(-1, top_ids)
    q_rest = torch.logsumexp(logq.scatter(-1, top_ids, float("-inf")), -1)
    p_rest_mass = (1 - top_logp.exp().sum(-1)).clamp_min(1e-12)
    kl = (top_logp.exp() * (top_logp - q_top)).sum(-1) + p_rest_mass * (p_rest_mass.log() - q_rest)
    return kl.mean()


def mean_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> float:
    """Mean over rows of KL(teacher ‖ student) (nats) between two (T, vocab) logit tensors, on the vocabulary
    they share (one tokenizer; a larger model may pad its embedding)."""
    v = min(teacher_logits.shape[-1], student_logits.shape[-1])
    t = torch.log_softmax(teacher_logits[..., :v].float(), dim=-1)
    s = torch.log_softmax(student_logits[..., :v].float(), dim=-1)
    return float((t.exp() * (t - s)).sum(-1).mean())
