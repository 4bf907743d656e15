"""Same-model exactness of spliced decoding on the real default edge model (Qwen2.5-Coder 0.5B), float32."""

import pytest
import torch

from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.models.loading import load_model
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession

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
    session.eos_ids = set()  # compare all 32 tokens
    for user in USERS:
        ids = edge.tokenizer(SYSTEM)["input_ids"] + edge.tokenizer(user, add_special_tokens=False)["input_ids"]
        full = torch.tensor(ids)[None]
        with torch.no_grad():
            want_logits = edge.model(full).logits[0, -1]
            want = edge.model.generate(full, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, full.shape[1]:].tolist()
            u = session.encode_user(user)
            got_logits = edge.model(u[None], cache=session.system.request_cache(), position_ids=torch.arange(
                session.prefix_len, session.prefix_len + len(u))[None]).logits[0, -1]
        assert (got_logits - want_logits).abs().max() < 1e-4
        assert session.complete(user, SamplingParams(max_new_tokens=32)).token_ids == want


def test_fuse_export_with_shut_gates_decodes_as_the_edge_alone_float32(tmp_path):
    """A fuse export on the real pair whose gates are open but shut (bias −10⁴): the edge's answers, token for
    token, and first-step logits within 1e-4 of a plain edge session (the fused path is really taken)."""
    from edgekv.kv.fusers import BiasFuser
    from edgekv.kv.registry import save_translator
    from edgekv.kv.translators import HiddenTranslator
    from edgekv.models.capture import capture
    from edgekv.texts import sharegpt_texts

    cloud, edge = load_model("default-cloud", "float32"), load_model("default-edge", "float32")
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:48]) for t in sharegpt_texts(4).texts]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), [(22, 26), (23, 27)], edge.model)
    fuser = BiasFuser.from_hidden(hidden, edge.model, init=-1e4)
    fuser.set_open([22, 23])
    save_translator(fuser, tmp_path / "fuser", cloud.fingerprint, edge.fingerprint)
    run_compress(CompressConfig(out=str(tmp_path / "kv"), system_prompt=SYSTEM, dtype="float32", quant="fp16",
                                splice="fuse", translator="fuse-bias", translator_path=str(tmp_path / "fuser")),
                 models=(cloud, edge))
    fused = EdgeSession(edge, str(tmp_path / "kv"), cache_dir=tmp_path / "cache")
    alone = EdgeSession(edge, None, SYSTEM)
    assert fused.describe()["fused_layers"] == [22, 23]
    for session in (fused, alone):
        session.eos_ids = set()
    for user in USERS:
        got, want = (s.complete(user, SamplingParams(max_new_tokens=24)) for s in (fused, alone))
        assert (got.first_logits - want.first_logits).abs().max() < 1e-4
        assert got.token_ids == want.token_ids
