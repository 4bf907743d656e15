"""ThinK pruning, quantization codecs and ridge maps: pure tensor functions."""

import math

import pytest
import torch

from edgekv import EdgeKVError
from edgekv.kv.codecs import Quantized, dequantize, quantize
from edgekv.kv.pruning import attention_error, kept_count, prune_keys, pruned_scores, think_scores, think_select
from edgekv.kv.translators import fit_ridge, r2_score


def _qk(q_heads=8, kv_heads=2, w=6, s=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(d, generator=g) * 3  # channels of very different size, as real keys have
    return (torch.randn(q_heads, w, d, generator=g) * scale.flip(0),
            torch.randn(kv_heads, s, d, generator=g) * scale)


@pytest.mark.parametrize("seed", range(5))
def test_think_ranking_equals_brute_force_frobenius(seed):
    q, k = _qk(seed=seed)
    group = q.shape[0] // k.shape[0]
    scores = think_scores(q, k)
    for h in range(k.shape[0]):
        qg = q[h * group:(h + 1) * group].reshape(-1, q.shape[-1])  # the group's query heads pooled
        brute = torch.stack([torch.linalg.matrix_norm(torch.outer(qg[:, c], k[h, :, c])) for c in range(k.shape[-1])])
        assert torch.allclose(scores[h], brute, rtol=1e-5)
        assert torch.equal(torch.argsort(scores[h], descending=True, stable=True),
                           torch.argsort(brute, descending=True, stable=True))


@pytest.mark.parametrize("d,ratio", [(16, 0.0), (16, 0.25), (16, 0.3), (64, 0.5), (128, 0.75), (7, 0.99)])
def test_kept_count_is_exact(d, ratio):
    q, k = _qk(d=d)
    index = think_select(think_scores(q, k), ratio)
    assert index.shape == (2, d - math.floor(d * ratio)) == (2, kept_count(d, ratio))
    assert torch.equal(index, index.sort(dim=-1).values)  # ascending: channel order kept


def test_ratio_zero_keeps_the_cache_bit_identical():
    q, k = _qk()
    pruned = prune_keys(k, think_select(think_scores(q, k), 0.0))
    assert torch.equal(pruned.kept, k) and torch.equal(pruned.zero_filled(), k)


@pytest.mark.parametrize("recent", [0, 5])
def test_attention_on_pruned_equals_attention_on_zero_filled(recent):
    q, k = _qk()
    index = think_select(think_scores(q[:, -4:], k), 0.5)
    pruned = prune_keys(k, index, keep_recent=recent)
    assert pruned.kept.shape == (2, 40 - recent, 8)  # only the kept channels are stored
    zero = pruned.zero_filled()
    assert torch.equal(zero[:, -recent:] if recent else zero[:, :0], k[:, -recent:] if recent else k[:, :0])
    group = q.shape[0] // k.shape[0]
    direct = (q @ zero.repeat_interleave(group, 0).transpose(1, 2)) / math.sqrt(k.shape[-1])
    assert torch.allclose(torch.softmax(pruned_scores(q, pruned), -1), torch.softmax(direct, -1), atol=1e-6)


def test_attention_error_prefers_think_over_random_channels():
    q, k = _qk(w=32, s=200, d=32)
    think = attention_error(q, k, think_select(think_scores(q, k), 0.5))
    g = torch.Generator().manual_seed(1)
    rand = attention_error(q, k, torch.stack([torch.randperm(32, generator=g)[:16].sort().values for _ in range(2)]))
    assert 0 < think < rand
    assert attention_error(q, k, think_select(think_scores(q, k), 0.0)) == 0.0


def test_prune_ratio_one_is_refused():
    with pytest.raises(EdgeKVError, match=r"prune ratio must be in \[0, 1\)"):
        think_select(torch.rand(2, 8), 1.0)


@pytest.mark.parametrize("scheme,axis", [("int8", "channel"), ("int8", "token"), ("int4", "channel"),
                                         ("int4", "token")])
def test_integer_roundtrip_within_half_a_step(scheme, axis):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 15, generator=g) * torch.rand(15, generator=g) * 10
    q = quantize(x, scheme, axis)
    back = dequantize(q)
    step = q.scale.float()  # broadcasts over the reduced axis
    assert back.shape == x.shape
    assert bool(((back - x).abs() <= step / 2 * (1 + 1e-6) + 1e-7).all())
    bits = 8 if scheme == "int8" else 4
    assert q.data.numel() * 8 == pytest.approx(x.numel() * bits, rel=0.1)  # real packing (odd dims padded)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_int2_packs_four_codes_a_byte_and_its_clip_beats_min_max(axis):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 15, generator=g) * torch.rand(15, generator=g) * 10 + 3  # rows off zero: asymmetric
    q = quantize(x, "int2", axis)
    back = dequantize(q)
    assert back.shape == x.shape and q.data.dtype == torch.uint8
    assert q.data.numel() * 4 == pytest.approx(x.numel(), rel=0.1)  # 2 bits a value (rows padded to 4)
    step, low = q.scale[..., 0].float(), q.scale[..., 1].float()
    levels = torch.round((back - low) / step)
    assert bool(((levels >= 0) & (levels <= 3)).all())
    dim = -2 if axis == "channel" else -1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)  # the unclipped grid: four levels over [lo, hi]
    s = (hi - lo) / 3
    min_max = lo + torch.round((x - lo) / s).clamp(0, 3) * s
    err, err_mm = ((back - x) ** 2).sum(dim), ((min_max - x) ** 2).sum(dim)
    assert bool((err <= err_mm * 1.01 + 1e-4).all()) and float(err.sum()) < float(err_mm.sum())
    assert float((back - x).norm() / x.norm()) < 0.35  # a real code, not the row means
    with pytest.raises(EdgeKVError, match=r"int2 data needs a \(step, low\) pair"):  # a damaged export's scales
        dequantize(Quantized("int2", q.data, q.scale[..., :1], q.shape, axis))


def test_passthrough_and_zero_rows():
    x = torch.randn(2, 5, 8).to(torch.bfloat16)
    assert torch.equal(dequantize(quantize(x, "bf16", "token"), torch.bfloat16), x)
    assert torch.equal(dequantize(quantize(x.float(), "fp16", "token")), x.float().half().float())
    zeros = torch.zeros(1, 4, 6)
    assert torch.equal(dequantize(quantize(zeros, "int8", "token")), zeros)
    assert torch.equal(dequantize(quantize(zeros, "int2", "channel")), zeros)


def test_ridge_recovers_a_known_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 24, generator=g)
    w, b = torch.randn(24, 10, generator=g), torch.randn(10, generator=g)
    y = x @ w + b + 0.01 * torch.randn(3000, 10, generator=g)
    texts = torch.arange(3000) // 300  # ten "texts"
    fitted, info = fit_ridge(x, y, texts)
    assert info["r2_test"] > 0.99
    assert torch.allclose(fitted.weight, w, atol=0.02) and torch.allclose(fitted.bias, b, atol=0.02)
    assert r2_score(y, y.mean(0, keepdim=True).expand_as(y)) == pytest.approx(0.0, abs=1e-9)


def test_ridge_needs_three_texts():
    with pytest.raises(EdgeKVError, match="at least 3 calibration texts"):
        fit_ridge(torch.randn(20, 3), torch.randn(20, 2), torch.tensor([0] * 10 + [1] * 10))
