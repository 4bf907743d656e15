"""A content-addressed catalog of KV exports on any fsspec store (a local folder, `file://`, `memory://`, `s3://`,
`gs://`; `http(s)://` read-only): CE-LSLM's cloud "stores the KV cache in the cloud service or distributes it to
the local disk of edge devices", LMCache keys KV by content.

An entry's key is the sha256 of everything that determines the export (both models' fingerprints, the system
prompt's token ids, every compress setting that changes bytes, a given translator's digest), so the same request
twice is the same entry and a different one can never overwrite it. What holds under faults (issue 35):

- An entry is the export's own files under `<root>/<key>/`, layer files first and the manifest last, each staged
  under a name unique to its writer and renamed into place (a local folder), or put whole (object stores put whole
  objects). The manifest is the commit point: a reader (which opens it first and checks every file's sha256) never
  sees a half entry, and two writers of one key write the same bytes.
- `<key>/entry.json` (after the manifest) records the entry's name, so `rebuild_index` restores names.
- `index.jsonl` lists key → name, system-prompt hash, bytes, created. It is read, changed and rewritten under an
  exclusive lock: a lock file (`fcntl.flock`) on a local folder, shared by every process of the machine, and a
  process lock on `memory://`, so concurrent writers never lose a row there. Object stores offer no lock: there
  two writers may still race on the index (never on an entry), and `rebuild_index` restores it from the entries.
- "Already there" means verified (`check`: the manifest parses and every file's sha256 matches); a damaged entry is
  recomputed by the next run (`status` repaired). `rebuild_index` skips and reports a damaged entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import exclusive
from edgekv.kv.export import MANIFEST, KVExport, KVStoreError
from edgekv.texts import jsonl_records

INDEX = "index.jsonl"
ENTRY = "entry.json"
LOCK = ".index.lock"
_LOCKS: dict[str, threading.Lock] = {}  # per catalog URL: the index lock of threads that share no file system
_LOCKS_GUARD = threading.Lock()


def export_key(identity: dict) -> str:
    """The content address of an export: sha256 of its identity as canonical JSON."""
    body = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(body).hexdigest()[:32]


class Catalog:
    """Exports by key on one fsspec store."""

    def __init__(self, url: str | Path):
        import fsspec

        self.url = str(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise EdgeKVError(f"--catalog {url}: cannot open this store ({exc})") from exc
        self.root = root.rstrip("/")
        self.protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = self.protocol in ("file", "local")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def source(self, key: str) -> str:
        """What `KVExport` opens for an entry: a local directory, or the entry's URL."""
        return self._path(key) if self.local else f"{self.protocol}://{self._path(key)}"

    # test hook: called with each file's name after it is written (a kill at every write step, simulated)
    after_write: Callable[[str], None] | None = None

    def has(self, key: str) -> bool:
        """Whether an entry's manifest (written last) exists; `check` says whether the entry is whole."""
        return self.fs.exists(self._path(key, MANIFEST))

    def check(self, key: str) -> str | None:
        """None when entry `key` is whole (its manifest parses and every file's sha256 matches), else why not."""
        try:
            KVExport(self.source(key)).verify_all()
        except (KVStoreError, OSError) as exc:
            return str(exc).splitlines()[0]
        return None

    def status(self, key: str) -> str:
        """`ok` (whole), `missing` (no manifest) or `damaged` (a manifest that does not verify)."""
        if not self.has(key):
            return "missing"
        return "ok" if self.check(key) is None else "damaged"

    def _write(self, path: str, body: bytes) -> None:
        """One file, all or nothing: staged under a name unique to this writer and renamed (a local folder), or
        put whole (an object store's put is atomic)."""
        if self.local:
            head, _, name = path.rpartition("/")
            tmp = f"{head}/.{name}.tmp-{uuid.uuid4().hex}"
            self.fs.pipe_file(tmp, body)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, body)
        if self.after_write is not None:
            self.after_write(path.rsplit("/", 1)[-1])

    def put(self, key: str, name: str, export_dir: str | Path, prompt_sha256: str, index: bool = True) -> dict:
        """Copy a finished export directory in as entry `key` (a damaged one there is replaced: its manifest goes
        first, so no reader trusts it meanwhile), then list it in the index (`index=False`: the caller lists many
        at once with `add_to_index`). Returns the index row."""
        export_dir = Path(export_dir)
        manifest = json.loads((export_dir / MANIFEST).read_bytes())
        # the export proper: its layer files and named extras (report.json, with timings and paths, stays out)
        files = [export_dir / e["file"] for e in manifest["layers"]] + [export_dir / n for n in manifest["files"]]
        row = {"key": key, "name": name, "prompt_sha256": prompt_sha256,
               "bytes": sum(f.stat().st_size for f in files) + (export_dir / MANIFEST).stat().st_size,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            self.fs.makedirs(self._path(key), exist_ok=True)
            if self.has(key):
                self.fs.rm_file(self._path(key, MANIFEST))
            for f in files:
                self._write(self._path(key, f.name), f.read_bytes())
            self._write(self._path(key, MANIFEST), (export_dir / MANIFEST).read_bytes())  # the commit point
            self._write(self._path(key, ENTRY), json.dumps(row, ensure_ascii=False).encode())
        except OSError as exc:
            raise EdgeKVError(f"cannot write entry {key} to {self.url}: {exc}") from exc
        if index:
            self.add_to_index([row])
        return row

    @contextlib.contextmanager
    def _index_lock(self) -> Iterator[None]:
        """Exclusive use of the index: a lock file on a local folder (every process of the machine), a process
        lock otherwise (threads sharing `memory://`); object stores get no more than that (see the module doc)."""
        with _LOCKS_GUARD:
            lock = _LOCKS.setdefault(self.url, threading.Lock())
        with lock:
            if not self.local:
                yield
                return
            self.fs.makedirs(self.root, exist_ok=True)
            with exclusive(self._path(LOCK)):
                yield

    def add_to_index(self, rows: list[dict]) -> None:
        """List entries in the index (a key listed again takes its new row), under the index lock."""
        keys = {r["key"] for r in rows}
        with self._index_lock():
            self._write_index([r for r in self.entries() if r["key"] not in keys] + rows)

    def list_written(self, rows: list[tuple[dict, bool]]) -> None:
        """List what workers wrote or found, given as (row, computed now): every computed entry, and any found
        entry not listed yet (one a killed run left unlisted); rows without bytes/created get them as None."""
        listed = {r["key"] for r in self.entries()}
        new = [{"bytes": None, "created": None, **row} for row, computed in rows
               if computed or row["key"] not in listed]
        if new:
            self.add_to_index(new)

    def entries(self) -> list[dict]:
        """The index rows (none for an empty catalog); a torn or foreign line is left out."""
        path = self._path(INDEX)
        if not self.fs.exists(path):
            return []
        lines = self.fs.cat_file(path).decode("utf-8", errors="replace").splitlines()
        return [row for _, row in jsonl_records(lines, path, on_bad=lambda n: None)
                if isinstance(row, dict) and {"key", "name", "prompt_sha256"} <= set(row)]

    def _write_index(self, rows: list[dict]) -> None:
        self._write(self._path(INDEX), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())

    def keys(self) -> list[str]:
        """Every entry folder's key (whole or not)."""
        out = []
        for path in sorted(self.fs.ls(self.root, detail=False)):
            key = path.rstrip("/").rsplit("/", 1)[-1]
            if not key.startswith(".") and key != INDEX and self.fs.isdir(path):
                out.append(key)
        return out

    def verify(self) -> dict:
        """Every entry checked: {ok: [keys], damaged: {key: why}, incomplete: [keys with no manifest]}, and
        whether the index lists exactly the whole entries."""
        out: dict = {"ok": [], "damaged": {}, "incomplete": []}
        for key in self.keys():
            if not self.has(key):
                out["incomplete"].append(key)
            elif (why := self.check(key)) is not None:
                out["damaged"][key] = why
            else:
                out["ok"].append(key)
        listed = {r["key"] for r in self.entries()}
        out["unlisted"] = sorted(set(out["ok"]) - listed)
        out["listed_not_whole"] = sorted(listed - set(out["ok"]))
        return out

    def rebuild_index(self) -> dict:
        """The index recovered from the whole entries (names from each entry's side record, else the index's row,
        else the key); damaged entries are left out and reported. Returns {rows, damaged: {key: why}}."""
        known = {r["key"]: r for r in self.entries()}
        rows, damaged = [], {}
        for key in self.keys():
            if not self.has(key):
                continue
            why = self.check(key)
            if why is not None:
                damaged[key] = why
                continue
            row = None
            try:
                side = json.loads(self.fs.cat_file(self._path(key, ENTRY)))
                if isinstance(side, dict) and side.get("key") == key:
                    row = side
            except (OSError, json.JSONDecodeError, UnicodeDecodeError):
                pass
            if row is None:
                manifest = KVExport(self.source(key)).manifest
                row = known.get(key) or {"key": key, "name": key,
                                         "prompt_sha256": manifest["system_prompt"]["token_ids_sha256"],
                                         "bytes": None, "created": None}
            rows.append(row)
        with self._index_lock():
            self._write_index(rows)
        return {"rows": rows, "damaged": damaged}

    def names(self) -> dict[str, str]:
        """Every way a request may name an entry → the entry's name."""
        return {alias: r["name"] for r in self.entries() for alias in _aliases(r)}

    def resolve(self, model: str) -> str:
        """The key of the entry a request names (a one-line error for none)."""
        for r in self.entries():
            if model in _aliases(r):
                return r["key"]
        raise KVStoreError(f"{self.url}: no entry named '{model}' (names, keys or prompt hashes)")


def _aliases(row: dict) -> tuple[str, str, str]:
    """An index row's names: its name, its key and its system prompt's hash."""
    return row["name"], row["key"], row["prompt_sha256"]
