"""One config object per command: dataclass defaults, then a YAML file, then command-line flags."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml

from edgekv import EdgeKVError
from edgekv.texts import read_text

T = TypeVar("T")
COMMAND_SECTIONS = ("align", "compress", "serve_edge", "eval", "train_fuser", "plan", "distill")
CONFIG_CLASSES: dict[str, type] = {}


def command_config(section: str):
    """Register a dataclass as the config of one command (its YAML section name)."""

    def deco(cls: type[T]) -> type[T]:
        CONFIG_CLASSES[section] = cls
        return cls

    return deco


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _check_keys(keys: set[str], allowed: set[str], where: str) -> None:
    for key in sorted(keys - allowed):
        hint = difflib.get_close_matches(key, sorted(allowed), n=1)
        raise EdgeKVError(f"{where}: unknown key '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else ""))


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from a file, with one-line errors."""
    path = Path(path)
    if not path.is_file():
        raise EdgeKVError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(read_text(path, "config file"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise EdgeKVError(f"{path}: invalid YAML{where}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EdgeKVError(f"{path}: expected a mapping of keys to values at the top level")
    return data


def load_config(cls: type[T], section: str, path: str | Path | None, overrides: dict[str, Any]) -> T:
    """Build `cls` from defaults, the file's shared top-level keys, its `section`, then non-None overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path)
        shared_allowed = set().union(*(_field_names(c) for c in CONFIG_CLASSES.values())) | set(COMMAND_SECTIONS)
        _check_keys(set(data), shared_allowed, str(path))
        mine = _field_names(cls)
        values.update({k: v for k, v in data.items() if k in mine})
        block = data.get(section) or {}
        if not isinstance(block, dict):
            raise EdgeKVError(f"{path}: section '{section}' must be a mapping")
        _check_keys(set(block), mine, f"{path} [{section}]")
        values.update(block)
    values.update({k: v for k, v in overrides.items() if v is not None})
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate:
        validate()
    return config


def to_dict(config: object) -> dict:
    """The config as a plain dict (for writing next to results)."""
    return dataclasses.asdict(config)
