"""reports/shared-prefix: the shared-prefix strategies of an eval run (issue 37) against EdgePrompt's exact KV,
paired per request, with each condition's share of the EdgePrompt → cloud gap, each shipped condition's share of
oracle-kv's gain (where oracle-kv ran), and the decomposition of the cloud's lead (each model with and without the
system prompt).

    python -m bench.shared_prefix_report reports/shared-prefix RUN_DIR [RUN_DIR ...] [--prefix runs/shared-prefix]
        [--held-out-source RUN_DIR]   # edgeprompt-shared there: a prefix trained without that source
        [--variant NAME=RUN_DIR ...]  # edgeprompt-shared there under another prefix (e.g. k64): edgeprompt-shared@NAME
        [--against NAME]              # the variants' contrasts against variant NAME (a control), not the shipped prefix
        [--fuser NAME=RUN_DIR ...]    # ce-lslm-fuse-shared there with another fuser (e.g. one trained under the
                                      # prefix): fuse-shared@NAME, against fuse-shared and edgeprompt-shared
        [--exclude DATASET:ID ...]    # a request left out of every cell (one some condition's training text holds)
        [--request DATASET:ID ...]    # that request's Δ vs EdgePrompt under every condition (a rule that names it)
        [--only CONDITION ...]        # only these conditions (and the cloud, the gaps' ceiling): the requests all of
                                      # them answered, when another condition ran on a few requests only
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bench.distill_report import REFERENCE, Spec, common_gap, write_distill_report
from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.eval.stats import cell_seed

HELD_OUT = "edgeprompt-shared-held-out-source"  # the prefix trained without this source's prompts (--held-out-source)
CONDITIONS = {"edgeprompt-shared": "edgeprompt-shared", "edgeprompt-shared-gated": "edgeprompt-shared-gated",
              HELD_OUT: HELD_OUT, "distill": "ce-lslm-distill",
              "distill-shared": "ce-lslm-distill-shared", "distill-c8-shared": "ce-lslm-distill-shared@c8",
              "distill-c8-shared-recall": "ce-lslm-distill-shared:recall@c8",
              "distill-c4-shared": "ce-lslm-distill-shared@c4", "distill-c2-shared": "ce-lslm-distill-shared@c2",
              # 8x fewer bytes by bits: every token at 2 bits, 35 % of key channels pruned (twelfth session)
              "edgeprompt-shared-int2": "edgeprompt-shared@0.35/int2",
              "distill-shared-int2": "ce-lslm-distill-shared@0.35/int2",
              "distill-shared-qat-int2": "ce-lslm-distill-shared:qat@0.35/int2",
              "distill-shared-qat-s96-int2": "ce-lslm-distill-shared:qat@s96/0.35/int2",
              # the same 2-bit student taught by the edge on the prefix: the codec's share (twentieth session)
              "selfdistill-shared-qat-int2": "edgeprompt-shared-selfdistill:qat@0.35/int2",
              "fuse": "ce-lslm-fuse", "fuse-shared": "ce-lslm-fuse-shared",
              "notes": "notes", "prefix-sft": "prefix-sft", "oracle-kv": "oracle-kv",
              "cloud": "cloud-only", "edge": "edge-only", "cloud-nosys": "cloud-nosys", "edge-nosys": "edge-nosys"}
CONTRASTS = {"distill-shared - distill": ("distill-shared", "distill"),
             "distill-shared - edgeprompt-shared": ("distill-shared", "edgeprompt-shared"),
             "edgeprompt-shared-gated - edgeprompt-shared": ("edgeprompt-shared-gated", "edgeprompt-shared"),
             "fuse-shared - edgeprompt-shared": ("fuse-shared", "edgeprompt-shared"),
             "fuse-shared - fuse": ("fuse-shared", "fuse"),
             "distill-c8-shared-recall - distill-c8-shared": ("distill-c8-shared-recall", "distill-c8-shared"),
             "edgeprompt-shared-int2 - edgeprompt-shared": ("edgeprompt-shared-int2", "edgeprompt-shared"),
             "distill-shared-qat-int2 - distill-shared-int2": ("distill-shared-qat-int2", "distill-shared-int2"),
             "distill-shared-qat-int2 - distill-c8-shared": ("distill-shared-qat-int2", "distill-c8-shared"),
             "distill-shared-qat-int2 - edgeprompt-shared-int2": ("distill-shared-qat-int2", "edgeprompt-shared-int2"),
             "distill-shared-qat-s96-int2 - distill-shared-qat-int2": ("distill-shared-qat-s96-int2",
                                                                       "distill-shared-qat-int2"),
             "distill-shared-qat-int2 - edgeprompt-shared": ("distill-shared-qat-int2", "edgeprompt-shared"),
             "selfdistill-shared-qat-int2 - edgeprompt-shared": ("selfdistill-shared-qat-int2", "edgeprompt-shared"),
             "distill-shared-qat-int2 - selfdistill-shared-qat-int2": ("distill-shared-qat-int2",
                                                                       "selfdistill-shared-qat-int2")}
SHIPPED = ("edgeprompt-shared", "edgeprompt-shared-gated", "distill", "distill-shared", "distill-c8-shared", "fuse")
# gap shares reported, not shipped (oracle-kv: a bound; the recall and 2-bit students: candidates until their rules
# are met; the P/4 and P/2 students: how much a longer student recovers)
BESIDE = (HELD_OUT, "notes", "prefix-sft", "oracle-kv", "distill-c8-shared-recall", "distill-c4-shared",
          "distill-c2-shared", "edgeprompt-shared-int2", "distill-shared-int2", "distill-shared-qat-int2",
          "distill-shared-qat-s96-int2", "selfdistill-shared-qat-int2", "fuse-shared")
VARIANT = "edgeprompt-shared@"  # a --variant's condition: edgeprompt-shared under another prefix, VARIANT + NAME
FUSER = "fuse-shared@"  # a --fuser's condition: ce-lslm-fuse-shared with another fuser, FUSER + NAME
SHARED = Spec(CONDITIONS, CONTRASTS, {f"gap_closed_by_{c}": c for c in SHIPPED + BESIDE}, REFERENCE)


def decomposition(rows: list[dict]) -> dict:
    """Per source, mean reference NLL of the cloud and the edge with and without the system prompt, and what
    reading it saves each (nats/token; the requests all four answered)."""
    out = {}
    need = ("cloud-only", "edge-only", "cloud-nosys", "edge-nosys")  # a tuple: summary.json's key order is fixed
    for source in dict.fromkeys(r["dataset"] for r in rows):
        nll: dict[str, dict[str, float]] = {}
        for r in rows:
            if r["dataset"] == source and r["strategy"] in need and r.get("ref_nll") is not None:
                nll.setdefault(r["strategy"], {})[r["id"]] = r["ref_nll"]
        ids = set.intersection(*(set(nll.get(s, {})) for s in need))
        if not ids:
            continue
        m = {s: sum(nll[s][i] for i in ids) / len(ids) for s in need}
        out[source] = {"n": len(ids), **{f"{s}_nll": v for s, v in m.items()},
                       "cloud_lead_without_prompt": m["edge-nosys"] - m["cloud-nosys"],
                       "cloud_lead_with_prompt": m["edge-only"] - m["cloud-only"],
                       "prompt_saves_edge": m["edge-nosys"] - m["edge-only"],
                       "prompt_saves_cloud": m["cloud-nosys"] - m["cloud-only"]}
    return out


def share_of_oracle(rows: list[dict], conditions: dict[str, str]) -> dict:
    """Per source, what each shipped condition (and each --variant's prefix) gains over EdgePrompt as a share of
    oracle-kv's gain on the same requests, (EdgePrompt − condition) / (EdgePrompt − oracle-kv), with its paired
    bootstrap interval (goal (4): ≥ 50 %); the cloud's NLL cancels, so it is the ratio of the two gap shares."""
    out: dict[str, dict] = {}
    for source in dict.fromkeys(r["dataset"] for r in rows):
        nll = {(r["strategy"], r["id"]): r.get("ref_nll") for r in rows if r["dataset"] == source}
        # --only may leave some out; a --variant is a shipped strategy under another prefix
        for cond in [c for c in SHIPPED if c in conditions] + [c for c in conditions if c.startswith(VARIANT)]:
            gap = common_gap(nll, REFERENCE, conditions[cond], "oracle-kv", cell_seed(0, source, "oracle", cond))
            if gap is not None:
                out.setdefault(source, {})[cond] = gap
    return out


def per_request(rows: list[dict], conditions: dict[str, str], picks: set[tuple[str, str]]) -> dict:
    """Each picked request's Δ reference NLL vs EdgePrompt under every condition that answered it (nats/token);
    None for a request EdgePrompt did not answer in these runs (nothing to pair with)."""
    nll = {(r["dataset"], r["id"], r["strategy"]): r.get("ref_nll") for r in rows}
    out: dict[str, dict[str, float] | None] = {}
    for d, i in sorted(picks):
        base = nll.get((d, i, REFERENCE))
        out[f"{d}:{i}"] = None if base is None else {
            c: v - base for c, s in conditions.items() if (v := nll.get((d, i, s))) is not None}
    return out


def gate_split(rows: list[dict], ungated: str = "edgeprompt-shared") -> dict:
    """Per source, where the gate (`edgeprompt-shared-gated`) read the prefix (its request read more tokens than
    EdgePrompt's) and where it declined it, with the ungated prefix's mean Δ vs EdgePrompt on each part (`ungated`:
    the condition that reads the gated prefix on every request): a gate worth its cloud seconds declines where the
    prefix hurts and reads where it helps."""
    out: dict[str, dict] = {}
    for source in dict.fromkeys(r["dataset"] for r in rows):
        by = {(r["strategy"], r["id"]): r for r in rows if r["dataset"] == source}
        parts: dict[str, list[float]] = {"read": [], "declined": []}
        for (s, i), g in by.items():
            ep, shared = by.get(("edgeprompt", i)), by.get((ungated, i))
            if s != "edgeprompt-shared-gated" or ep is None or shared is None:
                continue
            part = "read" if g["system_tokens"] > ep["system_tokens"] else "declined"
            parts[part].append(shared["ref_nll"] - ep["ref_nll"])
        if parts["read"] or parts["declined"]:
            out[source] = {part: {"n": len(d), "ungated_delta_mean": sum(d) / len(d) if d else None}
                           for part, d in parts.items()}
    return out


def with_variants(spec: Spec, names: list[str], against: str | None = None) -> Spec:
    """`spec` plus one condition per prefix variant (edgeprompt-shared under another prefix), its gap share, and its
    paired contrast with the shipped prefix, or with variant `against` (an ablation's control: trained on the same
    teacher sets) where given; the control itself is contrasted with the shipped prefix."""
    added = {VARIANT + n: VARIANT + n for n in names}
    base = "edgeprompt-shared"
    if against is not None:
        base = VARIANT + against
        if base not in added:
            raise EdgeKVError(f"--against {against}: no --variant of that name")
    pairs = {c: base if c != base else "edgeprompt-shared" for c in added}  # the control: against the shipped one
    contrasts = {f"{c} - {b}": (c, b) for c, b in pairs.items()}
    return replace(spec, conditions={**spec.conditions, **added}, contrasts={**spec.contrasts, **contrasts},
                   gaps={**spec.gaps, **{f"gap_closed_by_{c}": c for c in added}})


def with_fusers(spec: Spec, names: list[str]) -> Spec:
    """`spec` plus one condition per --fuser (the fuse export under the prefix with another fuser), its gap share,
    and its paired contrasts with the shipped fuser under the prefix, with the prefix alone and with each --fuser
    named before it (a control given second is contrasted with the fuser it controls)."""
    added = {FUSER + n: FUSER + n for n in names}
    fusers = list(added)
    contrasts = {f"{c} - {b}": (c, b) for i, c in enumerate(added)
                 for b in ("fuse-shared", "edgeprompt-shared", *fusers[:i])}
    return replace(spec, conditions={**spec.conditions, **added}, contrasts={**spec.contrasts, **contrasts},
                   gaps={**spec.gaps, **{f"gap_closed_by_{c}": c for c in added}})


def only(spec: Spec, names: list[str]) -> Spec:
    """`spec` reduced to the conditions `names` and the cloud (the gaps' ceiling), with the contrasts and gap
    shares among them."""
    if unknown := set(names) - set(spec.conditions):
        raise EdgeKVError(f"--only: no condition {', '.join(sorted(unknown))} (choose from "
                          f"{', '.join(spec.conditions)})")
    keep = {c: s for c, s in spec.conditions.items() if c in names or c == "cloud"}
    return replace(spec, conditions=keep,
                   contrasts={k: (a, b) for k, (a, b) in spec.contrasts.items() if a in keep and b in keep},
                   gaps={k: c for k, c in spec.gaps.items() if c in keep})


def request_keys(given: list[str]) -> set[tuple[str, str]]:
    """DATASET:ID flags as (dataset, id) pairs (an empty side is left for the caller to refuse)."""
    return {(d, i) for d, _, i in (g.partition(":") for g in given)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--prefix", type=Path, default=None, help="the shared prefix's training folder (report.json)")
    ap.add_argument("--held-out-source", type=Path, default=None,
                    help="a run of edgeprompt-shared under a prefix trained without that run's source")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="a run of edgeprompt-shared under another prefix, reported as edgeprompt-shared@NAME")
    ap.add_argument("--against", default=None, metavar="NAME",
                    help="contrast the variants with variant NAME (a control) instead of the shipped prefix")
    ap.add_argument("--fuser", action="append", default=[], metavar="NAME=RUN_DIR",
                    help="a run of ce-lslm-fuse-shared with another fuser, reported as fuse-shared@NAME")
    ap.add_argument("--gated", default=None, metavar="NAME",
                    help="the gated runs read variant NAME's prefix: split the gate's requests by its rows")
    ap.add_argument("--exclude", action="append", default=[], metavar="DATASET:ID",
                    help="leave this request out of every cell (its source's excluded_requests in summary.json)")
    ap.add_argument("--request", action="append", default=[], metavar="DATASET:ID",
                    help="report this request's Δ vs EdgePrompt under every condition (summary.json's requests)")
    ap.add_argument("--only", action="append", default=[], metavar="CONDITION",
                    help="compare only these conditions (and the cloud): the requests all of them answered")
    args = ap.parse_args()
    exclude, picks = request_keys(args.exclude), request_keys(args.request)
    if any(not d or not i for d, i in exclude | picks):
        ap.error("--exclude and --request take DATASET:ID")
    runs, relabel = list(args.runs), {}
    if args.held_out_source is not None:
        runs.append(args.held_out_source)
        relabel[args.held_out_source] = {"edgeprompt-shared": HELD_OUT}
    variants, fusers = [v.partition("=") for v in args.variant], [v.partition("=") for v in args.fuser]
    if any(not name or not run for name, _, run in variants):
        ap.error("--variant takes NAME=RUN_DIR")
    if any(not name or not run for name, _, run in fusers):
        ap.error("--fuser takes NAME=RUN_DIR")
    for name, _, run in fusers:
        runs.append(Path(run))
        relabel[Path(run)] = {"ce-lslm-fuse-shared": FUSER + name}
    for name, _, run in variants:
        runs.append(Path(run))
        relabel[Path(run)] = {"edgeprompt-shared": VARIANT + name}
    ungated = "edgeprompt-shared" if args.gated is None else VARIANT + args.gated  # the gated prefix
    try:
        if args.gated is not None and args.gated not in [name for name, _, _ in variants]:
            raise EdgeKVError(f"--gated {args.gated}: no --variant of that name")
        spec = with_fusers(with_variants(SHARED, [name for name, _, _ in variants], args.against),
                           [name for name, _, _ in fusers])
        if args.only:
            spec = only(spec, args.only)
        if args.gated is not None:  # the gate against the prefix it gated, read on every request
            contrasts = {k: v for k, v in spec.contrasts.items() if v[0] != "edgeprompt-shared-gated"}
            spec = replace(spec, contrasts={**contrasts, f"edgeprompt-shared-gated - {ungated}":
                                            ("edgeprompt-shared-gated", ungated)})
        summary = write_distill_report(runs, args.out, spec=spec, relabel=relabel, exclude=exclude)
    except EdgeKVError as exc:
        raise SystemExit(f"error: {exc}") from None
    rows = [json.loads(line) for line in (args.out / "rows.jsonl").read_text(encoding="utf-8").splitlines() if line]
    extra = {"decomposition": decomposition(rows), "share_of_oracle": share_of_oracle(rows, spec.conditions)}
    if picks:
        extra["requests"] = per_request(rows, spec.conditions, picks)
    if gates := gate_split(rows, ungated):
        extra["gate"] = gates
    if args.prefix is not None:
        report = json.loads((args.prefix / "report.json").read_text(encoding="utf-8"))
        manifest = json.loads((Path(report["out"]) / "manifest.json").read_text(encoding="utf-8"))
        extra["shared_prefix"] = {**report["shared_prefix"], "teach_s": report["teach_s"],
                                  "train_s": report["train_s"], "synthetic_samples": report["synthetic_samples"],
                                  # text targets read back from an earlier run: teach_s holds their recorded seconds,
                                  # except for the unrecorded ones (kept before the record existed)
                                  "targets_read_back": report.get("targets_read_back", 0),
                                  "targets_read_back_without_seconds": report.get("targets_read_back_without_seconds"),
                                  "train_s_all_processes": report.get("train_s_all_processes"),
                                  "bytes": sum(e["bytes"] for e in manifest["layers"]),
                                  "fingerprint": manifest["manifest_sha256"]}
    summary = {**summary, **extra}
    write_text_atomic(args.out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
