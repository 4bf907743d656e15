"""The shared prefix (issue 37) on tiny models: trained once across prompts it lowers the held-out KL of prompts it
never saw, resumes bit-exactly, ships as a verified export refused for another edge; the edge alone reads
[prefix | prompt] at the right positions (it equals one prefill of the prefix's text and the prompt); with K = 0
every path is EdgePrompt exactly; exports made without the prefix are refused under it."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import PrefixKV, continuation_logits, prefill_after, prefix_kv, read_after
from edgekv.distill import synthetic
from edgekv.distill.distill_job import DistillConfig, run_distill
from edgekv.distill.shared import init_ids, label_samples, prompt_labels, reply_samples, text_sample
from edgekv.distill.student import sample_loss
from edgekv.distill.teacher import BatchedTeacher
from edgekv.kv.export import KVStoreError
from edgekv.kv.shared_prefix import SharedPrefix, gate, write_shared_prefix
from edgekv.models.loading import load_model
from edgekv.models.targets import mean_kl
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from tests.helpers import PROMPT, edge_prefix, make_export, watch_rows

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
    path.write_text("".join(json.dumps({"name": f"p{i}", "system_prompt": f"System: a note about {t}. " * 2,
                                        "labels": [{"user": "User: what is it about?\nAnswer:",
                                                    "reference": f"It is about {t}."}]}) + "\n"
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
    assert s["no_prefix_held_out_kl"] > 0  # the same exchanges read without any prefix (EdgePrompt)
    assert len(s["held_out_prompts"]) == 2 and not set(s["held_out_prompts"]) & set(s["train_prompts"])
    assert (tmp_path / "a" / "s" / "loss_curve.png").stat().st_size > 0
    first = run_distill(_cfg(tmp_path / "b", prompts, steps=4), models=(cloud, edge))["shared"]
    (tmp_path / "b" / "s" / "report.json").unlink()  # not done: the next run goes on from step 4
    again = run_distill(_cfg(tmp_path / "b", prompts), models=(cloud, edge))["shared"]
    assert again["shared_prefix"]["held_out_kl"] == s["held_out_kl"]
    # the report's training seconds are both processes', not the finishing one's
    assert again["train_s_all_processes"] and again["train_s"] > first["train_s"] > 0
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
    with torch.no_grad():
        want = read_after(edge.model, shared.prefix, ids)
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


def _holds_no_graph(kv: PrefixKV, layers: int) -> bool:
    """No key or value of any layer requires grad or carries an autograd graph."""
    return not any(t.requires_grad or t.grad_fn is not None for i in range(layers) for t in kv.layer(i))


def test_a_session_under_the_prefix_holds_no_autograd_graph(tiny_models, tmp_path):
    """A freshly loaded edge's parameters require grad (until a training freezes them): the session's own prefill
    after the prefix must still build no graph, which its KV would keep alive with every activation, and
    which sent it down the slower attention path (measured on the real pair: +0.08 s at a session's start)."""
    edge = load_model(tiny_models["edge"], "float32")
    assert all(p.requires_grad for p in edge.model.parameters())
    session = EdgeSession(edge, None, system_prompt=PROMPT, shared=edge_prefix(edge, tmp_path / "prefix", 4))
    assert session.system.prefix_len > 4
    assert _holds_no_graph(session.system, edge.num_layers)


def test_a_teacher_under_the_prefix_holds_no_autograd_graph(tiny_models, tmp_path):
    """The self-teacher's prefill under a prefix (the freshly loaded edge reads the prompt after it) builds no graph
    either: the same bug as the session's, on the distillation side."""
    edge = load_model(tiny_models["edge"], "float32")
    assert all(p.requires_grad for p in edge.model.parameters())
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    teacher = BatchedTeacher.of_prompt(edge, ids, edge_prefix(edge, tmp_path / "prefix", 4).prefix)
    assert teacher.prefix.prefix_len == 4 + ids.numel()
    assert _holds_no_graph(teacher.prefix, edge.num_layers)


def test_k0_is_edgeprompt_exactly(pair, tiny_models, tmp_path):
    _, edge = pair
    empty = [(k[0, :, :0], v[0, :, :0]) for k, v in prefix_kv(edge.model, torch.tensor([1, 2]))]
    write_shared_prefix(tmp_path / "k0", edge, empty, torch.tensor([], dtype=torch.long), {"steps": 0})
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
    (["--train-shared", "--lr-schedule", "linear"], "--lr-schedule must be constant or cosine"),
    (["--train-shared", "--lr-decay-from", "1"], "--lr-decay-from needs --lr-schedule cosine"),
    (["--train-shared", "--lr-schedule", "cosine", "--lr-decay-from", "1"], "0 < it < --steps (1)"),
    (["--shared-start", "nowhere"], "--shared-start is where --train-shared starts from"),
    (["--train-shared", "--shared-start", "nowhere"], "nowhere"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_models, prompts, tmp_path, args, message):
    if "--system-prompt" not in args:
        args = args + ["--prompts", str(prompts)]
    r = runner.invoke(app, ["distill", "--cloud", tiny_models["cloud"], "--edge", tiny_models["edge"], "--dtype",
                            "float32", "--out", str(tmp_path / "o"), "--steps", "1", "--queries", "2", *args])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o" / "prefix").exists()


def _compress(edge_dir, out, shared=None, gate_against=None):
    from edgekv.kv.compress_job import CompressConfig, run_compress

    run_compress(CompressConfig(out=str(out), cloud=edge_dir, edge=edge_dir, system_prompt=PROMPT, dtype="float32",
                                quant="fp32", start_layer=0, shared=shared and str(shared), shared_gate=gate_against))
    return out


def test_spliced_export_under_the_prefix_equals_the_edge_alone(pair, tiny_models, prompts, tmp_path):
    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=4), models=(cloud, edge))["shared"]["out"]
    other = run_distill(_cfg(tmp_path / "o", prompts, steps=0, shared_tokens=4), models=(cloud, edge))["shared"]["out"]
    shared = SharedPrefix(trained, edge)
    kv = _compress(tiny_models["edge"], tmp_path / "kv", trained)
    manifest = json.loads((kv / "manifest.json").read_text())
    assert manifest["under_shared"]["fingerprint"] == shared.fingerprint
    n = manifest["system_prompt"]["num_tokens"]  # the export holds the prompt's tokens only
    spliced = EdgeSession(edge, str(kv), cache_dir=tmp_path / "c", shared=shared)
    alone = EdgeSession(edge, None, system_prompt=PROMPT, shared=shared)
    assert spliced.prefix_len == alone.prefix_len == shared.tokens + n == spliced.system.next_position
    for i in range(edge.num_layers):
        torch.testing.assert_close(spliced.system.layer(i)[0], alone.system.layer(i)[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(spliced.system.layer(i)[1], alone.system.layer(i)[1], atol=1e-6, rtol=1e-6)
    params = SamplingParams(max_new_tokens=12)
    assert spliced.complete("User: hi", params).token_ids == alone.complete("User: hi", params).token_ids
    # refused without the prefix, under another one, and the other way round
    with pytest.raises(EdgeKVError, match="give it with --shared"):
        EdgeSession(edge, str(kv), cache_dir=tmp_path / "c2")
    with pytest.raises(EdgeKVError, match="under shared prefix"):
        EdgeSession(edge, str(kv), cache_dir=tmp_path / "c3", shared=SharedPrefix(other, edge))
    # a heterogeneous cloud cannot read an edge-shaped prefix
    from edgekv.kv.compress_job import CompressConfig, run_compress

    with pytest.raises(EdgeKVError, match="same model"):
        run_compress(CompressConfig(out=str(tmp_path / "h"), cloud=tiny_models["cloud"], edge=tiny_models["edge"],
                                    system_prompt=PROMPT, dtype="float32", shared=trained, translator="ridge",
                                    splice="replace"))
    assert not (tmp_path / "h").exists()


class _UnderPrefix(torch.nn.Module):
    """A teacher that is the edge reading a prefix: the one the gate must find the prefix brings the edge to."""

    def __init__(self, model, prefix):
        super().__init__()
        self.model, self.prefix = model, prefix

    def forward(self, input_ids, logits_to_keep=0):
        return SimpleNamespace(logits=continuation_logits(self.model, self.prefix, input_ids[0], logits_to_keep)[None])


def test_the_gate_reads_the_prefix_only_where_it_brings_the_edge_to_the_teacher(pair, prompts, tmp_path):
    cloud, edge = pair
    shared = SharedPrefix(run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"],
                          edge)
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    # the edge itself as teacher: without the prefix the KL is 0, so any prefix is declined
    own = gate(shared, edge, edge, ids)
    assert own["kl_without"] == 0.0 < own["kl_with"] and not own["reads_prefix"] and own["tokens"] == ids.numel() // 2
    # a teacher that is the edge under the prefix: the prefix takes the edge there exactly, so it is read
    teacher = SimpleNamespace(model=_UnderPrefix(edge.model, shared.prefix), fingerprint="edge-under-prefix")
    under = gate(shared, edge, teacher, ids)
    assert under["kl_with"] < 1e-6 < under["kl_without"] and under["reads_prefix"]
    # the KL itself: 0 on equal rows, the textbook value on a two-way distribution, on the shared vocabulary
    p, q = torch.tensor([[0.0, 0.0]]), torch.log(torch.tensor([[0.25, 0.75]]))
    assert mean_kl(p, p) == 0.0 and abs(mean_kl(p, q) - 0.5 * math.log(0.5 / 0.25) - 0.5 * math.log(0.5 / 0.75)) < 1e-6
    assert mean_kl(torch.cat([p, torch.tensor([[9.0]])], -1), q) == pytest.approx(mean_kl(p, q))


def test_a_gated_export_that_declined_the_prefix_is_edgeprompt_read_without_it(pair, tiny_models, prompts, tmp_path):
    from edgekv.kv.export import KVExport

    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    other = run_distill(_cfg(tmp_path / "o", prompts, steps=0, shared_tokens=4), models=(cloud, edge))["shared"]["out"]
    r = runner.invoke(app, ["compress", "--cloud", tiny_models["edge"], "--edge", tiny_models["edge"], "--dtype",
                            "float32", "--quant", "fp32", "--start-layer", "0", "--system-prompt", PROMPT,
                            "--shared", trained, "--shared-gate", tiny_models["edge"], "--out", str(tmp_path / "g")])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "g" / "manifest.json").read_text())
    assert "under_shared" not in manifest and manifest["shared_declined"]["fingerprint"] == \
        SharedPrefix(trained, edge).fingerprint and not manifest["shared_declined"]["gate"]["reads_prefix"]
    gated, plain = KVExport(tmp_path / "g"), KVExport(_compress(tiny_models["edge"], tmp_path / "p"))
    for i in plain.layer_indices:  # EdgePrompt's own export, bit for bit
        for name, t in plain.layer(i).items():
            assert torch.equal(t, gated.layer(i)[name])
    params = SamplingParams(max_new_tokens=12)
    want = EdgeSession(edge, str(tmp_path / "p"), cache_dir=tmp_path / "c0").complete("User: hi", params).token_ids
    for holds in (SharedPrefix(trained, edge), None):  # the edge holding the declined prefix reads without it
        s = EdgeSession(edge, str(tmp_path / "g"), cache_dir=tmp_path / "c1", shared=holds)
        assert s.prefix_len == manifest["system_prompt"]["num_tokens"]
        assert s.complete("User: hi", params).token_ids == want
    with pytest.raises(EdgeKVError, match="gated against shared prefix"):
        EdgeSession(edge, str(tmp_path / "g"), cache_dir=tmp_path / "c2", shared=SharedPrefix(other, edge))
    # a gate without a prefix to check: one line, nothing written
    r = runner.invoke(app, ["compress", "--cloud", tiny_models["edge"], "--edge", tiny_models["edge"],
                            "--system-prompt", PROMPT, "--shared-gate", tiny_models["edge"], "--out",
                            str(tmp_path / "bad")])
    assert r.exit_code != 0 and "--shared-gate checks a shared prefix" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "bad").exists()


def test_a_batch_into_a_catalog_gates_each_prompt(pair, tiny_models, prompts, tmp_path):
    from edgekv.kv.batch_compress import run_compress_batch
    from edgekv.kv.catalog import Catalog
    from edgekv.kv.compress_job import CompressConfig

    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    done = run_compress_batch(CompressConfig(cloud=tiny_models["edge"], edge=tiny_models["edge"], dtype="float32",
                                             quant="fp32", start_layer=0, prompts=str(prompts),
                                             catalog=str(tmp_path / "cat"), shared=trained,
                                             shared_gate=tiny_models["edge"]))
    assert (done["computed"], done["failed"]) == (len(TOPICS), [])
    catalog = Catalog(str(tmp_path / "cat"))
    for row in catalog.entries():  # the edge as its own teacher declines every prompt, and each export says so
        gated = json.loads(catalog.fs.cat_file(f"{catalog.root}/{row['key']}/manifest.json"))["shared_declined"]
        assert gated["gate"]["kl_without"] == 0.0 < gated["gate"]["kl_with"]


def test_a_ratio_sweep_gates_once(pair, tiny_models, prompts, tmp_path):
    """Exports of one prompt that differ only in ThinK ratio or codec share the cloud side, the gate included: the
    teacher reads the prompt once, and every export records the same verdict."""
    from edgekv.kv.compress_job import CompressConfig, run_compress

    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    teacher, calls = load_model(tiny_models["cloud"], "float32"), []
    teacher.model.register_forward_hook(lambda *_: calls.append(1))
    cache, reports = {}, []
    for n, (ratio, quant) in enumerate([(0.0, "fp32"), (0.5, "fp32"), (0.5, "int8")]):
        cfg = CompressConfig(out=str(tmp_path / f"kv{n}"), cloud=tiny_models["edge"], edge=tiny_models["edge"],
                             system_prompt=PROMPT, dtype="float32", quant=quant, prune_ratio=ratio, start_layer=0,
                             shared=trained, shared_gate=tiny_models["cloud"])
        reports.append(run_compress(cfg, models=(edge, edge), layers_cache=cache, teacher=teacher))
    assert len(calls) == 1  # the gate's one teacher forward, in the first export only
    assert reports[0]["shared_gate"] == reports[1]["shared_gate"] == reports[2]["shared_gate"]
    assert "gate_s" in reports[0]["timings"] and reports[2]["timings"]["cached_cloud_kv_s"] >= \
        reports[0]["timings"]["gate_s"]


def test_the_planner_measures_an_export_under_its_prefix(pair, tiny_models, prompts, tmp_path):
    """`edgekv plan`'s candidate from an export made under a shared prefix: the export names the prefix, its bytes
    are the prompt's alone (the prefix ships once), and its cold TTFT reads the export under it, as the edge does."""
    from edgekv.eval.network import Link, candidate_from_export, cold_ttft, made_under

    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    kv = _compress(tiny_models["edge"], tmp_path / "kv", trained)
    manifest = json.loads((kv / "manifest.json").read_text())
    c = candidate_from_export(str(kv), "edgeprompt-shared")
    assert made_under(manifest) == str(trained) and c.bytes == sum(e["bytes"] for e in manifest["layers"])
    user = torch.tensor(edge.tokenizer("User: hi", add_special_tokens=False)["input_ids"])
    seconds, session = cold_ttft(edge, str(kv), PROMPT, user, Link(), tmp_path / "c")
    assert seconds > 0 and session.prefix_len == SharedPrefix(trained, edge).tokens + \
        manifest["system_prompt"]["num_tokens"]
    plain = _compress(tiny_models["edge"], tmp_path / "kv0")
    assert made_under(json.loads((plain / "manifest.json").read_text())) is None


def test_k0_compress_is_edgeprompt_exactly(pair, tiny_models, tmp_path):
    from edgekv.kv.export import KVExport

    _, edge = pair
    empty = [(k[0, :, :0], v[0, :, :0]) for k, v in prefix_kv(edge.model, torch.tensor([1, 2]))]
    write_shared_prefix(tmp_path / "k0", edge, empty, torch.tensor([], dtype=torch.long), {"steps": 0})
    under = KVExport(_compress(tiny_models["edge"], tmp_path / "a", tmp_path / "k0"))
    gated = KVExport(_compress(tiny_models["edge"], tmp_path / "g", tmp_path / "k0", tiny_models["cloud"]))
    plain = KVExport(_compress(tiny_models["edge"], tmp_path / "b"))
    assert gated.manifest["shared_declined"]["gate"]["kl_with"] == gated.manifest["shared_declined"]["gate"][
        "kl_without"]  # K = 0 changes nothing, and a tie reads no prefix
    for i in plain.layer_indices:
        for name, t in plain.layer(i).items():
            assert torch.equal(t, under.layer(i)[name]) and torch.equal(t, gated.layer(i)[name])


def test_eval_edgeprompt_shared(pair, tiny_models, prompts, tmp_path, monkeypatch):
    from edgekv.eval.eval_config import EvalConfig
    from edgekv.eval.eval_job import run_eval

    cloud, edge = pair
    shared = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    distill = tmp_path / "distill.yaml"
    distill.write_text("distill:\n  queries: 4\n  max_answer_tokens: 6\n  steps: 2\n  eval_every: 1\n  quant: fp32\n")
    xsum = tmp_path / "xsum.jsonl"
    xsum.write_text("".join(json.dumps({"id": str(i), "document": f"A council approved a cycle lane, item {i}. " * 3,
                                        "summary": f"A lane, item {i}."}) + "\n" for i in range(2)))
    cfg = dict(out=str(tmp_path / "run"), cloud=tiny_models["cloud"], edge=tiny_models["edge"], dtype="float32",
               limit=2, max_new_tokens=4, datasets=["xsum"], xsum_source=str(xsum), min_system_tokens=8,
               strategies=["edgeprompt", "edgeprompt-shared", "ce-lslm-distill-shared@c4", "oracle-kv", "cloud-nosys",
                           "edge-nosys", "notes", "prefix-sft", "edgeprompt-shared-gated",
                           "edgeprompt-shared-selfdistill:qat@0.3/int2"],
               distill_config=str(distill), notes_instruction="\nNotes:", notes_tokens=8)
    with pytest.raises(EdgeKVError, match="needs shared"):
        EvalConfig(**cfg).validate()
    sft = run_distill(_cfg(tmp_path / "sft", prompts, steps=2, shared_targets="labels", shared_tokens=3),
                      models=(cloud, edge))["shared"]["out"]
    with pytest.raises(EdgeKVError, match="needs shared_sft"):
        EvalConfig(**cfg, shared=shared).validate()
    seen = watch_rows(monkeypatch, tmp_path / "run")
    run_eval(EvalConfig(**cfg, shared=shared, shared_sft=sft), models=(cloud, edge))
    rows = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    by = {(r["strategy"], r["id"]): r for r in rows}
    assert len(rows) == 20 and seen == [(n, []) for n in range(1, 21)]  # no session waits for the cyclic collector
    for (s, i), r in by.items():
        if s == "oracle-kv":  # trained on the request's own reference: a bound, its cloud seconds counted
            assert r["cloud_s"] > 0 and r["ref_nll"] != by[("edgeprompt", i)]["ref_nll"]
            assert r["system_tokens"] == by[("edgeprompt", i)]["system_tokens"]
        if s == "notes":  # the prompt and the cloud's notes, both shipped as EdgePrompt's KV
            assert r["system_tokens"] > by[("edgeprompt", i)]["system_tokens"]
            assert r["bytes_cloud_to_edge"] > by[("edgeprompt", i)]["bytes_cloud_to_edge"] and r["cloud_s"] > 0
        if s == "prefix-sft":  # its own prefix of 3 tokens
            assert r["system_tokens"] == by[("edgeprompt", i)]["system_tokens"] + 3
        if s.endswith("nosys"):  # the user prompt alone
            assert r["system_tokens"] == 0
        if s.startswith("ce-lslm-distill-shared"):  # P/4 student tokens after the prefix's 6
            assert r["system_tokens"] == 6 + -(-(by[("edgeprompt", i)]["system_tokens"]) // 4) and r["cloud_s"] > 0
        if s.startswith("edgeprompt-shared-selfdistill"):  # every token after the prefix, 2-bit: fewer bytes
            assert r["system_tokens"] == by[("edgeprompt", i)]["system_tokens"] + 6 and r["cloud_s"] > 0
            assert r["bytes_cloud_to_edge"] < by[("edgeprompt", i)]["bytes_cloud_to_edge"] / 4
        if s == "edgeprompt-shared-gated":  # each request answered exactly as one of the two paths its gate chose
            ep = by[("edgeprompt", i)]
            chosen = by[("edgeprompt-shared", i)] if r["system_tokens"] == ep["system_tokens"] + 6 else ep
            assert r["system_tokens"] == chosen["system_tokens"] and r["ref_nll"] == chosen["ref_nll"]
            assert r["bytes_cloud_to_edge"] == ep["bytes_cloud_to_edge"] and r["cloud_s"] > 0
        if s == "edgeprompt-shared":  # K more tokens read, the same prompt bytes shipped
            assert r["system_tokens"] == by[("edgeprompt", i)]["system_tokens"] + 6
            assert r["bytes_cloud_to_edge"] == by[("edgeprompt", i)]["bytes_cloud_to_edge"]
            assert r["ref_nll"] != by[("edgeprompt", i)]["ref_nll"]


def test_a_training_prompts_name_says_which_eval_record_it_read():
    """The names `bench.shared_prefix_prompts` gives training prompts map to the eval records they were made from: an
    MMLU subject's dev prompt and its test shots both to the subject, which every question of it shares."""
    from edgekv.eval.datasets import record_of_request, record_of_training_prompt, training_prompt_name

    named = lambda source, record: record_of_training_prompt(training_prompt_name(source, record))  # noqa: E731
    assert training_prompt_name("mmlu", "high_school_physics") == "mmlu-high_school_physics"  # train-*.jsonl's names
    assert named("mmlu", "high_school_physics") == ("mmlu", "high_school_physics")
    assert named("mmlu-test", "high_school_physics-2") == ("mmlu", "high_school_physics")
    assert named("xsum", "34019374") == ("xsum", "34019374")
    assert named("sharegpt", "Y9mbtnD_19") == ("sharegpt", "Y9mbtnD_19")
    assert named("news", "lee-3") is None and record_of_training_prompt("p0") is None
    # the names already written in the committed train-*.jsonl files keep reading as before
    assert record_of_training_prompt("mmlu-test-high_school_physics-2") == ("mmlu", "high_school_physics")
    assert record_of_training_prompt("xsum-34019374") == ("xsum", "34019374")
    assert record_of_training_prompt("sharegpt-Y9mbtnD_19") == ("sharegpt", "Y9mbtnD_19")
    assert record_of_training_prompt("news-lee-3") is None
    assert record_of_request("mmlu", "high_school_physics-731") == ("mmlu", "high_school_physics")
    assert record_of_request("xsum", "34019374") == ("xsum", "34019374")
    assert record_of_request("sharegpt", "Y9mbtnD_19") == ("sharegpt", "Y9mbtnD_19")


def test_eval_refuses_a_prefix_on_a_record_it_trained_on(pair, tiny_models, prompts, tmp_path):
    """A shared prefix scored on a request whose record its training read (held-out prompts included) is refused
    before any forward, with one line naming both; the same prefix on records it never read runs."""
    from edgekv.eval.eval_config import EvalConfig
    from edgekv.eval.eval_job import run_eval

    cloud, edge = pair
    lines = prompts.read_text().splitlines()
    named = tmp_path / "named.jsonl"  # the last prompt made from XSum record "1", as the prompt builder names it
    named.write_text("\n".join([*lines[:-1], json.dumps({**json.loads(lines[-1]), "name": "xsum-1"})]) + "\n")
    shared = run_distill(_cfg(tmp_path / "t", named, steps=2), models=(cloud, edge))["shared"]["out"]
    # every prompt its training read, the 2 held out for early stopping included
    assert sorted(SharedPrefix(shared, edge).trained_on()) == sorted(json.loads(line)["name"]
                                                                     for line in named.read_text().splitlines())
    xsum = tmp_path / "xsum.jsonl"
    xsum.write_text("".join(json.dumps({"id": str(i), "document": f"A council approved a cycle lane, item {i}. " * 3,
                                        "summary": f"A lane, item {i}."}) + "\n" for i in range(3)))
    cfg = dict(cloud=tiny_models["cloud"], edge=tiny_models["edge"], dtype="float32", max_new_tokens=2,
               datasets=["xsum"], xsum_source=str(xsum), min_system_tokens=8, shared=shared,
               strategies=["edgeprompt", "edgeprompt-shared"])
    with pytest.raises(EdgeKVError, match=r"xsum request 1: the shared prefix .* trained on its record \(xsum-1\)"):
        run_eval(EvalConfig(**cfg, out=str(tmp_path / "bad"), limit=3), models=(cloud, edge))
    assert not (tmp_path / "bad" / "results.jsonl").exists()
    held = EvalConfig(**cfg, out=str(tmp_path / "ok"), limit=3, xsum_records=1)  # record 0 only
    run_eval(held, models=(cloud, edge))
    assert {json.loads(r)["id"] for r in (tmp_path / "ok" / "results.jsonl").read_text().splitlines()} == {"0"}
    only_edgeprompt = EvalConfig(**{**cfg, "strategies": ["edgeprompt"]}, out=str(tmp_path / "ep"), limit=3)
    only_edgeprompt.validate()  # no strategy reads the prefix: nothing to check
    run_eval(only_edgeprompt, models=(cloud, edge))


def test_serve_edge_batch_under_the_prefix(pair, tiny_models, prompts, tmp_path):
    cloud, edge = pair
    shared = run_distill(_cfg(tmp_path / "t", prompts, steps=2), models=(cloud, edge))["shared"]["out"]
    batch = tmp_path / "req.jsonl"
    batch.write_text(json.dumps({"id": "a", "prompt": "User: hi", "max_tokens": 6}) + "\n")
    args = ["serve-edge", "--edge", tiny_models["edge"], "--dtype", "float32", "--system-prompt", PROMPT,
            "--batch", str(batch), "--output", str(tmp_path / "out.jsonl")]
    r = runner.invoke(app, [*args, "--shared", shared])
    assert r.exit_code == 0, r.output
    got = json.loads((tmp_path / "out.jsonl").read_text())["text"]
    want = EdgeSession(edge, None, system_prompt=PROMPT, shared=SharedPrefix(shared, edge)).complete(
        "User: hi", SamplingParams(max_new_tokens=6)).text
    assert got == want
    r = runner.invoke(app, [*args[:-2], "--output", str(tmp_path / "bad.jsonl"), "--shared", str(tmp_path / "none")])
    assert r.exit_code != 0 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "bad.jsonl").exists()


def test_distill_on_top_of_the_prefix(pair, tiny_models, prompts, tmp_path):
    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=4), models=(cloud, edge))["shared"]["out"]
    shared = SharedPrefix(trained, edge)
    one = dict(out=str(tmp_path / "d"), system_prompt=PROMPT, dtype="float32", instructions=INSTRUCTIONS, queries=4,
               max_answer_tokens=10, steps=0, quant="fp32", shared=trained)
    # step 0 with P' = P under the prefix is EdgePrompt under the prefix, token for token
    report = run_distill(DistillConfig(**one), models=(cloud, edge))["reports"]["prompt"]
    manifest = json.loads((tmp_path / "d" / "prompt" / "kv" / "manifest.json").read_text())
    assert manifest["under_shared"]["fingerprint"] == shared.fingerprint
    kv = _compress(tiny_models["edge"], tmp_path / "kv", trained)
    params = SamplingParams(max_new_tokens=12)
    got = EdgeSession(edge, report["out"], cache_dir=tmp_path / "c", shared=shared).complete("User: hi", params)
    want = EdgeSession(edge, str(kv), cache_dir=tmp_path / "c2", shared=shared).complete("User: hi", params)
    assert got.token_ids == want.token_ids
    with pytest.raises(EdgeKVError, match="give it with --shared"):
        EdgeSession(edge, report["out"], cache_dir=tmp_path / "c3")
    # trained, shorter: the held-out KL falls and the export continues after K + P'
    short = run_distill(DistillConfig(**{**one, "out": str(tmp_path / "e"), "steps": 8, "lr": 0.05, "eval_every": 2,
                                         "compress": 4}), models=(cloud, edge))["reports"]["prompt"]
    d = short["distilled"]
    assert d["held_out_kl"] < d["initial_held_out_kl"]
    session = EdgeSession(edge, short["out"], cache_dir=tmp_path / "c4", shared=shared)
    assert session.system.next_position == shared.tokens + short["kv_tokens"] == session.prefix_len
    with pytest.raises(EdgeKVError, match="give one of them"):
        DistillConfig(**{**one, "train_shared": True, "prompts": str(prompts), "system_prompt": None}).validate()


def test_a_self_teacher_under_the_prefix_is_the_edge_reading_it(pair, prompts, tmp_path, monkeypatch):
    """teacher self + --shared: the teacher is the edge reading [prefix | prompt], so an uncompressed student of every
    token starts at it (held-out KL 0), and a teacher that skips the prefix does not."""
    cloud, edge = pair
    trained = run_distill(_cfg(tmp_path / "t", prompts, steps=4), models=(cloud, edge))["shared"]["out"]
    one = dict(system_prompt=PROMPT, dtype="float32", instructions=INSTRUCTIONS, queries=6, max_answer_tokens=10,
               steps=0, quant="fp32", shared=trained, teacher="self")
    start = run_distill(DistillConfig(out=str(tmp_path / "a"), **one), models=(cloud, edge))["reports"]["prompt"]
    assert start["distilled"]["held_out_kl"] < 1e-6
    # a teacher that forgets the prefix its student reads does not start where the student does (this tiny model's
    # KL is ~1e-4 then: small, but three orders above the one above)
    monkeypatch.setattr(synthetic, "self_under_shared", lambda cfg, shared: None)
    off = run_distill(DistillConfig(out=str(tmp_path / "b"), **one), models=(cloud, edge))["reports"]["prompt"]
    assert off["distilled"]["held_out_kl"] > 1e-5


def test_an_on_policy_set_is_made_again_for_a_prefix_retrained_in_place(pair, prompts, tmp_path):
    """An on-policy student reads the prefix, so its samples are kept under the prefix's fingerprint: a prefix
    retrained at the same path makes the set afresh instead of reading the old prefix's back."""
    cloud, edge = pair
    where = tmp_path / "prefix"
    one = dict(system_prompt=PROMPT, dtype="float32", instructions=INSTRUCTIONS, queries=6, max_answer_tokens=10,
               steps=0, quant="fp32", shared=str(where), on_policy=0.5, seeds=["question", "instruction"],
               synthetic_dir=str(tmp_path / "syn"))
    kept = lambda: json.loads((tmp_path / "syn" / "prompt" / "synthetic.json").read_text())["key"]  # noqa: E731
    fingerprints = []
    for n, steps in enumerate((4, 0)):
        trained = run_distill(_cfg(tmp_path / f"t{n}", prompts, steps=steps), models=(cloud, edge))["shared"]["out"]
        shutil.rmtree(where, ignore_errors=True)
        shutil.copytree(trained, where)
        fingerprints.append(SharedPrefix(str(where), edge).fingerprint)
        run_distill(DistillConfig(out=str(tmp_path / f"d{n}"), **one), models=(cloud, edge))
        assert kept()["shared"] == fingerprints[-1]
    assert fingerprints[0] != fingerprints[1]


def test_report_pairs_conditions_and_decomposes_the_lead():
    from bench.distill_report import distill_summary
    from bench.shared_prefix_report import SHARED, decomposition, per_request

    nll = {"edgeprompt": 3.0, "edge-only": 3.0, "edgeprompt-shared": 2.8, "cloud-only": 2.0, "cloud-nosys": 2.4,
           "edge-nosys": 3.5}
    rows = [{"dataset": "xsum", "id": str(i), "strategy": s, "ref_nll": v + 0.01 * i, "bytes_cloud_to_edge": 1,
             "cloud_s": 0.0} for i in range(6) for s, v in nll.items()]
    cells = distill_summary(rows, 0, SHARED)["xsum"]
    assert cells["edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.2)
    assert cells["gap_closed_by_edgeprompt-shared"]["fraction"] == pytest.approx(0.2)
    d = decomposition(rows)["xsum"]
    assert d["cloud_lead_without_prompt"] == pytest.approx(1.1) and d["prompt_saves_edge"] == pytest.approx(0.5)
    # the recall student beside plain @c8: its own cell, its contrast with @c8, and a named request's Δ per condition
    rows += [{**r, "strategy": s, "ref_nll": r["ref_nll"] + dv} for r in rows if r["strategy"] == "edgeprompt"
             for s, dv in (("ce-lslm-distill-shared@c8", 0.3 * (r["id"] == "5")),
                           ("ce-lslm-distill-shared:recall@c8", -0.05))]
    cells = distill_summary(rows, 0, SHARED)["xsum"]
    assert cells["distill-c8-shared-recall"]["delta_mean"] == pytest.approx(-0.05)
    assert cells["distill-c8-shared-recall - distill-c8-shared"]["delta_mean"] == pytest.approx(-0.05 - 0.05)
    picked = per_request(rows, SHARED.conditions, {("xsum", "5"), ("xsum", "9")})
    assert picked["xsum:9"] is None  # EdgePrompt never answered it: nothing to pair with
    assert picked["xsum:5"]["distill-c8-shared"] == pytest.approx(0.3)
    assert picked["xsum:5"]["distill-c8-shared-recall"] == pytest.approx(-0.05)
    assert picked["xsum:5"]["edgeprompt-shared"] == pytest.approx(-0.2) and "oracle-kv" not in picked["xsum:5"]
    # the 2-bit conditions: their cells and their contrasts (with the prefix's own KV, the float-trained 2-bit student
    # and @c8)
    rows += [{**r, "strategy": s, "ref_nll": r["ref_nll"] + dv} for r in rows if r["strategy"] == "edgeprompt"
             for s, dv in (("edgeprompt-shared@0.35/int2", -0.15), ("ce-lslm-distill-shared@0.35/int2", -0.1),
                           ("ce-lslm-distill-shared:qat@0.35/int2", -0.12))]
    cells = distill_summary(rows, 0, SHARED)["xsum"]
    assert cells["edgeprompt-shared-int2 - edgeprompt-shared"]["delta_mean"] == pytest.approx(0.05)
    assert cells["distill-shared-qat-int2 - distill-shared-int2"]["delta_mean"] == pytest.approx(-0.02)
    assert cells["distill-shared-qat-int2 - distill-c8-shared"]["delta_mean"] == pytest.approx(-0.12 - 0.05)
    assert cells["gap_closed_by_distill-shared-qat-int2"]["fraction"] == pytest.approx(0.12)
    # --only: the named conditions and the cloud, with the contrasts and gaps among them
    from bench.shared_prefix_report import only, share_of_oracle

    few = only(SHARED, ["distill-shared-qat-int2", "distill-c8-shared"])
    assert set(few.conditions) == {"distill-shared-qat-int2", "distill-c8-shared", "cloud"}
    assert list(few.contrasts) == ["distill-shared-qat-int2 - distill-c8-shared"]
    assert set(few.gaps.values()) == {"distill-shared-qat-int2", "distill-c8-shared"}
    assert share_of_oracle(rows, few.conditions) == {}  # no oracle-kv rows; the left-out conditions are skipped
    with pytest.raises(EdgeKVError, match="--only: no condition nope"):
        only(SHARED, ["nope"])


def test_report_splits_the_gates_requests_by_what_it_chose():
    from bench.shared_prefix_report import gate_split

    rows = []
    for i, (helps, reads) in enumerate([(-0.3, True), (-0.1, True), (0.2, False), (-0.4, False)]):
        rows += [{"dataset": "mmlu", "id": str(i), "strategy": "edgeprompt", "ref_nll": 1.0, "system_tokens": 10},
                 {"dataset": "mmlu", "id": str(i), "strategy": "edgeprompt-shared", "ref_nll": 1.0 + helps,
                  "system_tokens": 42},
                 {"dataset": "mmlu", "id": str(i), "strategy": "edgeprompt-shared-gated",
                  "ref_nll": 1.0 + helps * reads, "system_tokens": 42 if reads else 10}]
    split = gate_split(rows)["mmlu"]
    assert split["read"]["n"] == split["declined"]["n"] == 2
    assert split["read"]["ungated_delta_mean"] == pytest.approx(-0.2)
    assert split["declined"]["ungated_delta_mean"] == pytest.approx(-0.1)
    assert gate_split([r for r in rows if r["strategy"] != "edgeprompt-shared-gated"]) == {}
    # the gated runs read another prefix (a variant): its rows split the gate's requests, not the shipped prefix's
    other = [{**r, "strategy": "edgeprompt-shared@v", "ref_nll": 2 * r["ref_nll"] - 1.0} for r in rows
             if r["strategy"] == "edgeprompt-shared"]
    split = gate_split(rows + other, "edgeprompt-shared@v")["mmlu"]
    assert split["read"]["ungated_delta_mean"] == pytest.approx(-0.4)
    assert split["declined"]["ungated_delta_mean"] == pytest.approx(-0.2)


def test_report_keeps_a_source_a_strategy_skipped_and_relabels_a_runs_prefix(tmp_path, monkeypatch):
    """A strategy run on one source only (oracle-kv on XSum) leaves the other source's requests in the report; the
    same strategy from a run under another prefix (--held-out-source) is its own condition, not a duplicate."""
    from bench.distill_report import write_distill_report
    from bench.shared_prefix_report import HELD_OUT, SHARED, share_of_oracle, with_fusers, with_variants

    def run(name: str, rows: list[tuple[str, str, float]]) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"datasets": sorted({ds for ds, _, _ in rows})}))
        (d / "results.jsonl").write_text("".join(json.dumps(
            {"dataset": ds, "id": f"{ds}{i}", "strategy": s, "ref_nll": v + 0.01 * i, "bytes_cloud_to_edge": 1,
             "cloud_s": 0.0, "system_tokens": 42 if "shared" in s else 10}) + "\n"
            for i in range(4) for ds, s, v in rows))
        return d

    both = [(ds, s, v) for ds in ("xsum", "mmlu") for s, v in
            (("edgeprompt", 3.0), ("cloud-only", 2.0), ("edgeprompt-shared", 2.9))]
    a = run("a", both)
    b = run("b", [("xsum", "oracle-kv", 2.5)])
    c = run("c", [("xsum", "edgeprompt-shared", 2.7)])
    s = write_distill_report([a, b, c], tmp_path / "out", spec=SHARED, relabel={c: {"edgeprompt-shared": HELD_OUT}})
    assert s["mmlu"]["edgeprompt-shared"]["n"] == 4 and "oracle-kv" not in s["mmlu"]
    assert s["xsum"]["oracle-kv"]["delta_mean"] == pytest.approx(-0.5)
    assert s["xsum"]["edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.1)
    assert s["xsum"][HELD_OUT]["delta_mean"] == pytest.approx(-0.3)
    # a request left out (a leak into some condition's training text) leaves every cell of its source, and is named
    s = write_distill_report([a, b, c], tmp_path / "out-x", spec=SHARED, relabel={c: {"edgeprompt-shared": HELD_OUT}},
                             exclude={("xsum", "xsum3")})
    assert s["xsum"]["edgeprompt-shared"]["n"] == s["xsum"]["oracle-kv"]["n"] == 3
    assert s["xsum"]["excluded_requests"] == ["xsum3"] and "excluded_requests" not in s["mmlu"]
    assert s["mmlu"]["edgeprompt-shared"]["n"] == 4
    with pytest.raises(EdgeKVError, match="--exclude: no run holds xsum:xsum9"):
        write_distill_report([a], tmp_path / "out-y", spec=SHARED, exclude={("xsum", "xsum9")})
    # a source where only oracle-kv ran has no EdgePrompt to pair with: no entry, not one of empty costs
    d = run("d", [("sharegpt", "oracle-kv", 2.5)])
    s = write_distill_report([a, d], tmp_path / "out-d", spec=SHARED)
    assert set(s) == {"xsum", "mmlu"}
    # a prefix variant (another K) is one more condition with its own gap share, the K = 32 row untouched
    k = run("k", [("xsum", "edgeprompt-shared", 2.5)])
    s = write_distill_report([a, k], tmp_path / "out-k", spec=with_variants(SHARED, ["k64"]),
                             relabel={k: {"edgeprompt-shared": "edgeprompt-shared@k64"}})
    assert s["xsum"]["edgeprompt-shared@k64"]["delta_mean"] == pytest.approx(-0.5)
    assert s["xsum"]["gap_closed_by_edgeprompt-shared@k64"]["fraction"] == pytest.approx(0.5)
    assert s["xsum"]["edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.1)
    assert s["xsum"]["edgeprompt-shared@k64 - edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.4)
    # an ablation against its control (same teacher sets): each variant minus the control, the control minus the
    # shipped prefix; a control that is not a variant is refused
    f = run("f", [("xsum", "edgeprompt-shared", 2.6)])
    spec = with_variants(SHARED, ["k64", "f0"], against="k64")
    s = write_distill_report([a, k, f], tmp_path / "out-f", spec=spec, relabel={
        k: {"edgeprompt-shared": "edgeprompt-shared@k64"}, f: {"edgeprompt-shared": "edgeprompt-shared@f0"}})
    assert s["xsum"]["edgeprompt-shared@f0 - edgeprompt-shared@k64"]["delta_mean"] == pytest.approx(0.1)
    assert s["xsum"]["edgeprompt-shared@k64 - edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.4)
    assert "edgeprompt-shared@f0 - edgeprompt-shared" not in s["xsum"]
    with pytest.raises(EdgeKVError, match="--against k16"):
        with_variants(SHARED, ["k64"], against="k16")
    # another fuser under the prefix: its own condition beside the shipped fuser's, against it and the prefix alone
    base = run("base", [("xsum", "ce-lslm-fuse-shared", 2.85)])
    fk = run("fk", [("xsum", "ce-lslm-fuse-shared", 2.8)])
    s = write_distill_report([a, base, fk], tmp_path / "out-fk", spec=with_fusers(SHARED, ["k32"]),
                             relabel={fk: {"ce-lslm-fuse-shared": "fuse-shared@k32"}})
    assert s["xsum"]["fuse-shared@k32 - fuse-shared"]["delta_mean"] == pytest.approx(-0.05)
    assert s["xsum"]["fuse-shared@k32 - edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.1)
    assert s["xsum"]["gap_closed_by_fuse-shared@k32"]["fraction"] == pytest.approx(0.2)
    assert s["xsum"]["fuse-shared"]["delta_mean"] == pytest.approx(-0.15)
    # a second fuser (a control) is also contrasted with the first, the pair read from the same rows
    fc = run("fc", [("xsum", "ce-lslm-fuse-shared", 2.83)])
    s = write_distill_report([a, base, fk, fc], tmp_path / "out-fc", spec=with_fusers(SHARED, ["k32", "ctl"]),
                             relabel={fk: {"ce-lslm-fuse-shared": "fuse-shared@k32"},
                                      fc: {"ce-lslm-fuse-shared": "fuse-shared@ctl"}})
    assert s["xsum"]["fuse-shared@ctl - fuse-shared@k32"]["delta_mean"] == pytest.approx(0.03)
    assert s["xsum"]["fuse-shared@ctl - fuse-shared"]["delta_mean"] == pytest.approx(-0.02)
    assert "fuse-shared@k32 - fuse-shared@ctl" not in s["xsum"]
    from bench.shared_prefix_report import main  # on the command line: one line, no traceback, nothing written

    monkeypatch.setattr("sys.argv", ["x", str(tmp_path / "out-g"), str(a), "--variant", f"k64={k}", "--against", "k16"])
    with pytest.raises(SystemExit, match="^error: --against k16: no --variant of that name$"):
        main()
    assert not (tmp_path / "out-g").exists()
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path / "out-g"), str(a), "--variant", f"k64={k}", "--gated", "k16"])
    with pytest.raises(SystemExit, match="^error: --gated k16: no --variant of that name$"):
        main()
    assert not (tmp_path / "out-g").exists()
    # a gate run on a variant's prefix is contrasted with that variant, not with the shipped prefix
    g = run("g", [("xsum", "edgeprompt-shared-gated", 2.8)])
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path / "out-v"), str(a), str(g), "--variant", f"k64={k}",
                                     "--gated", "k64"])
    main()
    summary = json.loads((tmp_path / "out-v" / "summary.json").read_text())
    s = summary["xsum"]
    assert s["edgeprompt-shared-gated - edgeprompt-shared@k64"]["delta_mean"] == pytest.approx(0.3)
    assert "edgeprompt-shared-gated - edgeprompt-shared" not in s
    gate = summary["gate"]["xsum"]  # split by k64's rows
    assert gate["read"]["n"] == 4 and gate["read"]["ungated_delta_mean"] == pytest.approx(-0.5)
    # goal (4): the prefix's gain as a share of oracle-kv's on the same requests (−0.1 of −0.5), only where
    # oracle-kv ran (XSum), the cloud's NLL out of it
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines() if line]
    shares = share_of_oracle(rows, SHARED.conditions)
    assert set(shares) == {"xsum"} and set(shares["xsum"]) == {"edgeprompt-shared"}
    cell = shares["xsum"]["edgeprompt-shared"]
    assert cell["n"] == 4 and cell["fraction"] == pytest.approx(0.2) and cell["ci95_lo"] == pytest.approx(0.2)
    # a variant's prefix gets its own share of oracle-kv's gain (−0.5 of −0.5), the shipped one's unchanged
    s = write_distill_report([a, b, k], tmp_path / "out-ko", spec=with_variants(SHARED, ["k64"]),
                             relabel={k: {"edgeprompt-shared": "edgeprompt-shared@k64"}})
    rows = [json.loads(line) for line in (tmp_path / "out-ko" / "rows.jsonl").read_text().splitlines() if line]
    shares = share_of_oracle(rows, with_variants(SHARED, ["k64"]).conditions)["xsum"]
    assert shares["edgeprompt-shared@k64"]["fraction"] == pytest.approx(1.0)
    assert shares["edgeprompt-shared"]["fraction"] == pytest.approx(0.2)


def test_report_keeps_a_repeated_reference_once_and_refuses_a_conflicting_one(tmp_path):
    """Two runs each holding EdgePrompt on the same requests merge to one row per request; if their NLLs differ
    (runs of different code) the merge is refused, in the library and as a one-line error on the command line."""
    import subprocess
    import sys

    from bench.distill_report import write_distill_report
    from bench.shared_prefix_report import SHARED

    def run(name: str, rows: list[tuple[str, float]]) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"datasets": ["mmlu"]}))
        (d / "results.jsonl").write_text("".join(json.dumps(
            {"dataset": "mmlu", "id": str(i), "strategy": s, "ref_nll": v + 0.01 * i, "bytes_cloud_to_edge": 1 + i,
             "cloud_s": 0.0, "correct": i % 2 == 0}) + "\n" for i in range(5) for s, v in rows))
        return d

    a = run("a", [("edgeprompt", 3.0), ("edgeprompt-shared", 2.9), ("cloud-only", 2.0)])
    b = run("b", [("edgeprompt", 3.0), ("ce-lslm-distill-shared", 2.8)])
    s = write_distill_report([a, b], tmp_path / "out", spec=SHARED)
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines() if line]
    assert sum(r["strategy"] == "edgeprompt" for r in rows) == 5 and len(rows) == 20
    assert s["mmlu"]["distill-shared - edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.1)
    assert s["mmlu"]["accuracy"]["edgeprompt"] == pytest.approx(0.6)
    c = run("c", [("edgeprompt", 3.001)])
    with pytest.raises(EdgeKVError, match="edgeprompt on mmlu request 0"):
        write_distill_report([a, c], tmp_path / "out2", spec=SHARED)
    assert not (tmp_path / "out2").exists()
    cli = subprocess.run([sys.executable, "-m", "bench.shared_prefix_report", str(tmp_path / "out3"), str(a), str(c)],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert cli.returncode != 0 and not (tmp_path / "out3").exists()
    err = cli.stderr.strip()
    assert err.startswith("error: two runs score edgeprompt") and len(err.splitlines()) == 1


def test_report_reads_a_run_still_writing(tmp_path, caplog):
    """A report made while a run writes (or after it was stopped) drops the torn last line with a warning, as the
    eval's resume does, and pairs the requests whose rows are whole."""
    import logging

    from bench.distill_report import write_distill_report
    from bench.shared_prefix_report import SHARED

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"datasets": ["xsum"]}))
    rows = [{"dataset": "xsum", "id": str(i), "strategy": s, "ref_nll": v + 0.01 * i, "bytes_cloud_to_edge": 1,
             "cloud_s": 0.0} for i in range(3) for s, v in (("edgeprompt", 3.0), ("edgeprompt-shared", 2.8))]
    torn = json.dumps({**rows[-1], "id": "3"})[:25]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    with caplog.at_level(logging.WARNING, logger="edgekv"):
        s = write_distill_report([run], tmp_path / "out", spec=SHARED)
    assert "results.jsonl:7: dropping a torn line" in caplog.text
    assert s["xsum"]["edgeprompt-shared"]["n"] == 3
    assert s["xsum"]["edgeprompt-shared"]["delta_mean"] == pytest.approx(-0.2)


def test_prefix_sft_learns_the_labels_without_a_cloud(pair, tiny_models, prompts, tmp_path):
    _, edge = pair
    cfg = _cfg(tmp_path, prompts, shared_targets="labels", steps=16, held_prompts=1, cloud=str(tmp_path / "none"),
               edge=tiny_models["edge"])
    s = run_distill(cfg)["shared"]["shared_prefix"]  # loads the edge alone: the cloud path does not exist
    assert s["targets"] == "labels" and s["teacher"] is None
    assert s["held_out_kl"] < s["initial_held_out_kl"]  # cross-entropy on a held-out prompt's own label
    # a one-token reference (as MMLU's gold letter is on the real tokenizer) is one row of loss: the byte
    # tokenizer makes " " one token
    one = label_samples(edge, [{"user": "Q: yes?\nAnswer:", "reference": ""}], 64)
    assert len(one) == 1 and one[0].answer.numel() == 1
    assert float(sample_loss(edge, PrefixKV.of_model(edge.model, torch.tensor([1, 2])), one[0])) > 0
    bad = tmp_path / "nolabels.jsonl"
    bad.write_text(json.dumps({"name": "a", "system_prompt": "System: x."}) + "\n" + json.dumps(
        {"name": "b", "system_prompt": "System: y."}) + "\n")
    with pytest.raises(EdgeKVError, match="needs 'labels'"):
        run_distill(_cfg(tmp_path / "b", bad, shared_targets="labels", held_prompts=1), models=pair)


def test_text_targets_are_the_teachers_own_second_half(pair, prompts, tmp_path):
    cloud, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    first, sample, _, _ = text_sample(edge, ids, top_k=8)
    h = ids.numel() // 2
    assert torch.equal(first, ids[:h]) and torch.equal(torch.cat([sample.user, sample.answer]), ids[h:])
    assert sample.top_ids.shape == (ids.numel() - h - 1, 8) and sample.answer_from == 0
    # the edge as its own teacher, reading the first half as the teacher did: the rows line up, the KL is zero
    with torch.no_grad():
        assert float(sample_loss(edge, PrefixKV.of_model(edge.model, first), sample)) < 1e-5
    # and a real teacher trains a prefix that brings the edge closer on held-out prompts' second halves
    s = run_distill(_cfg(tmp_path, prompts, shared_targets="text", batch=1, steps=16),
                    models=(cloud, edge))["shared"]["shared_prefix"]
    assert s["targets"] == "text" and s["held_out_kl"] < s["initial_held_out_kl"]
    with pytest.raises(EdgeKVError, match="teacher, labels or text"):
        _cfg(tmp_path / "b", prompts, shared_targets="prose").validate()


def test_text_targets_are_kept_so_a_rerun_needs_no_teacher(pair, prompts, tmp_path):
    cloud, edge = pair
    kept = tmp_path / "targets"
    first = run_distill(_cfg(tmp_path / "a", prompts, shared_targets="text", batch=1, steps=8,
                             synthetic_dir=str(kept)), models=(cloud, edge))["shared"]
    assert first["targets_read_back"] == 0 and len(list(kept.glob("*/text.json"))) == len(TOPICS)

    class NoForward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))  # a device to be on

        def forward(self, *args, **kwargs):
            raise AssertionError("the teacher ran although its targets were kept")

    silent = dataclasses.replace(cloud, model=NoForward())
    again = run_distill(_cfg(tmp_path / "b", prompts, shared_targets="text", batch=1, steps=8,
                             synthetic_dir=str(kept)), models=(silent, edge))["shared"]
    assert again["targets_read_back"] == len(TOPICS) and again["targets_read_back_without_seconds"] == 0
    recorded = sum(json.loads(p.read_text())["teach_s"] for p in kept.glob("*/text.json"))
    assert recorded <= first["teach_s"] and again["teach_s"] >= recorded > 0  # the teacher's seconds, kept with them
    a, b = (SharedPrefix(r["out"], edge).prefix for r in (first, again))
    for i in range(a.num_layers):  # the same targets train the same prefix, bit for bit
        assert all(torch.equal(x, y) for x, y in zip(a.layer(i), b.layer(i)))
    # another teacher's targets are not this one's: it reads the prompts again
    other = dataclasses.replace(cloud, model=NoForward(), fingerprint="another-teacher")
    with pytest.raises(AssertionError, match="its targets were kept"):
        run_distill(_cfg(tmp_path / "c", prompts, shared_targets="text", batch=1, steps=8, synthetic_dir=str(kept)),
                    models=(other, edge))


def test_replies_are_the_teachers_reading_of_the_whole_conversation(pair, prompts, tmp_path):
    cloud, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    labels = [{"user": "User: and then?\nAssistant:", "reference": "Then it rained all day long."},
              {"user": "", "reference": "an empty turn is skipped"}]
    got, seconds, read_back = reply_samples(edge, edge, ids, labels, 5, 8)
    h = ids.numel() // 2
    (s,) = got
    user = torch.tensor(edge.tokenizer(labels[0]["user"], add_special_tokens=False)["input_ids"])
    assert torch.equal(s.user, torch.cat([ids[h:], user])) and s.answer.numel() == 5  # cut to the tokens scored
    assert s.top_ids.shape == (s.user.numel() + 5 - 1, 8) and (seconds, read_back) == (0.0, 0)
    # the edge as its own teacher, reading the first half as the training step does: the rows line up, KL zero
    with torch.no_grad():
        assert float(sample_loss(edge, PrefixKV.of_model(edge.model, ids[:h]), s)) < 1e-5
    # the cloud's rows are its one forward over prompt + turn + reply, on the reply's positions
    with torch.no_grad():
        full = torch.log_softmax(cloud.model(input_ids=torch.cat([ids, user, s.answer])[None]).logits[0].float(), -1)
    c, _, _ = reply_samples(cloud, edge, ids, labels[:1], 5, 8)
    rows = full[ids.numel() + user.numel() - 1:-1]
    assert torch.allclose(c[0].top_logp[c[0].answer_from:], rows.topk(8).values, atol=1e-5)


def test_replies_train_beside_the_text_only_for_named_sources(pair, prompts, tmp_path):
    cloud, edge = pair
    base = _cfg(tmp_path / "t", prompts, shared_targets="text", batch=1, steps=8, eval_every=8)
    plain = run_distill(base, models=(cloud, edge))["shared"]
    kw = dict(shared_targets="text", batch=1, steps=8, eval_every=8, synthetic_dir=str(tmp_path / "keep"))
    named = run_distill(_cfg(tmp_path / "r", prompts, reply_sources=["p0", "p1", "p2", "p3", "p4", "p5"], **kw),
                        models=(cloud, edge))["shared"]
    info = named["shared_prefix"]
    held = set(info["held_out_prompts"])
    # every training prompt (never a held-out one) has its reply; the held-out KL is the text recipe's measure
    assert info["reply_samples"] == len(TOPICS) - len(held)
    assert named["synthetic_samples"] == 2 * len(TOPICS) - len(held)
    assert info["initial_held_out_kl"] == pytest.approx(plain["shared_prefix"]["initial_held_out_kl"])
    assert named["log"][-1]["held_out_kl"] != pytest.approx(plain["log"][-1]["held_out_kl"])  # replies trained
    # a record whose labels are an empty list has none (the MMLU-format prompts of the real sets)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(prompts.read_text() + json.dumps({"name": "p6", "system_prompt": "System: a note. " * 3,
                                                       "labels": []}) + "\n")
    assert sorted(prompt_labels(str(empty), required=False)) == [f"p{i}" for i in range(len(TOPICS))]
    with pytest.raises(EdgeKVError, match="7: shared_targets labels needs 'labels'"):
        prompt_labels(str(empty))
    # a source not named adds nothing; a rerun reads every target back (text and replies) and trains the same
    other = run_distill(_cfg(tmp_path / "o", prompts, reply_sources=["sharegpt"], **kw), models=(cloud, edge))["shared"]
    assert other["shared_prefix"]["reply_samples"] == 0
    assert other["log"][-1]["held_out_kl"] == pytest.approx(plain["log"][-1]["held_out_kl"])
    again = run_distill(_cfg(tmp_path / "r2", prompts, reply_sources=["p0", "p1", "p2", "p3", "p4", "p5"], **kw),
                        models=(cloud, edge))["shared"]
    assert again["targets_read_back"] == 2 * len(TOPICS) - len(held)
    assert again["log"][-1]["held_out_kl"] == named["log"][-1]["held_out_kl"]
    # replies cut shorter are new targets beside the kept ones (only the text is read back), and the manifest says so
    short = run_distill(_cfg(tmp_path / "r3", prompts, reply_sources=["p0", "p1", "p2", "p3", "p4", "p5"],
                             label_tokens=2, **kw), models=(cloud, edge))["shared"]
    assert short["targets_read_back"] == len(TOPICS)
    assert short["shared_prefix"]["label_tokens"] == 2 and "label_tokens" not in info
    with pytest.raises(EdgeKVError, match="adds replies to text targets"):
        _cfg(tmp_path / "b", prompts, shared_targets="teacher", reply_sources=["sharegpt"]).validate()


def test_reply_weight_splits_a_conversations_step_between_its_text_and_its_replies(pair, prompts, tmp_path):
    cloud, edge = pair
    kw = dict(shared_targets="text", batch=1, steps=8, eval_every=4, synthetic_dir=str(tmp_path / "keep"))
    names = [f"p{i}" for i in range(len(TOPICS))]

    def kls(name: str, **more) -> list[float]:
        report = run_distill(_cfg(tmp_path / name, prompts, **kw, **more), models=(cloud, edge))["shared"]
        return [e["held_out_kl"] for e in report["log"] if "held_out_kl" in e]

    plain, equal = kls("plain"), kls("equal", reply_sources=names)
    # w = 0: the replies are read but weigh nothing, so it trains exactly as the text alone
    assert kls("w0", reply_sources=names, reply_weight=0.0) == plain
    # w = 0.5 with one reply a conversation is the equal average; w = 1 trains on the replies alone
    assert kls("w05", reply_sources=names, reply_weight=0.5) == pytest.approx(equal, rel=1e-6)
    alone = kls("w1", reply_sources=names, reply_weight=1.0)
    assert alone[1:] != pytest.approx(plain[1:]) and alone[1:] != pytest.approx(equal[1:])
    for bad in (dict(reply_weight=0.5), dict(reply_sources=names, reply_weight=1.5)):
        with pytest.raises(EdgeKVError, match="--reply-weight weighs"):
            _cfg(tmp_path / "b", prompts, **kw, **bad).validate()


def test_reply_step_weight_scales_only_the_conversations_steps(pair, prompts, tmp_path):
    cloud, edge = pair
    kw = dict(shared_targets="text", batch=1, steps=6, eval_every=3, synthetic_dir=str(tmp_path / "keep"))
    names = [f"p{i}" for i in range(len(TOPICS))]

    def run(name: str, **more) -> dict:
        return run_distill(_cfg(tmp_path / name, prompts, **kw, **more), models=(cloud, edge))["shared"]

    def kls(report: dict) -> list[float]:
        return [e["held_out_kl"] for e in report["log"] if "held_out_kl" in e]

    base = run("base", reply_sources=names, reply_weight=1.0)
    one = run("one", reply_sources=names, reply_weight=1.0, reply_step_weight=1.0)
    quarter = run("quarter", reply_sources=names, reply_weight=1.0, reply_step_weight=0.25)
    assert kls(one) == kls(base)  # 1 is the unset weight exactly
    # every training prompt is a conversation here: the first step, from the same start, is a quarter of the loss
    first = [next(e["train_loss"] for e in r["log"] if e["step"] == 1) for r in (base, quarter)]
    assert first[1] == pytest.approx(0.25 * first[0], rel=1e-6)
    assert kls(quarter)[1:] != pytest.approx(kls(base)[1:])
    assert quarter["shared_prefix"]["reply_step_weight"] == 0.25
    # a prompt that is not a named conversation keeps its whole step
    none_named = run("none", reply_sources=["sharegpt"], reply_step_weight=0.1)
    assert kls(none_named) == kls(run("plain"))
    for bad in (dict(reply_step_weight=0.5), dict(reply_sources=names, reply_step_weight=0.0)):
        with pytest.raises(EdgeKVError, match="--reply-step-weight scales"):
            _cfg(tmp_path / "b", prompts, **kw, **bad).validate()


def test_keep_last_exports_the_state_training_ended_on(pair, prompts, tmp_path):
    cloud, edge = pair
    ended = run_distill(_cfg(tmp_path / "a", prompts), models=(cloud, edge))["shared"]  # 12 steps
    early = run_distill(_cfg(tmp_path / "e", prompts, steps=4), models=(cloud, edge))["shared"]
    # a finished 12-step checkpoint whose best state is another run's step 4, so best and last differ for sure
    for name in ("b", "l"):
        shutil.copytree(tmp_path / "a" / "s" / "train", tmp_path / name / "s" / "train")
        for f in ("best.safetensors", "best.json"):
            shutil.copy(tmp_path / "e" / "s" / "train" / f, tmp_path / name / "s" / "train" / f)
    best = run_distill(_cfg(tmp_path / "b", prompts), models=(cloud, edge))["shared"]
    last = run_distill(_cfg(tmp_path / "l", prompts, keep="last"), models=(cloud, edge))["shared"]
    assert best["shared_prefix"]["best_step"] == 4 and "keep" not in best["shared_prefix"]
    s = last["shared_prefix"]  # no step trained again: the log is the finished run's
    assert s["keep"] == "last" and s["best_step"] == s["steps"] == 12 and last["log"] == ended["log"]
    assert s["held_out_kl"] == ended["log"][-1]["held_out_kl"]
    state = load_file(str(tmp_path / "l" / "s" / "train" / "state.safetensors"))
    names = sorted(f"{i}.{kv}" for i in range(edge.num_layers) for kv in "kv")  # Student.parameters' order
    a, b, e = (SharedPrefix(r["out"], edge) for r in (last, best, early))
    for i in range(edge.num_layers):
        k = state[f"param.{names.index(f'{i}.k')}"]
        assert torch.equal(a.prefix.layer(i)[0], k.reshape(a.prefix.layer(i)[0].shape))
        assert torch.equal(b.prefix.layer(i)[0], e.prefix.layer(i)[0])
        assert not torch.equal(a.prefix.layer(i)[0], b.prefix.layer(i)[0])
    with pytest.raises(EdgeKVError, match="--keep must be best or last"):
        _cfg(tmp_path / "c", prompts, keep="first").validate()


def test_a_finished_constant_run_resumes_into_a_decay_of_its_own_last_stretch(pair, prompts, tmp_path):
    """--lr-decay-from D: a constant run's D-step checkpoint, resumed with --lr-schedule cosine to 2D, ends where
    the same recipe run from scratch ends (the steps before D are the constant run's); the manifest records both."""
    cloud, edge = pair
    run_distill(_cfg(tmp_path / "a", prompts, steps=4, keep="last"), models=(cloud, edge))
    shutil.copytree(tmp_path / "a" / "s" / "train", tmp_path / "r" / "s" / "train")
    decay = dict(steps=8, lr_schedule="cosine", lr_decay_from=4, keep="last")
    resumed = run_distill(_cfg(tmp_path / "r", prompts, **decay), models=(cloud, edge))["shared"]
    straight = run_distill(_cfg(tmp_path / "s", prompts, **decay), models=(cloud, edge))["shared"]
    constant = run_distill(_cfg(tmp_path / "c", prompts, steps=8, keep="last"), models=(cloud, edge))["shared"]
    info = resumed["shared_prefix"]
    assert (info["lr_schedule"], info["lr_decay_from"], info["steps"]) == ("cosine", 4, 8)
    assert "lr_schedule" not in constant["shared_prefix"] and "lr_decay_from" not in constant["shared_prefix"]
    a, b, c = (SharedPrefix(r["out"], edge) for r in (resumed, straight, constant))
    for i in range(edge.num_layers):
        assert torch.equal(a.prefix.layer(i)[0], b.prefix.layer(i)[0])
        assert not torch.equal(a.prefix.layer(i)[0], c.prefix.layer(i)[0])


def test_a_warm_start_goes_on_from_where_a_trained_prefix_ended(pair, prompts, tmp_path):
    """--shared-start: step 0 is the start's KV exactly (no step exports it unchanged; on the same held-out prompts
    its first held-out KL is the start's last), the manifest records the start; another K is refused."""
    cloud, edge = pair
    done = run_distill(_cfg(tmp_path / "a", prompts, steps=4, keep="last"), models=(cloud, edge))["shared"]
    start = SharedPrefix(done["out"], edge)
    kept = run_distill(_cfg(tmp_path / "k", prompts, steps=0, keep="last", shared_start=done["out"]),
                       models=(cloud, edge))["shared"]
    went_on = run_distill(_cfg(tmp_path / "w", prompts, steps=4, keep="last", shared_start=done["out"]),
                          models=(cloud, edge))["shared"]
    assert went_on["shared_prefix"]["initial_held_out_kl"] == done["shared_prefix"]["held_out_kl"]
    assert went_on["shared_prefix"]["started_from"] == start.describe()
    assert "started_from" not in done["shared_prefix"]
    a, b = SharedPrefix(kept["out"], edge), SharedPrefix(went_on["out"], edge)
    assert a.manifest["system_prompt"] == start.manifest["system_prompt"]  # the start's K token ids
    for i in range(edge.num_layers):
        assert torch.equal(a.prefix.layer(i)[0], start.prefix.layer(i)[0])
        assert torch.equal(a.prefix.layer(i)[1], start.prefix.layer(i)[1])
        assert not torch.equal(b.prefix.layer(i)[0], start.prefix.layer(i)[0])
    with pytest.raises(EdgeKVError, match="holds K = 6 tokens, --shared-tokens says 4"):
        run_distill(_cfg(tmp_path / "m", prompts, shared_tokens=4, shared_start=done["out"]), models=(cloud, edge))
    assert not (tmp_path / "m" / "s" / "synthetic").exists()  # refused before the teacher read a prompt
    with pytest.raises(EdgeKVError, match="--shared-start is where --train-shared starts from"):
        _cfg(tmp_path / "n", prompts, train_shared=False, shared_start=done["out"]).validate()


def test_copy_spans_finds_where_a_reference_repeats_its_prompt(tmp_path, monkeypatch):
    """bench.copy_spans: the share of tokens inside repeated n-grams and where they first sit; a missing rows file is
    one line on the command line, nothing written."""
    from bench.copy_spans import covered, main, ngrams

    prompt = list(range(100, 140))
    reference = [1, 2] + prompt[20:30] + [3, 4, 5, 6]  # a 10-token span from position 20, 16 tokens in all
    grams = ngrams(prompt, 8)
    assert grams[tuple(prompt[20:28])] == 20
    assert covered(reference, grams, 8) == pytest.approx(10 / 16)
    assert covered(reference[:9], grams, 8) == 0.0  # 7 tokens of the span make no 8-gram
    assert covered([], grams, 8) == 0.0
    monkeypatch.setattr("sys.argv", ["x", str(tmp_path / "missing.jsonl"), str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="^error: .*missing.jsonl"):
        main()
    assert not (tmp_path / "o").exists()
