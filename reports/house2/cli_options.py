"""Every `edgekv` command's options and defaults, as JSON (issue 36: the before/after diff of the CLI).

    python reports/house2/cli_options.py > options.json     # run from the tree to describe
"""

import json

import typer

from cli.main import app


def describe(cmd, path: str) -> dict:
    """name → {options, default, flag, type} for one click command, recursing into groups."""
    out = {}
    if hasattr(cmd, "commands"):
        for name, sub in sorted(cmd.commands.items()):
            out.update(describe(sub, f"{path} {name}".strip()))
        return out
    params = {}
    for p in cmd.params:
        default = p.default
        if callable(default):
            default = "<callable>"
        params[p.name] = {"options": sorted(p.opts + p.secondary_opts), "default": default,
                          "flag": bool(getattr(p, "is_flag", False)), "help": getattr(p, "help", None),
                          "required": p.required}
    out[path] = params
    return out


print(json.dumps(describe(typer.main.get_command(app), ""), indent=1, sort_keys=True, default=str))
