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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--cont", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    tok = load_tokenizer("default-edge")
    share = [render_conversation(r) for k, r in enumerate(iter_sharegpt()) if k >= 2000]
    xsum = xsum_documents(ROOT / "data/xsum/xsum_sample.jsonl")
    texts = (split_texts(tok, share, "sharegpt", a.prefix, a.cont, a.texts)
             + split_texts(tok, xsum, "xsum", a.prefix, a.cont, a.texts))
    nll = {}
    for weights in ["bf16", *a.weights.split(",")]:
        edge = load_model("default-edge", "bfloat16", weights=weights)
        nll[weights] = [text_nll(edge.model, t.prefix, t.continuation) for t in texts]
        print(f"{weights}: {len(texts)} texts scored", flush=True)
        del edge
    out = {"setup": vars(a) | {"json": str(a.json)}, "sources": {}}
    for source in ("sharegpt", "xsum"):
        idx = [i for i, t in enumerate(texts) if t.source == source]
        base = [nll["bf16"][i] for i in idx]
        cells = {"bf16_mean_nll": sum(base) / len(base), "n": len(idx)}
        for w in a.weights.split(","):
            d = paired_bootstrap([nll[w][i] for i in idx], base)
            cells[w] = {"delta_mean": d["delta_mean"], "delta_ci95": [d["ci95_lo"], d["ci95_hi"]]}
            print(f"{source:9} {w}: Δ NLL vs bf16 {d['delta_mean']:+.4f} [{d['ci95_lo']:+.4f}, {d['ci95_hi']:+.4f}] "
                  f"(n = {len(idx)})")
        out["sources"][source] = cells
    if a.json:
        write_text_atomic(a.json, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
