"""Bench cross-model KV translation on the default pair: edge NLL on held-out continuations, with controls.

    python bench/fidelity.py [--texts 32] [--prefix 256] [--cont 64] [--splits 0,8,12,16,20] [--sink 1]
                             [--similarity runs/align-default/similarity.json] [--out runs/fidelity]
                             [--fusers fuse=DIR,self-fuse=DIR] [--replace hidden]
                             [--strategy last-aligned] [--also-mapping similarity]

Translators are fitted on ShareGPT calibration conversations (file order from 0); held-out texts are ShareGPT
conversations from record --heldout-offset on and XSum documents (data/xsum), reported separately. Prints one
table per source: rows = conditions, columns = split layer m, cells = mean NLL (nats/token) ± standard error
over texts, then the same for top-1 agreement with the edge's full prefill and with the cloud. With --fusers it
also scores each fuser and `fuse-closed` (the fused path, every gate closed), and summary.json becomes, per source
and condition, {n, delta_mean, delta_ci95} of the paired NLL difference to the edge's own prefill (95 % t-interval;
the per-condition details go to details.json). --also-mapping fits the translators under a second layer mapping
too (`replace@<mapping>` in summary.json): the mapping comparison on the same texts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.progress import Progress

from bench.fidelity_harness import context_gain, delta_ci95, evaluate_text, paired_delta, summarize
from edgekv.align.mapping import MappingParams, build_mapping
from edgekv.kv.registry import TRANSLATORS, load_translator
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.plots import interval_plot
from edgekv.texts import iter_sharegpt, render_conversation, sharegpt_texts, split_texts, tokenize, xsum_documents

ROOT = Path(__file__).resolve().parents[1]


def full_depth_pairs(similarity: str | None, n_cloud: int, n_edge: int,
                     strategy: str | None = None) -> tuple[list[tuple[int, int]], str]:
    """A mapping for every edge layer (m = 0): the similarity strategy on align's matrices, else `strategy`
    (uniform by default; last-aligned is C2C's rule)."""
    if similarity and strategy in (None, "similarity"):
        sim = json.loads(Path(similarity).read_text())
        matrices = {k: torch.tensor(sim["metrics"][k], dtype=torch.float64)
                    for k in ("linear_cka", "debiased_cka", "rsa")}
        name = "similarity"
    else:
        matrices = {k: torch.zeros(n_cloud, n_edge) for k in ("linear_cka", "debiased_cka", "rsa")}
        name = strategy or "uniform"
    mapping = build_mapping(name, matrices, MappingParams(0))
    return [(p["edge_layer"], p["cloud_layer"]) for p in mapping["pairs"]], name


def table(summary: list[dict], source: str, key: str, splits: list[int]) -> str:
    conditions = sorted({s["condition"] for s in summary if s["source"] == source},
                        key=lambda c: (c not in ("edge", "cloud", "no-prefix", "cloud-no-prefix"), c))
    cell = {(s["condition"], s["m"]): s for s in summary if s["source"] == source}
    lines = [f"{source}: {key} (mean ± s.e. over {next(iter(cell.values()))['texts']} texts)",
             f"{'condition':<14}" + "".join(f"{'m=' + str(m):>16}" for m in splits)]
    for c in conditions:
        if (c, None) in cell:
            s = cell[(c, None)]
            lines.append(f"{c:<14}{s[key]:>9.3f} ± {s[key + '_se']:.3f}" + " (no split)")
        else:
            lines.append(f"{c:<14}" + "".join(f"{cell[(c, m)][key]:>9.3f} ± {cell[(c, m)][key + '_se']:.3f}"
                                               if (c, m) in cell else f"{'–':>16}" for m in splits))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--cont", type=int, default=64)
    ap.add_argument("--splits", default="0,8,12,16,20")
    ap.add_argument("--sink", default="1", help="first s prefix tokens kept local; a list (0,1,4) compares them")
    ap.add_argument("--translators", default="ridge,hidden")
    ap.add_argument("--calib-texts", type=int, default=32)
    ap.add_argument("--calib-tokens", type=int, default=256)
    ap.add_argument("--heldout-offset", type=int, default=2000)
    ap.add_argument("--similarity", default=None)
    ap.add_argument("--strategy", default=None, help="uniform or last-aligned mapping (without --similarity)")
    ap.add_argument("--also-mapping", default=None, choices=("uniform", "last-aligned", "similarity"),
                    help="fit the translators under this mapping too (uniform|last-aligned|similarity; similarity "
                         "reads --similarity): conditions '<translator>@<mapping>', on the same texts and cloud pass")
    ap.add_argument("--out", default="runs/fidelity")
    ap.add_argument("--trained", default=None,
                    help="checkpoints of bench/train_translator.py to evaluate too: PATH or NAME=PATH,NAME=PATH")
    ap.add_argument("--fusers", default=None,
                    help="fusers of `edgekv train-fuser`: NAME=DIR,... (e.g. fuse=runs/fuser-bias-m12,self-fuse=...)")
    ap.add_argument("--replace", default="hidden", help="the translator reported as `replace` beside the fusers")
    ap.add_argument("--primary", default=None, help="the fuser also reported as `fuse` (and self-NAME as `self-fuse`)")
    ap.add_argument("--mismatched", action="store_true",
                    help="also feed each cloud fuser the cloud KV of the previous text of the same source "
                         "('<fuser>@mismatched'; the first text of each source has none)")
    args = ap.parse_args()
    if args.also_mapping == "similarity" and not args.similarity:  # before minutes of model loading and capture
        ap.error("--also-mapping similarity needs --similarity (align's similarity.json)")
    splits = [int(m) for m in args.splits.split(",")]
    sinks = [int(x) for x in args.sink.split(",")]
    torch.manual_seed(0)

    cloud, edge = load_model("default-cloud"), load_model("default-edge")
    pairs, mapping_name = full_depth_pairs(args.similarity, cloud.num_layers, edge.num_layers, args.strategy)
    calib = sharegpt_texts(args.calib_texts, offset=0)
    seqs = tokenize(edge.tokenizer, calib.texts, args.calib_tokens, min_tokens=2)
    start = time.perf_counter()
    features = sorted({f for name in args.translators.split(",") for f in TRANSLATORS[name].features})
    with torch.no_grad():
        c_cal, e_cal = capture(cloud.model, seqs, features), capture(edge.model, seqs, features)
    # the mapping comparison (--also-mapping) shares the calibration, the held-out texts and the cloud pass
    mappings = {"": pairs}
    if args.also_mapping:
        alt_pairs, alt = full_depth_pairs(args.similarity, cloud.num_layers, edge.num_layers, args.also_mapping)
        mappings[f"@{alt}"] = alt_pairs
    translators = {name + tag: TRANSLATORS[name]().fit(c_cal, e_cal, layer_pairs, edge.model)
                   for tag, layer_pairs in mappings.items() for name in args.translators.split(",")}
    del c_cal, e_cal
    for item in (args.trained.split(",") if args.trained else []):
        name, _, path = item.rpartition("=")
        translators[name or "trained"] = load_translator(path, cloud.fingerprint, edge.fingerprint)
    fusers = {}
    for item in (args.fusers.split(",") if args.fusers else []):
        name, _, path = item.partition("=")
        fuser = load_translator(path, None, edge.fingerprint)
        if not fuser.self_fuse:  # a cloud → edge fuser must be for this cloud too
            fuser = load_translator(path, cloud.fingerprint, edge.fingerprint)
        fusers[name] = fuser
        print(f"  fuser {name}: {fuser.name}, open layers {fuser.open_layers()}"
              f"{' (self-fusion: edge → edge)' if fuser.self_fuse else ''}")
    print(f"calibration: {calib.description}; {len(seqs)} texts; mapping {mapping_name} from m=0; "
          f"fit in {time.perf_counter() - start:.0f} s")
    for name, t in translators.items():
        print(f"  {name}: " + ", ".join(f"{i}←{v['cloud_layer']} " + " ".join(
            f"{k}={v[k]:.2f}" for k in v if k.startswith("r2")) for i, v in sorted(t.info.items())))

    share = [render_conversation(r) for k, r in enumerate(iter_sharegpt()) if k >= args.heldout_offset]
    heldout = (split_texts(edge.tokenizer, share, "sharegpt", args.prefix, args.cont, args.texts)
               + split_texts(edge.tokenizer, xsum_documents(ROOT / "data/xsum/xsum_sample.jsonl"), "xsum",
                             args.prefix, args.cont, args.texts))
    rows = []
    with Progress() as progress:
        task = progress.add_task("held-out texts", total=len(heldout))
        previous: dict = {}  # the last text's cloud activations, per source (the mismatched control)
        for n, text in enumerate(heldout):
            keep: dict = {}
            rows += evaluate_text(edge, cloud, text, translators, splits, sinks, seed=n, text_id=n, fusers=fusers,
                                  mismatched=previous.get(text.source) if args.mismatched else None, keep=keep)
            previous[text.source] = keep["cloud_acts"]
            progress.advance(task)
    summary = summarize(rows) + [dict(d, nll=d["delta_nll"], nll_se=d["delta_nll_se"],
                                      condition="Δ " + d["condition"]) for d in paired_delta(rows)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # with fusers, summary.json is the paired-Δ table below and these details move to details.json
    details = {"args": vars(args), "mapping": mapping_name, "pairs": pairs,
               "fit": {k: t.info for k, t in translators.items()}, "summary": summary}
    (out / ("details.json" if fusers else "summary.json")).write_text(json.dumps(details, indent=1))
    if fusers:  # paired Δ NLL with 95 % intervals, in the shape reports/fidelity-fuse/summary.json has
        m = min(min(f.info) for f in fusers.values())
        names = {("edge", None): "edge", ("cloud", None): "cloud", ("no-prefix", None): "no-prefix",
                 ("cloud-no-prefix", None): "cloud-no-prefix",
                 (args.replace, m): "replace", (f"noise:{args.replace}", m): "noise", ("fuse-closed", m): "fuse-closed",
                 **({(f"{args.replace}@{alt}", m): f"replace@{alt}", (f"noise:{args.replace}@{alt}", m): f"noise@{alt}"}
                    if args.also_mapping else {}),
                 **{(name, min(f.info)): name for name, f in fusers.items()},
                 **{(f"{name}@mismatched", min(f.info)): f"{name}@mismatched" for name, f in fusers.items()
                    if args.mismatched and not f.self_fuse}}
        ci = delta_ci95(rows, names)
        if args.primary:  # the default fuser is also reported as `fuse`, its self-fusion control as `self-fuse`
            for conditions in ci.values():
                for alias, name in (("fuse", args.primary), ("self-fuse", f"self-{args.primary}"),
                                    ("fuse@mismatched", f"{args.primary}@mismatched")):
                    if name in conditions:
                        conditions[alias] = dict(conditions[name], of=name)
        (out / "summary.json").write_text(json.dumps(ci, indent=1))
        interval_plot(ci, out / "delta_nll.png", "Δ NLL vs the edge's own prefill (nats/token, 95 % CI)")
        for source, conditions in ci.items():
            print(f"{source}: Δ NLL vs the edge's own prefill (nats/token), 95 % t-interval")
            for name, c in conditions.items():
                print(f"  {name:<14} n={c['n']:<4} {c['delta_mean']:+.4f}  "
                      f"[{c['delta_ci95'][0]:+.4f}, {c['delta_ci95'][1]:+.4f}]")
    gain = context_gain(rows)  # how much of the cloud's lead is its reading of the prefix
    (out / "context_gain.json").write_text(json.dumps(gain, indent=1))
    interval_plot(gain, out / "context_gain.png", "NLL saved by reading the prefix (95 % CI); cloud-extra = "
                  "cloud − edge", xlabel="nats/token")
    for source, g in gain.items():
        print(f"{source}: NLL saved by reading the prefix (nats/token, 95 % t-interval): " + ", ".join(
            f"{k} {c['delta_mean']:+.4f} [{c['delta_ci95'][0]:+.4f}, {c['delta_ci95'][1]:+.4f}]" for k, c in g.items()))
    for source in ("sharegpt", "xsum"):
        for key in ("nll", "top1_edge", "top1_cloud"):
            print(table([s for s in summary if key == "nll" or not s["condition"].startswith("Δ")], source, key,
                        splits))
            print()


if __name__ == "__main__":
    main()
