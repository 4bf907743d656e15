"""Quality per byte: for each splice family (edgeprompt, ce-lslm), every ThinK ratio × codec variant run by eval
(`family@λ/codec`) against the family's uncompressed splice (`family@0/fp16`, else the family as configured, e.g.
`edgeprompt-shared` in the run's dtype): bytes shipped, compression vs the
cloud's fp16 KV of the same layers, paired Δ reference NLL and Δ BERTScore with bootstrap intervals; a table, a
CSV and a Pareto plot."""

from __future__ import annotations

from pathlib import Path

from edgekv.eval.network import pareto
from edgekv.eval.stats import paired_to_edge
from edgekv.eval.strategies import parse_strategy
from edgekv.plots import plt, save_figure
from edgekv.summary import mean

# The compass goal of issue 14: ≥ 8× fewer bytes than the cloud's fp16 KV at ≤ 1 BERTScore point and ≤ 0.02 nats.
GOAL = {"ratio": 8.0, "bertscore": 0.01, "nll": 0.02}


def quality_per_byte(rows: list[dict], seed: int = 0) -> list[dict]:
    """One row per (dataset, variant) of a family whose uncompressed reference (`family@0/fp16`, else the bare
    family) was run."""
    out = []
    variants = {r["strategy"]: parse_strategy(r["strategy"]) for r in rows}
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        here = [r for r in rows if r["dataset"] == dataset]
        ran = {r["strategy"] for r in here}
        for name, st in variants.items():
            if st.prune_ratio is None:
                continue
            family = f"{st.base}{':' + st.variant if st.variant else ''}"
            reference = next((f for f in (f"{family}@0/fp16", family) if f in ran), None)
            mine = [r for r in here if r["strategy"] == name]
            if not mine or reference is None:
                continue
            pair = [r for r in here if r["strategy"] in (name, reference)]
            nll = paired_to_edge(pair, "ref_nll", reference, seed)
            bert = paired_to_edge(pair, "bertscore_f1", reference, seed)
            sent = mean([r["bytes_cloud_to_edge"] for r in mine])
            raw = mean([r.get("cloud_fp16_bytes") for r in mine])
            row = {"dataset": dataset, "family": st.base + (f":{st.variant}" if st.variant else ""),
                   "strategy": name, "prune_ratio": st.prune_ratio, "quant": st.quant, "n": len(mine),
                   "mb_sent": sent / 2**20, "ratio_vs_cloud_fp16": raw / sent if raw and sent else None,
                   "ref_nll": mean([r["ref_nll"] for r in mine]),
                   "bertscore_f1": mean([r["bertscore_f1"] for r in mine])}
            for key, diff in (("d_nll", nll), ("d_bertscore", bert)):
                d = diff[0] if diff else {"delta_mean": 0.0, "ci95_lo": None, "ci95_hi": None}
                row.update({key: d["delta_mean"], f"{key}_lo": d["ci95_lo"], f"{key}_hi": d["ci95_hi"]})
            row["meets_goal"] = meets_goal(row)
            out.append(row)
    return out


def meets_goal(row: dict) -> str:
    """"met" when the compression reaches the goal and both quality intervals stay within it (the upper bound of
    Δ NLL, the lower bound of Δ BERTScore); "point" when only the point estimates do; "no" otherwise."""
    if not (row["ratio_vs_cloud_fp16"] and row["ratio_vs_cloud_fp16"] >= GOAL["ratio"]):
        return "no"
    hi = row["d_nll"] if row["d_nll_hi"] is None else row["d_nll_hi"]
    lo = row["d_bertscore"] if row["d_bertscore_lo"] is None else row["d_bertscore_lo"]
    if hi <= GOAL["nll"] and lo >= -GOAL["bertscore"]:
        return "met"
    return "point" if row["d_nll"] <= GOAL["nll"] and row["d_bertscore"] >= -GOAL["bertscore"] else "no"


def _ci(v, lo, hi, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v:+.{digits}f}" + ("" if lo is None else f" [{lo:+.{digits}f}, {hi:+.{digits}f}]")


def qpb_table(rows: list[dict]) -> str:
    """Markdown table of quality_per_byte rows, Pareto-optimal variants (bytes vs Δ NLL) in bold."""
    lines = ["| dataset | family | λ | codec | n | MB sent | × vs cloud fp16 | Δ ref. NLL vs uncompressed | "
             "Δ BERTScore vs uncompressed | goal |", "|---|---|---:|---|---:|---:|---:|---|---|---|"]
    for (dataset, family) in dict.fromkeys((r["dataset"], r["family"]) for r in rows):
        part = [r for r in rows if r["dataset"] == dataset and r["family"] == family]
        front = set(pareto([(r["mb_sent"], r["d_nll"]) for r in part]))
        for k, r in enumerate(part):
            b = "**" if k in front else ""
            ratio = "–" if r["ratio_vs_cloud_fp16"] is None else f"{r['ratio_vs_cloud_fp16']:.1f}"
            lines.append(f"| {dataset} | {family} | {b}{r['prune_ratio']:g}{b} | {b}{r['quant']}{b} | {r['n']} | "
                         f"{r['mb_sent']:.3f} | {ratio} | {_ci(r['d_nll'], r['d_nll_lo'], r['d_nll_hi'])} | "
                         f"{_ci(r['d_bertscore'], r['d_bertscore_lo'], r['d_bertscore_hi'])} | "
                         f"{r['meets_goal']} |")
    return "\n".join(lines)


def plot_pareto(rows: list[dict], path: Path) -> None:
    """Δ reference NLL vs MB sent, one panel per dataset, a marker per variant, the Pareto front per family."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4.2), squeeze=False)
    markers = {"fp16": "o", "bf16": "o", "int8": "s", "int4": "^", "int2": "v", "fp32": "D"}
    for ax, d in zip(axes[0], datasets):
        for family in dict.fromkeys(r["family"] for r in rows if r["dataset"] == d):
            part = [r for r in rows if r["dataset"] == d and r["family"] == family]
            line = None
            for r in part:
                err = None if r["d_nll_lo"] is None else [[r["d_nll"] - r["d_nll_lo"]], [r["d_nll_hi"] - r["d_nll"]]]
                line = ax.errorbar(r["mb_sent"], r["d_nll"], yerr=err, fmt=markers.get(r["quant"], "o"),
                                   color=line[0].get_color() if line else None, alpha=0.8, capsize=2)
                ax.annotate(f"{r['prune_ratio']:g}/{r['quant']}", (r["mb_sent"], r["d_nll"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
            front = pareto([(r["mb_sent"], r["d_nll"]) for r in part])
            ax.plot([part[k]["mb_sent"] for k in front], [part[k]["d_nll"] for k in front], "-",
                    color=line[0].get_color(), label=f"{family} (Pareto front)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhline(GOAL["nll"], color="grey", lw=0.8, ls=":", label="+0.02 nats")
        ax.set_xscale("log")
        ax.set(title=f"{d}: quality per byte", xlabel="MB sent per system prompt (log)",
               ylabel="Δ ref. NLL vs uncompressed splice (nats/token)")
        ax.legend(fontsize=7)
    save_figure(fig, path)
