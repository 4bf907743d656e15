"""The process around the models: heap trimming, oneDNN's primitive cache and bf16 kernels, threads that leave no
OpenMP pool."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
ONEDNN_CACHE = 16  # oneDNN primitives kept for reuse (its default, 1,024, grows RSS with every new step shape)


def libc(name: str, argtypes: list | None = None):
    """A Linux libc function, or None elsewhere (the callers are then silent no-ops)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    return fn


_MALLOC_TRIM = None if os.environ.get("EDGEKV_NO_MALLOC_TRIM") is not None else libc("malloc_trim", [ctypes.c_size_t])


def trim_heap() -> None:
    """Give glibc's free heap pages back to the OS (a few ms). Freed work copies and the varying-size tensors of
    a server's steps otherwise stay resident, and RSS creeps up though nothing leaks. A no-op elsewhere, or with
    EDGEKV_NO_MALLOC_TRIM set."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def limit_onednn_cache(capacity: int = ONEDNN_CACHE) -> None:
    """Bound oneDNN's primitive cache for a long-running server: each step's packed token count is a new GEMM
    shape, and the default cache keeps 1,024 of them (with their scratch), which a soak sees as RSS creeping up
    (measured: reports/README). oneDNN reads the variable when it creates its first
    primitive, so call this before the process's first matmul; a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def onednn_bf16() -> bool:
    """Whether this CPU's oneDNN has bf16 kernels (AVX-512 and later): where bf16 matmuls are fast, and where
    prepacked bf16 linears run."""
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def on_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends with it; its result, or its exception re-raised here. Model
    work done this way (loading, a session's prefill) leaves no OpenMP pool behind on the calling thread, so a
    serving engine's thread keeps the process's only one (see `serve.engine.Engine`)."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            box["exc"] = exc

    thread = threading.Thread(target=run, name="edgekv-setup")
    thread.start()
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]
