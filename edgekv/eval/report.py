"""Summaries of an eval run: summary.csv, report.md in the paper's Table II layout, latency plots (PNG)."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

from edgekv.atomic import write_text_atomic

COLUMNS = ["dataset", "strategy", "requests", "ttft_s_median", "ttft_s_mean", "total_s_mean", "ms_per_token_median",
           "base_memory_mb", "inference_memory_mb", "upload_ratio", "transmitted_mb", "cloud_s_mean",
           "bertscore_f1", "rouge_l", "accuracy", "ref_nll"]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict]) -> list[dict]:
    """One summary row per (dataset, strategy), in first-seen order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["strategy"]), []).append(r)
    out = []
    for (dataset, strategy), rs in groups.items():
        col = lambda k: [r.get(k) for r in rs]  # noqa: E731
        out.append({
            "dataset": dataset, "strategy": strategy, "requests": len(rs),
            "ttft_s_median": _median(col("ttft_s")), "ttft_s_mean": _mean(col("ttft_s")),
            "total_s_mean": _mean(col("total_s")), "ms_per_token_median": _median(col("ms_per_token")),
            "base_memory_mb": _mean(col("base_memory_mb")), "inference_memory_mb": _mean(col("inference_memory_mb")),
            "upload_ratio": _mean(col("upload_ratio")),
            "transmitted_mb": _mean([b / 2**20 for b in col("bytes_cloud_to_edge")]),
            "cloud_s_mean": _mean(col("cloud_s")), "bertscore_f1": _mean(col("bertscore_f1")),
            "rouge_l": _mean(col("rouge_l")),
            "accuracy": _mean(col("correct")) if any("correct" in r for r in rs) else None,
            "ref_nll": _mean(col("ref_nll")),
        })
    return out


def paired_to_edge(rows: list[dict], key: str = "ref_nll", reference: str = "edge-only") -> list[dict]:
    """Per (dataset, strategy): mean difference of `key` to the reference strategy on the same requests, with a
    95 % Student t-interval over requests (paired, so request difficulty cancels)."""
    from scipy.stats import t as student

    ref = {(r["dataset"], r["id"]): r.get(key) for r in rows if r["strategy"] == reference}
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        base = ref.get((r["dataset"], r["id"]))
        if r["strategy"] != reference and r.get(key) is not None and base is not None:
            groups.setdefault((r["dataset"], r["strategy"]), []).append(r[key] - base)
    out = []
    for (dataset, strategy), d in groups.items():
        mean = sum(d) / len(d)
        half = None
        if len(d) > 1:
            sd = statistics.stdev(d)
            half = float(student.ppf(0.975, len(d) - 1)) * sd / len(d) ** 0.5
        lo, hi = (None, None) if half is None else (mean - half, mean + half)
        out.append({"dataset": dataset, "strategy": strategy, "n": len(d), "delta_mean": mean, "ci95_lo": lo,
                    "ci95_hi": hi, "excludes_zero": lo is not None and (lo > 0 or hi < 0)})
    return out


def paired_table(paired: list[dict], what: str) -> str:
    """Markdown table of paired differences to edge-only."""
    lines = [f"| dataset | strategy | n | Δ {what} vs edge-only | 95 % CI | excludes 0 |",
             "|---|---|---:|---:|---|---|"]
    for p in paired:
        ci = "–" if p["ci95_lo"] is None else f"[{p['ci95_lo']:+.3f}, {p['ci95_hi']:+.3f}]"
        lines.append(f"| {p['dataset']} | {p['strategy']} | {p['n']} | {p['delta_mean']:+.3f} | {ci} | "
                     f"{'yes' if p['excludes_zero'] else 'no'} |")
    return "\n".join(lines)


def _fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table_ii(summary: list[dict]) -> str:
    """Markdown table in the paper's Table II layout (dataset × strategy)."""
    head = ("| dataset | strategy | n | TTFT s (median) | total s (mean) | ms/token | base memory MB | inference "
            "memory MB | upload ratio | transmitted MB | BERTScore F1 | ROUGE-L | MMLU acc. | ref. NLL |")
    lines = [head, "|" + "---|" * 14]
    for s in summary:
        lines.append(f"| {s['dataset']} | {s['strategy']} | {s['requests']} | {_fmt(s['ttft_s_median'])} | "
                     f"{_fmt(s['total_s_mean'], 2)} | {_fmt(s['ms_per_token_median'], 1)} | "
                     f"{_fmt(s['base_memory_mb'], 0)} | {_fmt(s['inference_memory_mb'], 1)} | "
                     f"{_fmt(s['upload_ratio'], 2)} | {_fmt(s['transmitted_mb'], 3)} | {_fmt(s['bertscore_f1'])} | "
                     f"{_fmt(s['rouge_l'])} | {_fmt(s['accuracy'], 2)} | {_fmt(s['ref_nll'])} |")
    return "\n".join(lines)


def plot_latency(summary: list[dict], rows: list[dict], path: Path) -> None:
    """TTFT per request (box per strategy), one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(s["dataset"] for s in summary))
    strategies = list(dict.fromkeys(s["strategy"] for s in summary))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        data = [[r["ttft_s"] for r in rows if r["dataset"] == d and r["strategy"] == s] for s in strategies]
        ax.boxplot(data, tick_labels=strategies, showfliers=True)
        ax.set_title(f"{d}: time to first token")
        ax.set_ylabel("seconds")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def plot_load(load: list[dict], path: Path) -> None:
    """Average and normalized latency vs request rate, one line per strategy (the paper's Fig. 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for strategy in dict.fromkeys(r["strategy"] for r in load):
        pts = [r for r in load if r["strategy"] == strategy and r["latency_mean_s"] is not None]
        axes[0].plot([r["rate"] for r in pts], [r["latency_mean_s"] for r in pts], marker="o", label=strategy)
        axes[1].plot([r["rate"] for r in pts], [r["normalized_latency_s_per_token"] for r in pts], marker="o",
                     label=strategy)
    axes[0].set(xlabel="request rate (req/s)", ylabel="average latency (s)")
    axes[1].set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)")
    axes[0].legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def load_table(load: list[dict]) -> str:
    """Markdown table of the load runs."""
    lines = ["| strategy | rate req/s | requests | errors | mean latency s | p90 s | normalized s/token |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in load:
        lines.append(f"| {r['strategy']} | {r['rate']:g} | {r['requests']} | {r['errors']} | "
                     f"{_fmt(r['latency_mean_s'], 2)} | {_fmt(r['latency_p90_s'], 2)} | "
                     f"{_fmt(r['normalized_latency_s_per_token'], 3)} |")
    return "\n".join(lines)


def write_report(out: Path, rows: list[dict], config: dict, scorer: str | None, models: dict,
                 load: list[dict] | None = None) -> dict:
    """summary.csv, report.md, ttft.png, config.json (+ load.csv, load.png) written atomically; returns the
    summary."""
    summary = summarize(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(summary)
    write_text_atomic(out / "summary.csv", buf.getvalue())
    write_text_atomic(out / "config.json", json.dumps(config, indent=1))
    if rows:
        plot_latency(summary, rows, out / "ttft.png")
    md = [f"# edgekv eval: {', '.join(dict.fromkeys(r['dataset'] for r in rows))}", "",
          f"Models: cloud `{models['cloud']}`, edge `{models['edge']}`. BERTScore: {scorer or '–'}. "
          f"Link (edge strategies' export, cloud-only's prompt): {config.get('bandwidth_mbps')} Mbit/s, "
          f"{config.get('latency_ms')} ms.", "",
          table_ii(summary), "",
          "TTFT includes everything the edge waits for: system-prompt prefill (edge-only, cloud-only), the export's "
          "pipelined load and the shallow layers (edgeprompt, ce-lslm), the edge's own full system prefill "
          "overlapping the load (ce-lslm-fuse); the cloud's own KV computation is "
          "`cloud_s` in summary.csv (it happens ahead of the request). Memory: base = model weights; inference = "
          "the request's KV cache at the end of generation.", "", "![TTFT](ttft.png)", ""]
    paired = paired_to_edge(rows)
    if paired:
        md += ["## Reference NLL, paired with edge-only", "",
               "Each strategy's reference NLL minus edge-only's on the same requests (negative: better than the edge "
               "alone); 95 % Student t-interval over requests.", "", paired_table(paired, "ref. NLL"), ""]
    if load:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(load[0]))
        writer.writeheader()
        writer.writerows(load)
        write_text_atomic(out / "load.csv", buf.getvalue())
        plot_load(load, out / "load.png")
        md += ["## Latency under load (Poisson arrivals, loopback serve-edge)", "", load_table(load), "",
               "![load](load.png)", ""]
    else:  # a load table from an earlier run would no longer match this report
        for stale in ("load.csv", "load.png"):
            (out / stale).unlink(missing_ok=True)
    write_text_atomic(out / "report.md", "\n".join(md))
    return {"summary": summary, "rows": len(rows), "load": load or []}
