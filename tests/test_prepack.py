"""Prepacked linear layers: the same oneDNN kernel with the weight reordered once, so outputs are bit-identical."""

import pytest
import torch

from edgekv.models.prepack import PackedLinear, can_prepack, prepack_linears
from edgekv.runtime import onednn_bf16
from tests.helpers import tiny_qwen2

needs_bf16 = pytest.mark.skipif(not onednn_bf16(),
                                reason="this CPU's oneDNN has no bf16 kernels (prepacking is then a no-op)")


@needs_bf16
def test_packed_linear_is_bit_identical_at_every_row_count():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).to(torch.bfloat16)
    packed = PackedLinear(linear, rows_hint=64)
    for rows in (1, 7, 64, 300):
        x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(packed(x), linear(x)), rows


@needs_bf16
def test_a_prepacked_model_gives_the_same_logits_and_cache():
    model = tiny_qwen2(3, 64, 4, 2, seed=5).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        want = model(ids, use_cache=True)
        last = model(ids, logits_to_keep=1).logits  # the head's one-row product (a splice's first token)
        assert prepack_linears(model) == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
        assert prepack_linears(model) == 0  # idempotent
        got = model(ids, use_cache=True)
        assert torch.equal(model(ids, logits_to_keep=1).logits, last)
    assert not any(type(m) is torch.nn.Linear for m in model.model.layers.modules())
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert torch.equal(got.logits, want.logits)
    for a, b in zip(got.cache.layers, want.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_float32_models_are_left_alone():
    model = tiny_qwen2(2, 32, 4, 2, seed=6)
    assert not can_prepack(model)
    assert prepack_linears(model) == 0
    assert sum(type(m) is torch.nn.Linear for m in model.model.layers.modules()) == 2 * 7


def test_paging_out_a_weight_keeps_its_values():
    """Paging out is only a hint to the kernel: a tensor that is still read keeps its contents."""
    from edgekv.models.prepack import page_out

    x = torch.randn(4096, 1024)  # 16 MiB of anonymous memory
    want = x.clone()
    page_out(x)
    assert torch.equal(x, want)
