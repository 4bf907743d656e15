"""Summaries of an eval run: summary.csv, report.md in the paper's Table II layout, latency plots (PNG)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from edgekv.atomic import write_text_atomic
from edgekv.eval.quality_per_byte import GOAL, plot_pareto, qpb_table, quality_per_byte
from edgekv.eval.stats import bootstrap_ci, cell_seed, paired_to_edge
from edgekv.plots import plt, save_figure
from edgekv.summary import mean, median

# Cells with a 95 % bootstrap interval: (column, row key, statistic). Quality and latency; the rest are costs that
# do not vary between requests of one setting (memory, bytes) or are reported as plain means.
INTERVAL_CELLS = [("ttft_s_median", "ttft_s", "median"), ("total_s_mean", "total_s", "mean"),
                  ("ms_per_token_median", "ms_per_token", "median"), ("bertscore_f1", "bertscore_f1", "mean"),
                  ("rouge_l", "rouge_l", "mean"), ("accuracy", "correct", "mean"), ("ref_nll", "ref_nll", "mean")]
PLAIN_CELLS = ["ttft_s_mean", "base_memory_mb", "inference_memory_mb", "upload_ratio", "transmitted_mb",
               "cloud_s_mean"]
COLUMNS = ["dataset", "strategy", "n"] + [c for name, _, _ in INTERVAL_CELLS for c in
                                          (name, f"{name}_lo", f"{name}_hi")] + PLAIN_CELLS
PAIRED_METRICS = [("ref_nll", "ref. NLL"), ("bertscore_f1", "BERTScore F1"), ("correct", "MMLU acc.")]


def summarize(rows: list[dict], seed: int = 0) -> list[dict]:
    """One summary row per (dataset, strategy), in first-seen order, each quality and latency cell with its 95 %
    bootstrap interval over requests (seeded per cell)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["strategy"]), []).append(r)
    out = []
    for (dataset, strategy), rs in groups.items():
        col = lambda k: [r.get(k) for r in rs]  # noqa: E731
        s = {"dataset": dataset, "strategy": strategy, "n": len(rs)}
        for name, key, stat in INTERVAL_CELLS:
            values = [v for v in col(key) if v is not None]
            s[name] = (median if stat == "median" else mean)(values)
            s[f"{name}_lo"], s[f"{name}_hi"] = bootstrap_ci(values, stat, cell_seed(seed, dataset, strategy, name))
        s.update({"ttft_s_mean": mean(col("ttft_s")), "base_memory_mb": mean(col("base_memory_mb")),
                  "inference_memory_mb": mean(col("inference_memory_mb")), "upload_ratio": mean(col("upload_ratio")),
                  "transmitted_mb": mean([b / 2**20 for b in col("bytes_cloud_to_edge")]),
                  "cloud_s_mean": mean(col("cloud_s"))})
        out.append(s)
    return out


def paired_table(paired: list[dict], what: str) -> str:
    """Markdown table of paired differences to edge-only."""
    lines = [f"| dataset | strategy | n | Δ {what} vs edge-only | 95 % CI | excludes 0 |",
             "|---|---|---:|---:|---|---|"]
    for p in paired:
        ci = "–" if p["ci95_lo"] is None else f"[{p['ci95_lo']:+.3f}, {p['ci95_hi']:+.3f}]"
        lines.append(f"| {p['dataset']} | {p['strategy']} | {p['n']} | {p['delta_mean']:+.3f} | {ci} | "
                     f"{'**yes**' if p['excludes_zero'] else 'no'} |")
    return "\n".join(lines)


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _cell(s: dict, name: str, digits: int = 3) -> str:
    """A value with its interval, e.g. `1.448 [1.302, 1.611]`."""
    if s.get(name) is None:
        return "–"
    if s.get(f"{name}_lo") is None:
        return _fmt(s[name], digits)
    return f"{_fmt(s[name], digits)} [{_fmt(s[f'{name}_lo'], digits)}, {_fmt(s[f'{name}_hi'], digits)}]"


def table_ii(summary: list[dict]) -> str:
    """Markdown table in the paper's Table II layout (dataset × strategy), 95 % intervals in brackets."""
    head = ("| dataset | strategy | n | TTFT s (median) | total s (mean) | ms/token (median) | base memory MB | "
            "inference memory MB | upload ratio | transmitted MB | BERTScore F1 | ROUGE-L | MMLU acc. | ref. NLL |")
    lines = [head, "|" + "---|" * 14]
    for s in summary:
        lines.append(f"| {s['dataset']} | {s['strategy']} | {s['n']} | {_cell(s, 'ttft_s_median')} | "
                     f"{_cell(s, 'total_s_mean', 2)} | {_cell(s, 'ms_per_token_median', 1)} | "
                     f"{_fmt(s['base_memory_mb'], 0)} | {_fmt(s['inference_memory_mb'], 1)} | "
                     f"{_fmt(s['upload_ratio'], 2)} | {_fmt(s['transmitted_mb'], 3)} | {_cell(s, 'bertscore_f1')} | "
                     f"{_cell(s, 'rouge_l')} | {_cell(s, 'accuracy', 2)} | {_cell(s, 'ref_nll')} |")
    return "\n".join(lines)


def plot_latency(summary: list[dict], rows: list[dict], path: Path) -> None:
    """TTFT per request (box per strategy), one panel per dataset."""
    datasets = list(dict.fromkeys(s["dataset"] for s in summary))
    strategies = list(dict.fromkeys(s["strategy"] for s in summary))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        data = [[r["ttft_s"] for r in rows if r["dataset"] == d and r["strategy"] == s] for s in strategies]
        ax.boxplot(data, tick_labels=strategies, showfliers=True)
        ax.set_title(f"{d}: time to first token")
        ax.set_ylabel("seconds")
        ax.tick_params(axis="x", rotation=30)
    save_figure(fig, path)


def plot_load(load: list[dict], path: Path) -> None:
    """Average and normalized latency vs request rate, one line per strategy (the paper's Fig. 7)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for strategy in dict.fromkeys(r["strategy"] for r in load):
        pts = [r for r in load if r["strategy"] == strategy and r["latency_mean_s"] is not None]
        axes[0].plot([r["rate"] for r in pts], [r["latency_mean_s"] for r in pts], marker="o", label=strategy)
        axes[1].plot([r["rate"] for r in pts], [r["normalized_latency_s_per_token"] for r in pts], marker="o",
                     label=strategy)
    axes[0].set(xlabel="request rate (req/s)", ylabel="average latency (s)")
    axes[1].set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)")
    axes[0].legend()
    save_figure(fig, path)


def load_table(load: list[dict]) -> str:
    """Markdown table of the load runs."""
    lines = ["| strategy | rate req/s | requests | errors | mean latency s | p90 s | normalized s/token |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in load:
        lines.append(f"| {r['strategy']} | {r['rate']:g} | {r['requests']} | {r['errors']} | "
                     f"{_fmt(r['latency_mean_s'], 2)} | {_fmt(r['latency_p90_s'], 2)} | "
                     f"{_fmt(r['normalized_latency_s_per_token'], 3)} |")
    return "\n".join(lines)


def _csv(rows: list[dict], columns: list[str] | None = None) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns or list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_report(out: Path, rows: list[dict], config: dict, scorer: str | None, models: dict,
                 load: list[dict] | None = None) -> dict:
    """summary.csv, paired.csv, report.md, ttft.png, config.json (+ load.csv, load.png, quality per byte, and
    plan.md if `edgekv plan` wrote one here) written atomically; returns the summary."""
    seed = int(config.get("seed", 0))
    summary = summarize(rows, seed)
    write_text_atomic(out / "summary.csv", _csv(summary, COLUMNS))
    write_text_atomic(out / "config.json", json.dumps(config, indent=1))
    if rows:
        plot_latency(summary, rows, out / "ttft.png")
    md = [f"# edgekv eval: {', '.join(dict.fromkeys(r['dataset'] for r in rows))}", "",
          f"Models: cloud `{models['cloud']}`, edge `{models['edge']}`. BERTScore: {scorer or '–'}. "
          f"Link (edge strategies' export, cloud-only's prompt): {config.get('bandwidth_mbps')} Mbit/s, "
          f"{config.get('latency_ms')} ms.", "",
          table_ii(summary), "",
          "Brackets: 95 % percentile-bootstrap intervals over requests (seeded per cell; medians for TTFT and "
          "ms/token, means elsewhere). "
          "TTFT includes everything the edge waits for: system-prompt prefill (edge-only, edge-naive, cloud-only), "
          "the export's pipelined load and the shallow layers (edgeprompt, ce-lslm), the edge's own full system "
          "prefill overlapping the load (ce-lslm-fuse); the cloud's own KV computation is "
          "`cloud_s` in summary.csv (it happens ahead of the request). Memory: base = model weights; inference = "
          "the request's KV cache at the end of generation. ref. NLL: mean NLL of the reference's first "
          f"{config.get('reference_tokens')} tokens after the user prompt; on MMLU, of the gold answer letter after "
          "`Answer:` (the few-shot format), since the option text would score format, not knowledge.", "",
          "![TTFT](ttft.png)", ""]
    paired = [p for key, _ in PAIRED_METRICS for p in paired_to_edge(rows, key, seed=seed)]
    if paired:
        write_text_atomic(out / "paired.csv", _csv(paired))
        md += ["## Quality, paired with edge-only", "",
               "Each strategy's metric minus edge-only's on the same requests (ref. NLL: negative is better; "
               "BERTScore and accuracy: positive is better); 95 % bootstrap interval over requests; **yes**: the "
               "interval excludes 0, a difference this run can call real.", ""]
        for key, what in PAIRED_METRICS:
            part = [p for p in paired if p["metric"] == key]
            if part:
                md += [f"### {what}", "", paired_table(part, what), ""]
    if load:
        write_text_atomic(out / "load.csv", _csv(load))
        plot_load(load, out / "load.png")
        md += ["## Latency under load (Poisson arrivals, loopback serve-edge)", "", load_table(load), "",
               "![load](load.png)", ""]
    else:  # a load table from an earlier run would no longer match this report
        for stale in ("load.csv", "load.png"):
            (out / stale).unlink(missing_ok=True)
    qpb = []
    if any("@" in r["strategy"] for r in rows):

        qpb = quality_per_byte(rows, seed)
        if qpb:
            write_text_atomic(out / "quality_per_byte.csv", _csv(qpb))
            plot_pareto(qpb, out / "quality_per_byte.png")
            md += ["## Quality per byte", "",
                   "Each ThinK ratio λ × codec variant against its family's uncompressed splice (λ 0, fp16) on the "
                   "same requests (paired, 95 % bootstrap intervals); bold: Pareto-optimal in bytes vs Δ NLL. Goal: "
                   f"≥ {GOAL['ratio']:g}× fewer bytes than the cloud's fp16 KV of the same layers at ≤ "
                   f"{GOAL['nll']} nats and ≤ {GOAL['bertscore'] * 100:g} BERTScore point lost: `met` when both "
                   "95 % intervals stay within it, `point` when only the point estimates do.", "",
                   qpb_table(qpb), "", "![quality per byte](quality_per_byte.png)", ""]
    if (out / "plan.md").exists():  # `edgekv plan --out` this directory: the planner and the bandwidth sweep
        md += [(out / "plan.md").read_text(encoding="utf-8")]
    write_text_atomic(out / "report.md", "\n".join(md))
    return {"summary": summary, "paired": paired, "rows": len(rows), "load": load or [], "quality_per_byte": qpb}
