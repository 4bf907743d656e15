"""An eval run on disk: its rows (resumable, torn lines dropped), its shards and their merge into one report, and
the report made again from the rows (no model loaded)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.config import to_dict
from edgekv.eval.report import write_report
from edgekv.texts import jsonl_records

log = logging.getLogger("edgekv")


def parse_shard(shard: str) -> tuple[int, int]:
    """"i/n" → (i, n) with 1 ≤ i ≤ n."""
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise EdgeKVError(f"--shard must be i/n (e.g. 1/4), got '{shard}'") from None
    if not 1 <= i <= n:
        raise EdgeKVError(f"--shard i/n needs 1 ≤ i ≤ n, got '{shard}'")
    return i, n


def in_shard(group: int, shard: str | None) -> bool:
    """Whether the requests of this system-prompt group (`prompt_groups`) belong to the shard."""
    if shard is None:
        return True
    i, n = parse_shard(shard)
    return group % n == i - 1


def prompt_groups(systems: list[str]) -> list[int]:
    """Each request's group: its system prompt's rank among the sample's distinct system prompts, by first
    appearance. Shards and the answering order go by group, so a per-prompt export (a distillation, minutes) is made
    in one shard only, and a run stopped between groups leaves no prompt's export half-used (MMLU's questions share
    their subject's prompt)."""
    rank: dict[str, int] = {}
    return [rank.setdefault(s, len(rank)) for s in systems]


def read_results(path: Path) -> list[dict]:
    """Rows already written (a torn last line from an interrupted run is dropped)."""
    if not path.exists():
        return []
    torn = lambda n: log.warning("%s:%d: dropping a torn line (interrupted run)", path, n)  # noqa: E731
    return [r for _, r in jsonl_records(path.read_text(encoding="utf-8").splitlines(), path, torn)]


# Keys that choose what is run or reported, not what a row holds: rows made under other values are reusable.
RESUMABLE_KEYS = {"out", "ray", "workers", "datasets", "strategies", "limit", "align_config", "load_rates",
                  "load_seconds", "load_dataset", "load_max_tokens", "shard"}


RECIPE_KEY = "distill_recipe"  # in config.json only, never an EvalConfig field


def run_settings(cfg) -> dict:
    """The eval config as written beside its rows, with the distill recipe its `distill_config` file names read in:
    the file can change between runs under the same path, and rows its old recipe made must not be resumed."""
    settings = to_dict(cfg)
    if cfg.distill_config and Path(cfg.distill_config).exists():
        from edgekv.config import load_config
        from edgekv.distill.distill_job import DistillConfig  # the distill stage, only for runs that name it

        recipe = load_config(DistillConfig, "distill", cfg.distill_config, {"system_prompt": "unused"})
        settings[RECIPE_KEY] = to_dict(recipe)
    return settings


def check_resumable(out: Path, cfg) -> None:
    """Refuse to mix rows made under another config (or another distill recipe) into this run's results."""
    path = out / "config.json"
    if not path.exists():
        return
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgeKVError(f"{path}: unreadable ({exc}); pass another --out") from exc
    now = run_settings(cfg)
    differ = sorted(k for k in now if k not in RESUMABLE_KEYS and k in before and _differs(before[k], now[k]))
    if differ:
        raise EdgeKVError(f"{out}/results.jsonl was made with other settings ({', '.join(differ)}); "
                          "pass another --out, or delete it to start over")


def _differs(before, now) -> bool:
    """Whether a recorded setting differs from today's. Inside a dict (the distill recipe), a key the recorded run
    lacks (a setting added since, its default keeping the old behaviour) is no difference, as at the top level; a
    key only the recorded run has is one (a removed entry of a dict-valued setting changes what runs)."""
    if isinstance(before, dict) and isinstance(now, dict):
        return any(k in before and _differs(before[k], v) for k, v in now.items()) or any(k not in now for k in before)
    return before != now


def canonical(rows: list[dict], order: dict[tuple[str, str], tuple[int, int]], strategies: list[str]) -> list[dict]:
    """Rows in the order an unsharded run makes them: dataset, position in the sample, strategy."""
    rank = {s: k for k, s in enumerate(strategies)}
    return sorted(rows, key=lambda r: (*order[(r["dataset"], r["id"])], rank[r["strategy"]]))


# Settings that may differ between shards of one report; every other setting must match. `datasets` may differ
# too when the runs split the datasets between them (`--dataset xsum` here, `--dataset mmlu` there).
SHARD_KEYS = {"out", "shard", "ray", "workers"}


def merge_runs(dirs: list[Path], out: Path) -> dict:
    """Join the rows of runs split by shard (`--shard i/n`, together covering 1..n) or by dataset (disjoint
    `--dataset` lists) into one report in `out`; refuses runs made with other settings, a missing or repeated
    shard, overlapping datasets, or rows seen twice."""
    if not dirs:
        raise EdgeKVError("`edgekv report` needs at least one run directory")
    configs = []
    for d in dirs:
        try:
            configs.append(json.loads((Path(d) / "config.json").read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise EdgeKVError(f"{d}: not an eval run (config.json: {exc.__class__.__name__})") from exc
    first = configs[0]
    for d, c in zip(dirs[1:], configs[1:]):
        differ = sorted(k for k in set(first) | set(c)
                        if k not in SHARD_KEYS | {"datasets"} and first.get(k) != c.get(k))
        if differ:
            raise EdgeKVError(f"{d} was made with other settings than {dirs[0]} ({', '.join(differ)}); "
                              "runs of one report must share every setting but out, shard and datasets")
    splits: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for c in configs:
        splits.setdefault(tuple(c["datasets"]), []).append(parse_shard(c["shard"]) if c.get("shard") else (1, 1))
    datasets = [ds for split in splits for ds in split]
    if len(set(datasets)) < len(datasets):
        raise EdgeKVError(f"runs over {' and '.join('/'.join(s) for s in splits)} overlap: split the datasets "
                          "between runs, or shard one dataset list")
    for split, shards in splits.items():
        n = shards[0][1]
        got = sorted(i for i, _ in shards)
        if any(k != n for _, k in shards) or got != list(range(1, n + 1)):
            raise EdgeKVError(f"shards {', '.join(f'{i}/{k}' for i, k in shards)} of {'/'.join(split)} do not "
                              f"cover 1/{n}..{n}/{n} once each")
    rows, seen = [], set()
    for d in dirs:
        for r in read_results(Path(d) / "results.jsonl"):
            key = (r["dataset"], r["strategy"], r["id"])
            if key in seen:
                raise EdgeKVError(f"{d}: request {key} appears in two shards")
            seen.add(key)
            rows.append(r)
    cfg = dict(first, out=str(out), shard=None, datasets=datasets)
    rows = _in_order(rows, cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_text_atomic(out / "config.json", json.dumps(cfg, indent=1))
    return rewrite_report(out)


def _in_order(rows: list[dict], cfg: dict) -> list[dict]:
    """The config's datasets and strategies only, in canonical order (by each row's position in the sample)."""
    strategies, datasets = cfg["strategies"], cfg["datasets"]
    rows = [r for r in rows if r["dataset"] in datasets and r["strategy"] in strategies]
    order = {(r["dataset"], r["id"]): (datasets.index(r["dataset"]), r.get("index", 0)) for r in rows}  # stable
    return canonical(rows, order, strategies)


def rewrite_report(out: Path) -> dict:
    """Summaries and report.md of an eval directory made again from its results.jsonl and config.json (no
    model is loaded): after a merge, or when `edgekv plan` adds its sections."""
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    rows = _in_order(read_results(out / "results.jsonl"), cfg)
    scorer = next((r["bertscore_model"] for r in rows if r.get("bertscore_model")), None)
    return write_report(out, rows, cfg, scorer, {"cloud": cfg["cloud"], "edge": cfg["edge"]})
