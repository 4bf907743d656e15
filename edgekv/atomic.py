"""Write outputs all-or-nothing: stage into a temp path beside the target, then rename into place."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edgekv import EdgeKVError


def _fresh(parent: Path, prefix: str, create: Callable[[Path], None]) -> Path:
    """Create a new, unique path in `parent` with `create`. Unlike `tempfile.mkstemp`/`mkdtemp`, whose 0600/0700 the
    rename would carry to the output, `os.open`/`os.mkdir` honour the umask, so outputs get the user's usual mode."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            create(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp name for {prefix}* in {parent}")


def _new_file(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))


def _new_dir(path: Path) -> None:
    os.mkdir(path, 0o777)


@contextmanager
def staged_dir(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces `target` whole, on failure it vanishes."""
    target = Path(target).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = _fresh(parent, f".{target.name}.tmp-", _new_dir)
    except OSError as exc:
        raise EdgeKVError(f"cannot write output directory {target}: {exc.strerror or exc}") from exc
    try:
        yield staging
        old = None
        if target.exists():
            if not target.is_dir():
                raise EdgeKVError(f"output {target} exists and is not a directory")
            old = _fresh(parent, f".{target.name}.old-", _new_dir)
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
    tmp = _fresh(path.parent, f".{path.name}.tmp-", _new_file)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a UTF-8 text file atomically (see write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_tensors_atomic(path: str | Path, tensors: dict) -> None:
    """Write named tensors as safetensors via a temp file in the same directory and an atomic rename."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh(path.parent, f".{path.name}.tmp-", _new_file)
    mode = tmp.stat().st_mode & 0o777  # the umask's; safetensors re-creates the file as 0600
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
