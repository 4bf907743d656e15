"""Train a `fuse-bias` fuser on the default pair (or the self-fusion control) and choose its hard gates.

    python -m bench.train_fuser [--m 12] [--mapping last-aligned|uniform|similarity] [--similarity FILE]
                                [--train-texts 160] [--heldout-texts 24] [--minutes 10] [--self] [--out DIR]

Maps: the `hidden` translator fitted on ShareGPT conversations 0..31. Training texts: ShareGPT conversations
from --train-offset (100) on; gate-choice texts from --gate-offset (1500) on; both before the fidelity bench's
held-out texts (2000 on) and the eval's (5000 on). Features (own KV, translated KV, the cloud's top-k) are cached
under --cache. `--self` trains the same fuser edge → edge (the adapter-only control). Writes DIR/translator.*
(the fuser, with its hard gates), gates.json, log.json and loss_curve.png. Resumable: rerun with the same --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.fidelity import full_depth_pairs
from edgekv.align.align_job import tokenize
from edgekv.align.mapping import MappingParams, build_mapping
from edgekv.kv.fuser_training import choose_gates, prepare, train
from edgekv.kv.fusers import BiasFuser
from edgekv.kv.translators import HiddenTranslator, save_translator
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.plots import loss_curve
from edgekv.texts import iter_sharegpt, render_conversation, sharegpt_texts, split_texts


def pairs_for(mapping: str, similarity: str | None, n_cloud: int, n_edge: int, m: int) -> list[tuple[int, int]]:
    """(edge layer, cloud layer) for edge layers ≥ m."""
    if mapping == "similarity":
        pairs, _ = full_depth_pairs(similarity, n_cloud, n_edge)
        return [(i, j) for i, j in pairs if i >= m]
    zeros = {k: torch.zeros(n_cloud, n_edge) for k in ("linear_cka", "debiased_cka", "rsa")}
    return [(p["edge_layer"], p["cloud_layer"]) for p in build_mapping(mapping, zeros, MappingParams(m))["pairs"]]


def sharegpt_split(tokenizer, offset: int, count: int, prefix: int, cont: int):
    records = [render_conversation(r) for k, r in enumerate(iter_sharegpt()) if offset <= k < offset + 20 * count]
    return split_texts(tokenizer, records, "sharegpt", prefix, cont, count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=12)
    ap.add_argument("--mapping", default="last-aligned", choices=["last-aligned", "uniform", "similarity"])
    ap.add_argument("--similarity", default=None)
    ap.add_argument("--self", dest="self_fuse", action="store_true", help="edge → edge (adapter-only control)")
    ap.add_argument("--train-texts", type=int, default=160)
    ap.add_argument("--heldout-texts", type=int, default=24)
    ap.add_argument("--train-offset", type=int, default=100)
    ap.add_argument("--gate-offset", type=int, default=1500)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--cont", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ce-weight", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default="runs/fuser-cache")
    ap.add_argument("--out", default="runs/fuser-m12")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    out = Path(args.out)

    edge = load_model("default-edge")
    cloud = edge if args.self_fuse else load_model("default-cloud")
    pairs = pairs_for(args.mapping, args.similarity, cloud.num_layers, edge.num_layers, args.m)
    seqs = tokenize(edge.tokenizer, sharegpt_texts(32).texts, 256, min_tokens=2)
    with torch.no_grad():
        hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                        capture(edge.model, seqs, ("hidden_in",)), pairs, edge.model)
    fuser = BiasFuser.from_hidden(hidden, edge.model)
    pair = (cloud.fingerprint, edge.fingerprint)
    train_texts = sharegpt_split(edge.tokenizer, args.train_offset, args.train_texts, args.prefix, args.cont)
    gate_texts = sharegpt_split(edge.tokenizer, args.gate_offset, args.heldout_texts, args.prefix, args.cont)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[note]}"))
    with Progress(*columns) as bar:
        start = time.perf_counter()
        task = bar.add_task("features", total=len(train_texts) + len(gate_texts), note="")
        examples = prepare(edge, cloud, train_texts, fuser, pair, args.top_k, args.cache,
                           on_text=lambda n: bar.update(task, completed=n))
        held = prepare(edge, cloud, gate_texts, fuser, pair, args.top_k, args.cache,
                       on_text=lambda n: bar.update(task, completed=len(train_texts) + n))
        prepared_s = time.perf_counter() - start
        deadline = time.perf_counter() + 60 * args.minutes
        task = bar.add_task("train", total=args.steps, note="")

        def show(step, entry):
            note = f"loss {entry['train_loss']:.4f}"
            if "held_out_kl" in entry:
                note += f"  held-out KL {entry['held_out_kl']:.4f} NLL {entry['held_out_nll']:.4f}"
            bar.update(task, completed=step, note=note)

        log = train(edge, fuser, examples, held, args.steps, lr=args.lr, ce_weight=args.ce_weight, seed=args.seed,
                    checkpoint=out, every=25, on_step=show, stop=lambda s: time.perf_counter() > deadline, pair=pair)
        trained_s = time.perf_counter() - start - prepared_s
    gates = choose_gates(edge, fuser, held)
    save_translator(fuser, out, *pair)  # now with its hard gates
    gates.update({"mapping": args.mapping, "pairs": pairs, "self_fuse": args.self_fuse, "m": args.m,
                  "train_texts": len(examples), "gate_texts": len(held), "prepare_s": prepared_s,
                  "train_s": trained_s, "steps": log[-1]["step"],
                  "gate_bias": {str(i): b.tolist() for i, b in fuser.gate_bias.items()}})
    (out / "gates.json").write_text(json.dumps(gates, indent=1))
    (out / "log.json").write_text(json.dumps(log))
    loss_curve(log, out / "loss_curve.png", f"fuse-bias {'edge→edge' if args.self_fuse else 'cloud→edge'}, "
                                            f"m={args.m}, {args.mapping}, {len(examples)} texts")
    print(json.dumps({k: v for k, v in gates.items() if k != "leave_one_out_nll"}, indent=1))


if __name__ == "__main__":
    main()
