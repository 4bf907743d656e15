"""Fault injection (issue 35): what a user gets when a worker is killed, writers race, a write stops half-way, a
file is damaged or a store cannot be reached. Each case asserts the outcome a user sees: the batch completes or
names each failed item, every entry verifies, the index equals a rebuild, names resolve, and nothing half-written
is ever served. Tiny models; the Ray cases start a local cluster (marked slow)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.kv.batch_compress import run_compress_batch
from edgekv.kv.catalog import INDEX, Catalog
from edgekv.kv.compress_job import CompressConfig
from edgekv.kv.export import MANIFEST, KVExport, KVStoreError
from tests.helpers import PROMPT, SYSTEM

runner = CliRunner()
ENTRY = "entry.json"  # an entry's side record (its name)


def _prompts(path: Path, n: int = 2) -> Path:
    texts = [SYSTEM, PROMPT] + [f"{SYSTEM} Variant {k}: keep answers to {k} words." for k in range(max(0, n - 2))]
    path.write_text("".join(json.dumps({"name": f"p{k}", "system_prompt": t}) + "\n" for k, t in enumerate(texts[:n])))
    return path


def _cfg(edge_dir, **kw) -> CompressConfig:
    return CompressConfig(**{"cloud": edge_dir, "edge": edge_dir, "dtype": "float32", "quant": "int8",
                             "start_layer": 1, **kw})


def _whole(url: str, names: list[str]) -> None:
    """What a user expects of a catalog after any fault: every entry whole, the index = a rebuild, names resolve."""
    catalog = Catalog(url)
    report = catalog.verify()
    assert report["damaged"] == {} and report["unlisted"] == [] and report["listed_not_whole"] == [], report
    listed = sorted((r["key"], r["name"]) for r in catalog.entries())
    rebuilt = catalog.rebuild_index()
    assert rebuilt["damaged"] == {} and sorted((r["key"], r["name"]) for r in rebuilt["rows"]) == listed
    for name in names:
        KVExport(catalog.source(catalog.resolve(name))).verify_all()


# ------------------------------------------------------------------------------------------------ Ray workers

def _actor_pids() -> list[int]:
    import psutil

    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any("ray::Actor" in part for part in (p.info["cmdline"] or []))]


def kill_one_actor_after_first_entry(root: Path, killed: list, timeout: float = 300) -> None:
    """SIGKILL one Ray actor process of this batch as soon as the first entry's manifest appears (a worker dying
    mid-batch). The batch's actors (those that appear after this starts) are found while they load their models,
    so the kill lands the moment the entry does."""
    deadline = time.monotonic() + timeout
    before = set(_actor_pids())  # actors of another batch or an earlier test: never this batch's workers
    pids: list[int] = []
    while time.monotonic() < deadline and not pids:
        pids = [pid for pid in _actor_pids() if pid not in before]
        time.sleep(0.05)
    while time.monotonic() < deadline:
        if any(root.glob(f"*/{MANIFEST}")):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
                return
            return
        time.sleep(0.002)


@pytest.mark.slow
def test_ray_retry_reaches_a_live_worker(edge_dir, tmp_path):
    """compress --prompts (8 prompts) --ray local --workers 2, one actor SIGKILLed after the first entry: every
    prompt is written (the lost task retried on a live or fresh actor), none failed, the catalog whole."""
    url = str(tmp_path / "cat")
    killed: list[int] = []
    watcher = threading.Thread(target=kill_one_actor_after_first_entry, args=(tmp_path / "cat", killed))
    watcher.start()
    done = run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path / "p.jsonl", 8)), catalog=url, ray="",
                                   workers=2))
    watcher.join()
    assert killed, "no actor was killed: the case did not happen"
    assert done["failed"] == [] and done["computed"] + done["skipped"] == 8
    _whole(url, [f"p{k}" for k in range(8)])


def _self_killing(marker: str):
    def make():
        def work(item):
            if item == "poison-once" and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # the actor dies running this item, once
            if item == "poison":
                os.kill(os.getpid(), signal.SIGKILL)  # kills every actor that takes it
            return {"value": item}
        return work
    return make


@pytest.mark.slow
def test_a_dead_actor_leaves_the_pool_and_an_item_that_kills_every_actor_is_reported(tmp_path):
    """run_items: the item whose actor died once completes on another actor; an item that kills each actor that
    runs it is reported as failed after its retries, and every other item still completes."""
    from edgekv.cluster import run_items

    items = ["a", "poison-once", "b", "c", "poison", "d", "e"]
    results = run_items(_self_killing(str(tmp_path / "died")), items, address=None, workers=2)
    assert [r["item"] for r in results] == items
    assert [r.get("value") for r in results if r["item"] != "poison"] == [i for i in items if i != "poison"]
    poison = results[items.index("poison")]
    assert "died" in poison["error"]


# ------------------------------------------------------------------------------------------------ concurrent writers

def _index_writer(url: str, writer: int, n: int) -> int:
    catalog, errors = Catalog(url), 0
    for k in range(n):
        try:
            catalog.add_to_index([{"key": f"{writer}-{k}", "name": f"w{writer}-{k}", "prompt_sha256": f"{k}",
                                   "bytes": 1, "created": None}])
        except Exception:  # noqa: BLE001 - counted: any error is a lost row
            errors += 1
    return errors


@pytest.mark.parametrize("writers", [2, 4])
def test_concurrent_index_writers_on_a_folder_lose_no_row(tmp_path, writers):
    """Processes adding rows to one folder catalog's index at once: no error, no row lost. (Spawned, not forked:
    a fork of a process whose torch, OpenMP or Ray threads are running can crash in the child.)"""
    n = 100
    with mp.get_context("spawn").Pool(writers) as pool:
        errors = pool.starmap(_index_writer, [(str(tmp_path), w, n) for w in range(writers)])
    assert errors == [0] * writers
    assert sorted(r["key"] for r in Catalog(str(tmp_path)).entries()) == sorted(
        f"{w}-{k}" for w in range(writers) for k in range(n))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no staged file left behind


@pytest.mark.parametrize("writers", [2, 4])
def test_concurrent_index_writers_on_memory_lose_no_row(writers):
    """Threads sharing one memory:// catalog (the store of one process): no row lost."""
    import uuid

    url = f"memory://faults-{uuid.uuid4().hex}"
    errors: list[int] = []
    threads = [threading.Thread(target=lambda w=w: errors.append(_index_writer(url, w, 100))) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [0] * writers and len(Catalog(url).entries()) == 100 * writers


def _batch_writer(edge_dir: str, prompts: str, url: str) -> dict:
    return run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))


@pytest.mark.parametrize("writers", [2, 4])
def test_concurrent_batch_compress_on_one_catalog(edge_dir, tmp_path, writers):
    """`writers` processes compressing overlapping prompt files into one folder catalog at once: every prompt of
    every writer is written or found, the catalog is whole and its index equals a rebuild."""
    files = []
    for w in range(writers):  # writer w: prompts w .. w+3 of a shared list (neighbours overlap)
        rows = [json.loads(line) for line in _prompts(tmp_path / "all.jsonl", writers + 4).read_text().splitlines()]
        path = tmp_path / f"w{w}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[w:w + 4]))
        files.append(str(path))
    url = str(tmp_path / "cat")
    with mp.get_context("spawn").Pool(writers) as pool:
        done = pool.starmap(_batch_writer, [(edge_dir, f, url) for f in files])
    assert all(d["failed"] == [] and d["computed"] + d["skipped"] == 4 for d in done)
    _whole(url, [f"p{k}" for k in range(writers + 3)])


# ------------------------------------------------------------------------------------------------ a write stops

def _files_of_one_entry(edge_dir, tmp_path) -> int:
    """How many files one entry's put writes (layer files, manifest, side record)."""
    url = str(tmp_path / "count")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path / "one.jsonl", 1)), catalog=url))
    key = Catalog(url).entries()[0]["key"]
    return len([p for p in (tmp_path / "count" / key).iterdir()])


class Killed(Exception):
    """The simulated kill."""


def test_a_kill_at_every_write_step_is_never_served_and_a_rerun_heals(edge_dir, tmp_path, monkeypatch):
    """A writer stopped after each file of an entry in turn: the half entry is never served (no name resolves to
    it, opening it is refused), and the same command run again leaves the catalog whole."""
    steps = _files_of_one_entry(edge_dir, tmp_path)
    prompts = str(_prompts(tmp_path / "p.jsonl", 1))
    for stop_after in range(steps):
        url = str(tmp_path / f"cat{stop_after}")
        written: list[str] = []

        def hook(name: str, written=written, stop_after=stop_after) -> None:
            written.append(name)
            if len(written) > stop_after:
                raise Killed(f"killed after {name}")

        monkeypatch.setattr(Catalog, "after_write", staticmethod(hook))
        with pytest.raises(Killed):
            run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
        monkeypatch.setattr(Catalog, "after_write", None)
        catalog = Catalog(url)
        key = next(p.name for p in (tmp_path / f"cat{stop_after}").iterdir() if p.is_dir())
        if written[-1] not in (MANIFEST, ENTRY):  # stopped before the commit point: not an entry at all
            assert catalog.status(key) == "missing" and catalog.entries() == []
            with pytest.raises(KVStoreError):
                catalog.resolve("p0")
        done = run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
        assert done["failed"] == [] and done["computed"] + done["skipped"] == 1
        _whole(url, ["p0"])


# ------------------------------------------------------------------------------------------------ damaged files

def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        k = len(data) // 2
        path.write_bytes(data[:k] + bytes([data[k] ^ 0x01]) + data[k + 1:])
    else:
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("kind", ["layer", "manifest", "entry", "index"])
def test_a_damaged_file_is_refused_reported_and_healed(edge_dir, tmp_path, kind, how):
    """A flipped byte or a truncated file in each kind of file: a damaged entry is refused when opened and reported
    by verify (the other entry keeps serving), rebuild skips and reports it, and a rerun repairs it."""
    url = str(tmp_path / "cat")
    prompts = str(_prompts(tmp_path / "p.jsonl", 2))
    run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
    catalog = Catalog(url)
    key = catalog.resolve("p0")
    target = {"layer": tmp_path / "cat" / key / "layer_02.safetensors", "manifest": tmp_path / "cat" / key / MANIFEST,
              "entry": tmp_path / "cat" / key / ENTRY, "index": tmp_path / "cat" / INDEX}[kind]
    assert target.exists(), sorted(p.name for p in target.parent.iterdir())
    _damage(target, how)
    if kind in ("layer", "manifest"):  # the export itself: refused when opened, healed by the same command again
        with pytest.raises(KVStoreError):
            KVExport(catalog.source(key)).verify_all()
        KVExport(catalog.source(catalog.resolve("p1"))).verify_all()  # the other entry still serves
        assert key in Catalog(url).rebuild_index()["damaged"]  # skipped and reported, not a crash
        assert key in catalog.verify()["damaged"]
        again = run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
        KVExport(catalog.source(key)).verify_all()  # healed: "already there" meant verified
        assert again["repaired"] == 1 and again["skipped"] == 1
    else:  # the side record or the index: the entries are whole; a rebuild restores what was lost
        catalog.rebuild_index()
    _whole(url, ["p0", "p1"])


@pytest.mark.parametrize("kind,how", [("layer", "flip"), ("manifest", "truncate")])
def test_a_rerun_heals_a_damaged_entry(edge_dir, tmp_path, kind, how):
    """The same `compress --prompts` run again after a layer file or the manifest was damaged: the entry is
    computed again and opens whole (before issue 35 the rerun said "already in" and left it broken)."""
    url = str(tmp_path / "cat")
    prompts = str(_prompts(tmp_path / "p.jsonl", 1))
    run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
    key = next(p.name for p in (tmp_path / "cat").iterdir() if p.is_dir())
    _damage(tmp_path / "cat" / key / ("layer_02.safetensors" if kind == "layer" else MANIFEST), how)
    run_compress_batch(_cfg(edge_dir, prompts=prompts, catalog=url))
    KVExport(Catalog(url).source(key)).verify_all()


def test_rebuild_keeps_names(edge_dir, tmp_path):
    """A rebuild of a clean catalog restores every entry under its name (names live in each entry's side record),
    also when the index is gone."""
    url = str(tmp_path / "cat")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path / "p.jsonl", 2)), catalog=url))
    before = sorted((r["key"], r["name"]) for r in Catalog(url).entries())
    Catalog(url).rebuild_index()
    assert Catalog(url).resolve("p1") == dict((n, k) for k, n in before)["p1"]  # requests by name still resolve
    (tmp_path / "cat" / INDEX).unlink()
    Catalog(url).rebuild_index()
    assert sorted((r["key"], r["name"]) for r in Catalog(url).entries()) == before


def test_rebuild_skips_a_truncated_manifest(edge_dir, tmp_path):
    """One truncated manifest: rebuild lists the whole entries and leaves that one out (no JSON error)."""
    url = str(tmp_path / "cat")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path / "p.jsonl", 2)), catalog=url))
    key = Catalog(url).resolve("p0")
    _damage(tmp_path / "cat" / key / MANIFEST, "truncate")
    Catalog(url).rebuild_index()
    assert [r["name"] for r in Catalog(url).entries()] == ["p1"]


def test_catalog_verify_and_rebuild_commands(edge_dir, tmp_path):
    """`edgekv catalog verify` exits 1 and names a damaged entry; `rebuild` lists the whole ones; bad input is one
    line."""
    url = str(tmp_path / "cat")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path / "p.jsonl", 2)), catalog=url))
    ok = runner.invoke(app, ["catalog", "verify", url])
    assert ok.exit_code == 0, ok.output
    key = Catalog(url).resolve("p0")
    _damage(tmp_path / "cat" / key / MANIFEST, "truncate")
    bad = runner.invoke(app, ["catalog", "verify", url])
    assert bad.exit_code == 1 and key in bad.output
    rebuilt = runner.invoke(app, ["catalog", "rebuild", url])
    assert rebuilt.exit_code == 1 and key in rebuilt.output and "Traceback" not in rebuilt.output
    wrong = runner.invoke(app, ["catalog", "mend", url])
    assert wrong.exit_code == 1 and [ln for ln in wrong.output.splitlines() if ln.startswith("error: ")]


# ------------------------------------------------------------------------------------------------ inputs and stores

@pytest.mark.parametrize("command", ["compress", "distill"])
def test_non_utf8_prompts_are_one_line_naming_file_and_line(edge_dir, tmp_path, command):
    """Bytes that are not UTF-8 on line 2 of a --prompts file: one line naming the file and line, exit 1."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"name": "a", "system_prompt": "fine"}\n{"name": "b", "system_prompt": "\xff\xfe"}\n')
    args = ["--prompts", str(path), "--cloud", edge_dir, "--edge", edge_dir, "--dtype", "float32"]
    args += ["--catalog", str(tmp_path / "cat")] if command == "compress" else ["--out", str(tmp_path / "d")]
    result = runner.invoke(app, [command, *args])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(errors) == 1 and f"{path}:2: not UTF-8" in errors[0], result.output


def test_an_unreachable_store_is_one_line_for_the_server_and_the_operator(edge_dir, tmp_path):
    """serve-edge --catalog and catalog verify on a store nobody answers: one line, non-zero, nothing served."""
    url = "http://127.0.0.1:9/catalog"  # the discard port: nothing listens on loopback there
    served = runner.invoke(app, ["serve-edge", "--edge", edge_dir, "--catalog", url, "--dtype", "float32",
                                 "--cache-dir", str(tmp_path / "c")])
    errors = [line for line in served.output.splitlines() if line.startswith("error: ")]
    assert served.exit_code != 0 and "Traceback" not in served.output and len(errors) == 1, served.output
    checked = runner.invoke(app, ["catalog", "verify", url])
    assert checked.exit_code != 0 and "Traceback" not in checked.output


def test_catalog_errors_stay_edgekv_errors(tmp_path):
    """A store that cannot be opened is a one-line EdgeKVError, not a library exception."""
    with pytest.raises(EdgeKVError):
        Catalog("nosuchproto://x")


# ------------------------------------------------------------------------------------------------ file modes

@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_atomic_outputs_get_the_users_usual_mode(tmp_path, umask):
    """A file or folder written via temp-and-rename gets the mode a plain write would (the umask's), not the 0600/0700
    of a private temp file, so an export written by one user can be served by another; no temp is left behind."""
    import torch

    from edgekv.atomic import staged_dir, write_tensors_atomic, write_text_atomic

    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "a.json", "{}")
        write_tensors_atomic(tmp_path / "t.safetensors", {"x": torch.zeros(2)})
        with staged_dir(tmp_path / "d") as stage:
            write_text_atomic(stage / "b.json", "{}")
        with staged_dir(tmp_path / "d") as stage:  # replacing an output takes the same path
            write_text_atomic(stage / "b.json", "[]")
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert [mode(tmp_path / n) for n in ("a.json", "t.safetensors", "d/b.json")] == [0o666 & ~umask] * 3
    assert mode(tmp_path / "d") == 0o777 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "d", "t.safetensors"]
    assert (tmp_path / "d" / "b.json").read_text() == "[]"
