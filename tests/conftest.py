"""Shared fixtures: tiny randomly initialised models (built from configs) with a byte-level tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach for a hub


def byte_tokenizer(permute: bool = False):
    """A 256-token byte-level tokenizer (no merges); `permute` gives the same tokens other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    symbols = sorted(ByteLevel.alphabet())
    if permute:
        symbols = symbols[::-1]
    vocab = {s: i for i, s in enumerate(symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=symbols[0], pad_token=symbols[0])


def tiny_qwen2(layers: int, hidden: int, heads: int, kv_heads: int, seed: int, init: float = 0.02):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=init)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_opt(layers: int, hidden: int, heads: int, seed: int):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=256, hidden_size=hidden, ffn_dim=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, word_embed_proj_dim=hidden, max_position_embeddings=512)
    return OPTForCausalLM(cfg).eval()


def save_model(model, tokenizer, path: Path) -> str:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Directories of tiny models: a Qwen2 cloud (4 layers, head_dim 16), a Qwen2 edge (3 layers, head_dim 8),
    an OPT model, and an edge twin whose tokenizer has other ids."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "cloud": save_model(tiny_qwen2(4, 64, 4, 2, seed=1), byte_tokenizer(), root / "cloud"),
        "edge": save_model(tiny_qwen2(3, 32, 4, 2, seed=2), byte_tokenizer(), root / "edge"),
        "opt": save_model(tiny_opt(2, 32, 4, seed=3), byte_tokenizer(), root / "opt"),
        "edge_other_tokenizer": save_model(tiny_qwen2(3, 32, 4, 2, seed=2), byte_tokenizer(permute=True),
                                      root / "edge_other"),
    }


@pytest.fixture()
def calib_file(tmp_path) -> Path:
    """A small .jsonl of calibration texts."""
    import json

    texts = [f"Text number {i}: the cloud computes the system prompt once and edges reuse its cache. " * 2
             for i in range(6)]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    return path


# ------------------------------------------------------------------------------------------- shared texts and
# a tiny edge whose greedy path depends strongly on its cache (serving, engine and API tests)

SYSTEM = "System: you are a careful assistant for a cloud-edge research group. Answer briefly and exactly. "
USERS = ["User: what is a KV cache?", "User: name three prime numbers.", "User: ¿qué es la atención? ünïcode"]
PROMPT = "You are a helpful assistant. Background: the cloud computes this prompt's KV cache once. " * 2
ARTICLE = ("The council approved a new cycle lane along the river on Tuesday after a long public consultation. "
           "Residents said the lane would make the school run safer, while shop owners worried about parking. ")


@pytest.fixture(scope="module")
def edge_dir(tmp_path_factory):
    """A tiny Qwen2 edge (3 layers); initializer_range 0.2 makes its greedy path depend strongly on its cache."""
    model = tiny_qwen2(3, 32, 4, 2, seed=7, init=0.2)
    return save_model(model, byte_tokenizer(), tmp_path_factory.mktemp("e") / "edge")


@pytest.fixture(scope="module")
def edge(edge_dir):
    """The tiny edge, loaded in float32."""
    from edgekv.models.loading import load_model

    return load_model(edge_dir, "float32")


def make_export(edge_dir, out, start_layer=1, quant="fp32", system=SYSTEM, tar=False):
    """A same-model export of `system` for the tiny edge."""
    from edgekv.kv.compress_job import CompressConfig, run_compress

    run_compress(CompressConfig(out=str(out), cloud=edge_dir, edge=edge_dir, system_prompt=system, dtype="float32",
                                quant=quant, start_layer=start_layer, tar=tar))
    return out


@pytest.fixture(scope="module")
def export(edge_dir, tmp_path_factory):
    """make_export at its defaults (layers 1.. shipped)."""
    return make_export(edge_dir, tmp_path_factory.mktemp("kv") / "kv")
