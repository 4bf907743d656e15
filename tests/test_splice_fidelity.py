"""Spliced caches, the exact attention merge, translators and the fidelity harness on tiny models."""

import pytest
import torch

from bench.fidelity_harness import evaluate_text, summarize
from edgekv.attention.merge import merge_attention
from edgekv.attention.prefix_kv import PrefixKV, continuation_logits, continuation_nll
from edgekv.kv.translators import HiddenTranslator, RidgeMap, RidgeTranslator, kv_from_hidden
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.texts import HeldOutText
from tests.helpers import tiny_qwen2


def _attention(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("seed", range(5))
def test_merge_attention_is_exact(seed):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads = [(4, 2), (6, 3), (2, 2), (8, 1), (4, 4)][seed]
    t, s_a, s_b, d = 3 + seed, 5 + 2 * seed, 4 + seed, 8
    q = torch.randn(heads, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(kv_heads, s_a + s_b, d, generator=g, dtype=torch.float64).repeat_interleave(heads // kv_heads, 0)
    v = torch.randn(kv_heads, s_a + s_b, d, generator=g, dtype=torch.float64).repeat_interleave(heads // kv_heads, 0)
    mask = torch.rand(heads, t, s_a + s_b, generator=g) > 0.3
    mask[..., 0] = mask[..., s_a] = True  # every query sees at least one key in each part
    full, _ = _attention(q, k, v, mask)
    o_a, l_a = _attention(q, k[:, :s_a], v[:, :s_a], mask[..., :s_a])
    o_b, l_b = _attention(q, k[:, s_a:], v[:, s_a:], mask[..., s_a:])
    assert (merge_attention(o_a, l_a, o_b, l_b) - full).abs().max() < 1e-10


@torch.no_grad()
def test_splicing_own_kv_reproduces_full_prefill():
    model = tiny_qwen2(3, 32, 4, 2, seed=0).float()
    ids = torch.randint(0, 256, (20,))
    full = model(ids[None]).logits[0, 12:]
    base = PrefixKV.of_model(model, ids[:12])
    own = {i: (base.layer(i)[0][0].clone(), base.layer(i)[1][0].clone()) for i in (1, 2)}
    out = continuation_logits(model, base.replaced(own), ids[12:])
    assert (out - full).abs().max() < 1e-5
    wrong = base.replaced({2: (own[2][0] * 0, own[2][1] * 0)})
    assert (continuation_logits(model, wrong, ids[12:]) - full).abs().max() > 1e-3  # the splice reaches attention
    sunk = base.replaced({2: (own[2][0] * 0, own[2][1] * 0)}, keep_first=3)
    assert torch.equal(sunk.layer(2)[0][:, :, :3], base.layer(2)[0][:, :, :3]) and not sunk.layer(2)[0][:, :, 3:].any()
    with pytest.raises(ValueError, match="does not fit"):
        base.replaced({1: (own[1][0][:, :5], own[1][1][:, :5])})
    with pytest.raises(RuntimeError, match="read-only"):
        model(ids[None, 12:], cache=base, position_ids=torch.arange(12, 20)[None])


def test_continuation_nll_is_the_full_forwards_nll():
    """The reference NLL asks the head for the scored rows only; it is the NLL a full forward's logits give."""
    model = tiny_qwen2(3, 32, 4, 2, seed=0).float()
    ids = torch.randint(0, 256, (24,))
    logits = model(ids[None]).logits[0].float()
    want = -torch.log_softmax(logits[15:23], -1).gather(-1, ids[16:24, None]).mean()
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    got = continuation_nll(model, PrefixKV.of_model(model, ids[:10]), ids[10:16], ids[16:24])
    handle.remove()
    assert rows[-1] == 8  # the 8 scored rows, not the user prompt's 6 before them
    assert got.item() == pytest.approx(want.item(), abs=1e-5)
    assert abs(got.item() - continuation_nll(model, PrefixKV.of_model(model, ids[:10]), ids[10:15], ids[16:24])) > 1e-3


def test_hidden_translator_with_identity_map_reproduces_edge_kv():
    model = tiny_qwen2(3, 32, 4, 2, seed=0).float()
    ids = torch.randint(0, 256, (15,))
    acts = capture(model, [ids], ("hidden_in", "k", "v"))
    translator = HiddenTranslator()
    for i in range(3):
        translator.maps[i] = RidgeMap(torch.eye(32), torch.zeros(32), 0.0)
        translator.info[i] = {"cloud_layer": i}
    out = translator.translate(acts, model, [0, 1, 2])
    for i in range(3):
        keys, values = out[i]
        assert (keys - acts.layers["k"][i].reshape(15, 2, 8).transpose(0, 1)).abs().max() <= 1e-5
        assert (values - acts.layers["v"][i].reshape(15, 2, 8).transpose(0, 1)).abs().max() <= 1e-5
        k2, _ = kv_from_hidden(model, i, acts.layers["hidden_in"][i])
        assert torch.equal(k2, keys)


def test_fidelity_harness_on_tiny_pair(tiny_models, calib_file):
    cloud, edge = load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")
    texts = [t for t in calib_file.read_text().splitlines()]
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:60]) for t in texts]
    pairs = [(0, 0), (1, 2), (2, 3)]
    translators = {}
    for cls in (RidgeTranslator, HiddenTranslator):
        c_cal = capture(cloud.model, seqs, cls.features)
        e_cal = capture(edge.model, seqs, cls.features)
        translators[cls.name] = cls().fit(c_cal, e_cal, pairs, edge.model)
    text = HeldOutText("t", seqs[0][:40], seqs[0][40:60])
    rows = evaluate_text(edge, cloud, text, translators, splits=[0, 2], sink=1)
    by = {(r["condition"], r["m"]): r for r in rows}
    assert by[("edge", None)]["top1_edge"] == 1.0 and by[("cloud", None)]["top1_cloud"] == 1.0
    assert set(by) >= {("ridge", 0), ("ridge", 2), ("noise:ridge", 0), ("hidden", 2), ("no-prefix", None),
                       ("cloud-no-prefix", None)}
    assert all(r["nll"] > 0 for r in rows)
    summary = summarize(rows + rows)
    assert all(s["texts"] == 2 and s["nll_se"] == 0.0 for s in summary)
    several = {(r["condition"], r["m"]): r for r in evaluate_text(edge, cloud, text, translators, [2], sink=[0, 1])}
    assert {("ridge|sink=0", 2), ("ridge|sink=1", 2), ("noise:hidden|sink=0", 2)} <= set(several)
    assert several[("ridge|sink=0", 2)]["nll"] != several[("ridge|sink=1", 2)]["nll"]  # the sink is honoured
    # sink 1 is the same splice as the single-value run above
    assert several[("ridge|sink=1", 2)]["nll"] == pytest.approx(by[("ridge", 2)]["nll"], abs=1e-6)


def test_paired_delta():
    from bench.fidelity_harness import paired_delta

    rows = [{"text": t, "source": "s", "condition": c, "m": m, "nll": v}
            for t, (e, x) in enumerate([(1.0, 1.5), (3.0, 3.1), (2.0, 2.2)])
            for c, m, v in (("edge", None, e), ("ridge", 4, x))]
    (d,) = paired_delta(rows)
    assert d["delta_nll"] == pytest.approx((0.5 + 0.1 + 0.2) / 3)
    spread = torch.tensor([0.5, 0.1, 0.2], dtype=torch.float64).std().item()
    assert d["delta_nll_se"] == pytest.approx(spread / 3 ** 0.5)


def test_delta_ci95_is_a_t_interval_of_paired_differences():
    from bench.fidelity_harness import delta_ci95

    rows = [{"text": t, "source": "s", "condition": c, "m": m, "nll": v}
            for t, (e, x) in enumerate([(1.0, 1.5), (3.0, 3.1), (2.0, 2.2), (2.5, 2.5)])
            for c, m, v in (("edge", None, e), ("hidden", 12, x))]
    out = delta_ci95(rows, {("edge", None): "edge", ("hidden", 12): "replace"})
    d = torch.tensor([0.5, 0.1, 0.2, 0.0], dtype=torch.float64)
    half = 3.182446305284263 * float(d.std()) / 2  # t(0.975, 3) · s / √4
    assert out["s"]["replace"]["n"] == 4
    assert out["s"]["replace"]["delta_mean"] == pytest.approx(0.2)
    assert out["s"]["replace"]["delta_ci95"] == pytest.approx([0.2 - half, 0.2 + half])
    assert out["s"]["edge"]["delta_mean"] == 0.0


def test_context_gain_is_a_difference_in_differences_per_text():
    from bench.fidelity_harness import context_gain

    # per text: edge, no-prefix, cloud, cloud-no-prefix
    nlls = [(2.0, 3.0, 1.5, 2.9), (2.5, 3.0, 2.0, 2.6), (1.0, 2.5, 0.5, 2.2)]
    rows = [{"text": t, "source": "s", "condition": c, "m": None, "nll": v}
            for t, vals in enumerate(nlls)
            for c, v in zip(("edge", "no-prefix", "cloud", "cloud-no-prefix"), vals)]
    rows.append({"text": 0, "source": "s", "condition": "hidden", "m": 12, "nll": 9.0})  # spliced rows ignored
    g = context_gain(rows)["s"]
    edge, cloud = [1.0, 0.5, 1.5], [1.4, 0.6, 1.7]
    assert g["edge"]["delta_mean"] == pytest.approx(sum(edge) / 3)
    assert g["cloud"]["delta_mean"] == pytest.approx(sum(cloud) / 3)
    extra = torch.tensor([c - e for c, e in zip(cloud, edge)], dtype=torch.float64)
    half = 4.302652729911275 * float(extra.std()) / 3 ** 0.5  # t(0.975, 2) · s / √3
    assert g["cloud-extra"]["delta_mean"] == pytest.approx(float(extra.mean()))
    assert g["cloud-extra"]["delta_ci95"] == pytest.approx([float(extra.mean()) - half, float(extra.mean()) + half])
    assert g["cloud-extra"]["n"] == 3
