"""What every command shares: one-line errors, the rich console, the progress bar."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from edgekv import EdgeKVError
from edgekv.config import load_config

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


def show_default(value: Any) -> str | None:
    """A default as the help shows it (None: nothing to show)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _option(f: dataclasses.Field, hint: Any) -> tuple[inspect.Parameter, Callable[[Any], Any]]:
    """One config field as a Typer option (default None: unset flags leave the YAML and the field's default) and the
    conversion of its value."""
    meta = f.metadata
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    shown = meta["shown"] or show_default(default)
    help_text = f"{meta['help'].rstrip('.')} [{shown}]." if shown not in (None, "") else meta["help"]
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if meta["repeat"]:
        annotation, convert = Optional[list[str]], list
    elif list in (typing.get_origin(a) for a in args):
        item = typing.get_args(next(a for a in args if typing.get_origin(a) is list))[0]
        annotation = Optional[str]
        convert = parse_floats if item in (float, int) else parse_list
    else:
        base = next(a for a in args if a is not type(None))
        annotation, convert = Optional[base], (lambda v: v)
    decls = [meta["toggle"]] if meta["toggle"] else []
    option = typer.Option(None, *decls, help=help_text)
    parse = meta["parse"]
    name = meta["flag"] or f.name
    return (inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation),
            (lambda v: parse(convert(v))) if parse else convert)


def config_command(cls: type, section: str, config_help: str = "YAML config (flags override it).") -> Callable:
    """A command whose options are `cls`'s settings: flags, YAML keys and defaults from the same fields.

    The decorated function receives the config built from the field defaults, the `--config` file, then the flags."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
    built = [(f.name, *_option(f, hints[f.name])) for f in fields]
    params = [p for _, p, _ in built]
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY,
                                    default=typer.Option(None, help=config_help), annotation=Optional[Path]))

    def deco(present: Callable[[Any], None]) -> Callable:
        def command(**flags: Any) -> None:
            overrides = {field: (convert(flags[p.name]) if flags[p.name] is not None else None)
                         for field, p, convert in built}
            present(load_config(cls, section, flags["config"], overrides))

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__name__, command.__doc__ = present.__name__, present.__doc__
        command.config_class = cls
        return one_line_errors(command)

    return deco
