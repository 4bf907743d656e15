"""Bench prepacked linear layers against plain `nn.Linear` on the default edge, side by side in one run (medians).

    python -m bench.prepack [--system 1024] [--user 64] [--reps 9]

Two copies of the default edge in bf16, one prepacked (`edgekv.models.prepack`): a U-token forward on an S-token
cache (the splice's shape) and an (S+U)-token prefill (all logits), interleaved rounds; logits compared exactly.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from edgekv.models.loading import load_model
from edgekv.models.prepack import prepack_linears


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    torch.manual_seed(0)
    plain = load_model("default-edge", "bfloat16").model
    packed = load_model("default-edge", "bfloat16").model
    count = prepack_linears(packed)
    S, U = args.system, args.user
    ids = torch.randint(0, plain.config.vocab_size - 1000, (1, S + U))
    positions = torch.arange(S, S + U)[None]
    with torch.no_grad():
        caches = {m: m(ids[:, :S], use_cache=True).cache for m in (plain, packed)}
        same = {
            "splice": torch.equal(plain(ids[:, S:], cache=copy.deepcopy(caches[plain]),
                                        position_ids=positions).logits,
                                  packed(ids[:, S:], cache=copy.deepcopy(caches[packed]),
                                         position_ids=positions).logits),
            "prefill": torch.equal(plain(ids).logits, packed(ids).logits)}

    def splice(model):
        def run():
            with torch.no_grad():
                model(ids[:, S:], cache=copy.deepcopy(caches[model]), position_ids=positions,
                      logits_to_keep=1)
        return run

    def prefill(model):
        def run():
            with torch.no_grad():
                model(ids).logits
        return run

    conditions = {"splice forward, nn.Linear": splice(plain), "splice forward, prepacked": splice(packed),
                  "full prefill, nn.Linear": prefill(plain), "full prefill, prepacked": prefill(packed)}
    for fn in conditions.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in conditions}
    for _ in range(args.reps):
        for name, fn in conditions.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    print(f"default edge, bf16, {torch.get_num_threads()} threads, {count} linear layers prepacked; S = {S}, "
          f"U = {U}; median of {args.reps}; logits identical: splice {same['splice']}, prefill {same['prefill']}")
    for kind in ("splice forward", "full prefill"):
        a, b = med[f"{kind}, nn.Linear"], med[f"{kind}, prepacked"]
        print(f"{kind:<16} nn.Linear {a:8.1f} ms   prepacked {b:8.1f} ms   speed-up {a / b:.2f}×")


if __name__ == "__main__":
    main()
