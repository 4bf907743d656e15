"""One config object per command: dataclass defaults, then a YAML file, then command-line flags."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from edgekv import EdgeKVError
from edgekv.texts import read_text

T = TypeVar("T")
COMMAND_SECTIONS = ("align", "compress", "serve_edge", "eval", "train_fuser", "plan", "distill")
CONFIG_CLASSES: dict[str, type] = {}


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            shown: str | None = None, flag: str | None = None, toggle: str | None = None, repeat: bool = False,
            parse: Callable[[Any], Any] | None = None) -> Any:
    """A config field that is also a command-line option: its default is written here and nowhere else.

    `shown` describes a None default in the help; `flag` names the option when it differs from the field;
    `toggle` gives a bool's two switches ("--a/--b"); `repeat` makes a list option repeatable instead of
    comma-separated; `parse` converts the flag's value (YAML values are taken as they are)."""
    meta = {"help": help, "shown": shown, "flag": flag, "toggle": toggle, "repeat": repeat, "parse": parse}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# The settings several commands share, each default written once.
def cloud_setting(help: str = "Cloud model: alias (default-cloud), hub id, directory or .gguf.") -> Any:
    """The cloud model."""
    return setting("default-cloud", help)


def edge_setting(help: str = "Edge model: alias (default-edge), hub id, directory or .gguf.") -> Any:
    """The edge model."""
    return setting("default-edge", help)


def dtype_setting() -> Any:
    """The models' compute dtype."""
    return setting("auto", "auto (bfloat16 where the device computes it natively, else mixed on a CPU and float32 "
                           "on a GPU), bfloat16, float16, float32 or mixed (float32 arithmetic, linear weights held "
                           "in bf16: calls of up to 16 rows, decode steps, multiply in bf16).")


def device_setting() -> Any:
    """Where the models run."""
    return setting("cpu", "cpu, cuda or auto (CUDA when torch sees a GPU).")


def weights_setting() -> Any:
    """The edge's linear weights."""
    return setting("gguf-q8", "The edge's linears: gguf-q8 (the GGUF's own blocks, int8 activations as llama.cpp; "
                              "a model that is not a GGUF, or on a GPU, stays dense), gguf (the same blocks, bf16 "
                              "activations), bf16, int8 or int4.")


def device_map_setting() -> Any:
    """accelerate's device map for models larger than one device."""
    return setting(None, "accelerate device map for large models, e.g. auto.")


def seed_setting(help: str = "Seed.") -> Any:
    """The seed."""
    return setting(0, help)


def ray_setting(help: str = "Run --prompts on Ray: 'local' starts one here, 'auto' or an address joins a "
                            "cluster.") -> Any:
    """Ray: None in-process, "" a local cluster (the flag's 'local'), "auto" or an address."""
    return setting(None, help, shown="in-process", parse=lambda v: "" if v == "local" else v)


def workers_setting(help: str = "Ray actors, each loading the models once.") -> Any:
    """Ray actors."""
    return setting(2, help)


def check_choice(value: Any, allowed: Any, name: str) -> None:
    """One-line error for a value that is not one of `allowed`."""
    if value not in allowed:
        raise EdgeKVError(f"unknown {name} '{value}' (choose from {', '.join(map(str, allowed))})")


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


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """A YAML mapping from a file, with one-line errors. `extends: BASE.yaml` (relative to the file) reads BASE
    first; the file's own keys win, and a section's keys are merged key by key, so a variant says only what it
    changes."""
    path = Path(path)
    if not path.is_file():
        raise EdgeKVError(f"config file not found: {path}")
    if path.resolve() in _seen:
        raise EdgeKVError(f"{path}: 'extends' comes back to a file it started from")
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
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise EdgeKVError(f"{path}: 'extends' must name one config file")
    merged = read_yaml(path.parent / base, (*_seen, path.resolve()))
    for key, value in data.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = {**merged[key], **value} if both else value
    return merged


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


def _default(f: dataclasses.Field) -> object:
    """A field's default, built from its factory if it has one."""
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def changed(config: object, *names: str) -> dict:
    """The settings among `names` that differ from their defaults: a manifest records a setting added later only
    when it is set, so manifests written before it existed stay as they were."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    return {n: getattr(config, n) for n in names if getattr(config, n) != _default(fields[n])}


def to_dict(config: object) -> dict:
    """The config as a plain dict (for writing next to results)."""
    return dataclasses.asdict(config)
