"""Each command's options come from its config dataclass: a setting's flag, YAML key, help and default are one
field (issue 36)."""

from __future__ import annotations

import dataclasses

import typer

from cli.common import show_default
from cli.main import app
from edgekv.config import CONFIG_CLASSES

COMMANDS = typer.main.get_command(app).commands


def config_class(command) -> type | None:
    return getattr(command.callback, "config_class", None)


def test_every_option_walks_back_to_one_field_of_the_commands_config():
    checked = 0
    for name, command in COMMANDS.items():
        cls = config_class(command)
        if cls is None:
            continue
        fields = {f.metadata.get("flag") or f.name: f for f in dataclasses.fields(cls) if "help" in f.metadata}
        options = {p.name: p for p in command.params if p.name != "config"}
        assert set(options) == set(fields), f"{name}: options and settings differ"
        for flag, option in options.items():
            field = fields[flag]
            assert option.default is None, f"{name} --{flag}: a default on the option (it belongs to the field)"
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            shown = field.metadata["shown"] or show_default(default)
            if shown:
                assert f"[{shown}]" in option.help, f"{name} --{flag}: the help does not show the field's default"
            checked += 1
    assert checked > 150  # every command's settings, not a few


def test_only_commands_without_settings_write_their_options_by_hand():
    assert {n for n, c in COMMANDS.items() if config_class(c) is None} == {"report", "catalog"}
    assert {config_class(c) for c in COMMANDS.values()} - {None} == set(CONFIG_CLASSES.values())


def run_with(monkeypatch, *args: str, command: str = "eval"):
    """The config `edgekv COMMAND ARGS` builds (its `run_COMMAND` replaced by a stand-in that records it)."""
    from typer.testing import CliRunner

    seen = {}
    monkeypatch.setattr(f"cli.{command}.run_{command}", lambda cfg, progress: seen.setdefault("cfg", cfg) and 1 / 0)
    result = CliRunner().invoke(app, [command, *args])
    assert "cfg" in seen, result.output
    return seen["cfg"]


def test_a_flag_reaches_its_field_and_an_unset_one_leaves_the_default(tmp_path, monkeypatch):
    from edgekv.eval.eval_config import EvalConfig

    cfg = run_with(monkeypatch, "--dataset", "xsum,mmlu", "--load-rates", "0.5", "--limit", "4", "--out",
                   str(tmp_path))
    assert (cfg.datasets, cfg.load_rates, cfg.limit, cfg.out) == (["xsum", "mmlu"], [0.5], 4, str(tmp_path))
    default = EvalConfig()
    assert (cfg.strategies, cfg.max_new_tokens, cfg.ray) == (default.strategies, default.max_new_tokens, None)
    cfg = run_with(monkeypatch, "--ray", "local", "--workers", "3", "--out", str(tmp_path))
    assert (cfg.ray, cfg.workers) == ("", 3)  # 'local' on the command line: a cluster started here


def test_a_toggle_overrides_the_yaml_both_ways(monkeypatch):
    """configs/distill-shared.yaml keeps the prompt's KV constant; --grad-through-prompt turns the gradient back on
    for one run (the ablation) without another YAML file, and the YAML's value holds when no switch is given."""
    from pathlib import Path

    config = str(Path(__file__).parents[1] / "configs" / "distill-shared.yaml")
    for args, want in (([], False), (["--grad-through-prompt"], True), (["--prompt-kv-constant"], False)):
        cfg = run_with(monkeypatch, "--config", config, *args, command="distill")
        assert cfg.grad_through_prompt is want, args
