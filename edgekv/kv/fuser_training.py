"""Training a fuser's gates through the frozen edge, and choosing its per-layer hard gates on held-out text.

Target: the cloud's next-token distribution on each text's continuation (top-k log-probs plus the tail's mass,
an exact KL over the k+1 outcomes {top-k ids, everything else}), optionally plus cross-entropy on the text.
The expensive inputs — the edge's own prefix KV, the translated cloud KV and the cloud's top-k — are computed
once per text and cached on disk as safetensors keyed by a hash of everything they depend on, so epochs and
resumed runs never rerun the cloud. Seeded order, resumable (safetensors state + JSON log), held-out curve.

With `map_lr` the hidden-state maps train too (end to end with the gates). The cache then holds the cloud's
un-mapped input hidden states (`raw` features) and each step maps them: the ridge maps are fitted to predict the
edge's *own* hidden states, so their output is an estimate of KV the edge already has; only a map that learns
can carry what the cloud knows and the edge does not.

Under a shared prefix (`shared`, for `ce-lslm-fuse-shared`) the edge reads each text after the prefix's K tokens,
as it does when it serves: its own KV sits at positions K.., the fuser joins the cloud's KV there, and the
continuation attends to [prefix; fused own KV]. The target is unchanged: the cloud reading the text alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_tensors_atomic
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.prefix_kv import PrefixKV, continuation_logits, prefill_after, prefix_kv, prepend
from edgekv.kv.fusers import Fuser
from edgekv.kv.registry import save_translator
from edgekv.kv.train_loop import Trainee, example_index, train_loop
from edgekv.kv.translators import HiddenTranslator
from edgekv.models.capture import capture
from edgekv.models.structure import KVPair
from edgekv.models.targets import top_targets, topk_kl
from edgekv.summary import bootstrap_ci
from edgekv.texts import HeldOutText


@dataclass
class FuseExample:
    """Cached inputs of one text: own and translated KV of its prefix, the cloud's top-k on its continuation."""

    prefix: torch.Tensor
    continuation: torch.Tensor
    own: list[KVPair]  # every edge layer, (kv_heads, P, d)
    cloud: dict[int, KVPair]  # mapped edge layers, (kv_heads, P, d)
    top_ids: torch.Tensor  # (C−1, k)
    top_logp: torch.Tensor  # (C−1, k) the cloud's log-probs of those ids
    hidden: dict[int, torch.Tensor] | None = None  # raw features: mapped edge layer → cloud hidden_in (P, d_cloud)
    before: PrefixKV | None = None  # the shared prefix the own KV was read after (never cached: one for all texts)

    def cloud_kv(self, edge, fuser: Fuser, layers: list[int]) -> dict[int, KVPair]:
        """The translated cloud KV of `layers`: cached, or mapped now from raw features (differentiable)."""
        if self.hidden is None:
            return self.cloud
        return {i: tuple(t.to(edge.model.dtype) for t in fuser.layer_kv(edge.model, i, {"hidden_in": self.hidden[i]}))
                for i in layers if i in self.hidden}


def _maps_digest(fuser: Fuser, pair: tuple[str, str], top_k: int, raw: bool = False) -> str:
    """What cached features depend on besides the text: the model pair, k and the maps (never the gates; raw
    features do not depend on the maps either)."""
    layers = {str(i): fuser.info[i]["cloud_layer"] for i in sorted(fuser.info)}
    h = hashlib.sha256(json.dumps({"pair": pair, "k": top_k, "layers": layers, **({"raw": 1} if raw else {})}).encode())
    if not raw:
        for name, t in sorted(HiddenTranslator.tensors(fuser).items()):  # the maps only, never the gates
            h.update(name.encode() + t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _key(text: HeldOutText, digest: str) -> str:
    h = hashlib.sha256(digest.encode())
    h.update(text.prefix.numpy().tobytes() + b"|" + text.continuation.numpy().tobytes())
    return h.hexdigest()[:32]


def _target_key(text: HeldOutText, teacher_fingerprint: str, top_k: int) -> str:
    return _key(text, f"teacher:{teacher_fingerprint}:k={top_k}")


@torch.no_grad()
def _features(edge, source, text: HeldOutText, fuser: Fuser, top_k: int | None,
              raw: bool = False, before: PrefixKV | None = None) -> dict[str, torch.Tensor]:
    """Own prefix KV (read after `before`, when given), the source's translated KV (raw: its un-mapped hidden
    states), and (top_k given) the source's top-k on the continuation."""
    full = torch.cat([text.prefix, text.continuation])
    p = text.prefix.numel()
    seen = []
    acts = capture(source.model, [full], fuser.features, select=lambda t, n: torch.arange(p),
                   on_output=lambda t, out: seen.append(out.logits[0, p:-1]))
    own = prefix_kv(edge.model, text.prefix) if before is None else prefill_after(edge.model, before, text.prefix)
    out = {"prefix": text.prefix, "continuation": text.continuation}
    if top_k:
        out["top_logp"], out["top_ids"] = top_targets(seen[0], top_k)
    for i, (k, v) in enumerate(own):
        out[f"own.{i}.k"], out[f"own.{i}.v"] = k[0], v[0]
    if raw:
        for i in sorted(fuser.info):
            # capture widens to float32; the model's own dtype holds these values exactly at half the bytes
            out[f"hidden.{i}"] = acts.layers["hidden_in"][fuser.info[i]["cloud_layer"]].to(source.model.dtype)
        return out
    for i, (k, v) in fuser.translate(acts, edge.model, sorted(fuser.info)).items():
        out[f"cloud.{i}.k"], out[f"cloud.{i}.v"] = k.to(edge.model.dtype), v.to(edge.model.dtype)
    return out


@torch.no_grad()
def _targets(teacher, text: HeldOutText, top_k: int) -> dict[str, torch.Tensor]:
    """The teacher's top-k log-probs predicting continuation tokens 1..C−1."""
    full = torch.cat([text.prefix, text.continuation])
    logits = teacher.model(full[None]).logits[0, text.prefix.numel():-1]
    top_logp, top_ids = top_targets(logits, top_k)
    return {"top_ids": top_ids, "top_logp": top_logp}


def _example(t: dict[str, torch.Tensor], before: PrefixKV | None = None) -> FuseExample:
    own_layers = sorted({int(n.split(".")[1]) for n in t if n.startswith("own.")})
    cloud_layers = sorted({int(n.split(".")[1]) for n in t if n.startswith("cloud.")})
    hidden = {int(n.split(".")[1]): v for n, v in t.items() if n.startswith("hidden.")}
    return FuseExample(t["prefix"], t["continuation"], [(t[f"own.{i}.k"], t[f"own.{i}.v"]) for i in own_layers],
                       {i: (t[f"cloud.{i}.k"], t[f"cloud.{i}.v"]) for i in cloud_layers}, t["top_ids"], t["top_logp"],
                       hidden or None, before)


def prepare(edge, cloud, texts: list[HeldOutText], fuser: Fuser, pair: tuple[str, str], top_k: int = 64,
            cache_dir: str | Path | None = None, on_text: Callable[[int], None] | None = None,
            teacher=None, raw: bool = False, shared=None) -> list[FuseExample]:
    """One FuseExample per text: features from `cloud` (the source of the fused KV; the edge itself for a
    self-fusion control), targets from `teacher` (default: the source). Both are read from `cache_dir` when
    computed before (atomic safetensors per text: features keyed by the maps and `pair`, targets by the
    teacher's fingerprint), so a self-fusion run reuses the cloud's targets. `raw`: keep the source's
    un-mapped hidden states instead of translated KV (for training the maps). `shared` (a `SharedPrefix`): the
    edge's own KV is read after it (its fingerprint joins the features' key; the targets never depend on it)."""
    teacher = teacher or cloud
    same = teacher is cloud
    before = shared.prefix if shared is not None else None
    digest = _maps_digest(fuser, pair, top_k, raw) if cache_dir else ""
    if shared is not None:
        digest += f"|shared:{shared.fingerprint}"
    out = []
    for n, text in enumerate(texts):
        feat_path = Path(cache_dir) / f"{_key(text, digest)}.safetensors" if cache_dir else None
        target_path = (Path(cache_dir) / "targets" / f"{_target_key(text, teacher.fingerprint, top_k)}.safetensors"
                       if cache_dir else None)
        tensors = load_file(str(feat_path)) if feat_path is not None and feat_path.exists() else None
        if tensors is None:
            tensors = _features(edge, cloud, text, fuser, top_k if same else None, raw, before)
            if feat_path is not None:
                write_tensors_atomic(feat_path, tensors)
        if "top_ids" not in tensors or not same:
            if target_path is not None and target_path.exists():
                tensors.update(load_file(str(target_path)))
            else:
                tensors.update(_targets(teacher, text, top_k))
        if target_path is not None and not target_path.exists():
            write_tensors_atomic(target_path, {k: tensors[k] for k in ("top_ids", "top_logp")})
        out.append(_example(tensors, before))
        if on_text:
            on_text(n + 1)
    return out


def fused_continuation(edge, fuser: Fuser, own: list[KVPair], cloud: dict[int, KVPair], prefix_len: int,
                       continuation: torch.Tensor, layers: list[int] | None = None,
                       before: PrefixKV | None = None) -> torch.Tensor:
    """Edge logits predicting continuation tokens 1..C−1 over its own prefix KV (every layer, (kv_heads, P, d))
    plus the fuser's work on the cloud KV of `layers` (default: the open hard gates); differentiable in the gates.
    With `before` (a shared prefix the own KV was read after) the fuser joins the cloud at the own KV's positions
    and the continuation reads [before; fused own KV], as a session under that prefix does."""
    enable_fusion(edge.model)
    offset = before.next_position if before is not None else 0
    override, segments = fuser.fuse(edge.model, dict(enumerate(own)), cloud, layers, offset=offset)
    layers_kv = [tuple(t[None] for t in override.get(i, kv)) for i, kv in enumerate(own)]
    if before is not None:
        layers_kv = [prepend(before.layer(i), kv) for i, kv in enumerate(layers_kv)]
    prefix = PrefixKV(layers_kv, prefix_len + (before.prefix_len if before is not None else 0), segments,
                      next_position=offset + prefix_len)
    return continuation_logits(edge.model, prefix, continuation[:-1])


def fused_logits(edge, fuser: Fuser, ex: FuseExample, layers: list[int] | None = None) -> torch.Tensor:
    """`fused_continuation` of one cached training example."""
    layers = fuser.open_layers() if layers is None else layers
    return fused_continuation(edge, fuser, ex.own, ex.cloud_kv(edge, fuser, layers), ex.prefix.numel(),
                              ex.continuation, layers, ex.before)


def nll(logits: torch.Tensor, ex: FuseExample) -> torch.Tensor:
    """Mean NLL of continuation tokens 1..C−1."""
    return torch.nn.functional.cross_entropy(logits.float(), ex.continuation[1:])


def loss(edge, fuser: Fuser, ex: FuseExample, ce_weight: float = 0.0) -> torch.Tensor:
    """Training loss of one text with every trained gate in play."""
    logits = fused_logits(edge, fuser, ex, sorted(fuser.info))
    out = topk_kl(logits, ex.top_ids, ex.top_logp)
    return out + ce_weight * nll(logits, ex) if ce_weight else out


@torch.no_grad()
def per_text(edge, fuser: Fuser, examples: list[FuseExample], layers: list[int] | None) -> tuple[list, list]:
    """Top-k KL to the cloud and NLL of the text, one of each per example, with the segments of `layers`."""
    kl, nl = [], []
    for ex in examples:
        logits = fused_logits(edge, fuser, ex, layers)
        kl.append(float(topk_kl(logits, ex.top_ids, ex.top_logp)))
        nl.append(float(nll(logits, ex)))
    return kl, nl


def evaluate(edge, fuser: Fuser, examples: list[FuseExample], layers: list[int] | None) -> dict[str, float]:
    """Mean top-k KL to the cloud and NLL of the text over `examples` with the segments of `layers`."""
    kl, nl = per_text(edge, fuser, examples, layers)
    return {"kl": sum(kl) / len(kl), "nll": sum(nl) / len(nl)}


def train(edge, fuser: Fuser, examples: list[FuseExample], held_out: list[FuseExample], steps: int,
          lr: float = 0.05, ce_weight: float = 0.0, seed: int = 0, checkpoint: str | Path | None = None,
          every: int = 25, on_step=None, stop=None, pair: tuple[str | None, str | None] = (None, None),
          map_lr: float | None = None) -> list[dict]:
    """Adam on the fuser's gates (and, with `map_lr`, its maps at that rate: needs raw examples) through
    `train_loop`, one text per step in a seeded order; held-out KL/NLL every `every` steps and at the end (at
    step 0 with the hard gates as they are, later with every trained layer); resumes from `checkpoint`."""
    if map_lr is not None and any(ex.hidden is None for ex in examples + held_out):
        raise EdgeKVError("training the maps needs raw examples (prepare(..., raw=True))")
    groups = [{"params": fuser.parameters()}]
    if map_lr is not None:
        groups.append({"params": fuser.map_parameters(), "lr": map_lr})
    held = (lambda step: evaluate(edge, fuser, held_out, None if step == 0 else sorted(fuser.info))) \
        if held_out else None
    trainee = Trainee(groups, lambda step: loss(edge, fuser, examples[example_index(step, len(examples), seed)],
                                                ce_weight),
                      save=lambda path: save_translator(fuser, path, *pair), evaluate=held, frozen=[edge.model])
    return train_loop(trainee, steps, lr, checkpoint, every, on_step, stop)


GATE_LEVEL = 0.90  # two-sided 90 % interval: its lower end is a one-sided 95 % bound


@torch.no_grad()
def choose_gates(edge, fuser: Fuser, held_out: list[FuseExample], margin: float = 0.0,
                 max_open: int | None = None) -> dict:
    """Hard gates by held-out NLL of the text: from all trained layers open, close each layer whose closing
    (leave-one-out) lowers the NLL; with `max_open`, keep only that many, those whose closing costs most (a
    byte budget: a closed layer ships nothing). Keep the result only if its held-out gain over every gate closed
    clears noise: the mean gain exceeds `margin` nats/token and the one-sided 95 % lower bound of a paired
    bootstrap over the held-out texts (`GATE_LEVEL`) is above zero; else close all. Sets `fuser`'s open layers;
    returns the evidence."""
    layers = sorted(fuser.info)
    closed_texts = per_text(edge, fuser, held_out, [])[1]
    closed = sum(closed_texts) / len(closed_texts)
    everything = evaluate(edge, fuser, held_out, layers)["nll"]
    loo = {i: evaluate(edge, fuser, held_out, [j for j in layers if j != i])["nll"] for i in layers}
    chosen = [i for i in layers if loo[i] >= everything]
    if max_open is not None and len(chosen) > max_open:
        chosen = sorted(sorted(chosen, key=lambda i: -loo[i])[:max_open])
    chosen_texts = per_text(edge, fuser, held_out, chosen)[1] if chosen else closed_texts
    chosen_nll = sum(chosen_texts) / len(chosen_texts)
    gains = [c - o for c, o in zip(closed_texts, chosen_texts)]
    lower, _ = bootstrap_ci(gains, "mean", seed=0, level=GATE_LEVEL)
    if not chosen or closed - chosen_nll <= margin or lower is None or lower <= 0:
        chosen, chosen_nll = [], closed
    fuser.set_open(chosen)
    return {"closed_nll": closed, "all_open_nll": everything, "leave_one_out_nll": {str(i): v for i, v in loo.items()},
            "open": chosen, "chosen_nll": chosen_nll, "texts": len(held_out), "gain_lower_bound": lower,
            "gain_level": "one-sided 95 % (paired bootstrap over held-out texts)"}
