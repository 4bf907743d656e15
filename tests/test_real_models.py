"""The offline default pair (Qwen2.5-Coder 1.5B cloud / 0.5B edge from PyPI part packages), for real."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_align_on_the_default_pair(tmp_path):
    out = tmp_path / "align"
    result = CliRunner().invoke(app, ["align", "--config", str(ROOT / "configs/default.yaml"), "--out", str(out),
                                      "--num-texts", "3", "--max-tokens", "64"])
    assert result.exit_code == 0, result.output
    sim = json.loads((out / "similarity.json").read_text())
    assert (sim["cloud"]["num_layers"], sim["edge"]["num_layers"]) == (28, 24)
    assert sim["cloud"]["fingerprint"].startswith("gguf-sha256:cc324af0")
    cka = sim["metrics"]["linear_cka"]
    assert len(cka) == 28 and all(len(row) == 24 for row in cka)
    assert all(-1.0 <= v <= 1.0 + 1e-9 for row in cka for v in row)
    # depth lines up: the first edge block resembles an early cloud block, the last a late one
    column = lambda j: [cka[i][j] for i in range(28)]  # noqa: E731
    assert max(range(28), key=lambda i: column(0)[i]) < 7
    assert max(range(28), key=lambda i: column(23)[i]) >= 21
    mapping = json.loads((out / "mapping.json").read_text())
    chosen = [p["cloud_layer"] for p in mapping["pairs"]]
    assert [p["edge_layer"] for p in mapping["pairs"]] == list(range(12, 24))
    assert chosen == sorted(chosen)


def test_compress_on_the_default_pair_and_reload(tmp_path):
    import torch

    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.kv.export import Expect, KVExport, tokenizer_fingerprint
    from edgekv.kv.unpack import decode_layer, edge_kv
    from edgekv.models.loading import load_model

    out = tmp_path / "kv"
    prompt = ("You are a careful assistant for a small electronics shop. Answer briefly, cite the return policy "
              "(30 days, receipt required) when asked about refunds, and never invent stock levels.")
    auto = run_compress(CompressConfig(out=str(tmp_path / "auto"), system_prompt=prompt, quant="int8",
                                       prune_ratio=0.5))  # the default: the shipped fuser of this pair
    assert auto["config"]["splice"] == "fuse" and auto["translator"]["name"] == "fuse-residual"
    assert auto["translator"]["source"].endswith("fusers/default-residual-m12")
    report = run_compress(CompressConfig(out=str(out), system_prompt=prompt, quant="int8", prune_ratio=0.5,
                                         calib_texts=4, calib_tokens=64, splice="replace"))
    assert report["regime"] == "heterogeneous"
    assert [r["edge_layer"] for r in report["layers"]] == list(range(12, 24))
    assert all(r["kept_channels"] == 32 and r["head_dim"] == 64 for r in report["layers"])
    n = report["system_prompt_tokens"]
    # real bytes saved: int8 kept key channels (+ fp16 per-channel scales), int8 values (+ fp16 per-token scales)
    assert all(r["bytes"] == 2 * n * 32 + 2 * 32 * 2 + 2 * n * 64 + 2 * n * 2 for r in report["layers"])
    assert report["bytes_written"] < report["raw_fp16_shipped_bytes"] / 2
    edge = load_model("default-edge")
    export = KVExport(out, Expect(edge_fingerprint=edge.fingerprint,
                                  tokenizer_fingerprint=tokenizer_fingerprint(edge.tokenizer)))
    n = export.manifest["system_prompt"]["num_tokens"]
    for i in export.layer_indices:  # one verified layer at a time
        keys, values = edge_kv(decode_layer(export, i), edge.model)
        assert keys.shape == values.shape == (2, n, 64)
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()


def test_the_shipped_shared_prefix_loads_for_the_default_edge_and_is_trained_in_every_token():
    """prefixes/default-k32 (issue 37): a verified shared-prefix export of the default edge, K = 32, trained with no
    frozen sink (`freeze_first: 0`, configs/distill-shared-no-mmlu.yaml): every token, the first one
    included, has moved away from the edge's own KV of its init text, the state training starts from."""
    import torch

    from edgekv.attention.prefix_kv import prefix_kv
    from edgekv.kv.shared_prefix import SharedPrefix
    from edgekv.models.loading import load_model

    edge = load_model("default-edge")
    shared = SharedPrefix(ROOT / "prefixes" / "default-k32", edge)
    assert shared.tokens == 32 and shared.info["freeze_first"] == 0
    own = prefix_kv(edge.model, torch.tensor(shared.manifest["system_prompt"]["token_ids"]))

    def per_token(d: torch.Tensor) -> torch.Tensor:  # the largest change of each token (tokens on dim −2)
        return d.abs().movedim(-2, 0).flatten(1).amax(1)

    for i, (k, v) in enumerate(own):
        sk, sv = shared.prefix.layer(i)
        moved = torch.maximum(per_token(sk - k), per_token(sv - v))
        assert moved.shape == (32,) and bool((moved > 0).all()), f"layer {i}: a token kept its init KV"
