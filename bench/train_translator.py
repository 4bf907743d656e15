"""Train the `trained` translator on the default pair: the `hidden` maps, tuned end to end through the frozen
edge so that the edge's next-token distribution on a spliced cache matches a target.

    python -m bench.train_translator [--m 12] [--target edge|cloud] [--minutes 15] [--lr 5e-5]
                                     [--similarity runs/align-default/similarity.json] [--out runs/trained-m12]

Calibration for the initial hidden maps: ShareGPT conversations 0..31 (as bench/fidelity.py). Training texts:
conversations from --train-offset on, cut into prefix/continuation; held-out evaluation is bench/fidelity.py
with --trained OUT (its held-out texts start at record 2000). Resumable: rerun with the same --out.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from bench.fidelity import full_depth_pairs
from bench.translator_training import prepare, train
from edgekv.kv.translators import HiddenTranslator, TrainedTranslator
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.texts import iter_sharegpt, render_conversation, sharegpt_texts, split_texts, tokenize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=12)
    ap.add_argument("--target", default="edge", choices=["edge", "cloud"])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--train-texts", type=int, default=48)
    ap.add_argument("--train-offset", type=int, default=100)
    ap.add_argument("--prefix", type=int, default=192)
    ap.add_argument("--cont", type=int, default=64)
    ap.add_argument("--similarity", default=None)
    ap.add_argument("--out", default="runs/trained-m12")
    args = ap.parse_args()
    torch.manual_seed(0)

    cloud, edge = load_model("default-cloud"), load_model("default-edge")
    pairs, mapping = full_depth_pairs(args.similarity, cloud.num_layers, edge.num_layers)
    pairs = [(i, j) for i, j in pairs if i >= args.m]
    seqs = tokenize(edge.tokenizer, sharegpt_texts(32).texts, 256, min_tokens=2)
    with torch.no_grad():
        hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                        capture(edge.model, seqs, ("hidden_in",)), pairs, edge.model)
    trained = TrainedTranslator.from_hidden(hidden)
    share = [render_conversation(r) for k, r in enumerate(iter_sharegpt())
             if args.train_offset <= k < args.train_offset + 20 * args.train_texts]
    texts = split_texts(edge.tokenizer, share, "sharegpt", args.prefix, args.cont, args.train_texts)
    start = time.perf_counter()
    examples = prepare(edge, cloud, texts, trained, args.target)
    print(f"{len(examples)} training texts ({args.prefix}+{args.cont} tokens), mapping {mapping}, m={args.m}, "
          f"target {args.target}; prepared in {time.perf_counter() - start:.0f} s")

    deadline = time.perf_counter() + 60 * args.minutes
    with Progress(TextColumn("train"), BarColumn(), TextColumn("{task.fields[kl]}"), TimeElapsedColumn()) as bar:
        task = bar.add_task("train", total=args.max_steps, kl="")

        log = train(edge, trained, examples, m=args.m, steps=args.max_steps, lr=args.lr, sink=args.sink,
                    checkpoint=args.out, every=25, pair=(cloud.fingerprint, edge.fingerprint),
                    on_step=lambda step, e: bar.update(task, completed=step, kl=f"step {step} KL {e['kl']:.4f}"),
                    stop=lambda step: time.perf_counter() > deadline)
    window = max(1, len(examples))
    first = sum(e["kl"] for e in log[:window]) / min(window, len(log))
    last = sum(e["kl"] for e in log[-window:]) / min(window, len(log))
    print(f"{len(log)} steps: mean training KL over the first {window} steps {first:.4f}, last {window} {last:.4f}")


if __name__ == "__main__":
    main()
