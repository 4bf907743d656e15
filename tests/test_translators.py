"""Translators inside KV exports: bit-exact round trips, the same KV on either side, refusal of foreign ones."""

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.kv.export import KVExport, KVStoreError
from edgekv.kv.registry import TRANSLATORS, load_translator, save_translator
from edgekv.kv.translators import TrainedTranslator
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from tests.helpers import PROMPT

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")


def _fitted(name, pair, calib_file):
    cloud, edge = pair
    texts = [json.loads(line)["text"] for line in calib_file.read_text().splitlines()]
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:40]) for t in texts]
    base = "hidden" if name == "trained" else name
    feats = TRANSLATORS[base].features
    t = TRANSLATORS[base]().fit(capture(cloud.model, seqs, feats), capture(edge.model, seqs, feats), [(1, 2), (2, 3)],
                                edge.model)
    if name == "trained":  # a trained translator is a hidden one with other weights: perturb them
        t = TrainedTranslator.from_hidden(t)
        for m in t.maps.values():
            m.weight.add_(0.01 * torch.randn(m.weight.shape, generator=torch.Generator().manual_seed(0)))
    return t


def _compress(tiny_models, out, **kw):
    cfg = CompressConfig(out=str(out), cloud=tiny_models["cloud"], edge=tiny_models["edge"], system_prompt=PROMPT,
                         dtype="float32", calib_tokens=40, quant="fp16", **kw)
    return run_compress(cfg)


@pytest.mark.parametrize("name", ["ridge", "hidden", "trained"])
def test_translator_roundtrips_through_the_export_bit_exactly(name, pair, tiny_models, calib_file, tmp_path):
    cloud, edge = pair
    translator = _fitted(name, pair, calib_file)
    save_translator(translator, tmp_path / "t", cloud.fingerprint, edge.fingerprint)
    outs = {}
    for side in ("edge", "cloud"):
        outs[side] = tmp_path / f"kv-{side}"
        report = _compress(tiny_models, outs[side], calib=str(calib_file), map_on=side, translator=name,
                           translator_path=str(tmp_path / "t"))
        assert report["translator"]["name"] == name
    shipped = KVExport(outs["edge"])
    loaded = shipped.translator()
    assert type(loaded) is type(translator) and loaded.info == translator.info
    original, back = translator.tensors(), loaded.tensors()
    assert sorted(original) == sorted(back)
    assert all(torch.equal(original[k], back[k]) for k in original)  # bit-exact
    # the manifest names and hashes it; a cloud-side export records it without shipping it
    on_cloud = KVExport(outs["cloud"])
    assert on_cloud.manifest["translator"]["tensors_sha256"] == shipped.manifest["translator"]["tensors_sha256"]
    assert on_cloud.translator() is None and not on_cloud.manifest["translator"]["shipped"]
    # the edge applying it gives the KV the cloud computes with it (up to fp16 storage of either side's tensors)
    for i in shipped.layer_indices:
        k_e, v_e = edge_kv(decode_layer(shipped, i), edge.model, loaded)
        k_c, v_c = edge_kv(decode_layer(on_cloud, i), edge.model)
        for a, b in ((k_e, k_c), (v_e, v_c)):
            assert float((a - b).norm() / b.norm()) < 5e-3


def test_a_translator_from_another_model_pair_is_refused(pair, tiny_models, calib_file, tmp_path):
    cloud, edge = pair
    other = load_model(tiny_models["opt"], "float32")
    save_translator(_fitted("hidden", pair, calib_file), tmp_path / "t", other.fingerprint, edge.fingerprint)
    with pytest.raises(EdgeKVError, match="another cloud model"):
        load_translator(tmp_path / "t", cloud.fingerprint, edge.fingerprint)
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT)
    result = runner.invoke(app, ["compress", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"],
                                 "--system-prompt", f"@{prompt}", "--out", str(tmp_path / "kv"), "--calib",
                                 str(calib_file), "--translator", "hidden", "--translator-path",
                                 str(tmp_path / "t"), "--dtype", "float32"])
    assert result.exit_code == 1 and "another cloud model" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "kv").exists()


def test_a_tampered_translator_in_an_export_is_refused(pair, tiny_models, calib_file, tmp_path):
    out = tmp_path / "kv"
    _compress(tiny_models, out, calib=str(calib_file), map_on="edge", translator="hidden")
    blob = bytearray((out / "translator.safetensors").read_bytes())
    blob[-3] ^= 0x40
    (out / "translator.safetensors").write_bytes(bytes(blob))
    with pytest.raises(KVStoreError, match="translator.safetensors"):
        KVExport(out).translator()


def test_trained_needs_a_path(tiny_models, tmp_path):
    with pytest.raises(EdgeKVError, match="--translator-path"):
        _compress(tiny_models, tmp_path / "kv", translator="trained")
