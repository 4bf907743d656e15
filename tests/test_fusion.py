"""Fusion (issue 12): the biased two-segment merge is one softmax, closed gates are the edge alone, the fuser
saves and loads exactly (and only for its model pair), training its gates lowers held-out KL, resume is exact."""

import pytest
import torch

from edgekv import EdgeKVError
from edgekv.attention.merge import merge_attention, segment_attention
from edgekv.kv.fuser_training import choose_gates, evaluate, fused_logits, prepare, train
from edgekv.kv.fusers import BiasFuser, ResidualFuser
from edgekv.kv.registry import load_translator, save_translator
from edgekv.kv.translators import HiddenTranslator
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.texts import HeldOutText
from tests.helpers import PROMPT, byte_tokenizer, edge_prefix, save_model, tiny_qwen2


def _qkv(seed, heads=4, kv_heads=2, t=5, s_a=7, s_b=6, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, kv_heads, s_a + s_b, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv_heads, s_a + s_b, d, generator=g, dtype=torch.float64)
    return q, k, v, s_a


def _one_softmax(q, k, v, logit_bias):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + logit_bias
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("seed", range(3))
def test_unbiased_merge_is_one_softmax_over_both_segments(seed):
    q, k, v, s_a = _qkv(seed)
    o_a, l_a = segment_attention(q, k[:, :, :s_a], v[:, :, :s_a])
    o_b, l_b = segment_attention(q, k[:, :, s_a:], v[:, :, s_a:])
    full = _one_softmax(q, k, v, torch.zeros(k.shape[2], dtype=torch.float64))
    assert (merge_attention(o_a, l_a, o_b, l_b, 0.0) - full).abs().max() < 1e-10


@pytest.mark.parametrize("seed", range(3))
def test_bias_equals_adding_it_to_the_second_segments_logits(seed):
    q, k, v, s_a = _qkv(seed)
    heads, kv_heads = q.shape[1], k.shape[1]
    bias = torch.tensor([-1.5, 2.0], dtype=torch.float64)[:kv_heads]  # one per KV head
    o_a, l_a = segment_attention(q, k[:, :, :s_a], v[:, :, :s_a])
    o_b, l_b = segment_attention(q, k[:, :, s_a:], v[:, :, s_a:])
    per_head = bias.repeat_interleave(heads // kv_heads)[None, :, None]
    logit_bias = torch.cat([torch.zeros(heads, 1, s_a, dtype=torch.float64),
                            per_head[0, :, :, None].expand(heads, 1, k.shape[2] - s_a)], -1)[None]
    expected = _one_softmax(q, k, v, logit_bias)
    assert (merge_attention(o_a, l_a, o_b, l_b, per_head) - expected).abs().max() < 1e-10
    shut = merge_attention(o_a, l_a, o_b, l_b, float("-inf"))
    assert (shut - o_a).abs().max() < 1e-12  # −inf: the second segment is out, exactly


def test_causal_segment_attention_aligns_queries_with_the_last_keys():
    q, k, v, _ = _qkv(0, t=4, s_a=6, s_b=0)
    out, _ = segment_attention(q, k, v, causal=True)
    visible = torch.arange(6)[None, :] <= torch.arange(2, 6)[:, None]
    masked, _ = segment_attention(q, k, v, mask=visible[None, None])
    assert torch.equal(out, masked)


def _pair(tmp_path, calib_file):
    # initializer_range 0.2: at the usual 0.02 a random tiny model's outputs barely depend on its deep KV
    cloud_dir = save_model(tiny_qwen2(4, 64, 4, 2, seed=1, init=0.2), byte_tokenizer(), tmp_path / "cloud")
    edge_dir = save_model(tiny_qwen2(3, 32, 4, 2, seed=2, init=0.2), byte_tokenizer(), tmp_path / "edge")
    cloud, edge = load_model(cloud_dir, "float32"), load_model(edge_dir, "float32")
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:70]) for t in calib_file.read_text().splitlines()]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), [(1, 2), (2, 3)], edge.model)
    texts = [HeldOutText("t", s[:40], s[40:70]) for s in seqs]
    return cloud, edge, BiasFuser.from_hidden(hidden, edge.model), texts


def test_closed_gates_are_the_edge_alone_and_open_gates_are_not(calib_file, tmp_path):
    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    ex = prepare(edge, cloud, texts[:2], fuser, ("c", "e"), top_k=8)
    with torch.no_grad():
        for text, example in zip(texts[:2], ex):
            full = torch.cat([text.prefix, text.continuation])
            alone = edge.model(full[None]).logits[0, text.prefix.numel():-1]
            assert fuser.open_layers() == []
            assert (fused_logits(edge, fuser, example) - alone).abs().max() < 1e-5
            for b in fuser.gate_bias.values():
                b.fill_(0.0)
            opened = fused_logits(edge, fuser, example, [1, 2])
            assert (opened - alone).abs().max() > 1e-3  # the cloud segment does reach the logits
            for b in fuser.gate_bias.values():
                b.fill_(-6.0)


def test_fuser_round_trips_exactly_and_is_refused_for_another_pair(calib_file, tmp_path):
    _, edge, fuser, _ = _pair(tmp_path, calib_file)
    fuser.gate_bias[1] = torch.tensor([0.25, -3.0])
    fuser.set_open([1])
    save_translator(fuser, tmp_path / "f", "cloud-fp", "edge-fp")
    back = load_translator(tmp_path / "f", "cloud-fp", "edge-fp")
    assert isinstance(back, BiasFuser) and back.open_layers() == [1]
    for name, t in fuser.tensors().items():
        assert torch.equal(back.tensors()[name], t), name
    with pytest.raises(EdgeKVError, match="another edge model"):
        load_translator(tmp_path / "f", "cloud-fp", "other-edge")


def test_gate_training_lowers_heldout_kl_and_gates_are_chosen(calib_file, tmp_path):
    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    train_ex = prepare(edge, cloud, texts[:5], fuser, ("c", "e"), top_k=16, cache_dir=tmp_path / "cache")
    held = prepare(edge, cloud, texts[5:], fuser, ("c", "e"), top_k=16, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 6
    before = evaluate(edge, fuser, held, [1, 2])["kl"]
    log = train(edge, fuser, train_ex, held, steps=40, lr=0.2)
    after = evaluate(edge, fuser, held, [1, 2])["kl"]
    assert log[0]["step"] == 0 and log[-1]["step"] == 40 and "held_out_kl" in log[-1]
    assert after < before - 1e-3, (before, after)
    evidence = choose_gates(edge, fuser, held)
    assert evidence["chosen_nll"] <= evidence["closed_nll"]
    assert set(fuser.open_layers()) == set(evidence["open"])
    budget = choose_gates(edge, fuser, held, max_open=1)
    assert len(budget["open"]) <= 1 and fuser.open_layers() == budget["open"]
    if len(evidence["open"]) > 1 and budget["open"]:  # the kept layer is the one whose closing costs most
        assert budget["open"] == [max(evidence["open"], key=lambda i: evidence["leave_one_out_nll"][str(i)])]


def test_gate_training_resume_is_exact(calib_file, tmp_path):
    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    examples = prepare(edge, cloud, texts[:4], fuser, ("c", "e"), top_k=16)
    fresh = lambda: BiasFuser.from_hidden(fuser, edge.model)  # noqa: E731
    straight = fresh()
    train(edge, straight, examples, [], steps=8, lr=0.1)
    first = fresh()
    train(edge, first, examples, [], steps=4, lr=0.1, checkpoint=tmp_path / "ck", every=2)
    again = fresh()  # a fresh process: state comes from the checkpoint only
    log = train(edge, again, examples, [], steps=8, lr=0.1, checkpoint=tmp_path / "ck", every=2)
    assert [e["step"] for e in log] == list(range(1, 9))
    for i in straight.gate_bias:
        assert torch.equal(again.gate_bias[i], straight.gate_bias[i])


def test_residual_fuser_starts_as_the_edge_and_learns(calib_file, tmp_path):
    cloud, edge, bias_fuser, texts = _pair(tmp_path, calib_file)
    fuser = ResidualFuser.from_hidden(bias_fuser, edge.model, rank=8)
    examples = prepare(edge, cloud, texts[:5], fuser, ("c", "e"), top_k=16)
    held = prepare(edge, cloud, texts[5:], fuser, ("c", "e"), top_k=16)
    with torch.no_grad():
        text = texts[5]
        full = torch.cat([text.prefix, text.continuation])
        alone = edge.model(full[None]).logits[0, text.prefix.numel():-1]
        assert (fused_logits(edge, fuser, held[0], [1, 2]) - alone).abs().max() < 1e-5  # zero-initialised up
    before = evaluate(edge, fuser, held, [1, 2])["kl"]
    train(edge, fuser, examples, held, steps=40, lr=3e-3)
    assert evaluate(edge, fuser, held, [1, 2])["kl"] < before - 1e-3
    save_translator(fuser, tmp_path / "r", "c", "e")
    back = load_translator(tmp_path / "r", "c", "e")
    assert isinstance(back, ResidualFuser)
    assert all(torch.equal(back.tensors()[k], t) for k, t in fuser.tensors().items())


def test_fidelity_harness_runs_fusers_and_closed_equals_edge(calib_file, tmp_path):
    from bench.fidelity_harness import evaluate_text

    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    for b in fuser.gate_bias.values():
        b.fill_(0.0)
    fuser.set_open([1, 2])
    self_hidden = HiddenTranslator()
    seqs = [torch.cat([t.prefix, t.continuation]) for t in texts]
    self_hidden.fit(capture(edge.model, seqs, ("hidden_in",)), capture(edge.model, seqs, ("hidden_in",)),
                    [(1, 1), (2, 2)], edge.model)
    self_fuser = BiasFuser.from_hidden(self_hidden, edge.model, source="edge", init=0.0)
    self_fuser.set_open([1, 2])
    rows = evaluate_text(edge, cloud, texts[0], {}, [1], 1, fusers={"fuse": fuser, "self-fuse": self_fuser})
    by = {r["condition"]: r for r in rows}
    assert set(by) == {"edge", "cloud", "no-prefix", "cloud-no-prefix", "fuse-closed", "fuse", "self-fuse"}
    assert by["fuse-closed"]["nll"] == pytest.approx(by["edge"]["nll"], abs=1e-5)
    assert abs(by["fuse"]["nll"] - by["edge"]["nll"]) > 1e-4
    assert self_fuser.self_fuse and not fuser.self_fuse
    # the mismatched control: the cloud fuser fed another text's cloud KV; fed this text's own, it is the fuser
    keep: dict = {}
    evaluate_text(edge, cloud, texts[0], {}, [1], 1, fusers={"fuse": fuser}, keep=keep)
    assert texts[1].prefix.numel() == texts[0].prefix.numel()
    same: dict = {}
    evaluate_text(edge, cloud, texts[1], {}, [1], 1, fusers={"fuse": fuser}, keep=same)
    rows = evaluate_text(edge, cloud, texts[1], {}, [1], 1, fusers={"fuse": fuser, "self-fuse": self_fuser},
                         mismatched=keep["cloud_acts"])
    by = {r["condition"]: r for r in rows}
    assert "fuse@mismatched" in by and "self-fuse@mismatched" not in by
    assert abs(by["fuse@mismatched"]["nll"] - by["fuse"]["nll"]) > 1e-6
    control = {r["condition"]: r for r in evaluate_text(edge, cloud, texts[1], {}, [1], 1, fusers={"fuse": fuser},
                                                        mismatched=same["cloud_acts"])}
    assert control["fuse@mismatched"]["nll"] == pytest.approx(control["fuse"]["nll"], abs=1e-6)


def _fuse_export(tiny_models, calib_file, tmp_path, bias: float, name: str, shared=None):
    from edgekv.kv.compress_job import CompressConfig, run_compress

    cloud, edge = load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:40]) for t in calib_file.read_text().splitlines()]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), [(1, 2), (2, 3)], edge.model)
    fuser = BiasFuser.from_hidden(hidden, edge.model, init=bias)
    fuser.set_open([1, 2])
    save_translator(fuser, tmp_path / f"fuser-{name}", cloud.fingerprint, edge.fingerprint)
    cfg = CompressConfig(out=str(tmp_path / f"kv-{name}"), cloud=tiny_models["cloud"], edge=tiny_models["edge"],
                         system_prompt=PROMPT, dtype="float32", quant="fp16", splice="fuse", translator="fuse-bias",
                         translator_path=str(tmp_path / f"fuser-{name}"), shared=shared and str(shared))
    run_compress(cfg)
    return edge, fuser, tmp_path / f"kv-{name}", PROMPT


def test_fuse_export_round_trips_and_serves_the_edge_alone_when_gates_are_shut(tiny_models, calib_file, tmp_path):
    from edgekv.kv.export import KVExport
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    edge, fuser, out, prompt = _fuse_export(tiny_models, calib_file, tmp_path, -1e4, "shut")
    export = KVExport(out)
    assert export.manifest["splice"] == "fuse" and export.layer_indices == [1, 2]
    shipped = export.shipped_translator()
    assert isinstance(shipped, BiasFuser) and shipped.open_layers() == [1, 2]
    # the cloud applied the maps: only the gates travel, bit-exactly
    assert shipped.tensors().keys() == fuser.gate_tensors().keys() and not shipped.maps
    assert all(torch.equal(shipped.tensors()[k], t) for k, t in fuser.gate_tensors().items())
    assert export.manifest["translator"]["bytes"] < sum(t.numel() * 4 for t in fuser.tensors().values()) / 10
    alone = EdgeSession(edge, None, prompt, cache_dir=tmp_path / "c")
    fused = EdgeSession(edge, str(out), cache_dir=tmp_path / "c")
    params = SamplingParams(max_new_tokens=8)
    a, f = alone.complete("What does the cloud compute?", params), fused.complete("What does the cloud compute?",
                                                                                   params)
    assert f.token_ids == a.token_ids
    assert (f.first_logits - a.first_logits).abs().max() < 1e-5
    assert fused.describe()["splice"] == "fuse" and fused.describe()["bytes_loaded"] > 0
    _, _, open_out, _ = _fuse_export(tiny_models, calib_file, tmp_path, 0.0, "open")
    opened = EdgeSession(edge, str(open_out), cache_dir=tmp_path / "c").complete("What does the cloud compute?",
                                                                                 params)
    assert (opened.first_logits - a.first_logits).abs().max() > 1e-4  # an open gate reaches the answer


def test_compress_refuses_fuse_without_a_fuser_and_an_all_closed_fuser(tiny_models, calib_file, tmp_path):
    from edgekv.kv.compress_job import CompressConfig, run_compress

    base = dict(cloud=tiny_models["cloud"], edge=tiny_models["edge"], system_prompt=PROMPT, dtype="float32")
    with pytest.raises(EdgeKVError, match="--splice fuse needs a trained fuser"):
        run_compress(CompressConfig(out=str(tmp_path / "a"), splice="fuse", translator="hidden", **base))
    with pytest.raises(EdgeKVError, match="is a fuser"):
        run_compress(CompressConfig(out=str(tmp_path / "b"), translator="fuse-bias", translator_path="x",
                                    splice="replace", **base))
    edge, fuser, _, _ = _fuse_export(tiny_models, calib_file, tmp_path, 0.0, "x")
    fuser.set_open([])
    cloud = load_model(tiny_models["cloud"], "float32")
    save_translator(fuser, tmp_path / "closed", cloud.fingerprint, edge.fingerprint)
    with pytest.raises(EdgeKVError, match="every gate of this fuser is closed"):
        run_compress(CompressConfig(out=str(tmp_path / "c"), splice="fuse", translator="fuse-bias",
                                    translator_path=str(tmp_path / "closed"), **base))
    assert not (tmp_path / "c").exists()


def test_train_fuser_command_on_tiny_models(tiny_models, tmp_path):
    import json

    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    args = ["train-fuser", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--start-layer", "1",
            "--train-texts", "4", "--gate-texts", "2", "--steps", "6", "--out", str(tmp_path / "f"),
            "--cache", str(tmp_path / "cache")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    gates = json.loads((tmp_path / "f" / "gates.json").read_text())
    assert gates["steps"] == 6 and gates["train_texts"] == 4 and gates["pairs"] == [[1, 2], [2, 3]]
    assert gates["chosen_nll"] <= gates["closed_nll"]
    assert (tmp_path / "f" / "loss_curve.png").stat().st_size > 0
    fuser = load_translator(tmp_path / "f")
    assert isinstance(fuser, BiasFuser) and fuser.open_layers() == gates["open"]
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 6
    again = runner.invoke(app, args[:-4] + ["--steps", "8"] + args[-4:])  # resumes from step 6
    assert again.exit_code == 0, again.output
    log = json.loads((tmp_path / "f" / "log.json").read_text())
    assert [e["step"] for e in log] == list(range(0, 9))
    edge_prefix(load_model(tiny_models["edge"], "float32"), tmp_path / "k3", 3)
    under = runner.invoke(app, args[:-4] + ["--steps", "2", "--shared", str(tmp_path / "k3"), "--out",
                                            str(tmp_path / "fs"), "--cache", str(tmp_path / "cache")])
    assert under.exit_code == 0, under.output
    assert json.loads((tmp_path / "fs" / "gates.json").read_text())["shared_prefix"]["tokens"] == 3
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 12  # its own features: the own KV differs
    assert gates["shared_prefix"] is None
    bad = runner.invoke(app, ["train-fuser", "--gate", "nope"])
    assert bad.exit_code == 1 and "unknown --gate 'nope'" in bad.output and "Traceback" not in bad.output
    no_prefix = runner.invoke(app, ["train-fuser", "--shared", str(tmp_path / "none")])
    assert no_prefix.exit_code == 1 and "shared prefix not found" in no_prefix.output
    bad_rate = runner.invoke(app, ["train-fuser", "--map-lr", "0"])
    assert bad_rate.exit_code == 1 and "--map-lr must be > 0" in bad_rate.output and "Traceback" not in bad_rate.output


def test_compact_fuser_keeps_open_layers_in_float16_and_loads(calib_file, tmp_path):
    _, edge, fuser, _ = _pair(tmp_path, calib_file)
    fuser.gate_bias[2] = torch.tensor([0.5, -1.0])
    fuser.set_open([2])
    small = fuser.compact()
    assert sorted(small.info) == [2] and sorted(small.gate_bias) == [2]
    save_translator(small, tmp_path / "s", "c", "e")
    back = load_translator(tmp_path / "s", "c", "e")
    assert back.open_layers() == [2] and back.maps[2].weight.dtype == torch.float32
    assert torch.equal(back.maps[2].weight, fuser.maps[2].weight.half().float())
    assert torch.equal(back.gate_bias[2], fuser.gate_bias[2])
    big = (tmp_path / "s" / "translator.safetensors").stat().st_size
    save_translator(fuser, tmp_path / "f", "c", "e")
    assert big < (tmp_path / "f" / "translator.safetensors").stat().st_size / 3


def test_self_fusion_features_come_from_the_edge_and_targets_from_the_cloud(calib_file, tmp_path):
    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    seqs = [torch.cat([t.prefix, t.continuation]) for t in texts]
    self_hidden = HiddenTranslator().fit(capture(edge.model, seqs, ("hidden_in",)),
                                         capture(edge.model, seqs, ("hidden_in",)), [(1, 1), (2, 2)], edge.model)
    self_fuser = BiasFuser.from_hidden(self_hidden, edge.model, source="edge")
    cache = tmp_path / "cache"
    from_cloud = prepare(edge, cloud, texts[:2], fuser, ("c", "e"), top_k=8, cache_dir=cache)
    from_edge = prepare(edge, edge, texts[:2], self_fuser, ("e", "e"), top_k=8, cache_dir=cache, teacher=cloud)
    for a, b in zip(from_cloud, from_edge):
        assert torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logp, b.top_logp)  # the cloud's targets
        assert not torch.equal(a.cloud[1][0], b.cloud[1][0])  # the fused KV's source differs
    assert len(list((cache / "targets").glob("*.safetensors"))) == 2  # computed once, shared
    again = prepare(edge, edge, texts[:2], self_fuser, ("e", "e"), top_k=8, cache_dir=cache, teacher=cloud)
    assert torch.equal(again[0].cloud[2][1], from_edge[0].cloud[2][1])


def test_raw_features_map_as_cached_ones_and_trained_maps_learn_and_resume_exactly(calib_file, tmp_path):
    cloud, edge, bias_fuser, texts = _pair(tmp_path, calib_file)
    fuser = ResidualFuser.from_hidden(bias_fuser, edge.model, rank=8)
    cooked = prepare(edge, cloud, texts[:5], fuser, ("c", "e"), top_k=16)
    raw = prepare(edge, cloud, texts[:5], fuser, ("c", "e"), top_k=16, cache_dir=tmp_path / "cache", raw=True)
    held = prepare(edge, cloud, texts[5:], fuser, ("c", "e"), top_k=16, cache_dir=tmp_path / "cache", raw=True)
    assert raw[0].hidden[1].shape[-1] == 64 and not raw[0].cloud  # the cloud's own width, nothing mapped yet
    with torch.no_grad():
        for c, r in zip(cooked, raw):
            for i in (1, 2):
                mapped = r.cloud_kv(edge, fuser, [i])[i]
                assert all(torch.equal(a, b) for a, b in zip(mapped, c.cloud[i]))
    with pytest.raises(EdgeKVError, match="raw examples"):
        train(edge, fuser, cooked, [], steps=1, lr=3e-3, map_lr=1e-3)
    fresh = lambda: ResidualFuser.from_hidden(bias_fuser, edge.model, rank=8)  # noqa: E731
    before_maps = {i: m.weight.clone() for i, m in fuser.maps.items()}
    trained = fresh()
    before = evaluate(edge, trained, held, [1, 2])["kl"]
    train(edge, trained, raw, held, steps=30, lr=3e-3, map_lr=1e-3)
    assert evaluate(edge, trained, held, [1, 2])["kl"] < before - 1e-3
    assert all(not torch.equal(trained.maps[i].weight, w) for i, w in before_maps.items())  # the maps moved
    straight = fresh()
    train(edge, straight, raw, [], steps=6, lr=3e-3, map_lr=1e-3)
    train(edge, fresh(), raw, [], steps=3, lr=3e-3, map_lr=1e-3, checkpoint=tmp_path / "ck", every=3)
    again = fresh()
    train(edge, again, raw, [], steps=6, lr=3e-3, map_lr=1e-3, checkpoint=tmp_path / "ck", every=3)
    assert all(torch.equal(again.tensors()[k], t) for k, t in straight.tensors().items())
    with pytest.raises(EdgeKVError, match="trained other tensors"):  # gates-only run on a maps checkpoint
        train(edge, fresh(), raw, [], steps=9, lr=3e-3, checkpoint=tmp_path / "ck", every=3)


@pytest.mark.parametrize("gains, opens", [([2e-5, -1e-5, 3e-5, -2e-5, 1e-5, 2e-5], False),  # noise: stays shut
                                          ([0.08, 0.11, 0.09, 0.12, 0.1, 0.07], True)])  # a consistent gain opens
def test_gates_open_only_on_a_held_out_gain_that_clears_noise(calib_file, tmp_path, monkeypatch, gains, opens):
    from edgekv.kv import fuser_training

    _, edge, fuser, _ = _pair(tmp_path, calib_file)
    closed = [3.0, 2.5, 2.8, 3.1, 2.9, 2.7]

    def per_text(edge, fuser, examples, layers):  # the held-out NLLs: closed, or lowered by `gains` when open
        nll = closed if not layers else [c - g for c, g in zip(closed, gains)]
        return [0.0] * len(nll), nll

    monkeypatch.setattr(fuser_training, "per_text", per_text)
    evidence = choose_gates(edge, fuser, list(range(6)))
    assert (evidence["open"] != []) == opens and (evidence["gain_lower_bound"] > 0) == opens
    assert sum(gains) / 6 > 0  # the noise case does gain on average: the old rule (any gain) opened it


@pytest.mark.parametrize("kind", ["bias", "residual"])
def test_a_fuser_joins_the_cloud_where_the_own_kv_sits(calib_file, tmp_path, kind):
    """The own KV at positions K.. (after a shared prefix), the cloud's rotated at 0..: what the fuser gives,
    un-rotated at K.., is what it gives with both at 0.., un-rotated there (rotary moves, the content does not)."""
    from edgekv.models.structure import attn_shape, rotary_cos_sin, rotate_keys, unrotate_keys

    _, edge, fuser, _ = _pair(tmp_path, calib_file)
    if kind == "residual":
        fuser = ResidualFuser.from_hidden(fuser, edge.model, rank=8)
        g = torch.Generator().manual_seed(3)
        fuser.res = {k: torch.randn(t.shape, generator=g) * 0.3 for k, t in fuser.res.items()}  # a non-zero delta
    _, heads, d = attn_shape(edge.model)
    g = torch.Generator().manual_seed(4)
    own_k, own_v, cloud_k, cloud_v = (torch.randn(heads, 9, d, generator=g) for _ in range(4))

    def at(offset):
        return rotary_cos_sin(edge.model, torch.arange(offset, offset + 9)[None], own_k[None])

    def keys_of(offset):
        own = {i: (rotate_keys(own_k[None], *at(offset))[0], own_v) for i in (1, 2)}
        cloud = {i: (rotate_keys(cloud_k[None], *at(0))[0], cloud_v) for i in (1, 2)}
        override, segments = fuser.fuse(edge.model, own, cloud, [1, 2], offset=offset)
        k = override[2][0] if kind == "residual" else segments[2].keys[0]
        return unrotate_keys(k[None], *at(offset))[0]

    torch.testing.assert_close(keys_of(5), keys_of(0), atol=1e-5, rtol=1e-5)
    if kind == "residual":  # a real correction, not the own keys passed through
        assert (keys_of(0) - own_k).abs().max() > 1e-2


def test_a_fuse_export_under_a_shared_prefix(tiny_models, calib_file, tmp_path, monkeypatch):
    """The edge reads its own KV after the prefix and the fuser joins the cloud's there: with its gates shut it is
    the edge alone under the prefix; with K = 0 it is the plain fuse export to the bit; refused without its prefix."""
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    edge = load_model(tiny_models["edge"], "float32")
    k3, k0 = edge_prefix(edge, tmp_path / "k3", 3), edge_prefix(edge, tmp_path / "k0", 0)
    params, user = SamplingParams(max_new_tokens=8), "What does the cloud compute?"
    _, _, shut, _ = _fuse_export(tiny_models, calib_file, tmp_path, -1e4, "shut3", shared=tmp_path / "k3")
    fused = EdgeSession(edge, str(shut), cache_dir=tmp_path / "c", shared=k3)
    alone = EdgeSession(edge, None, PROMPT, shared=k3)
    assert fused.prefix_len == alone.prefix_len == 3 + fused.system.system_ids.numel()
    offsets, real = [], BiasFuser.fuse

    def spy(self, *args, **kw):
        offsets.append(kw.get("offset"))
        return real(self, *args, **kw)

    monkeypatch.setattr(BiasFuser, "fuse", spy)
    f, a = fused.complete(user, params), alone.complete(user, params)
    assert offsets == [3]  # the fuser is told where the own KV sits
    assert f.token_ids == a.token_ids and (f.first_logits - a.first_logits).abs().max() < 1e-5
    with pytest.raises(EdgeKVError, match="give it with --shared"):
        EdgeSession(edge, str(shut), cache_dir=tmp_path / "c2")
    _, _, open0, _ = _fuse_export(tiny_models, calib_file, tmp_path, 0.0, "open0", shared=tmp_path / "k0")
    _, _, plain, _ = _fuse_export(tiny_models, calib_file, tmp_path, 0.0, "open")
    got = EdgeSession(edge, str(open0), cache_dir=tmp_path / "c3", shared=k0).complete(user, params)
    want = EdgeSession(edge, str(plain), cache_dir=tmp_path / "c4").complete(user, params)
    assert torch.equal(got.first_logits, want.first_logits) and got.token_ids == want.token_ids
    assert (got.first_logits - a.first_logits).abs().max() > 1e-4  # the open gates reach the answer
    assert offsets == [3, 0, 0]



def test_training_a_fuser_under_a_shared_prefix_reads_the_text_after_it(calib_file, tmp_path, monkeypatch):
    """`train-fuser --shared`: the edge's own KV is read after the prefix and the fuser joins the cloud there, as
    `ce-lslm-fuse-shared` serves: shut gates are the edge reading [prefix; text], K = 0 is the plain training to
    the bit, and features under a prefix are cached apart from the plain ones (the cloud's targets shared)."""
    from edgekv.attention.prefix_kv import continuation_logits

    cloud, edge, fuser, texts = _pair(tmp_path, calib_file)
    k3, k0 = edge_prefix(edge, tmp_path / "k3", 3), edge_prefix(edge, tmp_path / "k0", 0)
    cache = tmp_path / "cache"
    plain = prepare(edge, cloud, texts[:2], fuser, ("c", "e"), top_k=8, cache_dir=cache)
    under0 = prepare(edge, cloud, texts[:2], fuser, ("c", "e"), top_k=8, cache_dir=cache, shared=k0)
    under3 = prepare(edge, cloud, texts[:2], fuser, ("c", "e"), top_k=8, cache_dir=cache, shared=k3)
    assert len(list(cache.glob("*.safetensors"))) == 6 and len(list((cache / "targets").glob("*"))) == 2
    offsets, real = [], BiasFuser.fuse

    def spy(self, *args, **kw):
        offsets.append(kw.get("offset"))
        return real(self, *args, **kw)

    monkeypatch.setattr(BiasFuser, "fuse", spy)
    with torch.no_grad():
        for text, p, z, u in zip(texts[:2], plain, under0, under3):
            assert torch.equal(u.top_logp, p.top_logp)  # the target is the cloud reading the text alone
            full = torch.cat([text.prefix, text.continuation])
            alone = continuation_logits(edge.model, k3.prefix, full)[text.prefix.numel():-1]
            assert (fused_logits(edge, fuser, u, []) - alone).abs().max() < 1e-5
            for b in fuser.gate_bias.values():
                b.fill_(0.0)
            assert torch.equal(fused_logits(edge, fuser, z, [1, 2]), fused_logits(edge, fuser, p, [1, 2]))
            assert (fused_logits(edge, fuser, u, [1, 2]) - alone).abs().max() > 1e-3  # the cloud reaches it
            for b in fuser.gate_bias.values():
                b.fill_(-6.0)
    assert offsets == [3, 0, 0, 3] * 2  # the fuser is told where the own KV sits
