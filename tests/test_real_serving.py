"""Same-model exactness of spliced decoding on the real default edge model (Qwen2.5-Coder 0.5B), float32."""

import pytest
import torch

from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.models.loading import load_model
from edgekv.serve.session import EdgeSession, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a senior Python reviewer. Answer in plain English, cite the line you mean, and keep every answer "
          "under five sentences. Background: the team ships a CLI that serves language models on edge devices.\n")
USERS = ["Question: what does `def f(x): return x * 2` do?\nAnswer:",
         "Question: why should a file be written to a temp path and renamed?\nAnswer:",
         "Question: what is the difference between a list and a tuple in Python?\nAnswer:"]


@pytest.mark.parametrize("start_layer", [0, 12])
def test_spliced_greedy_equals_generate_float32(tmp_path, start_layer):
    out = tmp_path / "kv"
    run_compress(CompressConfig(out=str(out), cloud="default-edge", edge="default-edge", system_prompt=SYSTEM,
                                dtype="float32", quant="fp32", start_layer=start_layer))
    edge = load_model("default-edge", "float32")
    session = EdgeSession(edge, str(out), cache_dir=tmp_path / "cache")
    session._eos_ids = lambda: set()  # compare all 32 tokens
    for user in USERS:
        ids = edge.tokenizer(SYSTEM)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
        full = torch.tensor(ids)[None]
        with torch.no_grad():
            want_logits = edge.model(full).logits[0, -1]
            want = edge.model.generate(full, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, full.shape[1]:].tolist()
            u = session.encode_user(user)
            got_logits = edge.model(u[None], past_key_values=session.new_cache(), position_ids=torch.arange(
                session.prefix_len, session.prefix_len + len(u))[None]).logits[0, -1]
        assert (got_logits - want_logits).abs().max() < 1e-4
        assert session.complete(user, SamplingParams(max_new_tokens=32)).token_ids == want
