"""Load any causal LM (alias, hub id, local directory, .gguf file) and check tokenizer compatibility."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.models.mixed import hold_linears_in_bf16
from edgekv.models.packaged import (
    DEFAULT_MODELS,
    assemble_gguf,
    cache_root,
    default_model_dir,
    file_sha256,
    files_sha256,
)
from edgekv.models.structure import check_supported
from edgekv.runtime import onednn_bf16

log = logging.getLogger("edgekv")
# mixed: float32 arithmetic, linear weights held in bf16 (models/mixed.py)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "mixed": torch.float32}


@dataclass
class LoadedModel:
    """A model, its tokenizer, and where it came from."""

    spec: str
    model: torch.nn.Module
    tokenizer: object
    source: str
    fingerprint: str
    quantization: dict | None = None  # what quantize_linears did (--weights int8/int4), None for bf16

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def source_shown(self) -> str:
        """`source` as files record it: the model cache named ($EDGEKV_CACHE), not where it lies on this machine,
        so an export or a mapping made from a default model can be committed and compared across machines."""
        return self.source.replace(str(cache_root()), "$EDGEKV_CACHE")


def native_bf16(device: str) -> bool:
    """Whether `device` computes bf16 matmuls natively: a GPU that supports bf16, or a CPU whose instructions
    oneDNN runs bf16 on (AVX-512 and later). On an AVX2-only CPU torch falls back to a slow path: the default pair's
    256-token prefill took 4.1–5.8× float32's time there in three runs (`python -m bench.dtype_speed`,
    reports/dtype-speed/)."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return onednn_bf16()


def resolve_dtype(name: str, device: str | None = None) -> str:
    """A dtype name as a run records it: `auto` becomes bfloat16 where `device` computes it natively, else mixed
    on a CPU (float32 with bf16-held linear weights, models/mixed.py) and float32 on a GPU; any other name is
    checked and kept (a one-line error for one that does not exist)."""
    if name == "auto":
        target = resolve_device(device)
        return "bfloat16" if native_bf16(target) else "mixed" if target == "cpu" else "float32"
    if name not in DTYPES:
        raise EdgeKVError(f"unknown dtype '{name}' (choose from auto, {', '.join(DTYPES)})")
    return name


@functools.cache
def _warn_slow_bf16(device: str) -> None:
    """Once a process: a model loaded in bf16 where bf16 is slow (a run keeps the dtype its config names)."""
    log.warning("bfloat16 on this %s has no native bf16 (CPU capability %s): its matmuls run many times slower "
                "than float32's; --dtype auto picks mixed here", device, torch.backends.cpu.get_cpu_capability())


_DIR_IDENTITY = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "tokenizer.model")


def _fingerprint(spec: str, source: str, model: torch.nn.Module) -> str:
    """Weights fingerprint: the GGUF sha256 (defaults, .gguf files), or the sha256 of a directory's weight files,
    or hub id + commit; a KV export records it so the edge can refuse a cache made for another model."""
    kind, _, where = source.partition(":")
    if kind == "default":
        return "gguf-sha256:" + DEFAULT_MODELS[spec].sha256
    if kind == "gguf":
        return "gguf-sha256:" + file_sha256(Path(where))
    if kind == "dir":  # weights, and the config and tokenizer that say how to read them
        files = sorted(p for p in Path(where).iterdir()
                       if p.suffix in (".safetensors", ".bin", ".pt") or p.name in _DIR_IDENTITY)
        return "files-sha256:" + files_sha256(files)
    commit = getattr(model.config, "_commit_hash", None) or "unknown-commit"
    return f"hub:{where}@{commit}"


@dataclass(frozen=True)
class _Resolved:
    where: str  # directory or hub id passed to from_pretrained
    source: str
    gguf_file: str | None = None


def _resolve(spec: str) -> _Resolved:
    path = Path(spec).expanduser()
    if spec in DEFAULT_MODELS:
        where = default_model_dir(spec)
        return _Resolved(str(where), f"default:{where}")
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EdgeKVError(f"model file not found: {spec}")
        return _Resolved(str(path.parent), f"gguf:{path.resolve()}", path.name)
    if path.is_dir():
        return _Resolved(str(path), f"dir:{path.resolve()}")
    if path.exists() or spec.startswith((".", "/", "~")):
        raise EdgeKVError(f"model '{spec}' is not a directory, a .gguf file or a known alias")
    return _Resolved(spec, f"hub:{spec}")


def _load_error(spec: str, exc: Exception) -> EdgeKVError:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return EdgeKVError(f"cannot load model '{spec}': {first} (offline? known aliases: {', '.join(DEFAULT_MODELS)})")


def _from_pretrained(spec: str, auto_class, **kwargs) -> tuple[object, _Resolved]:
    """`auto_class.from_pretrained` on a resolved spec; loader failures become one-line errors."""
    try:
        r = _resolve(spec)  # may assemble and convert a packaged default: its I/O errors are load errors too
        if r.gguf_file:
            kwargs["gguf_file"] = r.gguf_file
        return auto_class.from_pretrained(r.where, **kwargs), r
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise _load_error(spec, exc) from exc


def load_tokenizer(spec: str) -> object:
    """The tokenizer of a model spec, without loading its weights."""
    from transformers import AutoTokenizer

    return _from_pretrained(spec, AutoTokenizer)[0]


def num_layers(spec: str) -> int:
    """The decoder depth of a model spec, from its config alone."""
    from transformers import AutoConfig

    return _from_pretrained(spec, AutoConfig)[0].num_hidden_layers


DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str | None) -> str:
    """`cpu`, `cuda` (or `cuda:N`), or `auto` (CUDA when torch sees a GPU); a one-line error for anything else."""
    device = device or "cpu"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise EdgeKVError(f"unknown device '{device}' (choose from {', '.join(DEVICES)}, or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EdgeKVError(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__})")
    return device


def _from_gguf(spec: str, source: str, weights: str) -> dict:
    """What a GGUF model's own blocks give `weights` (see models/quantized.py), {} for other sources: its Q4_K
    tensors as exact int4 for int4, every tensor the kernels decode for gguf. For a packaged default they are
    extracted once (re-assembling its GGUF) and kept beside its converted copy."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from edgekv.models.gguf_linear import read_blocks
    from edgekv.models.quantized import GGUF_WEIGHTS, Int4Weight, gguf_q4k_weights

    if weights not in ("int4", *GGUF_WEIGHTS):
        return {}
    read = gguf_q4k_weights if weights == "int4" else read_blocks
    kind, _, where = source.partition(":")
    if kind == "gguf":
        return read(where)
    if kind != "default":
        return {}
    cached = Path(where) / ("q4k-int4.safetensors" if weights == "int4" else "gguf-blocks.safetensors")
    if not cached.exists():
        with tempfile.TemporaryDirectory(dir=Path(where).parent, prefix=".assemble-") as tmp:
            found = read(str(assemble_gguf(DEFAULT_MODELS[spec], Path(tmp))))
            if weights == "int4":
                tensors = {f"{n}.{part}": getattr(w, part).contiguous() for n, w in found.items()
                           for part in ("q", "scale", "zero")}
                meta = None
            else:
                tensors = {n: rows for n, (_, rows) in found.items()}
                meta = {n: str(t) for n, (t, _) in found.items()}
            save_file(tensors, str(Path(tmp) / cached.name), metadata=meta)
            os.replace(Path(tmp) / cached.name, cached)
    with safe_open(str(cached), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata() or {}
    if weights in GGUF_WEIGHTS:
        return {n: (int(meta[n]), rows) for n, rows in tensors.items()}
    names = {k.rsplit(".", 1)[0] for k in tensors}
    return {n: Int4Weight(tensors[f"{n}.q"], tensors[f"{n}.scale"], tensors[f"{n}.zero"]) for n in names}


def load_model(spec: str, dtype: str = "auto", device_map: str | None = None,
               device: str | None = None, weights: str = "bf16") -> LoadedModel:
    """Load a causal LM and its tokenizer from an alias, a .gguf file, a local directory or a hub id, onto
    `device` (cpu, cuda, auto) or sharded by an accelerate `device_map`; `weights` int8/int4 swaps its linears
    for weight-only quantized ones (int4 from a GGUF's own Q4_K blocks where it has them; gguf: every linear on
    the file's own blocks, the file's weights unrounded: the bf16 model's own file, hence its fingerprint)."""
    from edgekv.models.quantized import GGUF_WEIGHTS, check_weights, quantize_linears

    check_weights(weights)  # before the load: a typo costs no minute of loading
    from transformers import AutoModelForCausalLM

    target = resolve_device(device)
    dtype = resolve_dtype(dtype, target)
    kwargs: dict = {"dtype": DTYPES[dtype]}
    if kwargs["dtype"] == torch.bfloat16 and not native_bf16(target):
        _warn_slow_bf16(target)
    if device_map:
        kwargs["device_map"] = device_map
    model, r = _from_pretrained(spec, AutoModelForCausalLM, **kwargs)
    model.hf_quantizer = None  # a GGUF load is dequantized into plain tensors
    check_supported(model)
    if not device_map and target != "cpu":
        model.to(target)
    model.eval()
    fingerprint, quantization = _fingerprint(spec, r.source, model), None
    if weights != "bf16":
        quantization = quantize_linears(model, weights, _from_gguf(spec, r.source, weights))
        if weights not in GGUF_WEIGHTS:  # another model numerically: exports made by the bf16 model are refused
            fingerprint += f"+{weights}"
    if dtype == "mixed":  # after --weights: a quantized linear keeps its own kernel
        hold_linears_in_bf16(model)
    return LoadedModel(spec=spec, model=model, tokenizer=load_tokenizer(spec), source=r.source,
                       fingerprint=fingerprint, quantization=quantization)


def same_model(a: LoadedModel, b: LoadedModel) -> bool:
    """One model, whatever strings named it: the same weights fingerprint (resolved source, weight files,
    config and tokenizer files)."""
    return a is b or a.fingerprint == b.fingerprint


def load_pair(cloud: str, edge: str, dtype: str = "auto", device_map: str | None = None,
              device: str | None = None, edge_weights: str = "bf16") -> tuple[LoadedModel, LoadedModel]:
    """(cloud, edge), loaded once when both name the same model (`cloud is edge` then): `dir/` and an absolute
    path to it, or two copies of the same files, are the same model. `edge_weights` quantizes the edge (and the
    cloud with it when they are one model)."""
    edge_m = load_model(edge, dtype, device_map, device, edge_weights)
    try:
        same_source = _resolve(cloud).source == _resolve(edge).source
    except EdgeKVError:
        same_source = False
    if same_source:
        return edge_m, edge_m
    cloud_m = load_model(cloud, dtype, device_map, device)
    return (edge_m, edge_m) if same_model(cloud_m, edge_m) else (cloud_m, edge_m)


PROBE_TEXT = (
    "def cache(kv): return {'key': kv[0], 'value': kv[1]}  # Édge→cloud ✓ 12345 "
    "The quick brown fox jumps over the lazy dog.\n\t日本語のテキスト"
)


# tokenizer objects already found to agree (edgekv never edits a loaded tokenizer): an eval checks its pair at every
# export, and comparing two 151k-entry vocabularies took ~1 s each time (29 s of the README main job)
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_tokenizers(a: object, b: object, probe: str = PROBE_TEXT) -> None:
    """Refuse a pair whose tokenizers differ in vocabulary or in the ids they give a probe text."""
    remember = probe == PROBE_TEXT and getattr(a, "__hash__", None) is not None and \
        getattr(b, "__hash__", None) is not None  # a class with __eq__ but no __hash__ is checked every time
    if remember and b in _AGREED.get(a, ()):
        return
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only = len(set(va.items()) ^ set(vb.items()))
        raise EdgeKVError(
            f"incompatible tokenizers: vocabularies differ ({type(a).__name__} with {len(va)} vs "
            f"{type(b).__name__} with {len(vb)} tokens, {only} entries differ)"
        )
    ids_a, ids_b = a.encode(probe), b.encode(probe)
    if ids_a != ids_b:
        raise EdgeKVError(f"incompatible tokenizers: the same probe text encodes to different ids "
                          f"({type(a).__name__} vs {type(b).__name__})")
    if remember:
        _AGREED.setdefault(a, weakref.WeakSet()).add(b)


def eos_ids(edge: LoadedModel) -> set[int]:
    """Every id that ends an answer: the generation config's, the model config's and the tokenizer's."""
    ids = set()
    for source in (edge.model.generation_config, edge.model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if edge.tokenizer.eos_token_id is not None:
        ids.add(edge.tokenizer.eos_token_id)
    return ids
