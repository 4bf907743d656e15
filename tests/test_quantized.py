"""Weight-only int8/int4 edge linears: exact GGUF Q4_K loading, the kernels against their dequantized weights,
fallback for shapes the kernel cannot take, and same-model splice on the quantized edge."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from edgekv import EdgeKVError
from edgekv.models import quantized as qz
from tests.helpers import SYSTEM, USERS, byte_tokenizer, make_export, save_model, tiny_qwen2


def _q4k_block(rng: np.random.Generator) -> bytes:
    """One random Q4_K super-block (144 bytes) with finite fp16 d and dmin."""
    d, dmin = np.array([rng.uniform(1e-3, 1e-2), rng.uniform(1e-3, 1e-2)], np.float16)
    return d.tobytes() + dmin.tobytes() + rng.integers(0, 256, 140, dtype=np.uint8).tobytes()


def test_q4k_blocks_load_as_exact_int4():
    """Against gguf's own Q4_K dequantizer: bit-equal in float32."""
    import gguf

    rng = np.random.default_rng(0)
    n, k = 32, 512
    raw = np.frombuffer(b"".join(_q4k_block(rng) for _ in range(n * k // 256)), np.uint8).reshape(n, -1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    got = qz.q4k_to_int4(raw, n, k).dequantize().numpy()
    assert want.shape == got.shape == (n, k) and np.array_equal(want, got)


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_quantized_linear_equals_its_dequantized_weight(weights, rows):
    """Decode-sized and prefill-sized row counts against x·Ŵᵀ in float64, Ŵ the dequantized weight with its scales
    as the kernel holds them (bf16): tolerance 1e-2 relative (bf16 activations)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 64).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    if weights == "int4":
        w4 = qz.int4_rtn(lin.weight)
        q = qz.Int4Linear(w4, lin.bias, torch.bfloat16)
        held = [t.to(torch.bfloat16).float() for t in (w4.scale, w4.zero)]
        w_hat = qz.Int4Weight(w4.q, *held).dequantize().double()
    else:
        q = qz.Int8Linear(lin.weight, lin.bias, torch.bfloat16)
        w_hat = q.q.double() * q.scale.double()[:, None]
    want = x.double() @ w_hat.T + lin.bias.double()
    got = q(x).double()
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert (w_hat - lin.weight.double()).abs().max() <= (0.07 if weights == "int4" else 0.01) * lin.weight.abs().max()


def test_a_shape_the_kernel_cannot_take_stays_and_says_so(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.Linear(40, 32)).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="edgekv"):
        report = qz.quantize_linears(model, "int4")
    assert report["quantized"] == 0 and report["kept"] == ["0", "1"]
    assert isinstance(model[0], torch.nn.Linear) and len(caplog.records) == 2
    assert "0 stays bfloat16: int4 needs out_features % 16 == 0 and in_features % 32 == 0, got 40×64" in caplog.text
    with pytest.raises(EdgeKVError, match="unknown --weights 'int3'"):
        qz.quantize_linears(model, "int3")


@pytest.fixture(scope="module")
def edge_dir_bf16(tmp_path_factory):
    model = tiny_qwen2(3, 64, 4, 2, seed=7, init=0.2).to(torch.bfloat16)
    return save_model(model, byte_tokenizer(), tmp_path_factory.mktemp("q") / "edge")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_same_model_splice_equals_its_own_full_prefill(edge_dir_bf16, weights, tmp_path):
    """Greedy on the quantized edge: the spliced export (made by the same quantized model) answers as that
    model's own `generate` on the concatenation; a bf16-made export is refused for it."""
    from edgekv.kv.compress_job import CompressConfig, run_compress
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    edge = load_model(edge_dir_bf16, "bfloat16", weights=weights)
    assert edge.quantization["quantized"] == 3 * 7 + 1 and edge.fingerprint.endswith("+" + weights)
    run_compress(CompressConfig(out=str(tmp_path / "kv"), cloud=edge_dir_bf16, edge=edge_dir_bf16,
                                system_prompt=SYSTEM, dtype="bfloat16", quant="bf16", start_layer=1, weights=weights))
    session = EdgeSession(edge, str(tmp_path / "kv"), cache_dir=tmp_path / "c")
    session.eos_ids = set()
    for user in [*USERS, "hi", "ok?"]:  # short and long user prompts: one kernel for every row count
        ids = edge.tokenizer(SYSTEM)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = edge.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist()
        assert session.complete(user, SamplingParams(max_new_tokens=12)).token_ids == want
    bf16_export = make_export(edge_dir_bf16, tmp_path / "kv-bf16")
    with pytest.raises(EdgeKVError, match="edge model"):
        EdgeSession(edge, str(bf16_export), cache_dir=tmp_path / "c2")


@pytest.mark.slow
def test_the_default_edges_q4k_tensor_loads_exactly_and_computes_as_its_bf16_copy(tmp_path):
    """A real Q4_K tensor of the default edge's GGUF: the int4 weights dequantize bit-equal to gguf's own
    dequantizer, and the int4 linear equals the converted bf16 model's linear up to bf16 rounding (relative 2e-2
    of the output scale: the bf16 copy rounds each weight, the kernel rounds scales and zeros to bf16)."""
    import gguf

    from edgekv.models.loading import load_model
    from edgekv.models.packaged import DEFAULT_MODELS, assemble_gguf

    path = assemble_gguf(DEFAULT_MODELS["default-edge"], tmp_path)
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_K)
    k, n = (int(x) for x in tensor.shape)
    w4 = qz.q4k_to_int4(np.asarray(tensor.data), n, k)
    assert np.array_equal(w4.dequantize().numpy(), gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    layer = int(tensor.name.split(".")[1])
    edge = load_model("default-edge", "bfloat16")
    dense = edge.model.model.layers[layer].mlp.down_proj
    torch.manual_seed(0)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    want = dense(x).double()
    got = qz.Int4Linear(w4, None, torch.bfloat16)(x).double()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.slow
def test_int4_real_edge_splice_equals_its_own_full_prefill(tmp_path):
    from edgekv.models.loading import load_model
    from edgekv.serve.sampling import SamplingParams
    from edgekv.serve.session import EdgeSession

    edge = load_model("default-edge", "bfloat16", weights="int4")
    assert edge.quantization["exact_from_gguf"] == 12 and not edge.quantization["kept"]
    system = "You are a careful assistant. The council approved a new cycle lane along the river on Tuesday. " * 4
    session = EdgeSession(edge, None, system, cache_dir=None)
    session.eos_ids = set()
    for user in ["\nUser: what did the council approve?\nAssistant:", "\nUser: hi\nAssistant:"]:
        ids = edge.tokenizer(system)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            want = edge.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(ids):].tolist()
        assert session.complete(user, SamplingParams(max_new_tokens=16)).token_ids == want


def test_int4_linears_join_only_on_whole_pack_blocks():
    """q/k/v joined into one int4 product: bit-equal to the three on any row count where every part but the last
    fills whole 64-row pack blocks; refused (None) where a part would straddle a block."""
    from edgekv.models.quantized import Int4Linear, int4_rtn

    torch.manual_seed(0)
    make = lambda n: Int4Linear(int4_rtn(torch.randn(n, 96)), torch.randn(n), torch.bfloat16)  # noqa: E731
    parts = [make(128), make(64), make(48)]
    joined = Int4Linear.concat(parts)
    x = torch.randn(5, 96).to(torch.bfloat16)
    assert joined is not None and torch.equal(joined(x), torch.cat([m(x) for m in parts], -1))
    assert Int4Linear.concat([make(32), make(64)]) is None


def test_training_a_kv_through_quantized_linears_is_one_line(edge_dir_bf16, tmp_path):
    """A distilled KV trains through the edge: on quantized linears (no backward) that is a one-line error before
    any step, never autograd's bare RuntimeError."""
    from edgekv.distill.distill_job import DistillConfig
    from edgekv.distill.student import initial_student, train_student
    from edgekv.models.loading import load_model
    from edgekv.progress import Tasks

    edge = load_model(edge_dir_bf16, "bfloat16", weights="int8")
    ids = torch.tensor(edge.tokenizer(SYSTEM)["input_ids"])
    student, _ = initial_student(edge, ids, ids.numel(), "all")
    with pytest.raises(EdgeKVError, match="--weights bf16"):
        train_student(DistillConfig(out=str(tmp_path), system_prompt="x", steps=2), edge, student, [], [],
                      tmp_path / "ckpt", Tasks(None))
