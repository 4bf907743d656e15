"""Where a decode step's milliseconds go on the default edge at batch 1: linears vs attention vs the other ops vs
what no op accounts for (Python, transformers and edgekv bookkeeping), per `--weights`, from torch's profiler.

    python -m bench.decode_profile [--weights bf16,int4] [--system 1024] [--tokens 32] [--json OUT]

A session over S system-prompt tokens (what an export gives) answers one short prompt greedily; the profiler
records the decode steps after the first token. Each op's self CPU time is summed into its category; "unaccounted"
is the wall time minus every op's self time. Run it on a quiet machine: its shares are only as good as the clock.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from edgekv.atomic import write_text_atomic

CATEGORIES = {
    "linear": ("linear", "addmm", "aten::mm", "matmul", "_weight_int4pack", "_weight_int8pack", "mkldnn", "gguf_mm"),
    "attention": ("attention", "flash", "softmax", "logsumexp", "bmm"),
}


def category(name: str) -> str:
    """The category of an op by its name."""
    low = name.lower()
    for cat, keys in CATEGORIES.items():
        if any(k in low for k in keys):
            return cat
    return "other ops"


def _label_gguf_products() -> None:
    """GGUF products are pybind calls the profiler does not see: label each (record_function, ~1 µs a call) so
    they count as linears rather than as unaccounted time."""
    from edgekv.models.gguf_linear import GGUFLinear

    if getattr(GGUFLinear.forward, "labelled", False):
        return
    plain = GGUFLinear.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("gguf_mm"):
            return plain(self, x)

    forward.labelled = True
    GGUFLinear.forward = forward


def profile_weights(weights: str, system: int, tokens: int) -> dict:
    """The decode-step breakdown (ms/token) of one `--weights`."""
    from bench.compress import xsum_prompt
    from edgekv.models.loading import load_model
    from edgekv.models.prepack import prepack_linears
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    edge = load_model("default-edge", "bfloat16", weights=weights)
    _label_gguf_products()
    if weights == "bf16":
        prepack_linears(edge.model)
    ids = xsum_prompt(edge.tokenizer, system)
    session = EdgeSession(edge, None, edge.tokenizer.decode(ids), cache_dir=None)
    session.eos_ids.clear()
    user = edge.tokenizer("\nUser: summarise the text above.\nAssistant:", add_special_tokens=False)["input_ids"]
    user = torch.tensor(user)
    session.complete(user, SamplingParams(max_new_tokens=4))  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        r = session.complete(user, SamplingParams(max_new_tokens=tokens))
        wall = time.perf_counter() - start
    steps = len(r.token_ids) - 1
    decode_s = r.total_s - r.ttft_s
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.key.startswith(("aten::", "mkldnn", "gguf_mm")) or "int4pack" in ev.key or "int8pack" in ev.key:
            totals[category(ev.key)] = totals.get(category(ev.key), 0.0) + ev.self_cpu_time_total / 1e6
    # the profiled call includes the user prompt's prefill: scale every op total to the decode share of the wall
    share = decode_s / wall
    out = {k: 1e3 * v * share / steps for k, v in totals.items()}
    out["unaccounted"] = 1e3 * decode_s / steps - sum(out.values())
    out["total_ms_per_token"] = 1e3 * decode_s / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="bf16,int4")
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results = {w: profile_weights(w, a.system, a.tokens) for w in a.weights.split(",")}
    keys = ["linear", "attention", "other ops", "unaccounted", "total_ms_per_token"]
    print(f"{'ms/token':22}" + "".join(f"{w:>10}" for w in results))
    for k in keys:
        print(f"{k:22}" + "".join(f"{results[w].get(k, 0.0):10.2f}" for w in results))
    if a.json:
        write_text_atomic(a.json, json.dumps({"setup": vars(a) | {"json": str(a.json)}, "ms_per_token": results},
                                             indent=1))


if __name__ == "__main__":
    main()
