"""Any model pair: tiny random OPT (pre-LN), OPT-350m-style (post-LN, word_embed_proj_dim ≠ hidden), Llama (GQA,
explicit head_dim), Qwen2 and Gemma models, alone and in two cross-family pairs, through every command; the
structure checks (identity maps rebuild the edge's KV), context limits, the same model under two names, and the
paper's OPT-6.7B/1.3B pair planned from its real configs without weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from tests.helpers import ARTICLE, SYSTEM, USERS, byte_tokenizer, save_model

runner = CliRunner()
FAMILIES = ("opt", "opt-post", "llama", "qwen2", "gemma")


def tiny(kind: str, layers: int, width: int, seed: int):
    """A tiny random model of one family, norm weights and biases randomised (a wrong norm order must show)."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=256, num_hidden_layers=layers, max_position_embeddings=512)
    if kind in ("opt", "opt-post"):
        cfg = T.OPTConfig(hidden_size=width, ffn_dim=2 * width, num_attention_heads=4, **common,
                          word_embed_proj_dim=width if kind == "opt" else width // 2,
                          do_layer_norm_before=kind == "opt")
    elif kind == "llama":  # GQA, head_dim 16 ≠ hidden / heads
        cfg = T.LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, **common)
    elif kind == "qwen2":
        cfg = T.Qwen2Config(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=False, **common)
    elif kind == "gemma":  # one KV head (MQA), explicit head_dim, (1 + w) RMSNorm, scaled embeddings
        cfg = T.GemmaConfig(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=16, **common)
    else:
        raise ValueError(kind)
    cfg.initializer_range = 0.2  # outputs that depend on the KV, so that a wrong KV changes answers
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1 + 0.3 * torch.randn_like(p)) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Directories: per family a cloud (4 layers, width 64) and an edge (3 layers, width 32)."""
    root = tmp_path_factory.mktemp("arch")
    out = {}
    for i, kind in enumerate(FAMILIES):
        out[f"{kind}/cloud"] = save_model(tiny(kind, 4, 64, seed=10 + i), byte_tokenizer(), root / f"{kind}-cloud")
        out[f"{kind}/edge"] = save_model(tiny(kind, 3, 32, seed=20 + i), byte_tokenizer(), root / f"{kind}-edge")
    return out


PAIRS = {**{k: (k, k) for k in FAMILIES}, "llama>opt-post": ("llama", "opt-post"), "opt>gemma": ("opt", "gemma")}


def _pair(models, name):
    cloud, edge = PAIRS[name]
    return models[f"{cloud}/cloud"], models[f"{edge}/edge"]


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"text": ARTICLE + f" number {i}"}) + "\n" for i in range(6)))
    return path


@pytest.mark.parametrize("kind", FAMILIES)
def test_identity_hidden_map_rebuilds_the_edges_kv(models, kind):
    from edgekv.kv.translators import HiddenTranslator, RidgeMap
    from edgekv.models.capture import capture
    from edgekv.models.loading import load_model

    edge = load_model(models[f"{kind}/edge"], "float32")
    ids = torch.tensor(edge.tokenizer(SYSTEM)["input_ids"])
    acts = capture(edge.model, [ids], ("hidden_in", "k", "v"))
    width = acts.layers["hidden_in"][0].shape[1]
    t = HiddenTranslator()
    for i in range(edge.num_layers):
        t.maps[i], t.info[i] = RidgeMap(torch.eye(width), torch.zeros(width), 0.0), {"cloud_layer": i}
    for i in range(edge.num_layers):
        keys, values = t.layer_kv(edge.model, i, {"hidden_in": acts.layers["hidden_in"][i]})
        want_k = acts.layers["k"][i].reshape(len(ids), keys.shape[0], -1).transpose(0, 1)
        want_v = acts.layers["v"][i].reshape(len(ids), values.shape[0], -1).transpose(0, 1)
        assert (keys - want_k).abs().max() <= 1e-5 * max(1.0, want_k.abs().max())
        assert (values - want_v).abs().max() <= 1e-5 * max(1.0, want_v.abs().max())


def test_a_block_rebuilt_in_the_wrong_order_is_refused(models, monkeypatch):
    """The structure check catches the old defect: the pre-attention norm applied on a post-LN block."""
    from edgekv.models import structure
    from edgekv.models.capture import check_kv_reconstruction
    from edgekv.models.loading import load_model

    edge = load_model(models["opt-post/edge"], "float32")
    ids = torch.tensor(edge.tokenizer(SYSTEM)["input_ids"])
    assert check_kv_reconstruction(edge.model, ids) == 0.0
    monkeypatch.setattr(structure, "attention_input_norm", lambda layer: layer.self_attn_layer_norm)
    with pytest.raises(EdgeKVError, match=r"rebuilds OPTDecoderLayer KV wrongly \(layer 0"):
        check_kv_reconstruction(edge.model, ids)


@pytest.mark.parametrize("kind", FAMILIES)
def test_same_model_splice_is_exact_under_two_names(models, kind, tmp_path):
    """float32 greedy: the spliced same-model export answers as generate on the concatenation, also when the
    cloud and the edge name the model by different strings (dir/ and its absolute path)."""
    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    path = models[f"{kind}/edge"]
    report = run_compress(CompressConfig(out=str(tmp_path / "kv"), cloud=path + "/", edge=str(Path(path).resolve()),
                                         system_prompt=SYSTEM, dtype="float32", quant="fp32", start_layer=1))
    assert report["regime"] == "same-model"
    edge = load_model(path, "float32")
    session = EdgeSession(edge, str(tmp_path / "kv"), cache_dir=tmp_path / "c")
    session.eos_ids = set()
    for user in USERS[:2]:
        ids = edge.tokenizer(SYSTEM)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = edge.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist()
        assert session.complete(user, SamplingParams(max_new_tokens=12)).token_ids == want


@pytest.mark.parametrize("name", list(PAIRS))
def test_every_command_runs_on_the_pair(models, calib, name, tmp_path):
    """align → compress (ridge, hidden, int8, int4, ThinK) → serve-edge --batch → a fuser's export served →
    train-fuser → eval (limit 1), each on this pair."""
    from edgekv.align.align_job import AlignConfig, run_align
    from edgekv.eval.eval_config import EvalConfig
    from edgekv.eval.eval_job import run_eval
    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.kv.fusers import BiasFuser
    from edgekv.kv.registry import save_translator
    from edgekv.kv.translators import HiddenTranslator
    from edgekv.models.capture import capture
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    cloud_dir, edge_dir = _pair(models, name)
    align = tmp_path / "align"
    run_align(AlignConfig(out=str(align), cloud=cloud_dir, edge=edge_dir, dtype="float32", texts=str(calib),
                          max_tokens=40, start_layer=1, outlier_ratio=None))
    mapping = json.loads((align / "mapping.json").read_text())
    assert mapping["num_edge_layers"] == 3 and mapping["pairs"]

    base = dict(cloud=cloud_dir, edge=edge_dir, system_prompt=SYSTEM, dtype="float32",
                mapping=str(align / "mapping.json"), calib=str(calib), calib_texts=6, calib_tokens=40, splice="replace")
    variants = {"ridge": dict(translator="ridge", quant="fp16"), "hidden": dict(translator="hidden", quant="fp16"),
                "int8": dict(translator="hidden", quant="int8"), "int4": dict(translator="hidden", quant="int4"),
                "think": dict(translator="hidden", quant="fp16", prune_ratio=0.5)}
    reports = {}
    for v, kw in variants.items():
        reports[v] = run_compress(CompressConfig(out=str(tmp_path / f"kv-{v}"), **base, **kw))
        assert reports[v]["regime"] == "heterogeneous" and reports[v]["bytes_written"] > 0
        if kw["translator"] == "hidden":  # the edge's own block rebuilt its KV: checked, and exact in float32
            assert reports[v]["kv_reconstruction_max_rel_error"] <= 1e-4
    assert all(r["kept_channels"] < r["head_dim"] for r in reports["think"]["layers"])
    assert reports["int4"]["bytes_written"] < reports["int8"]["bytes_written"] < reports["hidden"]["bytes_written"]

    batch = tmp_path / "in.jsonl"
    batch.write_text("".join(json.dumps({"id": i, "prompt": u, "max_tokens": 4}) + "\n" for i, u in enumerate(USERS)))
    result = runner.invoke(app, ["serve-edge", "--edge", edge_dir, "--kv", str(tmp_path / "kv-int8"), "--dtype",
                                 "float32", "--batch", str(batch), "--output", str(tmp_path / "out.jsonl"),
                                 "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(answers) == 3 and all(a["completion_tokens"] == 4 for a in answers)

    cloud, edge = load_model(cloud_dir, "float32"), load_model(edge_dir, "float32")
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:40]) for t in calib.read_text().splitlines()]
    pairs = [(p["edge_layer"], p["cloud_layer"]) for p in mapping["pairs"]]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), pairs, edge.model)
    fuser = BiasFuser.from_hidden(hidden, edge.model, init=0.0)
    fuser.set_open([i for i, _ in pairs])
    save_translator(fuser, tmp_path / "fuser", cloud.fingerprint, edge.fingerprint)
    run_compress(CompressConfig(out=str(tmp_path / "kv-fuse"), **{**base, "splice": "fuse"}, translator="fuse-bias",
                                translator_path=str(tmp_path / "fuser"), quant="fp16"))
    session = EdgeSession(edge, str(tmp_path / "kv-fuse"), cache_dir=tmp_path / "c2")
    assert session.system.splice == "fuse"
    assert len(session.complete(USERS[0], SamplingParams(max_new_tokens=3)).token_ids) == 3

    args = ["train-fuser", "--cloud", cloud_dir, "--edge", edge_dir, "--dtype", "float32", "--start-layer", "1",
            "--train-texts", "2", "--gate-texts", "2", "--steps", "2", "--out", str(tmp_path / "f"),
            "--cache", str(tmp_path / "fc")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "f" / "gates.json").read_text())["steps"] == 2

    xsum = tmp_path / "xsum.jsonl"
    xsum.write_text(json.dumps({"id": "0", "document": ARTICLE, "summary": "A cycle lane was approved."}) + "\n")
    out = tmp_path / "eval"
    run_eval(EvalConfig(out=str(out), cloud=cloud_dir, edge=edge_dir, dtype="float32", datasets=["xsum"], limit=1,
                        strategies=["edge-only", "edgeprompt", "ce-lslm", "ce-lslm-fuse"], xsum_source=str(xsum),
                        max_new_tokens=3, align_dir=str(align), align_config=None, calib=str(calib),
                        calib_tokens=40, min_system_tokens=8, max_system_tokens=300, fuser_path=str(tmp_path / "fuser"),
                        bandwidth_mbps=50.0, latency_ms=1.0))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["strategy"] for r in rows) == ["ce-lslm", "ce-lslm-fuse", "edge-only", "edgeprompt"]
    assert all(r.get("error") is None and r["ref_nll"] is not None for r in rows)


@pytest.mark.parametrize("family, message", [("gpt2", "cannot find the decoder layers of GPT2LMHeadModel"),
                                             ("phi", "PhiForCausalLM: partial rotary (partial_rotary_factor = 0.5)")])
def test_a_family_edgekv_cannot_read_is_refused_in_one_line(family, message, tmp_path):
    import transformers as T

    cfg = (T.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4) if family == "gpt2" else
           T.PhiConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, partial_rotary_factor=0.5))
    path = save_model(T.AutoModelForCausalLM.from_config(cfg), byte_tokenizer(), tmp_path / family)
    result = runner.invoke(app, ["compress", "--cloud", path, "--edge", path, "--system-prompt", SYSTEM, "--out",
                                 str(tmp_path / "kv"), "--dtype", "float32"])
    assert result.exit_code == 1 and "Traceback" not in result.output and message in result.output
    assert not (tmp_path / "kv").exists()


# ------------------------------------------------------------------------------------------- context limits

LONG = "word " * 130  # 650 byte tokens: beyond the tiny models' 512 positions


@pytest.mark.parametrize("kind", ["opt", "llama"])
def test_an_over_long_system_prompt_is_one_line_at_compress_and_serve(models, kind, tmp_path):
    path = models[f"{kind}/edge"]
    result = runner.invoke(app, ["compress", "--cloud", path, "--edge", path, "--system-prompt", LONG, "--out",
                                 str(tmp_path / "kv"), "--dtype", "float32"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "the system prompt = 650 tokens exceeds the model's context of 512 tokens" in result.output
    assert not (tmp_path / "kv").exists() and not list(tmp_path.glob(".kv*"))
    batch = tmp_path / "in.jsonl"
    batch.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = runner.invoke(app, ["serve-edge", "--edge", path, "--system-prompt", LONG, "--batch", str(batch),
                                 "--output", str(tmp_path / "out.jsonl"), "--dtype", "float32"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "650 tokens exceeds the model's context of 512 tokens" in result.output
    assert not (tmp_path / "out.jsonl").exists()
    result = runner.invoke(app, ["serve-edge", "--edge", path, "--system-prompt", SYSTEM, "--batch", str(batch),
                                 "--output", str(tmp_path / "out.jsonl"), "--dtype", "float32", "--max-new-tokens",
                                 "500"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "exceeds the model's context of 512 tokens" in result.output


def test_an_over_long_request_is_one_line_at_eval(models, calib, tmp_path):
    path = models["opt/edge"]
    xsum = tmp_path / "xsum.jsonl"
    xsum.write_text(json.dumps({"id": "0", "document": LONG, "summary": "Words."}) + "\n")
    result = runner.invoke(app, ["eval", "--cloud", path, "--edge", path, "--dtype", "float32", "--dataset", "xsum",
                                 "--strategies", "edge-only", "--limit", "1", "--out", str(tmp_path / "run"),
                                 "--config", str(_eval_yaml(tmp_path, xsum, max_system_tokens=600))])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "exceeds the model's context of 512 tokens" in result.output and "0: system + user prompt" in result.output
    assert not (tmp_path / "run" / "results.jsonl").exists()


def _eval_yaml(tmp_path: Path, xsum: Path, **kw) -> Path:
    import yaml

    body = {"eval": {"xsum_source": str(xsum), "min_system_tokens": 8, "max_new_tokens": 3, "align_config": None,
                     "bertscore": "minilm", **kw}}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_eval_truncates_by_ids_when_decoding_re_encodes_longer(tmp_path):
    """A tokenizer without a decoder joins tokens with spaces, so decode → encode roughly doubles the count: the
    truncated system prompt must still fit the budget."""
    from edgekv.eval.datasets import load_requests

    tok = byte_tokenizer()
    tok.backend_tokenizer.decoder = None
    text = ARTICLE * 3
    assert len(tok(tok.decode(tok(text)["input_ids"][:100]))["input_ids"]) > 150  # the trap is real
    xsum = tmp_path / "xsum.jsonl"
    xsum.write_text(json.dumps({"id": "0", "document": text, "summary": "A lane."}) + "\n")
    (req,) = load_requests("xsum", tok, 1, source=str(xsum), max_system_tokens=100, min_system_tokens=8)
    assert 50 <= len(tok(req.system, add_special_tokens=True)["input_ids"]) <= 100


# ------------------------------------------------------------------------------------------- the paper's pair


def test_the_papers_opt_pair_plans_from_real_configs_without_weights():
    """OPT-6.7B (cloud) and OPT-1.3B (edge) at their published sizes on the meta device: layer counts, head
    mapping, per-layer KV shapes and the export's byte estimate, no weights loaded."""
    from transformers import OPTConfig, OPTForCausalLM

    from edgekv.align.mapping import layer_pairs
    from edgekv.kv.encode import raw_fp16_bytes
    from edgekv.models.structure import attn_shape, context_limit, decoder_layers

    published = {"cloud": dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32, num_attention_heads=32),
                 "edge": dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32)}
    with torch.device("meta"):
        cloud, edge = (OPTForCausalLM(OPTConfig(vocab_size=50272, max_position_embeddings=2048,
                                                word_embed_proj_dim=published[k]["hidden_size"], **published[k]))
                       for k in ("cloud", "edge"))
    assert sum(p.numel() for p in cloud.parameters()) == pytest.approx(6.66e9, rel=0.01)
    assert sum(p.numel() for p in edge.parameters()) == pytest.approx(1.32e9, rel=0.01)
    assert len(decoder_layers(cloud)) == 32 and len(decoder_layers(edge)) == 24
    assert attn_shape(cloud) == (32, 32, 128) and attn_shape(edge) == (32, 32, 64)
    assert context_limit(edge.config) == 2048
    pairs, how = layer_pairs(None, None, 32, 24)
    assert how.startswith("uniform") and [p[0] for p in pairs] == list(range(12, 24))
    assert all(0 <= c < 32 for _, c in pairs) and [c for _, c in pairs] == sorted(c for _, c in pairs)
    # a 1,024-token system prompt: edge-shaped fp16 KV of the 12 deep layers, K and V, 32 heads × 64 channels
    assert sum(raw_fp16_bytes(1024, 32, 64) for _ in pairs) == 12 * 2 * 1024 * 32 * 64 * 2


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("dtype,weights", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"), (torch.bfloat16, "int4")])
def test_the_decode_step_is_the_models_forward_bit_for_bit(kind, dtype, weights):
    """`DecodeStep` (a prompt block, then tokens, without transformers' wrapper; int4 q/k/v and gate/up joined,
    q and k rotated as one tensor) gives the model's own logits and KV, bit for bit, on every layout it takes
    (Llama, Qwen2); the others (OPT, Gemma's scaled embeddings) are not taken."""
    from edgekv.attention.decode_step import DecodeStep
    from edgekv.attention.fuse import enable_fusion
    from edgekv.attention.prefix_kv import PrefixKV
    from edgekv.models.quantized import quantize_linears

    model = tiny(kind, 3, 128, seed=5).to(dtype)  # Qwen2's k/v rows (2 × 32) fill int4's 64-row pack blocks
    quantize_linears(model, weights)
    enable_fusion(model)
    step = DecodeStep.for_model(model)
    if kind not in ("llama", "qwen2"):
        assert step is None
        return
    assert step is not None
    joined = [len(groups) == 1 for groups in step.qkv]  # q/k/v as one product (int4: rows in blocks of 64)
    assert all(joined) == (weights == "int4" and kind == "qwen2")  # Llama's head_dim 16: 32 k/v rows
    assert all(g is not None for g in step.gate_up) == (weights == "int4")  # gate/up: 256 rows each
    prefix = PrefixKV.of_model(model, torch.arange(3, 40))
    caches = prefix.request_cache(), prefix.request_cache()
    block = torch.tensor([[7, 19, 4, 88, 23]])
    where = torch.arange(prefix.next_position, prefix.next_position + 5)[None]
    with torch.no_grad():  # a one-request prompt block: the model's causal mask over its cache
        want = model(input_ids=block, cache=caches[0], position_ids=where, use_cache=True, logits_to_keep=5).logits[0]
        got = step(block, where, caches[1], torch.arange(5))
        assert torch.equal(got, want)
    token, position = want[-1].argmax()[None], prefix.next_position + 5
    with torch.no_grad():
        for _ in range(6):
            want = model(input_ids=token[None], cache=caches[0], position_ids=torch.tensor([[position]]),
                         use_cache=True, logits_to_keep=1).logits[0, -1]
            got = step(token[None], torch.tensor([[position]]), caches[1])
            assert torch.equal(got[-1], want)
            token, position = want.argmax()[None], position + 1
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
