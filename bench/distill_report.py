"""reports/distill: the distilled strategies of an eval run against EdgePrompt's exact full KV, paired per request.

Conditions (issue "the cloud teaches the edge's system-prompt KV"): `distill` (P' = P, cloud), `distill-c8`
(P/8, cloud), `self-distill-c8` (P/8, self), `truncate-c8` (the P/8 student untrained), `distill-nosum` (no
summarising seed instruction), `distill-v1` (the recipe shipped before issue 34), `fuse` (the shipped fuser),
`cloud` (the ceiling), `edge` (the edge alone on the whole prompt: EdgePrompt's NLL up to the splice's rounding).
Δ = reference NLL − EdgePrompt's on the same request, with a seeded bootstrap 95 % interval.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.eval.datasets import record_of_request
from edgekv.eval.runs import read_results
from edgekv.eval.stats import cell_seed, gap_closed, paired_bootstrap
from edgekv.plots import interval_plot
from edgekv.summary import mean, median

CONDITIONS = {"distill": "ce-lslm-distill", "distill-c8": "ce-lslm-distill@c8",
              "self-distill-c8": "edgeprompt-selfdistill@c8", "truncate-c8": "edgeprompt-truncate@c8",
              "distill-nosum": "ce-lslm-distill:nosum", "distill-v1": "ce-lslm-distill:v1", "fuse": "ce-lslm-fuse",
              "cloud": "cloud-only", "edge": "edge-only"}
REFERENCE = "edgeprompt"
CONTRASTS = {"distill - fuse": ("distill", "fuse"), "distill - distill-v1": ("distill", "distill-v1"),
             "distill-c8 - self-distill-c8": ("distill-c8", "self-distill-c8"),
             "distill-c8 - truncate-c8": ("distill-c8", "truncate-c8")}


@dataclass(frozen=True)
class Spec:
    """What a report compares: condition → strategy, named contrasts (condition a − condition b), and the
    conditions whose share of the gap from `gap_from` (a strategy) to the cloud is reported."""

    conditions: dict[str, str]
    contrasts: dict[str, tuple[str, str]] = field(default_factory=dict)
    gaps: dict[str, str] = field(default_factory=dict)  # summary key → condition
    gap_from: str = "edge-only"


DISTILL = Spec(CONDITIONS, CONTRASTS, {f"gap_closed_by_{c}": c for c in ("distill", "distill-v1", "fuse")})


def _paired(rows: list[dict], a: str, b: str, seed: int, *names: str) -> dict | None:
    """a − b over the requests (of one source) both answered; where some of them share a system prompt (MMLU's
    subjects), also the interval that resamples whole prompts (`delta_ci95_by_prompt`)."""
    by = {(r["strategy"], r["id"]): r.get("ref_nll") for r in rows}
    ids = sorted({r["id"] for r in rows if r["strategy"] == a} & {r["id"] for r in rows if r["strategy"] == b})
    if not ids:
        return None
    pairs = [by[(a, i)] for i in ids], [by[(b, i)] for i in ids]
    d = paired_bootstrap(*pairs, cell_seed(seed, *names))
    cell = {"n": d["n"], "delta_mean": d["delta_mean"], "delta_ci95": [d["ci95_lo"], d["ci95_hi"]]}
    prompts = [record_of_request(rows[0]["dataset"], i)[1] for i in ids]
    if len(set(prompts)) < len(prompts):
        c = paired_bootstrap(*pairs, cell_seed(seed, *names), clusters=prompts)
        cell["delta_ci95_by_prompt"] = [c["ci95_lo"], c["ci95_hi"]]
    return cell


def common_gap(nll: dict[tuple[str, str], float | None], start: str, method: str, ceiling: str,
               seed: int) -> dict | None:
    """`gap_closed` of `method` from `start` toward `ceiling` (strategies; `nll` keyed (strategy, id)) over the
    requests all three scored, or None where they share none."""
    have = lambda s: {i for t, i in nll if t == s and nll[t, i] is not None}  # noqa: E731
    ids = sorted(have(start) & have(method) & have(ceiling))
    if not ids:
        return None
    return gap_closed([nll[start, i] for i in ids], [nll[method, i] for i in ids], [nll[ceiling, i] for i in ids],
                      seed)


def distill_summary(rows: list[dict], seed: int = 0, spec: Spec = DISTILL) -> dict:
    """{source: {condition: {n, delta_mean, delta_ci95}, contrasts, gap_closed, bytes, cost}} per dataset that has
    EdgePrompt's rows (a source where only other strategies ran, e.g. oracle-kv alone, has nothing to compare)."""
    out: dict[str, dict] = {}
    every = {**spec.conditions, "edgeprompt": REFERENCE}
    for source in dict.fromkeys(r["dataset"] for r in rows):
        here = [r for r in rows if r["dataset"] == source]
        if not any(r["strategy"] == REFERENCE for r in here):  # nothing to pair against: no cells, not empty ones
            continue
        cells: dict[str, dict] = {}
        for cond, strategy in spec.conditions.items():
            p = _paired(here, strategy, REFERENCE, seed, source, cond)
            if p is not None:
                cells[cond] = p
        for name, (a, b) in spec.contrasts.items():
            p = _paired(here, spec.conditions[a], spec.conditions[b], seed, source, name)
            if p is not None:
                cells[name] = p
        nll = {(r["strategy"], r["id"]): r.get("ref_nll") for r in here}
        for key, cond in spec.gaps.items():
            gap = common_gap(nll, spec.gap_from, spec.conditions[cond], "cloud-only", cell_seed(seed, source))
            if gap is not None:
                cells[key] = gap
        cells["bytes_mean"] = {c: mean([r["bytes_cloud_to_edge"] for r in here if r["strategy"] == s])
                               for c, s in every.items()}
        cells["cloud_s_median"] = {c: median([r["cloud_s"] for r in here if r["strategy"] == s])
                                   for c, s in every.items()}
        if source == "mmlu":
            cells["accuracy"] = {c: mean([r.get("correct") for r in here if r["strategy"] == s])
                                 for c, s in every.items()}
        out[source] = cells
    return out


def distill_costs(runs: list[Path], out: Path | None = None) -> dict:
    """{source/export: medians over the prompts of the runs' distill reports (generation, targets and training
    seconds, best step, held-out KL at step 0 and at the best step)}, read from each run's work folder; with
    `out`, one loss curve per source and export (its first prompt's) into out/loss_curves. Runs of one source (the
    shards of a dataset) pool their prompts; a system prompt exported by two shards counts once."""
    reports: dict[str, dict[str, Path]] = {}  # source/export → {system-prompt hash → report.json}
    for run in runs:
        source = "+".join(json.loads((run / "config.json").read_text(encoding="utf-8"))["datasets"])
        for export in sorted(p for p in (run / "work" / "exports").glob("*") if p.is_dir()):
            for path in sorted(export.glob("*/prompt/report.json")):
                reports.setdefault(f"{source}/{export.name}", {}).setdefault(path.parent.parent.name, path)
    costs = {}
    for key, paths in reports.items():
        rs = [json.loads(p.read_text(encoding="utf-8")) for p in paths.values()]
        if "distilled" not in rs[0]:  # not a distilled export (compress's have no report.json)
            continue
        d = [r["distilled"] for r in rs]
        costs[key] = {
            "n": len(rs), **{f"{k}_median": median([r[k] for r in rs]) for k in ("generate_s", "targets_s",
                                                                                  "train_s")},
            "best_step_median": median([x["best_step"] for x in d]),
            "held_out_kl_step0_median": median([x.get("initial_held_out_kl") for x in d]),
            "held_out_kl_best_median": median([x.get("held_out_kl") for x in d]),
            "samples_median": median([x["samples"] for x in d]),
            "kv_tokens_median": median([r["kv_tokens"] for r in rs]),
            "system_tokens_median": median([r["system_prompt_tokens"] for r in rs])}
        curve = next(iter(paths.values())).parent / "loss_curve.png"
        if out is not None and curve.exists():
            (out / "loss_curves").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(curve, out / "loss_curves" / f"{key.replace('/', '_')}.png")
    return costs


def _once(rows: list[dict]) -> list[dict]:
    """The rows with each (source, request, strategy) once: runs merged into one report may each hold the same
    reference (EdgePrompt in every run); an identical repeat is dropped, a repeat with another NLL is refused,
    since pairing would silently take one run's number against another's."""
    first: dict[tuple[str, str, str], dict] = {}
    for r in rows:
        key = (r["dataset"], r["id"], r["strategy"])
        if key not in first:
            first[key] = r
        elif first[key].get("ref_nll") != r.get("ref_nll"):
            raise EdgeKVError(f"two runs score {key[2]} on {key[0]} request {key[1]} differently "
                             f"({first[key].get('ref_nll')} and {r.get('ref_nll')}): merge runs of one code")
    return list(first.values())


def write_distill_report(runs: list[Path], out: Path, seed: int = 0, spec: Spec = DISTILL,
                         relabel: dict[Path, dict[str, str]] | None = None,
                         exclude: set[tuple[str, str]] | None = None) -> dict:
    """summary.json and rows.jsonl (the runs' rows of the compared strategies) into `out`; costs.json and
    loss_curves/ where the runs' work folders are at hand. `relabel` renames a run's strategies (run → {strategy:
    name}): the same strategy under another setting, e.g. another shared prefix, kept apart. `exclude`: (dataset,
    request id) pairs left out of every cell (a request some condition trained on), listed under their source's
    `excluded_requests`."""
    keep, exclude = {*spec.conditions.values(), REFERENCE, spec.gap_from}, set(exclude or ())
    rows = []
    for run in runs:
        names = (relabel or {}).get(run, {})
        # the eval's own reader: a run still writing (or stopped) may end in a torn line, dropped with a warning
        rows += [{**r, "strategy": names.get(r["strategy"], r["strategy"])}
                 for r in read_results(run / "results.jsonl")]
    request = lambda r: (r["dataset"], str(r["id"]))  # noqa: E731
    if unknown := exclude - set(map(request, rows)):  # a typo would silently exclude nothing
        raise EdgeKVError(f"--exclude: no run holds {', '.join(sorted(f'{d}:{i}' for d, i in unknown))}")
    rows = _once([r for r in rows if r["strategy"] in keep and request(r) not in exclude])
    # a run stopped mid-request (resumable) leaves some strategies of its last request unanswered: compare only
    # requests every strategy run on their source answered, so each condition is paired over the same requests
    answered: dict[tuple[str, str], set[str]] = {}
    ran: dict[str, set[str]] = {}
    for r in rows:
        answered.setdefault((r["dataset"], r["id"]), set()).add(r["strategy"])
        ran.setdefault(r["dataset"], set()).add(r["strategy"])
    rows = [r for r in rows if answered[(r["dataset"], r["id"])] == ran[r["dataset"]]]
    summary = distill_summary(rows, seed, spec)
    for d, i in sorted(exclude):
        if d in summary:
            summary[d].setdefault("excluded_requests", []).append(i)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "rows.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))
    if costs := distill_costs(runs, out):
        write_text_atomic(out / "costs.json", json.dumps(costs, indent=1))
    ci = {src: drawn for src, cells in summary.items()  # the paired cells with an interval (n ≥ 2)
          if (drawn := {k: v for k, v in cells.items()
                        if (k in spec.conditions or k in spec.contrasts) and v["delta_ci95"][0] is not None})}
    if ci:
        interval_plot(ci, out / "delta_nll.png",
                      "reference NLL vs EdgePrompt's exact KV (and contrasts), paired, 95 % bootstrap")
    return summary


if __name__ == "__main__":  # python -m bench.distill_report OUT_DIR RUN_DIR [RUN_DIR ...]
    import sys

    try:
        print(json.dumps(write_distill_report([Path(a) for a in sys.argv[2:]], Path(sys.argv[1])), indent=1))
    except EdgeKVError as exc:
        raise SystemExit(f"error: {exc}") from None
