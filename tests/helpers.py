"""Test helpers imported by the test modules: tiny randomly initialised models (built from configs), a byte-level
tokenizer, shared texts and a same-model export. The fixtures built on them are in conftest.py."""

from __future__ import annotations

from pathlib import Path

import torch


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


# ------------------------------------------------------------------------------------------- shared texts and
# a tiny edge whose greedy path depends strongly on its cache (serving, engine and API tests)

SYSTEM = "System: you are a careful assistant for a cloud-edge research group. Answer briefly and exactly. "
USERS = ["User: what is a KV cache?", "User: name three prime numbers.", "User: ¿qué es la atención? ünïcode"]
PROMPT = "You are a helpful assistant. Background: the cloud computes this prompt's KV cache once. " * 2
ARTICLE = ("The council approved a new cycle lane along the river on Tuesday after a long public consultation. "
           "Residents said the lane would make the school run safer, while shop owners worried about parking. ")


def make_export(edge_dir, out, start_layer=1, quant="fp32", system=SYSTEM, tar=False, dtype="float32"):
    """A same-model export of `system` for the tiny edge."""
    from edgekv.kv.compress_job import CompressConfig, run_compress

    run_compress(CompressConfig(out=str(out), cloud=edge_dir, edge=edge_dir, system_prompt=system, dtype=dtype,
                                quant=quant, start_layer=start_layer, tar=tar))
    return out


def edge_prefix(edge, path, tokens: int):
    """A shared prefix of `tokens` tokens (0: K = 0) for the loaded `edge`: its own KV of a few ids, where training
    starts from."""
    from edgekv.attention.prefix_kv import prefix_kv
    from edgekv.kv.shared_prefix import SharedPrefix, write_shared_prefix

    kv = prefix_kv(edge.model, torch.arange(5, 5 + max(tokens, 2)))
    write_shared_prefix(path, edge, [(k[0, :, :tokens], v[0, :, :tokens]) for k, v in kv], torch.arange(5, 5 + tokens),
                        {"steps": 0})
    return SharedPrefix(path, edge)


SESSION_TYPES = ("EdgeSession", "SystemKV", "Engine", "LayerLoader", "PrefixKV")


def cyclic_sessions() -> list[str]:
    """The sessions (and what holds their KV) that only the cyclic collector would free, freeing them."""
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = sorted(type(o).__name__ for o in gc.garbage if type(o).__name__ in SESSION_TYPES)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()
    return found


def watch_rows(monkeypatch, out) -> list:
    """After each eval row: (rows on disk, sessions left in reference cycles); the heap trim it replaces must come
    after the row is written."""
    import edgekv.eval.eval_job as job
    from edgekv.eval.runs import read_results

    seen = []
    monkeypatch.setattr(job, "trim_heap", lambda: seen.append((len(read_results(out / "results.jsonl")),
                                                               cyclic_sessions())))
    cyclic_sessions()  # what earlier tests left
    return seen
