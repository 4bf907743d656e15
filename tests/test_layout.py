"""The package layout: one folder per stage of the data flow, imports only towards earlier stages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "edgekv"
# text → models → attention → align → kv → serve → distill → eval (edgekv/__init__.py says it in words)
STAGES = {"models": 1, "attention": 2, "align": 3, "kv": 4, "serve": 5, "distill": 6, "eval": 7}
HELPERS = {"__init__", "atomic", "cluster", "config", "progress", "plots", "runtime", "summary", "texts"}  # rank 0


def rank(module: str) -> int:
    """Stage rank of an `edgekv...` module name."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in HELPERS:
        return 0
    if parts[1] not in STAGES:
        raise AssertionError(f"{module}: not in a known stage; add the stage to STAGES and the package docstring")
    return STAGES[parts[1]]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str) -> list[str]:
    """Every edgekv module a source imports, at top level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "edgekv":
                out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "edgekv"]
    return out


def module_imports(module: str, source: str) -> set[str]:
    """The edgekv modules `module` imports: at top level, in functions, and under `if TYPE_CHECKING:` too (a
    type-only circle is still two modules that each need the other); `from pkg import name` counts as importing
    `pkg.name` when that is a module of the project."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("edgekv"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "edgekv"}
    return {m for m in out if m in MODULES and m != module}


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of the import graph, each once (depth-first search from each module in name order)."""
    cycles, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle + [nxt])
            elif len(path) < 12:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def test_checker_catches_an_import_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert not import_cycles({"a": {"b"}, "b": set()})


def test_no_import_circle_within_a_stage():
    graph = {m: module_imports(m, p.read_text(encoding="utf-8")) for m, p in MODULES.items()}
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(" → ".join(c) for c in cycles)


def test_a_type_only_import_counts():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edgekv.serve.engine import Engine\n"
    assert "edgekv.serve.engine" in module_imports("edgekv.serve.session", source)


def test_jobs_import_libraries_never_other_jobs():
    """A command's job module (`*_job.py`) builds on libraries; what two jobs share lives in a library."""
    bad = [f"{m} imports {t}" for m, p in MODULES.items() if m.endswith("_job")
           for t in module_imports(m, p.read_text(encoding="utf-8")) if t.endswith("_job") and m != t]
    assert not bad, "\n".join(bad)


def violations(module: str, source: str) -> list[str]:
    """Imports of `module` that go against the flow (a later stage)."""
    own = rank(module)
    bad = []
    for target in imported(source):
        r = rank(target)
        if r > own:
            bad.append(f"{module} (stage {own}) imports {target} (stage {r})")
    return bad


def test_checker_catches_a_backward_import():
    assert violations("edgekv.kv.decode", "def f():\n    from edgekv.serve.session import EdgeSession\n")
    assert violations("edgekv.align.mapping", "import edgekv.eval.report\n")
    assert not violations("edgekv.eval.report", "from edgekv.kv.export import KVExport\nfrom edgekv import X\n")


def test_imports_follow_the_data_flow():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        bad += violations(module_name(path), path.read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


def test_every_stage_is_a_folder_with_a_docstring_and_few_top_modules():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert len(top) <= 10, top
    assert set(top) == HELPERS
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted(STAGES)
    for stage in STAGES:
        doc = ast.get_docstring(ast.parse((ROOT / stage / "__init__.py").read_text()))
        assert doc and "import" in doc, f"edgekv/{stage}/__init__.py must say what it may import"


def test_the_offline_samples_are_found_from_the_moved_modules():
    from edgekv.eval.datasets import ROOT as data_root

    assert (data_root / "data" / "xsum" / "xsum_sample.jsonl").is_file()
    assert (data_root / "data" / "mmlu" / "mmlu_dev.jsonl").is_file()
