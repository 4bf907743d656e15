"""The KV export (DESIGN.md §4): manifest.json + one layer_XX.safetensors per edge layer; never pickle.

Writing stages everything in a temp directory and renames it into place (optionally packing a single .tar).
Reading checks the manifest's own checksum, format version, model and tokenizer fingerprints, then each layer
file's size and sha256 before its bytes are parsed, so the edge can load one verified layer at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgekv import EdgeKVError, __version__
from edgekv.atomic import staged_dir
from edgekv.kv.registry import TRANSLATOR_CONFIG, TRANSLATOR_TENSORS, translator_from_files
from edgekv.models.loading import LoadedModel
from edgekv.models.structure import attn_shape, rotary_cos_sin

FORMAT = "edgekv-kv-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class KVStoreError(EdgeKVError):
    """A KV export that cannot be trusted or does not fit: the message names the file and what is wrong."""


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def token_ids_sha256(ids: list[int]) -> str:
    """Fingerprint of a token-id sequence (JSON list, no spaces)."""
    return sha256_bytes(json.dumps(list(map(int, ids)), separators=(",", ":")).encode())


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the sorted vocabulary (token → id) plus the special tokens (computed once per tokenizer object:
    hashing a 150k-token vocabulary takes half a second, too long to pay per request)."""
    cached = getattr(tokenizer, "_edgekv_fingerprint", None)
    if cached is not None and cached[0] == len(tokenizer):  # len() is cheap; get_vocab() builds a dict
        return cached[1]
    vocab = tokenizer.get_vocab()
    special = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    digest = sha256_bytes(json.dumps([sorted(vocab.items()), special], ensure_ascii=False,
                                     separators=(",", ":")).encode())
    try:
        tokenizer._edgekv_fingerprint = (len(tokenizer), digest)
    except AttributeError:  # a tokenizer that refuses new attributes: no caching
        pass
    return digest


def model_info(m: LoadedModel) -> dict:
    """Identity and attention shape of a model, for the manifest."""
    heads, kv_heads, head_dim = attn_shape(m.model)
    return {"model": m.spec, "source": m.source_shown, "fingerprint": m.fingerprint, "num_layers": m.num_layers,
            "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "rotary": rotary_cos_sin(m.model, torch.zeros(1, 1, dtype=torch.long),
                                     torch.zeros(1, 1, 1, head_dim)) is not None}


def export_manifest(cloud: dict, edge: LoadedModel, ids: torch.Tensor, layers: list[dict], *, regime: str, splice: str,
                    start_layer: int, mapping: str, map_location: str, local_sink_tokens: int, prune: dict,
                    quant: str, **more) -> dict:
    """An export's manifest: the models (`cloud`: its model_info; `edge`: the loaded edge model), the tokenizer and
    the system prompt's tokens every reader checks, how the layers were made, and the layers' entries."""
    return {"regime": regime, "splice": splice, "cloud": cloud, "edge": model_info(edge),
            "tokenizer_fingerprint": tokenizer_fingerprint(edge.tokenizer),
            "system_prompt": {"num_tokens": int(ids.numel()), "token_ids_sha256": token_ids_sha256(ids.tolist()),
                              "token_ids": ids.tolist()},
            "start_layer": start_layer, "mapping": mapping, "map_location": map_location,
            "local_sink_tokens": local_sink_tokens, "prune": prune, "quant": quant, "layers": layers, **more}


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def layer_file(edge_layer: int) -> str:
    """File name of an edge layer's tensors."""
    return f"layer_{edge_layer:02d}.safetensors"


def write_export(out: str | Path, manifest: dict, layers: dict[int, dict[str, torch.Tensor]],
                 as_tar: bool = False, extra: dict[str, bytes] | None = None) -> Path:
    """Write manifest + layer files (+ `extra` named files, e.g. a translator) atomically; fills in each file's
    bytes and sha256. Returns the path."""
    out = Path(out)
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION, created_by=f"edgekv {__version__}")
    entries = {e["edge_layer"]: e for e in manifest["layers"]}
    if set(entries) != set(layers):
        raise ValueError("manifest layers and tensors differ")
    blobs = {}
    for i, tensors in sorted(layers.items()):
        blob = st_save({k: v.contiguous() for k, v in tensors.items()})
        entries[i].update(file=layer_file(i), bytes=len(blob), sha256=sha256_bytes(blob),
                          tensors=sorted(tensors))
        blobs[layer_file(i)] = blob
    for name, blob in sorted((extra or {}).items()):
        blobs[name] = blob
    manifest["files"] = {name: {"bytes": len(blob), "sha256": sha256_bytes(blob)}
                         for name, blob in sorted((extra or {}).items())}
    manifest["manifest_sha256"] = sha256_bytes(_canonical(manifest))
    manifest_bytes = json.dumps(manifest, indent=1, ensure_ascii=False).encode()
    if as_tar:
        return _write_tar(out, manifest_bytes, blobs)
    with staged_dir(out) as staging:
        for name, blob in blobs.items():
            (staging / name).write_bytes(blob)
        (staging / MANIFEST).write_bytes(manifest_bytes)  # last: a directory with a manifest is complete
    return out


def _write_tar(out: Path, manifest_bytes: bytes, blobs: dict[str, bytes]) -> Path:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tarfile.open(tmp, "w") as tar:
            for name, blob in [(MANIFEST, manifest_bytes), *sorted(blobs.items())]:
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        os.replace(tmp, out)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise EdgeKVError(f"cannot write {out}: {exc.strerror or exc}") from exc
    return out


class FetchError(KVStoreError):
    """A file of a remote export could not be fetched (unreachable, refused, missing): a reason to fall back."""


def is_url(path: str | Path) -> bool:
    """A URL (http(s)://, s3://, …) rather than a local path."""
    return "://" in str(path) and not str(path).startswith("file://")


class _Source:
    """Reads named files of an export from a directory, a .tar (no extraction to disk), or a URL (fsspec)."""

    def __init__(self, path: Path | str):
        self.path = path
        self.tar = None
        self.fs = None
        if is_url(path):
            import fsspec

            try:
                self.fs, self.root = fsspec.core.url_to_fs(str(path))
            except (ImportError, ValueError) as exc:
                raise KVStoreError(f"{path}: cannot open this URL ({exc})") from exc
            return
        if path.is_file():
            try:
                self.tar = tarfile.open(path, "r:")
                self.members = {m.name: m for m in self.tar.getmembers() if m.isfile()}
            except (tarfile.TarError, OSError, EOFError) as exc:
                raise KVStoreError(f"{path}: not a readable KV export tar ({exc})") from exc
        elif not path.is_dir():
            raise KVStoreError(f"{path}: no KV export there")

    def read(self, name: str) -> bytes:
        where = f"{self.path}/{name}"
        if self.fs is not None:
            try:
                return self.fs.cat_file(f"{self.root.rstrip('/')}/{name}")
            except FileNotFoundError as exc:
                raise FetchError(f"{where}: missing") from exc
            except Exception as exc:  # network stacks raise many types; all mean "not fetched"
                raise FetchError(f"{where}: cannot fetch ({type(exc).__name__}: {exc})") from exc
        try:
            if self.tar is None:
                return (self.path / name).read_bytes()
            if name not in self.members:
                raise FileNotFoundError(name)
            handle = self.tar.extractfile(self.members[name])
            return handle.read()
        except FileNotFoundError as exc:
            raise KVStoreError(f"{where}: missing") from exc
        except (OSError, tarfile.TarError, EOFError) as exc:
            raise KVStoreError(f"{where}: cannot read ({exc})") from exc


@dataclass
class Expect:
    """What the reader requires of an export; None skips that check."""

    edge_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    cloud_fingerprint: str | None = None


class KVExport:
    """An opened, manifest-verified export; `layer(i)` verifies and parses one layer file."""

    def __init__(self, path: str | Path, expect: Expect | None = None):
        self.path = str(path).rstrip("/") if is_url(path) else Path(path)
        self._src = _Source(self.path)
        raw = self._src.read(MANIFEST)
        where = f"{self.path}/{MANIFEST}"
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise KVStoreError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(manifest, dict):
            raise KVStoreError(f"{where}: not a manifest object")
        if manifest.get("format") != FORMAT:
            raise KVStoreError(f"{where}: not an edgekv KV export (format {manifest.get('format')!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise KVStoreError(f"{where}: unknown format version {manifest.get('format_version')!r} "
                               f"(this edgekv reads version {FORMAT_VERSION})")
        if manifest.get("manifest_sha256") != sha256_bytes(_canonical(manifest)):
            raise KVStoreError(f"{where}: manifest checksum mismatch (edited or corrupted)")
        self.manifest = manifest
        self.manifest_bytes = raw
        self._check(expect or Expect(), where)
        try:
            self.entries = {int(e["edge_layer"]): e for e in manifest["layers"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise KVStoreError(f"{where}: malformed layer entries") from exc

    def _check(self, expect: Expect, where: str) -> None:
        m = self.manifest
        checks = [("edge model", expect.edge_fingerprint, m.get("edge", {}).get("fingerprint")),
                  ("cloud model", expect.cloud_fingerprint, m.get("cloud", {}).get("fingerprint")),
                  ("tokenizer", expect.tokenizer_fingerprint, m.get("tokenizer_fingerprint"))]
        for what, want, have in checks:
            if want is not None and want != have:
                raise KVStoreError(f"{where}: made for another {what} (fingerprint {str(have)[:24]}…, "
                                   f"this one is {want[:24]}…)")

    @property
    def layer_indices(self) -> list[int]:
        """Edge layers present, ascending."""
        return sorted(self.entries)

    def layer(self, edge_layer: int) -> dict[str, torch.Tensor]:
        """The verified tensors of one edge layer."""
        return self.parse_layer(edge_layer, self.layer_bytes(edge_layer))

    def layer_bytes(self, edge_layer: int) -> bytes:
        """The verified bytes of one edge layer's file (size and sha256 as in the manifest)."""
        entry = self.entries.get(edge_layer)
        if entry is None:
            raise KVStoreError(f"{self.path}: no layer {edge_layer} in the manifest")
        name = entry.get("file", "?")
        where = f"{self.path}/{name}"
        blob = self._src.read(name)
        if len(blob) != entry.get("bytes"):
            raise KVStoreError(f"{where}: {len(blob)} bytes, manifest says {entry.get('bytes')} (truncated?)")
        if sha256_bytes(blob) != entry.get("sha256"):
            raise KVStoreError(f"{where}: sha256 mismatch (corrupted or tampered)")
        return blob

    def parse_layer(self, edge_layer: int, blob: bytes) -> dict[str, torch.Tensor]:
        """Tensors of a layer file already verified by `layer_bytes`."""
        entry = self.entries[edge_layer]
        where = f"{self.path}/{entry.get('file', '?')}"
        try:
            tensors = st_load(blob)
        except Exception as exc:  # safetensors raises its own error types; the checksum passed, so the writer erred
            raise KVStoreError(f"{where}: not a valid safetensors file ({exc})") from exc
        if sorted(tensors) != entry.get("tensors"):
            raise KVStoreError(f"{where}: tensors {sorted(tensors)} differ from the manifest's")
        return tensors

    def file(self, name: str) -> bytes:
        """The verified bytes of a named extra file (e.g. translator.safetensors)."""
        entry = self.manifest.get("files", {}).get(name)
        if entry is None:
            raise KVStoreError(f"{self.path}: no file {name} in the manifest")
        blob = self._src.read(name)
        if len(blob) != entry.get("bytes") or sha256_bytes(blob) != entry.get("sha256"):
            raise KVStoreError(f"{self.path}/{name}: size or sha256 differs from the manifest (truncated or altered)")
        return blob

    def translator(self):
        """The translator the edge applies (map_location "edge"), checked against this export's model pair; None
        when the KV is already edge-shaped."""
        info = self.manifest.get("translator")
        if not info or info.get("applied_on") != "edge":
            return None
        return self.shipped_translator()

    def shipped_translator(self):
        """The translator (or fuser) shipped inside the export, checked against its model pair; None if none is."""
        info = self.manifest.get("translator")
        if not info or not info.get("shipped"):
            return None
        files = {n: self.file(n) for n in (TRANSLATOR_TENSORS, TRANSLATOR_CONFIG)}
        return translator_from_files(files, f"{self.path}/{TRANSLATOR_CONFIG}",
                                     self.manifest.get("cloud", {}).get("fingerprint"),
                                     self.manifest.get("edge", {}).get("fingerprint"))

    def verify_all(self) -> None:
        """Verify every layer file (reads them all)."""
        for i in self.layer_indices:
            self.layer(i)
        for name in self.manifest.get("files", {}):
            self.file(name)


def write_copy(export: KVExport, out: str | Path, blobs: dict[str, bytes]) -> None:
    """Write a verified local copy of an export (its manifest bytes and the given verified files), atomically."""
    with staged_dir(out) as staging:
        for name, blob in blobs.items():
            (staging / name).write_bytes(blob)
        (staging / MANIFEST).write_bytes(export.manifest_bytes)
