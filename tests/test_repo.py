"""What the repository holds: no path of the machine it was made on, every report indexed (issue 36)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# written in pieces, so this file does not hold what it looks for
ROOTS = ["/wo" "rk/", "/ho" "me/[a-z_]", "/ro" "ot/", "/Us" "ers/", "/t" "mp/[A-Za-z]", r"C:\\Us" "ers"]
MACHINE_PATH = re.compile(r"(?<![\w.~])(" + "|".join(ROOTS) + ")")


def repo_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.splitlines() if (ROOT / p).is_file()]


def ours(line: str) -> str:
    """What of a line this project wrote: a training-prompt record (`bench.shared_prefix_prompts`) quotes its
    dataset's text verbatim, and a ShareGPT user's own paths are theirs, not this machine's."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if isinstance(record, dict) and record.get("source") in ("xsum", "sharegpt", "mmlu") and "system_prompt" in record:
        return json.dumps({k: v for k, v in record.items() if k not in ("system_prompt", "labels")})
    return line


def test_the_checker_sees_a_machine_path():
    assert MACHINE_PATH.search("written to /wo" "rk/main/runs/x") and MACHINE_PATH.search("/ro" "ot/.cache/y")
    assert not MACHINE_PATH.search("~/.cache/edgekv and runs/work/x and reports/*/work")
    quoted = {"name": "sharegpt-a", "source": "sharegpt", "system_prompt": "error in /Us" "ers/me/app.js",
              "labels": []}
    assert not MACHINE_PATH.search(ours(json.dumps(quoted)))
    assert MACHINE_PATH.search(ours(json.dumps({**quoted, "out": "/wo" "rk/main/runs/x"})))


def test_no_absolute_machine_path_anywhere_in_the_repo():
    bad = []
    for path in repo_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (plots, safetensors)
        bad += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                if MACHINE_PATH.search(ours(line))]
    assert not bad, "\n".join(bad[:20])


def test_reports_readme_indexes_every_report():
    index = (ROOT / "reports" / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "reports").iterdir()) if p.is_dir() and p.name not in index]
    assert not missing, missing


def test_readme_is_read_in_one_sitting_and_holds_the_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 450
    assert readme.count("python3 -m venv .venv") == 2


def test_tests_take_fixtures_from_conftest_and_helpers_from_a_module():
    needle = "tests.conf" "test import"  # in pieces, so this file does not hold it
    importing = [p.name for p in (ROOT / "tests").glob("test_*.py") if needle in p.read_text("utf-8")]
    assert not importing, importing
