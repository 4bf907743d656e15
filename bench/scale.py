"""What Ray costs and buys on this machine: the same batch compress and the same eval in-process and on a local Ray
cluster of 1 and 2 workers, side by side in one run (issue: past one machine).

    python -m bench.scale [--sizes 2,4] [--eval-sizes 2,4] [--json reports/scale/scale.json]

Each mode runs every workload at two sizes (items = system prompts for compress, requests for eval), from scratch
(a fresh catalog / output folder, the models loaded inside the run as a user's command loads them). Two sizes give
a line `wall = fixed + per_item × items`: `fixed` is loading (and, on Ray, the actors' start), `per_item` the
marginal cost; Ray's overhead is the difference to in-process on each. Ray's own start (`ray.init`, once per
process) is timed apart. This machine has 2 cores: in-process runs use both through torch's threads, each Ray
actor one (Ray sets OMP_NUM_THREADS=1 per actor), so 2 workers parallelise items and 1 worker gives up a core.

Compress: XSum documents (the data/ sample, first `--system` tokens) with the compress defaults of
configs/default.yaml (the shipped fuser's export). Eval: XSum requests of configs/eval/default.yaml, strategies
edge-only and edgeprompt.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from edgekv.atomic import write_text_atomic
from edgekv.config import load_config
from edgekv.eval.eval_config import EvalConfig
from edgekv.eval.eval_job import run_eval
from edgekv.kv.batch_compress import run_compress_batch
from edgekv.kv.compress_job import CompressConfig
from edgekv.models.loading import load_tokenizer
from edgekv.texts import xsum_documents

ROOT = Path(__file__).resolve().parents[1]
MODES = {"in-process": None, "ray-1": 1, "ray-2": 2}


def fit_line(sizes: list[int], walls: list[float]) -> dict:
    """Least-squares `wall = fixed + per_item × n` (exact through two points)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(walls) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, walls)) / sum((x - mx) ** 2 for x in sizes)
    return {"fixed_s": my - slope * mx, "per_item_s": slope}


def prompts_file(path: Path, n: int, system_tokens: int) -> Path:
    """The first n XSum documents cut to `system_tokens` edge tokens, one {name, system_prompt} per line."""
    tok = load_tokenizer("default-edge")
    docs = xsum_documents(ROOT / "data/xsum/xsum_sample.jsonl")[:n]
    rows = [{"name": f"xsum-{i}", "system_prompt": tok.decode(tok(d)["input_ids"][:system_tokens])}
            for i, d in enumerate(docs)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def time_compress(mode: str, n: int, system_tokens: int, tmp: Path) -> float:
    """Seconds for one batch compress of n prompts into a fresh catalog."""
    workers = MODES[mode]
    cfg = load_config(CompressConfig, "compress", ROOT / "configs/default.yaml", {
        "prompts": str(prompts_file(tmp / f"p-{mode}-{n}.jsonl", n, system_tokens)),
        "catalog": str(tmp / f"cat-{mode}-{n}"), "ray": "" if workers else None, "workers": workers or 1})
    start = time.perf_counter()
    done = run_compress_batch(cfg)
    wall = time.perf_counter() - start
    if done["computed"] != n or done["failed"]:
        raise SystemExit(f"compress {mode} n={n}: {done['failed'] or done}")
    return wall


def time_eval(mode: str, n: int, tmp: Path) -> float:
    """Seconds for one eval of n XSum requests (edge-only, edgeprompt) into a fresh folder."""
    workers = MODES[mode]
    cfg = load_config(EvalConfig, "eval", ROOT / "configs/eval/default.yaml", {
        "out": str(tmp / f"eval-{mode}-{n}"), "datasets": ["xsum"], "strategies": ["edge-only", "edgeprompt"],
        "limit": n, "load_rates": [], "ray": "" if workers else None, "workers": workers or 1})
    start = time.perf_counter()
    run_eval(cfg)
    return time.perf_counter() - start


def plot(out: dict, path: Path) -> None:
    """Wall seconds against items, one panel per workload, a line per mode (measured points, fitted line)."""
    from edgekv.plots import plt, save_figure  # headless matplotlib

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, work in zip(axes, ("compress", "eval")):
        for mode, r in out[work].items():
            xs = [0, max(r["sizes"])]
            label = f"{mode}: {r['fixed_s']:.0f} s + {r['per_item_s']:.2f} s/item"
            line = ax.plot(r["sizes"], r["wall_s"], "o", label=label)
            ax.plot(xs, [r["fixed_s"] + r["per_item_s"] * x for x in xs], "--", color=line[0].get_color())
        ax.set(title=f"{work} ({'system prompts' if work == 'compress' else 'requests'})", xlabel="items",
               ylabel="wall s")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4", help="prompts per batch compress (two or more sizes)")
    ap.add_argument("--eval-sizes", default="2,4", help="requests per eval (two or more sizes)")
    ap.add_argument("--system", type=int, default=384, help="system-prompt tokens per compress prompt")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    eval_sizes = [int(s) for s in a.eval_sizes.split(",")]
    modes = a.modes.split(",")
    out: dict = {"setup": vars(a) | {"json": str(a.json)}, "compress": {}, "eval": {}}
    if any(MODES[m] for m in modes):
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        out["ray_init_s"] = time.perf_counter() - start
        print(f"ray.init: {out['ray_init_s']:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="edgekv-scale-") as tmp:
        # untimed: the first load reads the weights from disk and builds the prepacked/quantized caches
        (Path(tmp) / "warm").mkdir()
        time_compress("in-process", 1, a.system, Path(tmp) / "warm")
        for work, sizes_, run in (("compress", sizes, lambda m, n: time_compress(m, n, a.system, Path(tmp))),
                                  ("eval", eval_sizes, lambda m, n: time_eval(m, n, Path(tmp)))):
            for mode in modes:
                walls = []
                for n in sizes_:
                    walls.append(run(mode, n))
                    print(f"{work} {mode} n={n}: {walls[-1]:.1f} s", flush=True)
                line = fit_line(sizes_, walls)
                out[work][mode] = {"sizes": sizes_, "wall_s": walls, **line,
                                   "items_per_s": max(sizes_) / walls[-1],
                                   "items_per_s_marginal": 1 / line["per_item_s"] if line["per_item_s"] > 0 else None}
            base = out[work].get("in-process")
            for mode in modes:
                row = out[work][mode]
                if base and mode != "in-process":
                    row["overhead_fixed_s"] = row["fixed_s"] - base["fixed_s"]
                    row["overhead_per_item_s"] = row["per_item_s"] - base["per_item_s"]
                    row["speedup_vs_in_process"] = base["wall_s"][-1] / row["wall_s"][-1]
    print(f"\n{'work':8} {'mode':11} {'fixed s':>8} {'s/item':>7} {'items/s':>8} {'Δfixed':>7} {'Δs/item':>8} "
          f"{'× in-proc':>9}")
    for work in ("compress", "eval"):
        for mode, r in out[work].items():
            extra = (f"{r['overhead_fixed_s']:7.1f} {r['overhead_per_item_s']:8.2f} {r['speedup_vs_in_process']:9.2f}"
                     if "overhead_fixed_s" in r else f"{'–':>7} {'–':>8} {'–':>9}")
            print(f"{work:8} {mode:11} {r['fixed_s']:8.1f} {r['per_item_s']:7.2f} {r['items_per_s']:8.3f} {extra}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.json, json.dumps(out, indent=1))
        plot(out, a.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
