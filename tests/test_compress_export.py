"""`edgekv compress` on tiny models, the KV export format, and every way a bad export must be refused."""

import json
import random
import shutil

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.kv.export import Expect, KVExport, KVStoreError, tokenizer_fingerprint
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.loading import load_model
from tests.helpers import PROMPT, byte_tokenizer

runner = CliRunner()


def _compress(tiny_models, out, **kw):
    cfg = CompressConfig(out=str(out), cloud=tiny_models[kw.pop("cloud", "edge")], edge=tiny_models["edge"],
                         system_prompt=kw.pop("system_prompt", PROMPT), dtype="float32", **kw)
    return run_compress(cfg)


def test_same_model_fp16_roundtrip_is_bit_exact(tiny_models, tmp_path):
    out = tmp_path / "same"
    report = _compress(tiny_models, out, quant="fp16", prune_ratio=0.0)
    assert report["regime"] == "same-model"
    model = load_model(tiny_models["edge"], "float32")
    ids = torch.tensor(model.tokenizer(PROMPT)["input_ids"])
    cache = model.model(ids[None], use_cache=True).cache
    export = KVExport(out, Expect(edge_fingerprint=model.fingerprint,
                                  tokenizer_fingerprint=tokenizer_fingerprint(model.tokenizer)))
    assert export.layer_indices == [0, 1, 2]
    for i in export.layer_indices:
        layer = decode_layer(export, i)
        keys, values = edge_kv(layer, model.model)
        assert torch.equal(keys, cache.layers[i].keys[0].half().float())
        assert torch.equal(values, cache.layers[i].values[0].half().float())
    assert export.manifest["system_prompt"]["num_tokens"] == ids.numel()


def test_same_model_int8_pruned(tiny_models, tmp_path):
    report = _compress(tiny_models, tmp_path / "p", quant="int8", prune_ratio=0.5, keep_recent=3)
    for row in report["layers"]:
        assert row["kept_channels"] == 4 and row["head_dim"] == 8
        assert 0 < row["attn_error_prune"] < 1 and row["attn_error_total"] >= 0
    export = KVExport(tmp_path / "p")
    layer = decode_layer(export, 1)
    assert layer.keys.kept.shape[-1] == 4 and layer.keys.recent.shape[1] == 3
    n = report["system_prompt_tokens"]
    # real bytes: int8 kept channels + fp16 per-channel scales, int8 recent keys, int8 values + fp16 token scales
    keys = 2 * (n - 3) * 4 + 2 * 4 * 2 + 2 * 3 * 8 + 2 * 8 * 2
    values = 2 * n * 8 + 2 * n * 2
    assert all(row["bytes"] == keys + values for row in report["layers"])
    assert report["bytes_written"] > 3 * (keys + values)  # three layer files, each with a safetensors header


@pytest.mark.parametrize("map_on", ["cloud", "edge"])
def test_heterogeneous_export(tiny_models, calib_file, tmp_path, map_on):
    out = tmp_path / f"het-{map_on}"
    report = _compress(tiny_models, out, cloud="cloud", calib=str(calib_file), calib_tokens=40, map_on=map_on,
                       quant="int8", prune_ratio=0.25, start_layer=1)
    assert report["regime"] == "heterogeneous"
    assert [r["edge_layer"] for r in report["layers"]] == [1, 2]
    assert all("r2_k" in r and "r2_v" in r for r in report["layers"])
    edge = load_model(tiny_models["edge"], "float32")
    export = KVExport(out)
    assert export.manifest["map_location"] == map_on
    translator = export.translator()
    assert (translator is None) == (map_on == "cloud")
    for i in export.layer_indices:
        keys, values = edge_kv(decode_layer(export, i), edge.model, translator)
        assert keys.shape == values.shape == (2, export.manifest["system_prompt"]["num_tokens"], 8)  # edge-shaped


def test_tar_export(tiny_models, tmp_path):
    out = tmp_path / "kv.tar"
    _compress(tiny_models, out, tar=True)
    export = KVExport(out)
    export.verify_all()
    assert (tmp_path / "kv.report.json").exists()


def test_cli_compress_and_mapping(tiny_models, calib_file, tmp_path):
    align_out = tmp_path / "align"
    result = runner.invoke(app, ["align", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"],
                                 "--out", str(align_out), "--texts", str(calib_file), "--max-tokens", "30",
                                 "--start-layer", "1"])
    assert result.exit_code == 0, result.output
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    out = tmp_path / "kv"
    result = runner.invoke(app, ["compress", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"],
                                 "--system-prompt", f"@{prompt_file}", "--out", str(out), "--mapping",
                                 str(align_out / "mapping.json"), "--calib", str(calib_file), "--calib-tokens", "30",
                                 "--quant", "int4", "--prune-ratio", "0.5"])
    assert result.exit_code == 0, result.output
    mapping = json.loads((align_out / "mapping.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(e["edge_layer"], e["cloud_layer"]) for e in manifest["layers"]] == \
        [(p["edge_layer"], p["cloud_layer"]) for p in mapping["pairs"]]
    report = json.loads((out / "report.json").read_text())
    assert report["ratio_vs_shipped_fp16"] > 3


# ------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def export_dir(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("exp") / "kv"
    cfg = CompressConfig(out=str(out), cloud=tiny_models["edge"], edge=tiny_models["edge"], system_prompt=PROMPT,
                         dtype="float32", quant="int8", prune_ratio=0.5)
    run_compress(cfg)
    return out


def _copy(export_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(export_dir, target)
    return target


def test_tampered_byte_in_any_layer(export_dir, tmp_path):
    for name in ("layer_00.safetensors", "layer_02.safetensors"):
        copy = _copy(export_dir, tmp_path / name)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        export = KVExport(copy)  # the manifest is fine; the layer is refused when it is read
        with pytest.raises(KVStoreError, match=f"{name}: sha256 mismatch"):
            export.layer(int(name[6:8]))


def test_truncated_and_missing_layer(export_dir, tmp_path):
    copy = _copy(export_dir, tmp_path)
    blob = (copy / "layer_01.safetensors").read_bytes()
    (copy / "layer_01.safetensors").write_bytes(blob[:-10])
    with pytest.raises(KVStoreError, match=r"layer_01.safetensors: \d+ bytes, manifest says \d+ \(truncated\?\)"):
        KVExport(copy).layer(1)
    (copy / "layer_02.safetensors").unlink()
    with pytest.raises(KVStoreError, match="layer_02.safetensors: missing"):
        KVExport(copy).layer(2)


def test_manifest_for_another_model_or_tokenizer(export_dir, tiny_models):
    other = load_model(tiny_models["cloud"], "float32")
    with pytest.raises(KVStoreError, match="manifest.json: made for another edge model"):
        KVExport(export_dir, Expect(edge_fingerprint=other.fingerprint))
    with pytest.raises(KVStoreError, match="manifest.json: made for another tokenizer"):
        KVExport(export_dir, Expect(tokenizer_fingerprint=tokenizer_fingerprint(byte_tokenizer(permute=True))))


def test_unknown_format_version_and_edited_manifest(export_dir, tmp_path):
    copy = _copy(export_dir, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KVStoreError, match="unknown format version 99"):
        KVExport(copy)
    manifest["format_version"] = 1
    manifest["layers"][0]["key"]["kept_channels"][0][0] = 7  # a plausible edit: checksum must catch it
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KVStoreError, match="manifest checksum mismatch"):
        KVExport(copy)


def _load_everything(path):
    export = KVExport(path)
    return {i: (decode_layer(export, i).keys.kept, decode_layer(export, i).values) for i in export.layer_indices}


def test_fuzz_200_mutations_succeed_exactly_or_fail_cleanly(export_dir, tmp_path):
    reference = _load_everything(export_dir)
    files = sorted(p.name for p in export_dir.iterdir() if p.name != "report.json")
    rng = random.Random(1234)
    outcomes = {"refused": 0, "identical": 0}
    for trial in range(200):
        copy = tmp_path / f"m{trial}"
        shutil.copytree(export_dir, copy)
        name = rng.choice(files)
        data = bytearray((copy / name).read_bytes())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]  # truncation too
        (copy / name).write_bytes(bytes(data))
        try:
            loaded = _load_everything(copy)
        except KVStoreError:
            outcomes["refused"] += 1
        else:  # a mutation that changed nothing that matters (e.g. JSON whitespace) must load bit-exactly
            assert loaded.keys() == reference.keys()
            for i in reference:
                assert torch.equal(loaded[i][0], reference[i][0]) and torch.equal(loaded[i][1], reference[i][1])
            outcomes["identical"] += 1
        shutil.rmtree(copy)
    print(f"fuzz outcomes: {outcomes}")
    assert outcomes["refused"] > 150


@pytest.mark.parametrize("case", ["prune_one", "empty_prompt", "missing_prompt_file", "bad_quant", "bad_mapping",
                                  "tokenizer"])
def test_cli_bad_input(case, tiny_models, tmp_path):
    out = tmp_path / "kv"
    args = ["compress", "--cloud", tiny_models["edge"], "--edge", tiny_models["edge"], "--system-prompt", PROMPT,
            "--out", str(out)]
    expect = {"prune_one": "prune ratio must be in [0, 1)", "empty_prompt": "the system prompt is empty",
              "missing_prompt_file": "system prompt file not found", "bad_quant": "unknown --quant 'int3'",
              "bad_mapping": "mapping file not found", "tokenizer": "incompatible tokenizers"}[case]
    if case == "prune_one":
        args += ["--prune-ratio", "1.0"]
    elif case == "empty_prompt":
        args[6] = "   "
    elif case == "missing_prompt_file":
        args[6] = f"@{tmp_path / 'nope.txt'}"
    elif case == "bad_quant":
        args += ["--quant", "int3"]
    elif case == "bad_mapping":
        args[2] = tiny_models["cloud"]
        args += ["--mapping", str(tmp_path / "nope.json")]
    elif case == "tokenizer":
        args[2] = tiny_models["edge_other_tokenizer"]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], result.stderr
    assert not out.exists() and not any(p.name.startswith(".kv") for p in tmp_path.iterdir())


def test_splice_auto_takes_the_shipped_fuser_of_this_pair_only(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from edgekv.kv import compress_job
    from edgekv.kv.compress_job import CompressConfig, resolve_splice, shipped_fuser

    root = tmp_path / "fusers"
    (root / "f").mkdir(parents=True)
    (root / "f" / "translator.json").write_text(json.dumps({"name": "fuse-residual", "cloud_fingerprint": "c1",
                                                            "edge_fingerprint": "e1"}))
    monkeypatch.setattr(compress_job, "SHIPPED_FUSERS", root)
    assert shipped_fuser("c1", "e1") == root / "f" and shipped_fuser("c1", "e2") is None
    cloud, edge = SimpleNamespace(fingerprint="c1"), SimpleNamespace(fingerprint="e1")
    base = CompressConfig(out="o", system_prompt="s")
    got = resolve_splice(base, cloud, edge, same=False)
    assert (got.splice, got.translator, got.translator_path) == ("fuse", "fuse-residual", str(root / "f"))
    assert base.splice == "auto" and base.translator is None  # the caller's config is not changed
    other = resolve_splice(base, cloud, SimpleNamespace(fingerprint="e2"), same=False)
    assert (other.splice, other.translator) == ("replace", "ridge")
    asked = resolve_splice(CompressConfig(out="o", system_prompt="s", translator="hidden"), cloud, edge, False)
    assert (asked.splice, asked.translator) == ("replace", "hidden")  # an explicit translator wins
    same = resolve_splice(base, cloud, edge, same=True)
    assert (same.splice, same.translator) == ("replace", "ridge")


def test_exports_of_one_prompt_share_the_clouds_forward(tiny_models, calib_file, tmp_path):
    """A second export of the same prompt by the same cloud (ce-lslm-fuse after ce-lslm in an eval) reuses its
    capture: the same bytes, one prompt forward, and the reused seconds reported, not hidden."""
    cloud, edge = load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")
    prompt_len = len(edge.tokenizer(PROMPT)["input_ids"])
    lengths = []
    hook = cloud.model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                                 with_kwargs=True)

    def compress(out, prompt=PROMPT):
        cfg = CompressConfig(out=str(tmp_path / out), cloud=tiny_models["cloud"], edge=tiny_models["edge"],
                             system_prompt=prompt, dtype="float32", calib=str(calib_file), calib_tokens=40,
                             map_on="edge", translator="hidden", quant="int8", start_layer=1)
        return run_compress(cfg, models=(cloud, edge))

    try:
        first, second = compress("a"), compress("b")
        other = compress("c", prompt=PROMPT + " And one more sentence.")
    finally:
        hook.remove()
    assert lengths.count(prompt_len) == 1
    assert "cached_cloud_forward_s" not in first["timings"] and "cached_cloud_forward_s" not in other["timings"]
    assert second["timings"]["cached_cloud_forward_s"] > 0
    for f in sorted((tmp_path / "a").iterdir()):
        if f.name != "report.json":  # which names its own out and timings
            assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_a_fitted_translators_edge_queries_are_kept_for_its_exports(tiny_models, calib_file, tmp_path):
    """The eval fits the translator, then exports with it saved: the edge's calibration forward runs once."""
    from dataclasses import replace

    from edgekv.align.mapping import layer_pairs
    from edgekv.kv import cloud_kv
    from edgekv.kv.registry import save_translator
    from edgekv.progress import Tasks

    cloud, edge = load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")
    cfg = CompressConfig(out=str(tmp_path / "o"), cloud=tiny_models["cloud"], edge=tiny_models["edge"],
                         system_prompt=PROMPT, dtype="float32", calib=str(calib_file), calib_tokens=40,
                         translator="hidden", start_layer=1)
    calib = cloud_kv.calibration(cfg, edge.tokenizer)
    pairs, _ = layer_pairs(None, 1, cloud.num_layers, edge.num_layers)
    cloud_kv._QUERY_CACHE.clear()
    forwards = []
    hook = edge.model.register_forward_pre_hook(lambda m, a, kw: forwards.append(1), with_kwargs=True)
    try:
        translator, fitted = cloud_kv.get_translator(cfg, cloud, edge, pairs, calib, Tasks())
        save_translator(translator, tmp_path / "t", cloud.fingerprint, edge.fingerprint)
        _, kept = cloud_kv.get_translator(replace(cfg, translator_path=str(tmp_path / "t")), cloud, edge, pairs,
                                          calib, Tasks())
    finally:
        hook.remove()
    assert len(forwards) == len(calib)
    assert set(kept.layers) == {"q"} and all(torch.equal(a, b) for a, b in zip(kept.layers["q"], fitted.layers["q"]))
    cloud_kv._QUERY_CACHE.clear()
    fresh = cloud_kv._edge_queries(edge, calib, Tasks())
    assert all(torch.equal(a, b) for a, b in zip(kept.layers["q"], fresh.layers["q"]))
