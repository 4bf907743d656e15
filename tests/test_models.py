"""Model loading pieces that need no real weights."""

import hashlib
import logging
import sys

import pytest
import torch

from edgekv import EdgeKVError
from edgekv.models import loading
from edgekv.models.loading import check_tokenizers, load_model, resolve_dtype
from edgekv.models.mixed import BF16_ROWS, CHUNK, MixedLinear
from edgekv.models.packaged import PackagedGGUF, assemble_gguf
from edgekv.models.settings import ModelSettings
from tests.helpers import byte_tokenizer


@pytest.fixture()
def fake_parts(tmp_path, monkeypatch):
    """Three importable-looking part packages holding data/partNN.bin, never imported."""
    site = tmp_path / "site"
    chunks = [b"GGUF", b"\x00" * 1000, b"tail-bytes"]
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"fake_edgekv_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('data carriers must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    return b"".join(chunks)


def test_assemble_in_order_and_verify(fake_parts, tmp_path):
    entry = PackagedGGUF("fake", tuple(f"fake_edgekv_part{i}" for i in (1, 2, 3)), "m.gguf",
                         hashlib.sha256(fake_parts).hexdigest(), "fake")
    out = assemble_gguf(entry, tmp_path / "a")
    assert out.read_bytes() == fake_parts
    assert not any(name.startswith("fake_edgekv_part") for name in sys.modules)


def test_assemble_refuses_wrong_checksum(fake_parts, tmp_path):
    entry = PackagedGGUF("fake", tuple(f"fake_edgekv_part{i}" for i in (3, 2, 1)), "m.gguf",
                         hashlib.sha256(fake_parts).hexdigest(), "fake")  # wrong order → wrong bytes
    with pytest.raises(EdgeKVError, match="sha256"):
        assemble_gguf(entry, tmp_path / "b")
    assert not (tmp_path / "b" / "m.gguf").exists()


def test_missing_part_package(tmp_path):
    entry = PackagedGGUF("fake", ("no_such_edgekv_part_pkg",), "m.gguf", "0" * 64, "fake")
    with pytest.raises(EdgeKVError, match="not installed"):
        assemble_gguf(entry, tmp_path)


def test_tokenizer_check():
    check_tokenizers(byte_tokenizer(), byte_tokenizer())
    with pytest.raises(EdgeKVError, match="incompatible tokenizers: vocabularies differ \\(TokenizersBackend "
                                          "with 256 vs TokenizersBackend with 256 tokens"):
        check_tokenizers(byte_tokenizer(), byte_tokenizer(permute=True))


def test_tokenizer_check_remembers_agreeing_objects_only():
    """A pair found to agree is not compared again; a refused pair is refused every time; a new object is checked."""
    a, b, bad = byte_tokenizer(), byte_tokenizer(), byte_tokenizer(permute=True)
    calls = []
    real = a.get_vocab
    a.get_vocab = lambda: calls.append(1) or real()
    check_tokenizers(a, b)
    check_tokenizers(a, b)
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(EdgeKVError, match="vocabularies differ"):
            check_tokenizers(a, bad)
    check_tokenizers(a, byte_tokenizer())
    assert len(calls) == 4

    class Unhashable:  # __eq__ without __hash__: checked every time, never an error of its own
        __eq__ = object.__eq__
        __hash__ = None

        def __init__(self, tok):
            self.get_vocab, self.encode = tok.get_vocab, tok.encode

    check_tokenizers(Unhashable(byte_tokenizer()), Unhashable(byte_tokenizer()))
    with pytest.raises(EdgeKVError, match="vocabularies differ"):
        check_tokenizers(Unhashable(byte_tokenizer()), Unhashable(bad))


def test_bad_specs(tmp_path):
    with pytest.raises(EdgeKVError, match="unknown dtype"):
        resolve_dtype("float8")
    with pytest.raises(EdgeKVError, match="model file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(EdgeKVError, match="not a directory, a .gguf file or a known alias"):
        load_model(str(tmp_path / "weights.bin"))
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(EdgeKVError, match="cannot load model"):
        load_model(str(empty))


def test_files_record_the_model_cache_by_name_not_this_machines_path(monkeypatch, tmp_path):
    """A manifest or a mapping from a default model names $EDGEKV_CACHE, so it can be committed; a hub id or a
    user's own directory is kept as given."""
    from edgekv.models.loading import LoadedModel

    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    seen = lambda source: LoadedModel("default-edge", None, None, source, "f").source_shown  # noqa: E731
    assert seen(f"default:{tmp_path}/cache/models/edge-1d96") == "default:$EDGEKV_CACHE/models/edge-1d96"
    assert seen("hub:Qwen/Qwen2.5-0.5B") == "hub:Qwen/Qwen2.5-0.5B"
    assert seen(f"dir:{tmp_path}/mine") == f"dir:{tmp_path}/mine"


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "mixed")])
def test_auto_dtype_is_bf16_only_where_the_device_computes_it(monkeypatch, native, expected):
    monkeypatch.setattr(loading, "native_bf16", lambda device: native)
    assert resolve_dtype("auto") == expected
    settings = ModelSettings(dtype="auto")
    settings.check_models()  # the config a run records names what it computed in, never "auto"
    assert settings.dtype == expected
    assert resolve_dtype("float16") == "float16"  # a named dtype is kept, whatever the device


def test_bf16_without_native_support_is_kept_and_warned_once_at_load(monkeypatch, caplog, tiny_models):
    monkeypatch.setattr(loading, "native_bf16", lambda device: False)
    loading._warn_slow_bf16.cache_clear()
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        assert resolve_dtype("bfloat16") == "bfloat16"  # a config that names bf16 reproduces its report's numbers
        assert not caplog.records  # a config read (a recipe recorded beside a run) loads no model: no warning
        for _ in range(2):
            assert next(load_model(tiny_models["edge"], "bfloat16").model.parameters()).dtype is torch.bfloat16
    assert [r.getMessage().count("--dtype auto picks mixed") for r in caplog.records] == [1]
    with pytest.raises(EdgeKVError, match="choose from auto, bfloat16"):
        ModelSettings(dtype="bf16").check_models()


def test_native_bf16_follows_the_cpu_probe(monkeypatch):
    monkeypatch.setattr(loading.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert not loading.native_bf16("cpu")
    monkeypatch.setattr(loading.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    assert loading.native_bf16("cpu")


def test_mixed_linear_prefills_in_float32_and_decodes_in_bf16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    mixed = MixedLinear(linear)
    assert mixed.weight.dtype is torch.bfloat16 and mixed.bias.dtype is torch.float32
    rounded = torch.nn.Linear(64, 48)
    with torch.no_grad():
        rounded.weight.copy_(linear.weight.bfloat16().float())
        rounded.bias.copy_(linear.bias)
        many, one = torch.randn(2, BF16_ROWS // 2 + 1, 64), torch.randn(1, 1, 64)
        assert torch.equal(mixed(many), rounded(many))  # a prefill: float32 on the bf16 weights, bit for bit
        by_hand = torch.nn.functional.linear(one.bfloat16(), linear.weight.bfloat16()).float() + linear.bias
        assert torch.equal(mixed(one), by_hand)  # a decode step: bf16 operands
        few = torch.randn(BF16_ROWS, 64)  # a batched decode step of BF16_ROWS sequences: bf16 too
        assert torch.equal(mixed(few), torch.nn.functional.linear(few.bfloat16(), mixed.weight).float() + linear.bias)
        assert not torch.equal(mixed(one), rounded(one))
        assert torch.allclose(mixed(one), rounded(one), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("bias", [True, False])
def test_mixed_linear_upcasts_tile_by_tile_bit_for_bit(bias):
    """More output rows than one upcast tile (CHUNK): the tiles' products are nn.Linear's on the rounded weight."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 2 * CHUNK + 77, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16().float())
        x = torch.randn(3, 20, 96)
        assert torch.equal(MixedLinear(linear)(x), linear(x))
        assert torch.equal(MixedLinear(linear)(x[:, ::2]), linear(x[:, ::2]))  # a strided input


def test_mixed_dtype_loads_float32_with_bf16_linears(tiny_models):
    mixed, plain = load_model(tiny_models["edge"], "mixed").model, load_model(tiny_models["edge"], "float32").model
    linears = [m for m in plain.modules() if type(m) is torch.nn.Linear]
    assert linears and not [m for m in mixed.modules() if type(m) is torch.nn.Linear]
    assert sum(isinstance(m, MixedLinear) for m in mixed.modules()) == len(linears)
    assert next(mixed.parameters()).dtype is torch.float32  # activations and the KV cache stay float32
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(m.weight.bfloat16().float())
        ids = torch.arange(3, 3 + 7 * (BF16_ROWS + 4), 7)[None]  # a prompt longer than BF16_ROWS
        assert torch.equal(mixed(ids).logits, plain(ids).logits)  # a prefill is float32 on the same weights


def _mixed_and_its_float32(path):
    """The model under mixed, and under float32 with its linear weights rounded as mixed holds them (bf16)."""
    mixed, plain = load_model(path, "mixed").model, load_model(path, "float32").model
    with torch.no_grad():
        for m in plain.modules():
            if type(m) is torch.nn.Linear:
                m.weight.copy_(m.weight.bfloat16().float())
    return mixed, plain


def test_mixed_scores_in_float32_however_few_the_rows(tiny_models):
    """A reference NLL's head sees only the scored rows (one for an MMLU letter): under mixed they are still
    multiplied in float32, so the score is the float32 model's to the bit; a decode step outside stays bf16."""
    from edgekv.attention.prefix_kv import PrefixKV, continuation_nll
    from edgekv.models.mixed import float32_scoring

    mixed, plain = _mixed_and_its_float32(tiny_models["edge"])
    with torch.no_grad():
        ids = torch.arange(3, 3 + 7 * 30, 7)
        for user, letter in ((ids[20:24], ids[24:25]), (ids[20:23], ids[23:27])):  # 1 and 4 scored rows
            got = continuation_nll(mixed, PrefixKV.of_model(mixed, ids[:20]), user, letter)
            assert torch.equal(got, continuation_nll(plain, PrefixKV.of_model(plain, ids[:20]), user, letter))
        x = torch.randn(1, mixed.config.hidden_size)
        head = mixed.lm_head
        with float32_scoring():
            assert torch.equal(head(x), plain.lm_head(x))
        assert not torch.equal(head(x), plain.lm_head(x))  # outside: the bf16 path of a decode step


def test_mixed_gate_and_teacher_targets_are_float32_scores(tiny_models):
    """The gate's KLs and a teacher's top-k targets are scores too: under mixed, their heads (16 and 10 rows
    here) multiply in float32, so each equals the float32 model's to the bit."""
    from types import SimpleNamespace

    from edgekv.attention.prefix_kv import PrefixKV
    from edgekv.distill.shared import _teacher_rows
    from edgekv.kv.shared_prefix import gate

    mixed, plain = _mixed_and_its_float32(tiny_models["edge"])
    prefix_ids, ids = torch.arange(5, 5 + 3 * 20, 3), torch.arange(3, 3 + 7 * 32, 7)  # 32 tokens: the gate reads 16

    def as_loaded(model, name):
        return SimpleNamespace(model=model, fingerprint=name)

    got, want = (gate(SimpleNamespace(tokens=20, prefix=PrefixKV.of_model(m, prefix_ids)), as_loaded(m, "e"),
                      as_loaded(m, "t"), ids) for m in (mixed, plain))
    assert got["tokens"] == 16 and got["kl_with"] == want["kl_with"] > 0
    rows = [_teacher_rows(as_loaded(m, "t"), ids[:20], 10, 4, None, "x")[:2] for m in (mixed, plain)]
    assert rows[0][0].shape == (9, 4) and torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])
