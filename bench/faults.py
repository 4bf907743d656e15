"""The fault matrix and a concurrent batch under a kill (issue 35).

    python -m bench.faults [--writers 4] [--prompts 200] [--out reports/faults] [--before BEFORE.xml]
                           [--skip-matrix | --skip-batch]

1. The matrix: `tests/test_faults.py` run here (pytest, JUnit XML); each case × its outcome. `--before` adds the
   outcomes of the same suite run on an earlier tree (its JUnit XML) as a second column.
2. The batch: `--writers` processes compress `--prompts` system prompts each into ONE folder catalog at once (tiny
   random models, so the faults are the point, not the compute); neighbouring writers share half their prompts, so
   they race on the same keys and on the index; writer 0 runs on a local Ray cluster with 2 workers, one of which is
   SIGKILLed after the catalog's first entry. Counted: index rows lost (prompts reported written or found that the
   index does not list), entries broken (`Catalog.verify`), prompts neither written nor reported.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from edgekv.atomic import write_text_atomic
from edgekv.kv.catalog import Catalog
from edgekv.kv.compress_job import CompressConfig

ROOT = Path(__file__).resolve().parent.parent


TMP = re.compile(r"/tmp/[^\s'\"]*")  # pytest's temp folders: this machine's paths, never committed


def junit_outcomes(path: Path) -> dict[str, str]:
    """test id → passed | failed: <first line of the message> | skipped, from a JUnit XML file."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                message = TMP.sub("<tmp>", (child.get("message") or "").splitlines()[0] if child.get("message") else "")
                kind = f"failed: {message[:120]}" if message else "failed"
            elif child.tag == "skipped":
                kind = "skipped"
        out[name] = kind
    return out


def matrix(out: Path, before: Path | None) -> dict:
    """Run the suite here; the case × outcome table (and the earlier tree's outcomes when given)."""
    xml = out / "after.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_faults.py",
                    f"--junitxml={xml}"], cwd=ROOT, check=False)
    after = junit_outcomes(xml)
    xml.unlink()
    old = junit_outcomes(before) if before else {}
    rows = [{"case": name, "after": outcome, **({"before": old.get(name, "absent")} if before else {})}
            for name, outcome in after.items()]
    lines = ["| case | before (issue 35 filed) | after |", "|---|---|---|"] if before else \
        ["| case | outcome |", "|---|---|"]
    for r in rows:
        lines.append(f"| `{r['case']}` | {r['before']} | {r['after']} |" if before else
                     f"| `{r['case']}` | {r['after']} |")
    write_text_atomic(out / "matrix.md", "\n".join(lines) + "\n")
    return {"cases": len(rows), "passed": sum(r["after"] == "passed" for r in rows), "rows": rows}


def _writer(edge_dir: str, prompts: str, url: str, ray: bool, result: str) -> None:
    from edgekv.kv.batch_compress import run_compress_batch

    cfg = CompressConfig(cloud=edge_dir, edge=edge_dir, dtype="float32", quant="int8", start_layer=1,
                         prompts=prompts, catalog=url, ray="" if ray else None, workers=2)
    done = run_compress_batch(cfg)
    Path(result).write_text(json.dumps(done))


def concurrent_batch(writers: int, prompts: int, work: Path) -> dict:
    """The batch of the module doc; returns its counts."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import byte_tokenizer, save_model, tiny_qwen2
    from tests.test_faults import kill_one_actor_after_first_entry

    edge_dir = save_model(tiny_qwen2(3, 32, 4, 2, seed=7, init=0.2), byte_tokenizer(), work / "edge")
    texts = [f"System {k}: you answer questions about topic {k} briefly and exactly. " * 2
             for k in range(prompts * (writers + 1) // 2)]
    files = []
    for w in range(writers):
        mine = texts[w * prompts // 2: w * prompts // 2 + prompts]
        path = work / f"writer{w}.jsonl"
        path.write_text("".join(json.dumps({"name": f"t{w * prompts // 2 + k}", "system_prompt": t}) + "\n"
                                for k, t in enumerate(mine)))
        files.append(path)
    url = work / "catalog"
    killed: list[int] = []
    watcher = threading.Thread(target=kill_one_actor_after_first_entry, args=(url, killed, 900))
    watcher.start()
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(edge_dir, str(f), str(url), w == 0, str(work / f"done{w}.json")))
             for w, f in enumerate(files)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    watcher.join(timeout=1)
    seconds = time.perf_counter() - start
    done = [json.loads((work / f"done{w}.json").read_text()) for w in range(writers)]
    catalog = Catalog(url)
    listed = {r["key"] for r in catalog.entries()}
    claimed = {e["key"] for d in done for e in d["entries"]}
    verified = catalog.verify()
    accounted = [d["computed"] + d["repaired"] + d["skipped"] + len(d["failed"]) for d in done]
    return {"writers": writers, "prompts_per_writer": prompts, "distinct_prompts": len({t for t in texts}),
            "actor_killed": bool(killed), "seconds": seconds,
            "per_writer": [{k: d[k] for k in ("computed", "repaired", "skipped")} | {"failed": len(d["failed"])}
                           for d in done],
            "rows_lost": len(claimed - listed), "entries_broken": len(verified["damaged"]),
            "incomplete_entries": len(verified["incomplete"]),
            "prompts_unaccounted": sum(prompts - a for a in accounted),
            "index_equals_rebuild": sorted(listed) == sorted(r["key"] for r in catalog.rebuild_index()["rows"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "reports/faults")
    ap.add_argument("--before", type=Path, default=None, help="JUnit XML of the suite run on an earlier tree (e.g. "
                    "`pytest tests/test_faults.py --junitxml=before.xml` in a worktree of that commit)")
    ap.add_argument("--skip-matrix", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "summary.json"
    summary = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}  # a part run keeps the other
    if not args.skip_matrix:
        summary["matrix"] = matrix(args.out, args.before)
    if not args.skip_batch:
        with tempfile.TemporaryDirectory(prefix="edgekv-faults-") as tmp:
            summary["concurrent_batch"] = concurrent_batch(args.writers, args.prompts, Path(tmp))
    write_text_atomic(path, json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "matrix"}, indent=1))


if __name__ == "__main__":
    main()
