"""Fidelity of cross-model KV: teacher-forced NLL of the edge on a continuation, given a spliced prefix cache.

For each held-out text (prefix = system prompt, continuation = what follows), the edge computes its own prefix
cache; for a split layer m, layers ≥ m get the translated cloud KV (the first `sink` prefix tokens stay local),
and the edge is scored on the continuation. Controls, on the same tokens:
- `edge`: the edge's own full prefill (no reuse), the target to match;
- `cloud`: the cloud model's own NLL, what the edge could gain;
- `noise:<translator>`: the edge's own KV plus Gaussian noise whose per-layer variance equals that translator's
  error on this text (is the translator's error worse than random error of the same size?);
- `no-prefix`: the edge on the continuation alone; `cloud-no-prefix`: the cloud on it alone. Their difference in
  differences, (cloud − cloud-no-prefix) − (edge − no-prefix), is how much more the cloud gains from reading the
  prefix than the edge does: the part of the cloud's lead that a better prefix KV could carry (`context_gain`);
- fusers (`fusers={name: Fuser}`): the edge's own prefix KV with the fuser's cloud KV joined at its open layers
  (a self-fusion fuser takes its features from the edge itself), and `fuse-closed`: the same path with every
  gate closed, which must equal `edge`;
- `<fuser>@mismatched` (given `mismatched`, the cloud activations of another text with as many prefix tokens):
  a cloud fuser fed the cloud's KV of the wrong document. Equal to the fuser → it does not read the cloud's
  content (the gain is the adapter's); worse → it does.
Every condition predicts the continuation's tokens 1..C−1 (token 0 has no predictor without a prefix).
"""

from __future__ import annotations

import math

import torch

from edgekv.attention.prefix_kv import PrefixKV, continuation_logits
from edgekv.kv.fuser_training import fused_continuation
from edgekv.models.capture import capture
from edgekv.texts import HeldOutText


def _nll_top1(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)
    return float(nll.mean()), logits.argmax(-1)


def matched_noise(true: dict, translated: dict, seed: int) -> dict:
    """The edge's own KV plus Gaussian noise of the translation error's per-layer variance (keys, values apart)."""
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for i, (k, v) in true.items():
        tk, tv = translated[i]
        sk = float((tk - k).float().square().mean().sqrt())
        sv = float((tv - v).float().square().mean().sqrt())
        noisy[i] = (k + sk * torch.randn(k.shape, generator=g), v + sv * torch.randn(v.shape, generator=g))
    return noisy


@torch.no_grad()
def _fused(edge, base, fuser, acts, text: HeldOutText, layers=None) -> torch.Tensor:
    """Continuation logits over the edge's own prefix cache joined with a fuser's KV (its open layers)."""
    translated = fuser.translate(acts, edge.model, sorted(fuser.info)) if layers != [] else {}
    own = [(k[0], v[0]) for k, v in (base.layer(i) for i in range(base.num_layers))]
    return fused_continuation(edge, fuser, own, translated, text.prefix.numel(), text.continuation, layers)


@torch.no_grad()
def evaluate_text(edge, cloud, text: HeldOutText, translators: dict, splits: list[int], sink: int | list[int],
                  seed: int = 0, text_id: int = 0, fusers: dict | None = None, mismatched: dict | None = None,
                  keep: dict | None = None) -> list[dict]:
    """All conditions for one text → rows {condition, m, nll, top1_edge, top1_cloud}. Several `sink` values
    name the spliced conditions `<translator>|sink=<s>` (one set of model passes serves them all).
    `keep["cloud_acts"]` receives this text's cloud prefix activations (the next text's `mismatched`)."""
    fusers = fusers or {}
    sinks = [sink] if isinstance(sink, int) else list(sink)
    full = torch.cat([text.prefix, text.continuation])
    p = text.prefix.numel()
    targets = text.continuation[1:]
    rows = []

    def row(condition, m, logits):
        nll, top = _nll_top1(logits, targets)
        rows.append({"text": text_id, "source": text.source, "condition": condition, "m": m, "nll": nll,
                     "top1_edge": float((top == edge_top).float().mean()),
                     "top1_cloud": float((top == cloud_top).float().mean())})

    edge_logits = edge.model(full[None]).logits[0, p:-1]
    edge_top = edge_logits.argmax(-1)
    seen = []  # one cloud pass: its logits score the cloud, its prefix activations feed the translators
    features = sorted({f for t in [*translators.values(), *fusers.values()] for f in t.features})
    cloud_acts = capture(cloud.model, [full], features, select=lambda t, n: torch.arange(p),
                         on_output=lambda t, out: seen.append(out.logits[0, p:-1]))
    cloud_logits = seen[0]
    if keep is not None:
        keep["cloud_acts"] = cloud_acts
    cloud_top = cloud_logits.argmax(-1)
    row("edge", None, edge_logits)
    row("cloud", None, cloud_logits)
    row("no-prefix", None, edge.model(text.continuation[None, :-1]).logits[0])
    row("cloud-no-prefix", None, cloud.model(text.continuation[None, :-1]).logits[0])

    base = PrefixKV.of_model(edge.model, text.prefix)
    if fusers:
        self_features = sorted({f for t in fusers.values() if t.self_fuse for f in t.features})
        edge_acts = capture(edge.model, [text.prefix], self_features) if self_features else None
        first = next(iter(fusers.values()))
        row("fuse-closed", min(first.info), _fused(edge, base, first, None, text, []))
        for name, fuser in fusers.items():
            row(name, min(fuser.info), _fused(edge, base, fuser, edge_acts if fuser.self_fuse else cloud_acts, text))
            if mismatched is not None and not fuser.self_fuse:
                row(f"{name}@mismatched", min(fuser.info), _fused(edge, base, fuser, mismatched, text))
    own = {i: (base.layer(i)[0][0].float(), base.layer(i)[1][0].float()) for i in range(edge.num_layers)}
    for name, translator in translators.items():
        translated = translator.translate(cloud_acts, edge.model, list(range(min(splits), edge.num_layers)))
        noisy = matched_noise({i: own[i] for i in translated}, translated, seed)
        for m in splits:
            deep = [i for i in translated if i >= m]
            for s in sinks:
                tag = "" if len(sinks) == 1 else f"|sink={s}"
                for condition, kv in ((name, translated), (f"noise:{name}", noisy)):
                    spliced = base.replaced({i: kv[i] for i in deep}, keep_first=s)
                    row(condition + tag, m, continuation_logits(edge.model, spliced, text.continuation[:-1]))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean and standard error over texts per (source, condition, m)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["condition"], r["m"]), []).append(r)
    out = []
    for (source, condition, m), rs in groups.items():
        n = len(rs)
        stats = {"source": source, "condition": condition, "m": m, "texts": n}
        for key in ("nll", "top1_edge", "top1_cloud"):
            vals = torch.tensor([r[key] for r in rs], dtype=torch.float64)
            stats[key] = float(vals.mean())
            stats[key + "_se"] = float(vals.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
        out.append(stats)
    return out


def _deltas(rows: list[dict], reference: str) -> dict[tuple, list[float]]:
    """(source, condition, m) → each text's NLL minus the same text's `reference` NLL (paired: difficulty cancels;
    the reference itself: zeros)."""
    ref = {(r["source"], r["text"]): r["nll"] for r in rows if r["condition"] == reference}
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        delta = r["nll"] - ref[(r["source"], r["text"])]
        groups.setdefault((r["source"], r["condition"], r["m"]), []).append(delta)
    return groups


def paired_delta(rows: list[dict], reference: str = "edge") -> list[dict]:
    """Per (source, condition, m): mean over texts of NLL minus the same text's reference NLL, with its standard
    error."""
    out = []
    for (source, condition, m), d in _deltas(rows, reference).items():
        if condition == reference:
            continue
        t = torch.tensor(d, dtype=torch.float64)
        se = float(t.std(unbiased=True) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
        out.append({"source": source, "condition": condition, "m": m, "texts": len(d), "delta_nll": float(t.mean()),
                    "delta_nll_se": se})
    return out


def _t_interval(d: torch.Tensor) -> dict:
    """{n, delta_mean, delta_ci95}: mean and two-sided 95 % Student t-interval over texts."""
    from scipy.stats import t as student

    mean = float(d.mean())
    half = float(student.ppf(0.975, d.numel() - 1) * d.std(unbiased=True) / math.sqrt(d.numel())) \
        if d.numel() > 1 else float("nan")
    return {"n": int(d.numel()), "delta_mean": mean, "delta_ci95": [mean - half, mean + half]}


def context_gain(rows: list[dict]) -> dict:
    """{source: {edge, cloud, cloud-extra}}: what reading the prefix saves each model (NLL without it − with it,
    nats/token, paired per text) and how much more it saves the cloud: the most of the cloud's lead that the
    edge could take from the cloud's prefix KV while its own layers still read the continuation."""
    nll = {(r["source"], r["text"], r["condition"]): r["nll"] for r in rows if r["m"] is None}
    out: dict[str, dict] = {}
    for source in sorted({r["source"] for r in rows}):
        texts = sorted({t for s, t, c in nll if s == source and c == "cloud-no-prefix"})
        if not texts:
            continue
        edge = torch.tensor([nll[source, t, "no-prefix"] - nll[source, t, "edge"] for t in texts], dtype=torch.float64)
        cloud = torch.tensor([nll[source, t, "cloud-no-prefix"] - nll[source, t, "cloud"] for t in texts],
                             dtype=torch.float64)
        out[source] = {"edge": _t_interval(edge), "cloud": _t_interval(cloud), "cloud-extra": _t_interval(cloud - edge)}
    return out


def delta_ci95(rows: list[dict], names: dict[tuple[str, int | None], str], reference: str = "edge") -> dict:
    """{source: {name: {n, delta_mean, delta_ci95}}} of the paired NLL differences to `reference` for the
    (condition, m) pairs in `names`; the interval is Student's t over texts (95 %, two-sided)."""
    groups = _deltas(rows, reference)
    out: dict[str, dict] = {}
    for source in sorted({r["source"] for r in rows}):
        for (condition, m), name in names.items():
            if groups.get((source, condition, m)):
                out.setdefault(source, {})[name] = _t_interval(torch.tensor(groups[source, condition, m],
                                                                            dtype=torch.float64))
    return out
