"""Every kind of translator and fuser, registered by name, and how a translator is saved and read back.

Importing this module registers every kind (`translators.py`: ridge, hidden, trained; `fusers.py`: fuse-bias,
fuse-residual); code that looks a translator up by name, or reads one from disk or an export, goes through here.
A new translator is one class with `@register_translator` in a module imported below.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.atomic import write_bytes_atomic
from edgekv.kv import fusers
from edgekv.kv.translators import TRANSLATORS, Translator

__all__ = ["TRANSLATORS", "fusers", "is_fuser", "load_translator", "save_translator", "translator_class",
           "translator_files", "translator_from_files"]


def translator_class(name: str) -> type[Translator]:
    """The registered class of `name`; one-line error naming the choices."""
    if name not in TRANSLATORS:
        raise EdgeKVError(f"unknown translator '{name}' (choose from {', '.join(TRANSLATORS)})")
    return TRANSLATORS[name]


def is_fuser(name: str | None) -> bool:
    """Whether `name` is a fuser (its cloud KV joins the edge's own through gates) rather than a replacement."""
    return name in TRANSLATORS and issubclass(TRANSLATORS[name], fusers.Fuser)


# ------------------------------------------------------------------------------------- saving and loading
# A saved translator is two files: translator.safetensors (its maps) and translator.json (name, layer pairing,
# fit statistics, the fingerprints of the model pair it was made for, and the sha256 of the tensor file).

TRANSLATOR_TENSORS = "translator.safetensors"
TRANSLATOR_CONFIG = "translator.json"


def translator_files(translator, cloud_fingerprint: str, edge_fingerprint: str) -> dict[str, bytes]:
    """The two files of a saved translator, as bytes."""
    from safetensors.torch import save as st_save

    # float16 stays float16 (a compact fuser's maps); everything else is stored as float32
    blob = st_save({k: v.detach().contiguous() if v.dtype == torch.float16 else v.detach().contiguous().float()
                    for k, v in translator.tensors().items()})
    config = {"format": "edgekv-translator", "version": 1, "name": translator.name,
              "info": {str(i): v for i, v in sorted(translator.info.items())},
              "cloud_fingerprint": cloud_fingerprint, "edge_fingerprint": edge_fingerprint,
              "tensors_sha256": hashlib.sha256(blob).hexdigest()}
    return {TRANSLATOR_TENSORS: blob, TRANSLATOR_CONFIG: json.dumps(config, indent=1).encode()}


def translator_from_files(files: dict[str, bytes], where: str, cloud_fingerprint: str | None = None,
                          edge_fingerprint: str | None = None):
    """Rebuild a translator from its two files; refuses one made for another model pair, or altered bytes."""
    from safetensors.torch import load as st_load

    try:
        config = json.loads(files[TRANSLATOR_CONFIG].decode("utf-8"))
        blob = files[TRANSLATOR_TENSORS]
        if config.get("format") != "edgekv-translator":
            raise ValueError("not an edgekv translator")
        cls = translator_class(config["name"])
    except KeyError as exc:
        raise EdgeKVError(f"{where}: translator is missing {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, EdgeKVError) as exc:
        raise EdgeKVError(f"{where}: not a readable translator ({exc})") from exc
    for what, want, have in (("cloud", cloud_fingerprint, config.get("cloud_fingerprint")),
                             ("edge", edge_fingerprint, config.get("edge_fingerprint"))):
        if want is not None and want != have:
            raise EdgeKVError(f"{where}: translator made for another {what} model (fingerprint "
                              f"{str(have)[:16]}…, this one is {want[:16]}…)")
    if hashlib.sha256(blob).hexdigest() != config.get("tensors_sha256"):
        raise EdgeKVError(f"{where}: translator tensors do not match their sha256 (corrupted or altered)")
    translator = cls()
    translator.info = {int(i): v for i, v in config["info"].items()}
    try:
        translator.load_tensors(st_load(blob))
    except Exception as exc:  # safetensors' own error types, or a missing map
        raise EdgeKVError(f"{where}: translator tensors do not fit its config ({exc})") from exc
    return translator


def save_translator(translator, path: str | Path, cloud_fingerprint: str, edge_fingerprint: str) -> None:
    """Write translator.safetensors + translator.json into directory `path` (each file atomically)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name, blob in translator_files(translator, cloud_fingerprint, edge_fingerprint).items():
        write_bytes_atomic(path / name, blob)


def load_translator(path: str | Path, cloud_fingerprint: str | None = None, edge_fingerprint: str | None = None):
    """A translator saved with `save_translator` (or a training checkpoint directory)."""
    path = Path(path)
    files = {}
    for name in (TRANSLATOR_TENSORS, TRANSLATOR_CONFIG):
        try:
            files[name] = (path / name).read_bytes()
        except OSError as exc:
            raise EdgeKVError(f"{path}: no saved translator there ({name}: {exc.strerror or exc})") from exc
    return translator_from_files(files, str(path), cloud_fingerprint, edge_fingerprint)


