"""A content-addressed catalog of KV exports on any fsspec store (a local folder, `file://`, `memory://`, `s3://`,
`gs://`; `http(s)://` read-only): CE-LSLM's cloud "stores the KV cache in the cloud service or distributes it to
the local disk of edge devices", LMCache keys KV by content.

An entry's key is the sha256 of everything that determines the export (both models' fingerprints, the system
prompt's token ids, every compress setting that changes bytes, a given translator's digest), so the same request
twice is the same entry and a different one can never overwrite it. An entry is the export's own files under
`<root>/<key>/`, written layer files first and the manifest last: a reader (which opens the manifest first and
checks every file's sha256) never sees a half entry, and two writers of one key write the same bytes.
`index.jsonl` lists key → name, system-prompt hash, bytes, created; it is rewritten whole (object stores have no
append) and `rebuild_index` recovers it from the entries themselves.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.kv.export import MANIFEST, KVStoreError

INDEX = "index.jsonl"


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

    def has(self, key: str) -> bool:
        """Whether a complete entry (its manifest, written last) exists."""
        return self.fs.exists(self._path(key, MANIFEST))

    def put(self, key: str, name: str, export_dir: str | Path, prompt_sha256: str, index: bool = True) -> dict:
        """Copy a finished export directory in as entry `key` (layer files first, manifest last), then list it in
        the index (`index=False`: the caller lists many at once with `add_to_index`). Returns the index row."""
        export_dir = Path(export_dir)
        manifest = json.loads((export_dir / MANIFEST).read_bytes())
        # the export proper: its layer files and named extras (report.json, with timings and paths, stays out)
        files = [export_dir / e["file"] for e in manifest["layers"]] + [export_dir / n for n in manifest["files"]]
        try:
            self.fs.makedirs(self._path(key), exist_ok=True)
            for f in files:
                self.fs.pipe_file(self._path(key, f.name), f.read_bytes())
            self.fs.pipe_file(self._path(key, MANIFEST), (export_dir / MANIFEST).read_bytes())
        except OSError as exc:
            raise EdgeKVError(f"cannot write entry {key} to {self.url}: {exc}") from exc
        row = {"key": key, "name": name, "prompt_sha256": prompt_sha256,
               "bytes": sum(f.stat().st_size for f in files) + (export_dir / MANIFEST).stat().st_size,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if index:
            self.add_to_index([row])
        return row

    def add_to_index(self, rows: list[dict]) -> None:
        """List entries in the index (a key listed again takes its new row)."""
        keys = {r["key"] for r in rows}
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
        """The index rows (none for an empty catalog); a torn last line is left out."""
        path = self._path(INDEX)
        if not self.fs.exists(path):
            return []
        rows = []
        for line in self.fs.cat_file(path).decode("utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def _write_index(self, rows: list[dict]) -> None:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
        if self.local:  # a local folder: staged and renamed, so a reader never sees half an index
            tmp = self._path(f".{INDEX}.tmp")
            self.fs.pipe_file(tmp, body)
            self.fs.mv(tmp, self._path(INDEX))
        else:  # object stores put whole objects
            self.fs.pipe_file(self._path(INDEX), body)

    def rebuild_index(self) -> list[dict]:
        """The index recovered from the complete entries' manifests (after two writers raced on it)."""
        known = {r["key"]: r for r in self.entries()}
        rows = []
        for path in sorted(self.fs.ls(self.root, detail=False)):
            key = path.rstrip("/").rsplit("/", 1)[-1]
            if key.startswith(".") or key == INDEX or not self.has(key):
                continue
            manifest = json.loads(self.fs.cat_file(self._path(key, MANIFEST)))
            rows.append(known.get(key) or {"key": key, "name": key,
                                           "prompt_sha256": manifest["system_prompt"]["token_ids_sha256"],
                                           "bytes": None, "created": None})
        self._write_index(rows)
        return rows

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
