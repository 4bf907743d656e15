"""End-to-end training of a KV translator through the frozen edge model (issue: translators that keep quality).

Loss per text: KL(target ‖ edge-on-spliced-cache) over the continuation's next-token distributions, where the
spliced cache has the edge's own KV below layer m and the translator's KV from layer m on (first `sink` tokens
local). The target is the edge's own full prefill (`edge`) or the cloud's distribution (`cloud`). Only the
translator's maps learn; every model weight is frozen. Seeded; checkpoints are safetensors + JSON (resumable).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv.attention.prefix_kv import PrefixKV, continuation_logits
from edgekv.kv.registry import save_translator
from edgekv.kv.train_loop import Trainee, example_index, train_loop
from edgekv.kv.translators import TrainedTranslator
from edgekv.models.capture import capture
from edgekv.models.structure import kv_from_hidden
from edgekv.texts import HeldOutText


@dataclass
class TrainExample:
    """Precomputed inputs of one training text."""

    prefix: torch.Tensor
    continuation: torch.Tensor
    cloud_hidden: dict[int, torch.Tensor]  # cloud layer → prefix input hidden states (tokens, d_cloud)
    target_logp: torch.Tensor  # (C−1, vocab) log-probs to match


@torch.no_grad()
def prepare(edge, cloud, texts: list[HeldOutText], translator: TrainedTranslator, target: str) -> list[TrainExample]:
    """Cloud activations and target distributions for each text (computed once, no grad)."""
    if target not in ("edge", "cloud"):
        raise ValueError(f"target must be 'edge' or 'cloud', got {target!r}")
    layers = sorted({v["cloud_layer"] for v in translator.info.values()})
    out = []
    for text in texts:
        full = torch.cat([text.prefix, text.continuation])
        p = text.prefix.numel()
        seen = []
        acts = capture(cloud.model, [full], ("hidden_in",), select=lambda t, n: torch.arange(p),
                       on_output=lambda t, o: seen.append(o.logits[0, p:-1]))
        logits = seen[0] if target == "cloud" else edge.model(full[None]).logits[0, p:-1]
        out.append(TrainExample(text.prefix, text.continuation,
                                {j: acts.layers["hidden_in"][j] for j in layers},
                                torch.log_softmax(logits.float(), -1)))
    return out


def spliced_logits(edge, translator: TrainedTranslator, ex: TrainExample, m: int, sink: int) -> torch.Tensor:
    """Edge logits on the continuation over a prefix whose layers ≥ m come from the translator (differentiable)."""
    own = PrefixKV.of_model(edge.model, ex.prefix)
    kv = {i: kv_from_hidden(edge.model, i, translator.maps[i].apply(ex.cloud_hidden[translator.info[i]["cloud_layer"]]))
          for i in translator.maps if i >= m}
    return continuation_logits(edge.model, own.replaced(kv, keep_first=sink), ex.continuation[:-1])


def kl_loss(edge, translator, ex: TrainExample, m: int, sink: int) -> torch.Tensor:
    """Mean over tokens of KL(target ‖ student)."""
    student = torch.log_softmax(spliced_logits(edge, translator, ex, m, sink).float(), -1)
    return (ex.target_logp.exp() * (ex.target_logp - student)).sum(-1).mean()


def train(edge, translator: TrainedTranslator, examples: list[TrainExample], m: int, steps: int, lr: float = 1e-4,
          sink: int = 1, seed: int = 0, checkpoint: str | Path | None = None, every: int = 50,
          on_step=None, stop=None, pair: tuple[str | None, str | None] = (None, None)) -> list[dict]:
    """Adam on the translator's maps (`train_loop`), one text per step in a seeded order, gradients clipped at
    norm 1; resumes from `checkpoint`; `pair` = (cloud, edge) fingerprints recorded in the saved translator.
    Returns the loss log (`kl` per step)."""
    trainee = Trainee([{"params": translator.parameters()}],
                      lambda step: kl_loss(edge, translator, examples[example_index(step, len(examples), seed)], m,
                                           sink),
                      save=lambda path: save_translator(translator, path, *pair), clip=1.0, loss_key="kl",
                      frozen=[edge.model])
    return train_loop(trainee, steps, lr, checkpoint, every, on_step, stop)
