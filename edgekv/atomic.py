"""Write outputs all-or-nothing: stage into a temp path beside the target, then rename into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from edgekv import EdgeKVError


@contextmanager
def staged_dir(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces `target` whole, on failure it vanishes."""
    target = Path(target).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    except OSError as exc:
        raise EdgeKVError(f"cannot write output directory {target}: {exc.strerror or exc}") from exc
    try:
        yield staging
        old = None
        if target.exists():
            if not target.is_dir():
                raise EdgeKVError(f"output {target} exists and is not a directory")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
            os.rename(target, old / "previous")
        try:
            os.rename(staging, target)
        except OSError:
            if old is not None:  # put the previous output back rather than lose it
                os.rename(old / "previous", target)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextmanager
def exclusive(lock_path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock (`fcntl.flock` on `lock_path`) shared by every process of the machine."""
    import fcntl

    with open(lock_path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write a file via a temp file in the same directory and an atomic rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a UTF-8 text file atomically (see write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_tensors_atomic(path: str | Path, tensors: dict) -> None:
    """Write named tensors as safetensors via a temp file in the same directory and an atomic rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
