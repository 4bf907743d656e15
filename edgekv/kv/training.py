"""End-to-end training of a KV translator through the frozen edge model (issue: translators that keep quality).

Loss per text: KL(target ‖ edge-on-spliced-cache) over the continuation's next-token distributions, where the
spliced cache has the edge's own KV below layer m and the translator's KV from layer m on (first `sink` tokens
local). The target is the edge's own full prefill (`edge`) or the cloud's distribution (`cloud`). Only the
translator's maps learn; every model weight is frozen. Seeded; checkpoints are safetensors + JSON (resumable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from edgekv.atomic import write_tensors_atomic, write_text_atomic
from edgekv.attention.splice import splice_layers
from edgekv.kv.registry import load_translator, save_translator
from edgekv.kv.translators import TrainedTranslator, kv_from_hidden
from edgekv.models.capture import capture
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
    """Edge logits on the continuation over a cache whose layers ≥ m come from the translator (differentiable)."""
    with torch.no_grad():
        cache = edge.model(ex.prefix[None], use_cache=True).past_key_values
    kv = {i: kv_from_hidden(edge.model, i, translator.maps[i].apply(ex.cloud_hidden[translator.info[i]["cloud_layer"]]))
          for i in translator.maps if i >= m}
    splice_layers(cache, kv, keep_first=sink)
    p = ex.prefix.numel()
    positions = torch.arange(p, p + ex.continuation.numel() - 1)[None]
    return edge.model(input_ids=ex.continuation[None, :-1], past_key_values=cache, position_ids=positions).logits[0]


def kl_loss(edge, translator, ex: TrainExample, m: int, sink: int) -> torch.Tensor:
    """Mean over tokens of KL(target ‖ student)."""
    student = torch.log_softmax(spliced_logits(edge, translator, ex, m, sink).float(), -1)
    return (ex.target_logp.exp() * (ex.target_logp - student)).sum(-1).mean()


def optimizer_tensors(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as named tensors (`opt.<n>.<key>`), for a safetensors checkpoint."""
    return {f"opt.{n}.{k}": v.detach().reshape(v.shape).contiguous().clone()
            for n, p in enumerate(params) for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)}


def restore_optimizer(params: list[torch.Tensor], opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `optimizer_tensors` (resume is bit-exact)."""
    for n, p in enumerate(params):
        state = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{n}.")}
        if state:
            opt.state[p] = {k: (v if k != "step" else v.reshape(())) for k, v in state.items()}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], translator, pair, progress: dict) -> None:
    """A training checkpoint: state.safetensors (parameters + optimizer), the usable translator
    (translator.safetensors + translator.json) and progress.json, each file written atomically."""
    write_tensors_atomic(path / "state.safetensors", tensors)
    save_translator(translator, path, *pair)
    write_text_atomic(path / "progress.json", json.dumps(progress))


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(state tensors, progress) of a checkpoint written by `write_checkpoint`, or None when there is none."""
    if not (path / "progress.json").exists():
        return None
    return load_file(str(path / "state.safetensors")), json.loads((path / "progress.json").read_text())


def _save(path: Path, translator: TrainedTranslator, opt: torch.optim.Optimizer, step: int, log: list,
          pair: tuple[str | None, str | None]) -> None:
    tensors = {f"map.{i}.{k}": getattr(translator.maps[i], k).detach().contiguous()
               for i in translator.maps for k in ("weight", "bias")}
    tensors.update(optimizer_tensors(translator.parameters(), opt))
    info = {str(i): v for i, v in translator.info.items()}
    write_checkpoint(path, tensors, translator, pair, {"step": step, "log": log, "info": info})


def _load(path: Path, translator: TrainedTranslator, opt: torch.optim.Optimizer) -> tuple[int, list]:
    found = read_checkpoint(path)
    if found is None:
        return 0, []
    tensors, progress = found
    with torch.no_grad():
        for i in translator.maps:
            translator.maps[i].weight.copy_(tensors[f"map.{i}.weight"])
            translator.maps[i].bias.copy_(tensors[f"map.{i}.bias"])
    restore_optimizer(translator.parameters(), opt, tensors)
    return progress["step"], progress["log"]


def example_index(step: int, n: int, seed: int) -> int:
    """A fresh seeded permutation per epoch: the order of step s never depends on how many steps are asked for."""
    epoch = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + step // n))
    return int(epoch[step % n])


def train(edge, translator: TrainedTranslator, examples: list[TrainExample], m: int, steps: int, lr: float = 1e-4,
          sink: int = 1, seed: int = 0, checkpoint: str | Path | None = None, every: int = 50,
          on_step=None, stop=None, pair: tuple[str | None, str | None] = (None, None)) -> list[dict]:
    """Adam on the translator's maps for `steps` steps, one text per step in a seeded order; resumes from
    `checkpoint` when it holds a saved state; `stop(step)` may end it early (a time budget). `pair` = (cloud,
    edge) fingerprints recorded in the saved translator. Returns the loss log."""
    for p in edge.model.parameters():
        p.requires_grad_(False)
    params = translator.parameters()
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    start, log = _load(Path(checkpoint), translator, opt) if checkpoint else (0, [])
    for step in range(start, steps):
        ex = examples[example_index(step, len(examples), seed)]
        loss = kl_loss(edge, translator, ex, m, sink)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log.append({"step": step + 1, "kl": float(loss.detach())})
        if on_step:
            on_step(step + 1, log[-1]["kl"])
        done = step + 1 == steps or (stop is not None and stop(step + 1))
        if checkpoint and ((step + 1) % every == 0 or done):
            _save(Path(checkpoint), translator, opt, step + 1, log, pair)
        if done:
            break
    for p in params:
        p.requires_grad_(False)
    return log


def load_trained(path: str | Path, cloud_fingerprint: str | None = None,
                 edge_fingerprint: str | None = None) -> TrainedTranslator:
    """The trained translator of a training checkpoint (its translator.safetensors + translator.json)."""
    return load_translator(path, cloud_fingerprint, edge_fingerprint)
