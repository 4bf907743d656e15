"""The export catalog (a folder or any fsspec store) and batch compress into it: byte-identical to one-by-one
compress, idempotent, no half entries, tampering refused, and serve-edge --catalog by name and by hash."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.kv.batch_compress import run_compress_batch
from edgekv.kv.catalog import Catalog
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.kv.export import MANIFEST, KVExport
from tests.helpers import PROMPT, SYSTEM

runner = CliRunner()
PROMPTS = {"assistant": SYSTEM, "background": PROMPT}


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"name": k, "system_prompt": v}) + "\n" for k, v in PROMPTS.items()))
    return path


def _cfg(edge_dir, **kw) -> CompressConfig:
    return CompressConfig(**{"cloud": edge_dir, "edge": edge_dir, "dtype": "float32", "quant": "int8",
                             "start_layer": 1, **kw})


@pytest.mark.parametrize("store", ["folder", "memory"])
def test_batch_compress_equals_one_by_one_and_reruns_compute_nothing(edge_dir, tmp_path, store):
    url = str(tmp_path / "cat") if store == "folder" else f"memory://edgekv-{uuid.uuid4().hex}"
    cfg = _cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=url)
    done = run_compress_batch(cfg)
    assert (done["computed"], done["skipped"], done["failed"]) == (2, 0, [])
    catalog = Catalog(url)
    rows = {r["name"]: r for r in catalog.entries()}
    assert set(rows) == set(PROMPTS) and all(len(r["key"]) == 32 for r in rows.values())
    for name, prompt in PROMPTS.items():  # the same bytes as compressing that prompt alone
        alone = tmp_path / f"alone-{name}"
        run_compress(_cfg(edge_dir, out=str(alone), system_prompt=prompt))
        manifest = json.loads((alone / MANIFEST).read_bytes())
        key = rows[name]["key"]
        for f in [MANIFEST] + [e["file"] for e in manifest["layers"]]:
            assert catalog.fs.cat_file(f"{catalog.root}/{key}/{f}") == (alone / f).read_bytes(), f
        export = KVExport(catalog.source(key))
        export.verify_all()
        assert export.manifest["system_prompt"]["token_ids_sha256"] == rows[name]["prompt_sha256"]
    again = run_compress_batch(cfg)
    assert (again["computed"], again["skipped"]) == (0, 2)
    other = run_compress_batch(_cfg(edge_dir, prompts=cfg.prompts, catalog=url, quant="int4"))
    assert other["computed"] == 2 and len(Catalog(url).entries()) == 4  # another setting: other keys


def test_a_killed_run_leaves_no_half_entry_and_resumes(edge_dir, tmp_path, monkeypatch):
    url = str(tmp_path / "cat")
    cfg = _cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=url)
    real = Catalog.put
    calls = []

    def dies_before_the_manifest(self, key, name, export_dir, sha, **kw):
        calls.append(name)
        if len(calls) == 2:  # the second entry: its layer files land, then the process "dies"
            layer = next(Path(export_dir).glob("layer_*.safetensors"))
            self.fs.makedirs(self._path(key), exist_ok=True)
            self.fs.pipe_file(self._path(key, layer.name), layer.read_bytes())
            raise KeyboardInterrupt
        return real(self, key, name, export_dir, sha, **kw)

    monkeypatch.setattr(Catalog, "put", dies_before_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        run_compress_batch(cfg)
    monkeypatch.setattr(Catalog, "put", real)
    catalog = Catalog(url)
    complete = [p.name for p in (tmp_path / "cat").iterdir() if p.is_dir() and catalog.has(p.name)]
    half = [p for p in (tmp_path / "cat").iterdir() if p.is_dir() and not catalog.has(p.name)]
    assert len(complete) == 1 and len(half) == 1 and not (half[0] / MANIFEST).exists()  # never served
    done = run_compress_batch(cfg)  # the finished entry is skipped (and listed), the half one computed
    assert (done["computed"], done["skipped"]) == (1, 1)
    assert sorted(r["name"] for r in catalog.entries()) == ["assistant", "background"]
    assert len(catalog.rebuild_index()["rows"]) == 2


def test_a_tampered_entry_is_refused(edge_dir, tmp_path):
    url = str(tmp_path / "cat")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=url))
    catalog = Catalog(url)
    key = catalog.resolve("assistant")
    layer = next((tmp_path / "cat" / key).glob("layer_*.safetensors"))
    blob = bytearray(layer.read_bytes())
    blob[-1] ^= 1
    layer.write_bytes(bytes(blob))
    with pytest.raises(EdgeKVError, match="sha256"):
        KVExport(catalog.source(key)).verify_all()


def test_bad_batch_input_is_one_line(edge_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "a", "system_prompt": "x"}\n{"name": "a", "system_prompt": "y"}\n')
    result = runner.invoke(app, ["compress", "--cloud", edge_dir, "--edge", edge_dir, "--prompts", str(bad),
                                 "--catalog", str(tmp_path / "cat")])
    assert result.exit_code == 1 and "bad.jsonl:2: the name 'a' is used twice" in result.output
    result = runner.invoke(app, ["compress", "--prompts", str(bad)])
    assert result.exit_code == 1 and "--prompts and --catalog go together" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "cat").exists()


def test_serve_edge_catalog_by_name_and_by_hash(edge_dir, tmp_path):
    from edgekv.serve.http_server import EdgeServer
    from edgekv.serve.serve_job import ServeConfig, open_session

    url = str(tmp_path / "cat")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=url))
    rows = {r["name"]: r for r in Catalog(url).entries()}
    pool = open_session(ServeConfig(edge=edge_dir, catalog=url, dtype="float32", cache_dir=str(tmp_path / "c")))
    assert sorted(pool.ids()) == sorted(PROMPTS) and pool.loaded() == {}  # lazy: fetched on first use
    server = EdgeServer(pool, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for model in ("assistant", rows["background"]["prompt_sha256"], rows["background"]["key"]):
            body = json.dumps({"model": model, "prompt": "User: hi", "max_tokens": 3}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            assert answer["usage"]["completion_tokens"] == 3
        assert sorted(pool.loaded()) == ["assistant", "background"]  # the hash and the key named one model
        body = json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
        pool.close()


@pytest.mark.slow
def test_batch_compress_on_ray_equals_in_process(edge_dir, tmp_path):
    """A local Ray cluster (2 CPUs, 2 actors that each load the model once): the same entries, byte for byte."""
    here, there = str(tmp_path / "here"), str(tmp_path / "there")
    run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=here))
    done = run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=there, ray="", workers=2))
    assert (done["computed"], done["failed"]) == (2, [])
    a, b = Catalog(here), Catalog(there)
    assert sorted((r["name"], r["key"]) for r in a.entries()) == sorted((r["name"], r["key"]) for r in b.entries())
    for r in a.entries():
        files = sorted(p.name for p in (tmp_path / "here" / r["key"]).iterdir())
        assert files == sorted(p.name for p in (tmp_path / "there" / r["key"]).iterdir())
        for f in files:  # the export's files; the side record says when the entry was written (its own time)
            if f == "entry.json":
                continue
            assert (tmp_path / "here" / r["key"] / f).read_bytes() == (tmp_path / "there" / r["key"] / f).read_bytes()
    again = run_compress_batch(_cfg(edge_dir, prompts=str(_prompts(tmp_path)), catalog=there, ray="", workers=2))
    assert (again["computed"], again["skipped"]) == (0, 2)
