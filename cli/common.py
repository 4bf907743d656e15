"""What every command shares: one-line errors, the rich console, the progress bar."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from edgekv import EdgeKVError

console = Console(stderr=True)


def fail(message: str, code: int = 1) -> None:
    """Print one line to stderr and exit non-zero."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def one_line_errors(fn: Callable) -> Callable:
    """Turn the library's errors (and any surprise) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EdgeKVError as exc:
            fail(str(exc).replace("\n", " "))
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # a bug, not bad input: still one line unless asked for the traceback
            if os.environ.get("EDGEKV_DEBUG"):
                raise
            fail(f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                 "(set EDGEKV_DEBUG=1 for the traceback)", 3)

    return wrapper


def progress_bar() -> Progress:
    """The rich progress bar long commands show (on stderr)."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
    )


def parse_list(value: str | None) -> list[str] | None:
    """A comma-separated flag value as a list (None stays None)."""
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def parse_floats(value: str | None) -> list[float] | None:
    """A comma-separated list of numbers (None stays None); a non-number is a one-line error."""
    items = parse_list(value)
    if items is None:
        return None
    try:
        return [float(v) for v in items]
    except ValueError:
        raise EdgeKVError(f"expected comma-separated numbers, got '{value}'") from None
