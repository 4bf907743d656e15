"""The shared prefix (issue 37) on tiny models: trained once across prompts it lowers the held-out KL of prompts it
never saw, resumes bit-exactly, ships as a verified export refused for another edge; the edge alone reads
[prefix | prompt] at the right positions (it equals one prefill of the prefix's text and the prompt); with K = 0
every path is EdgePrompt exactly; exports made without the prefix are refused under it."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import PrefixKV, prefill_after, prefix_kv
from edgekv.distill.distill_job import DistillConfig, run_distill
from edgekv.distill.shared import init_ids
from edgekv.kv.export import KVStoreError
from edgekv.kv.shared_prefix import SharedPrefix, write_shared_prefix
from edgekv.models.loading import load_model
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from tests.helpers import PROMPT, make_export

runner = CliRunner()
INSTRUCTIONS = ["\nSay what the text above is about.\nAnswer:", "\nContinue the text above.\n"]
TOPICS = ["rivers and the sea", "a small bakery", "the night train", "mountain weather", "an old library",
          "a chess club"]


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"name": f"p{i}", "system_prompt": f"System: a note about {t}. " * 2}) + "\n"
                            for i, t in enumerate(TOPICS)))
    return path


def _cfg(tmp_path, prompts, **kw) -> DistillConfig:
    base = dict(out=str(tmp_path / "s"), prompts=str(prompts), train_shared=True, shared_tokens=6, dtype="float32",
                instructions=INSTRUCTIONS, queries=4, max_answer_tokens=10, steps=12, lr=0.05, eval_every=4,
                patience=50, quant="fp32", held_prompts=2, held_samples=4, batch=2)
    return DistillConfig(**{**base, **kw})


def test_prefill_after_a_prefix_is_one_prefill_of_both(pair):
    _, edge = pair
    tok = edge.tokenizer
    head = torch.tensor(tok("Shared words first. ")["input_ids"])
    body = torch.tensor(tok("Then the system prompt.", add_special_tokens=False)["input_ids"])
    whole = prefix_kv(edge.model, torch.cat([head, body]))
    after = prefill_after(edge.model, PrefixKV(prefix_kv(edge.model, head), head.numel()), body)
    for (k, v), (ak, av) in zip(whole, after):
        torch.testing.assert_close(ak, k[:, :, head.numel():], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(av, v[:, :, head.numel():], atol=1e-5, rtol=1e-5)
    # an empty prefix is the plain prefill, bit for bit
    empty = [(k[:, :, :0], v[:, :, :0]) for k, v in whole]
    for (k, v), (ek, ev) in zip(prefix_kv(edge.model, body), prefill_after(edge.model, PrefixKV(empty, 0), body)):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_training_lowers_held_out_kl_resumes_bit_exactly_and_ships(pair, prompts, tmp_path):
    cloud, edge = pair
    straight = run_distill(_cfg(tmp_path / "a", prompts), models=(cloud, edge))["shared"]
    s = straight["shared_prefix"]
    assert s["held_out_kl"] < s["initial_held_out_kl"]  # held-out prompts: never trained on
    assert len(s["held_out_prompts"]) == 2 and not set(s["held_out_prompts"]) & set(s["train_prompts"])
    assert (tmp_path / "a" / "s" / "loss_curve.png").stat().st_size > 0
    run_distill(_cfg(tmp_path / "b", prompts, steps=4), models=(cloud, edge))
    (tmp_path / "b" / "s" / "report.json").unlink()  # not done: the next run goes on from step 4
    again = run_distill(_cfg(tmp_path / "b", prompts), models=(cloud, edge))["shared"]
    assert again["shared_prefix"]["held_out_kl"] == s["held_out_kl"]
    a, b = SharedPrefix(straight["out"], edge), SharedPrefix(again["out"], edge)
    assert a.tokens == 6 and a.info["prompts_sha256"] == b.info["prompts_sha256"]
    for i in range(edge.num_layers):
        assert torch.equal(a.prefix.layer(i)[0], b.prefix.layer(i)[0])
        assert torch.equal(a.prefix.layer(i)[1], b.prefix.layer(i)[1])
    # a frozen sink (the prefix's first token) keeps the edge's own KV of that token, bit for bit
    frozen = run_distill(_cfg(tmp_path / "f", prompts, steps=4, freeze_first=1), models=(cloud, edge))["shared"]
    own = prefix_kv(edge.model, init_ids(edge, DistillConfig.shared_init, 6))
    got = SharedPrefix(frozen["out"], edge)
    for i, (k, v) in enumerate(own):
        assert torch.equal(got.prefix.layer(i)[0][:, :, :1], k[:, :, :1])
        assert torch.equal(got.prefix.layer(i)[1][:, :, :1], v[:, :, :1])
        assert not torch.equal(got.prefix.layer(i)[0][:, :, 1:], k[:, :, 1:])  # the rest did train


def test_the_edge_alone_reads_prefix_then_prompt(pair, prompts, tmp_path):
    cloud, edge = pair
    out = run_distill(_cfg(tmp_path, prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    shared = SharedPrefix(out, edge)
    session = EdgeSession(edge, None, system_prompt=PROMPT, shared=shared)
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    assert session.system.prefix_len == session.system.next_position == 6 + ids.numel()
    assert session.describe()["shared_prefix"]["fingerprint"] == shared.fingerprint
    want = shared.system_kv(edge.model, ids)
    for i in range(edge.num_layers):
        assert torch.equal(session.system.layer(i)[0], want.layer(i)[0])
    # greedy tokens of the session = a plain greedy loop over [prefix | prompt] with positions from K + P
    params = SamplingParams(max_new_tokens=8)
    got = session.complete("User: hi", params).token_ids
    user = edge.tokenizer("User: hi", add_special_tokens=False)["input_ids"]
    seq = list(user)
    with torch.no_grad():
        for _ in range(8):
            logits = edge.model(input_ids=torch.tensor([seq]), cache=want.request_cache(),
                                position_ids=torch.arange(want.next_position,
                                                          want.next_position + len(seq))[None]).logits[0, -1]
            seq.append(int(logits.argmax()))
    assert got == seq[len(user):len(user) + len(got)]


def test_k0_is_edgeprompt_exactly(pair, tiny_models, tmp_path):
    _, edge = pair
    ids = torch.tensor(edge.tokenizer("x")["input_ids"][:0])
    empty = [(k[0, :, :0], v[0, :, :0]) for k, v in prefix_kv(edge.model, torch.tensor(edge.tokenizer("x")["input_ids"]))]
    write_shared_prefix(tmp_path / "k0", edge, empty, ids, {"steps": 0})
    shared = SharedPrefix(tmp_path / "k0", edge)
    assert shared.tokens == 0
    params = SamplingParams(max_new_tokens=10)
    under = EdgeSession(edge, None, system_prompt=PROMPT, shared=shared)
    plain = EdgeSession(edge, None, system_prompt=PROMPT)
    for i in range(edge.num_layers):
        assert torch.equal(under.system.layer(i)[0], plain.system.layer(i)[0])
        assert torch.equal(under.system.layer(i)[1], plain.system.layer(i)[1])
    assert under.complete("User: hi", params).token_ids == plain.complete("User: hi", params).token_ids
    # EdgePrompt's export is exactly the local prefill too (K = 0 changes nothing)
    ref = make_export(tiny_models["edge"], tmp_path / "ep", start_layer=0, system=PROMPT)
    exported = EdgeSession(edge, str(ref), cache_dir=tmp_path / "c")
    assert exported.complete("User: hi", params).token_ids == plain.complete("User: hi", params).token_ids


def test_refusals(pair, tiny_models, prompts, tmp_path):
    cloud, edge = pair
    out = run_distill(_cfg(tmp_path, prompts, steps=0), models=(cloud, edge))["shared"]["out"]
    shared = SharedPrefix(out, edge)
    # an export made without the prefix is refused under it
    ref = make_export(tiny_models["edge"], tmp_path / "ep", start_layer=0, system=PROMPT)
    with pytest.raises(EdgeKVError, match="without a shared prefix"):
        EdgeSession(edge, str(ref), cache_dir=tmp_path / "c", shared=shared)
    # a prefix for another edge, or something that is not a prefix
    with pytest.raises(KVStoreError):
        SharedPrefix(out, cloud)
    with pytest.raises(KVStoreError, match="not a shared prefix"):
        SharedPrefix(ref, edge)


@pytest.mark.parametrize("args, message", [
    (["--train-shared", "--system-prompt", "hi"], "--prompts"),
    (["--train-shared", "--on-policy", "0.5"], "teacher answers only"),
    (["--train-shared", "--held-prompts", "6"], "more than --held-prompts"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_models, prompts, tmp_path, args, message):
    if "--system-prompt" not in args:
        args = args + ["--prompts", str(prompts)]
    r = runner.invoke(app, ["distill", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--dtype",
                            "float32", "--out", str(tmp_path / "o"), "--steps", "1", "--queries", "2", *args])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o" / "prefix").exists()
