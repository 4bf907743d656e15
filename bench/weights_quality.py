"""Quality of the edge's quantized weights: NLL of held-out continuations under `--weights int8|int4` against the
bf16 edge on the same texts (paired, 95 % bootstrap), ShareGPT and XSum reported separately.

    python -m bench.weights_quality [--texts 32] [--prefix 256] [--cont 64] [--json reports/serve/weights_quality.json]

Held-out texts as bench/fidelity.py takes them (ShareGPT from record 2,000; the XSum sample's documents): the
first P tokens are read, the next C scored. NLLs do not depend on timing, so this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from edgekv.atomic import write_text_atomic
from edgekv.eval.stats import paired_bootstrap
from edgekv.models.loading import load_model, load_tokenizer
from edgekv.texts import iter_sharegpt, render_conversation, split_texts, xsum_documents

ROOT = Path(__file__).resolve().parent.parent


@torch.no_grad()
def text_nll(model, prefix: torch.Tensor, continuation: torch.Tensor) -> float:
    """Mean NLL (nats/token) of the continuation after the prefix, one forward."""
    ids = torch.cat([prefix, continuation])[None]
    logits = model(ids, logits_to_keep=continuation.numel() + 1).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, continuation))


def held_out_texts(tok, n: int, prefix: int, cont: int) -> list:
    """n ShareGPT texts (from record 2,000) then n XSum documents, cut to prefix + continuation tokens."""
    share = (render_conversation(r) for k, r in enumerate(iter_sharegpt()) if k >= 2000)  # lazy: stops at n
    xsum = xsum_documents(ROOT / "data/xsum/xsum_sample.jsonl")
    return split_texts(tok, share, "sharegpt", prefix, cont, n) + split_texts(tok, xsum, "xsum", prefix, cont, n)


def nll_deltas(nll: dict, sources: list[str], weights: list[str], base: str = "bf16") -> dict:
    """Per source: the base's mean NLL and each setting's paired Δ against it (95 % bootstrap)."""
    out = {}
    for source in ("sharegpt", "xsum"):
        idx = [i for i, s in enumerate(sources) if s == source]
        ref = [nll[base][i] for i in idx]
        cells = {f"{base}_mean_nll": sum(ref) / len(ref), "n": len(idx)}
        for w in weights:
            d = paired_bootstrap([nll[w][i] for i in idx], ref)
            cells[w] = {"delta_mean": d["delta_mean"], "delta_ci95": [d["ci95_lo"], d["ci95_hi"]]}
        out[source] = cells
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--cont", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    texts = held_out_texts(load_tokenizer("default-edge"), a.texts, a.prefix, a.cont)
    nll = {}
    for weights in ["bf16", *a.weights.split(",")]:
        edge = load_model("default-edge", "bfloat16", weights=weights)
        nll[weights] = [text_nll(edge.model, t.prefix, t.continuation) for t in texts]
        print(f"{weights}: {len(texts)} texts scored", flush=True)
        del edge
    weights = a.weights.split(",")
    out = {"setup": vars(a) | {"json": str(a.json)},
           "sources": nll_deltas(nll, [t.source for t in texts], weights)}
    for source, cells in out["sources"].items():
        for w in weights:
            lo, hi = cells[w]["delta_ci95"]
            print(f"{source:9} {w}: Δ NLL vs bf16 {cells[w]['delta_mean']:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                  f"(n = {cells['n']})")
    if a.json:
        write_text_atomic(a.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
