"""A distillation step's seconds with the batch's sequences packed into one forward (relay attention over the
student) against one stock forward per sequence (what training did before), on the default edge, side by side.

    python -m bench.student_pack [--system 544] [--batch 4] [--held 16] [--reps 5] [--json OUT]

The student is the edge's own prefill of `--system` XSum tokens (every layer trainable, as `distill` trains it);
each sequence is a 20-token query and a 64-token answer (the recipe's maxima) with random top-64 targets (the
seconds do not depend on them). A training step is the batch's loss and its backward; a held-out pass is the loss
of `--held` sequences without gradients. Arms alternate within each repetition; medians are quoted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edgekv.atomic import write_text_atomic
from edgekv.summary import median

QUERY, ANSWER, TOP_K = 20, 64, 64  # configs/distill.yaml's max_query_tokens, max_answer_tokens, top_k


def _samples(ids: torch.Tensor, n: int, vocab: int, seed: int) -> list:
    from edgekv.distill.teacher import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, ids.numel() - QUERY - ANSWER, (1,), generator=g))
        rows = QUERY + ANSWER - 1
        top = torch.stack([torch.randperm(vocab, generator=g)[:TOP_K] for _ in range(rows)])
        out.append(Sample("bench", ids[start:start + QUERY], ids[start + QUERY:start + QUERY + ANSWER], top,
                          torch.log_softmax(torch.randn(rows, TOP_K + 1, generator=g), -1)[:, :TOP_K]))
    return out


def run(system: int, batch: int, held: int, reps: int) -> dict:
    """Median seconds of each arm and their ratios."""
    from bench.compress import xsum_prompt
    from edgekv.attention.prefix_kv import continuation_logits
    from edgekv.distill.student import initial_student, sample_losses
    from edgekv.models.loading import load_model
    from edgekv.models.targets import topk_kl

    edge = load_model("default-edge", "bfloat16")
    ids = xsum_prompt(edge.tokenizer, system)
    student, _ = initial_student(edge, ids, ids.numel(), "all")
    for t in student.parameters():
        t.requires_grad_(True)
    vocab = edge.model.config.vocab_size
    train, heldout = _samples(ids, batch, vocab, 0), _samples(ids, held, vocab, 1)

    def one_each(samples):
        prefix = student.prefix()
        return [topk_kl(continuation_logits(edge.model, prefix, torch.cat([s.user, s.answer[:-1]])), s.top_ids,
                        s.top_logp) for s in samples]

    def packed(samples):
        return sample_losses(edge, student.prefix(), samples, query_loss=True)

    arms = {"one forward per sequence": one_each, "packed": packed}
    seconds: dict[str, dict[str, list[float]]] = {a: {"train step": [], "held-out pass": []} for a in arms}
    losses: dict[str, float] = {}
    for rep in range(reps + 1):  # the first repetition warms up and is not counted
        for name, losses_of in arms.items():
            start = time.perf_counter()
            loss = sum(losses_of(train)) / batch
            loss.backward()
            step = time.perf_counter() - start
            for t in student.parameters():
                t.grad = None
            start = time.perf_counter()
            with torch.no_grad():
                kl = float(sum(float(x) for x in losses_of(heldout)) / held)
            passed = time.perf_counter() - start
            if rep:
                seconds[name]["train step"].append(step)
                seconds[name]["held-out pass"].append(passed)
            losses[name] = kl
    med = {a: {k: median(v) for k, v in d.items()} for a, d in seconds.items()}
    base, new = med["one forward per sequence"], med["packed"]
    return {"median_s": med, "speedup": {k: base[k] / new[k] for k in base},
            "held_out_kl": losses, "torch_threads": torch.get_num_threads(), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=544)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--held", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    r = run(a.system, a.batch, a.held, a.reps)
    print(f"{'median s':18}{'one each':>10}{'packed':>10}{'ratio':>8}")
    for k in ("train step", "held-out pass"):
        print(f"{k:18}{r['median_s']['one forward per sequence'][k]:10.3f}{r['median_s']['packed'][k]:10.3f}"
              f"{r['speedup'][k]:8.2f}")
    print("held-out KL: " + ", ".join(f"{k} {v:.5f}" for k, v in r["held_out_kl"].items()))
    if a.json:
        write_text_atomic(a.json, json.dumps({"setup": vars(a) | {"json": str(a.json)}, **r}, indent=1))


if __name__ == "__main__":
    main()
