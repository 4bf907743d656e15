"""`edgekv align` end to end on tiny models, and every bad input it must refuse in one line."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _assert_one_line_error(result, pattern):
    assert result.exit_code != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr  # progress lines may precede it
    assert pattern in errors[0], errors[0]
    assert "Traceback" not in result.output


def _no_leftovers(parent, name):
    return not any(p.name.startswith(f".{name}.") for p in parent.iterdir())


def test_help_lists_the_four_commands():
    out = subprocess.run([sys.executable, "-m", "cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for name in ("align", "compress", "serve-edge", "eval"):
        assert name in out.stdout


def test_align_writes_everything(tiny_models, calib_file, tmp_path):
    out = tmp_path / "align"
    result = _run("align", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--out", out,
                  "--texts", calib_file, "--max-tokens", 40, "--start-layer", 1, "--features", "hidden,k_unrot,v",
                  "--outlier-ratio", 0)
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    for metric in ("linear_cka", "debiased_cka", "rsa", "k_unrot.linear_cka", "v.rsa"):
        assert {f"{metric}.csv", f"{metric}.png"} <= names
    sim = json.loads((out / "similarity.json").read_text())
    assert sim["cloud"]["num_layers"] == 4 and sim["edge"]["num_layers"] == 3
    assert len(sim["metrics"]["linear_cka"]) == 4 and len(sim["metrics"]["linear_cka"][0]) == 3  # rows = cloud
    assert sim["num_tokens"] == 6 * (40 - 1)  # skip_first=1 leaves out each text's first token
    assert sim["outlier_ratio"] is None and sim["dropped_tokens"] == []
    mapping = json.loads((out / "mapping.json").read_text())
    assert [p["edge_layer"] for p in mapping["pairs"]] == [1, 2]
    csv_rows = (out / "linear_cka.csv").read_text().splitlines()
    assert csv_rows[0] == "cloud_layer,edge_0,edge_1,edge_2" and len(csv_rows) == 5
    assert (out / "linear_cka.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _no_leftovers(tmp_path, "align")


def test_model_against_itself_has_unit_diagonal(tiny_models, calib_file, tmp_path):
    out = tmp_path / "self"
    result = _run("align", "--cloud", tiny_models["edge"], "--edge", tiny_models["edge"], "--out", out,
                  "--texts", calib_file, "--max-tokens", 30, "--start-layer", 0)
    assert result.exit_code == 0, result.output
    sim = json.loads((out / "similarity.json").read_text())
    for metric in ("linear_cka", "debiased_cka", "rsa"):
        m = sim["metrics"][metric]
        assert all(abs(m[i][i] - 1.0) < 1e-6 for i in range(3)), metric
    mapping = json.loads((out / "mapping.json").read_text())
    assert [p["cloud_layer"] for p in mapping["pairs"]] == [0, 1, 2]


def test_rerun_replaces_output_whole(tiny_models, calib_file, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    result = _run("align", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--out", out,
                  "--texts", calib_file, "--max-tokens", 20, "--start-layer", 1)
    assert result.exit_code == 0, result.output
    assert not (out / "stale.txt").exists() and (out / "mapping.json").exists()
    assert _no_leftovers(tmp_path, "again")


def test_config_file_and_flag_override(tiny_models, calib_file, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cloud: {tiny_models['cloud']}\nedge: {tiny_models['edge']}\n"
                   f"align:\n  max_tokens: 25\n  strategy: uniform\n  texts: {calib_file}\n")
    out = tmp_path / "cfg"
    result = _run("align", "--config", cfg, "--out", out, "--start-layer", 1, "--strategy", "last-aligned")
    assert result.exit_code == 0, result.output
    used = json.loads((out / "config.json").read_text())
    assert used["max_tokens"] == 25 and used["strategy"] == "last-aligned"


@pytest.mark.parametrize("case", ["unknown_model", "tokenizer", "empty_text", "max_tokens_0", "unwritable",
                                  "start_layer", "config_typo", "bad_strategy", "missing_texts"])
def test_bad_input_is_one_line_and_leaves_nothing(case, tiny_models, calib_file, tmp_path):
    out = tmp_path / "out"
    base = ["align", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--texts", calib_file,
            "--out", out, "--max-tokens", 20]
    expect = {
        "unknown_model": "cannot load model 'no-such-org/no-such-model'",
        "tokenizer": "incompatible tokenizers",
        "empty_text": "no texts",
        "max_tokens_0": "--max-tokens must be ≥ 1",
        "unwritable": "cannot write output directory",
        "start_layer": "--start-layer 3 is out of range",
        "config_typo": "unknown key 'max_tokenz' (did you mean 'max_tokens'?)",
        "bad_strategy": "unknown strategy 'diagonal'",
        "missing_texts": "text file not found",
    }[case]
    if case == "unknown_model":
        base[2] = "no-such-org/no-such-model"
    elif case == "tokenizer":
        base[4] = tiny_models["edge_other_tokenizer"]
    elif case == "empty_text":
        empty = tmp_path / "empty.txt"
        empty.write_text("\n  \n")
        base[6] = empty
    elif case == "max_tokens_0":
        base[-1] = 0
    elif case == "unwritable":
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        out = blocker / "out"
        base[8] = out
    elif case == "start_layer":
        base += ["--start-layer", 3]
    elif case == "config_typo":
        cfg = tmp_path / "typo.yaml"
        cfg.write_text("align:\n  max_tokenz: 5\n")
        base += ["--config", cfg]
    elif case == "bad_strategy":
        base += ["--strategy", "diagonal"]
    elif case == "missing_texts":
        base[6] = tmp_path / "nope.jsonl"
    result = _run(*base)
    _assert_one_line_error(result, expect)
    assert not out.exists()
    assert _no_leftovers(tmp_path, "out")
