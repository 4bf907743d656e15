"""`edgekv distill` on tiny models: the student starts as EdgePrompt exactly, learns, resumes bit-exactly, ships as
an ordinary export refused for another edge, and the self-teacher path never loads the cloud; the batched teacher
gives what one request at a time gives (float32), its on-policy samples are seeded and resumable, a frozen
first token keeps its KV bit for bit, a student trained through its codec ships the KV it was trained on, and a
training batch read in one packed forward gives what one forward per sequence gives."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import (
    PrefixKV,
    continuation_logits,
    continuation_nll,
    packed_continuation_logits,
    prefix_kv,
)
from edgekv.distill import distill_job
from edgekv.distill import student as student_module
from edgekv.distill.distill_job import DistillConfig, run_distill
from edgekv.distill.student import initial_student, sample_losses, select_tokens
from edgekv.distill.teacher import RECALL, RECALL_FORMAT, SEED_PROMPTS, BatchedTeacher, Sample, plan_seeds, synthesize
from edgekv.kv.cloud_kv import same_model_layers
from edgekv.kv.encode import coded
from edgekv.kv.export import KVExport, KVStoreError
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.loading import load_model
from edgekv.models.targets import topk_kl
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from tests.helpers import PROMPT, make_export

runner = CliRunner()
INSTRUCTIONS = ["\nSay what the text above is about.\nAnswer:", "\nContinue the text above.\n"]


@pytest.fixture(scope="module")
def pair(tiny_models):
    return load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")


def _cfg(tmp_path, **kw) -> DistillConfig:
    base = dict(out=str(tmp_path / "d"), system_prompt=PROMPT, dtype="float32", instructions=INSTRUCTIONS,
                queries=4, max_answer_tokens=12, steps=12, lr=0.05, eval_every=2, patience=50, quant="fp32")
    return DistillConfig(**{**base, **kw})


def test_select_tokens_rules():
    assert select_tokens(10, 10, "first")[0].tolist() == list(range(10))
    assert select_tokens(10, 3, "first") [1] == 3
    idx, nxt = select_tokens(10, 4, "even")
    assert idx.tolist() == [0, 3, 6, 9] and nxt == 10
    with pytest.raises(EdgeKVError, match="--length"):
        select_tokens(10, 11, "first")


def test_step_zero_is_edgeprompt_exactly(pair, tiny_models, tmp_path):
    cloud, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    student, index = initial_student(edge, ids, ids.numel(), "all")
    own = prefix_kv(edge.model, ids)
    for i, (k, v) in enumerate(own):
        got_k, got_v = student.prefix().layer(i)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # the 0-step export answers as EdgePrompt's own export does, token for token
    run_distill(_cfg(tmp_path, steps=0), models=(cloud, edge))
    ref = make_export(tiny_models["edge"], tmp_path / "ep", start_layer=0, system=PROMPT)
    params = SamplingParams(max_new_tokens=12)
    distilled = EdgeSession(edge, str(tmp_path / "d" / "prompt" / "kv"), cache_dir=tmp_path / "c")
    got = distilled.complete("User: hi", params)
    want = EdgeSession(edge, str(ref), cache_dir=tmp_path / "c2").complete("User: hi", params)
    assert got.token_ids == want.token_ids


def test_training_lowers_held_out_kl_and_ships_a_shorter_export(pair, tmp_path):
    cloud, edge = pair
    summary = run_distill(_cfg(tmp_path, compress=4, steps=16), models=(cloud, edge))
    report = summary["reports"]["prompt"]
    d = report["distilled"]
    assert d["held_out_kl"] < d["initial_held_out_kl"]  # the cloud's answers are better predicted
    export = KVExport(report["out"])
    n = export.manifest["system_prompt"]["num_tokens"]
    assert export.manifest["kv_tokens"] == -(-n // 4) and export.manifest["distilled"]["teacher"] == "cloud"
    assert (tmp_path / "d" / "prompt" / "loss_curve.png").stat().st_size > 0
    # served: the session holds P' tokens and continues at P' (rule first)
    session = EdgeSession(edge, report["out"], cache_dir=tmp_path / "c")
    assert session.system.prefix_len == export.manifest["kv_tokens"] == session.system.next_position
    assert session.complete("User: hi", SamplingParams(max_new_tokens=4)).finish_reason in ("length", "stop")


def test_resume_is_bit_exact(pair, tmp_path):
    cloud, edge = pair
    straight = run_distill(_cfg(tmp_path / "a", steps=8), models=(cloud, edge))["reports"]["prompt"]
    run_distill(_cfg(tmp_path / "b", steps=4), models=(cloud, edge))
    (tmp_path / "b" / "d" / "prompt" / "report.json").unlink()  # not done: the next run goes on from step 4
    again = run_distill(_cfg(tmp_path / "b", steps=8), models=(cloud, edge))["reports"]["prompt"]
    assert again["distilled"]["held_out_kl"] == straight["distilled"]["held_out_kl"]
    a = KVExport(straight["out"])
    b = KVExport(again["out"])
    for i in a.layer_indices:
        for name, t in a.layer(i).items():
            assert torch.equal(t, b.layer(i)[name])


def test_export_is_refused_for_another_edge(pair, tiny_models, tmp_path):
    cloud, edge = pair
    report = run_distill(_cfg(tmp_path, steps=2), models=(cloud, edge))["reports"]["prompt"]
    other = load_model(tiny_models["cloud"], "float32")
    with pytest.raises(KVStoreError, match="another"):
        EdgeSession(other, report["out"], cache_dir=tmp_path / "c")


def test_self_teacher_never_loads_the_cloud(tiny_models, tmp_path, monkeypatch):
    loaded = []
    real = distill_job.load_model
    monkeypatch.setattr(distill_job, "load_model", lambda spec, *a, **k: loaded.append(spec) or real(spec, *a, **k))
    cfg = _cfg(tmp_path, teacher="self", compress=4, steps=2, edge=tiny_models["edge"], cloud=tiny_models["cloud"])
    report = run_distill(cfg)["reports"]["prompt"]
    assert loaded == [tiny_models["edge"]]
    assert report["distilled"]["teacher"] == "self"


def test_distilled_prefix_is_differentiable(pair):
    _, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    student, _ = initial_student(edge, ids, 8, "first")
    for t in student.parameters():
        t.requires_grad_(True)
    nll = continuation_nll(edge.model, student.prefix(), ids[8:12], ids[12:20])
    nll.backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in student.parameters())
    assert isinstance(student.prefix(), PrefixKV)


def test_packed_sample_losses_equal_one_sequence_at_a_time(pair, monkeypatch):
    """The training batch read after the student in one packed forward (relay attention) gives each sequence's
    logits, loss and gradient as a forward of that sequence alone on stock attention does (float32)."""
    _, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    student, _ = initial_student(edge, ids, 8, "first")
    for t in student.parameters():
        t.requires_grad_(True)
    seqs = [ids[8:12], ids[12:13], ids[12:21], ids[9:11]]  # lengths 4, 1, 9, 2: a one-token row decodes
    with torch.no_grad():
        packed = packed_continuation_logits(edge.model, student.prefix(), seqs)
        for seq, got in zip(seqs, packed):
            torch.testing.assert_close(got, continuation_logits(edge.model, student.prefix(), seq),
                                       atol=1e-4, rtol=1e-4)
    vocab = packed[0].shape[-1]
    # each sample's user + answer[:-1] is one of `seqs` (the one-token one included)
    samples = [Sample("x", seq[:1], torch.cat([seq[1:], seq[:1]])) for seq in seqs]
    for n, (s, seq) in enumerate(zip(samples, seqs)):  # any targets: the losses are compared, not judged
        g = torch.Generator().manual_seed(n)
        s.top_ids = torch.stack([torch.randperm(vocab, generator=g)[:5] for _ in range(seq.numel())])
        s.top_logp = torch.log_softmax(torch.randn(seq.numel(), 6, generator=g), -1)[:, :5]
    together = sum(sample_losses(edge, student.prefix(), samples, query_loss=True))
    grads_packed = torch.autograd.grad(together, student.parameters())
    alone = sum(topk_kl(continuation_logits(edge.model, student.prefix(), seq), s.top_ids, s.top_logp)
                for s, seq in zip(samples, seqs))
    grads_alone = torch.autograd.grad(alone, student.parameters())
    assert float(together.detach()) > 0
    monkeypatch.setattr(student_module, "PACK_TOKENS", 5)  # packs of 4 + 1, 9 and 2 tokens
    with torch.no_grad():
        torch.testing.assert_close(sum(sample_losses(edge, student.prefix(), samples, query_loss=True)),
                                   together.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert all(b.abs().sum() > 0 for b in grads_alone)  # every layer's KV gets a gradient: the check is not empty
    for a, b in zip(grads_packed, grads_alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("args,message", [
    (["--system-prompt", " "], "empty"),
    (["--system-prompt", "short", "--length", "999"], "beyond"),
    (["--system-prompt", "x" * 600], "context"),
    (["--system-prompt", "hello", "--teacher", "oracle"], "--teacher"),
    (["--system-prompt", "hello", "--seeds", "question,gossip"], "gossip"),
    (["--system-prompt", "hello", "--on-policy", "1.5"], "on_policy"),
    (["--system-prompt", "hello", "--quant", "int3", "--train-codec"], "unknown --quant 'int3'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_models, tmp_path, args, message):
    out = tmp_path / "d"
    result = runner.invoke(app, ["distill", *args, "--out", str(out), "--edge", tiny_models["edge"], "--cloud",
                                 tiny_models["cloud"], "--dtype", "float32", "--steps", "1", "--queries", "2"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert len(errors) == 1 and message in errors[0]
    assert not list(out.glob("*/kv/manifest.json"))


def test_tokenizer_mismatch_is_refused(tiny_models, tmp_path):
    result = runner.invoke(app, ["distill", "--system-prompt", "hello there", "--out", str(tmp_path / "d"),
                                 "--edge", tiny_models["edge"], "--cloud", tiny_models["edge_other_tokenizer"],
                                 "--dtype", "float32"])
    assert result.exit_code != 0 and "Traceback" not in result.output and "tokenizer" in result.output.lower()


def test_prompts_file_is_resumable_and_skips_failures(pair, tmp_path):
    cloud, edge = pair
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"name": "a", "system_prompt": PROMPT}) + "\n"
                    + json.dumps({"name": "b", "system_prompt": "x" * 600}) + "\n")
    cfg = _cfg(tmp_path, system_prompt=None, prompts=str(path), steps=2)
    summary = run_distill(cfg, models=(cloud, edge))
    assert summary["done"] == 1 and "context" in summary["failed"]["b"]
    assert not (tmp_path / "d" / "b" / "kv").exists()
    mtime = (tmp_path / "d" / "a" / "kv" / "manifest.json").stat().st_mtime
    run_distill(cfg, models=(cloud, edge))
    assert (tmp_path / "d" / "a" / "kv" / "manifest.json").stat().st_mtime == mtime  # done prompts are skipped


def _two_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"name": "a", "system_prompt": PROMPT}) + "\n"
                    + json.dumps({"name": "b", "system_prompt": PROMPT[::-1]}) + "\n")
    return str(path)


def test_prompts_go_to_a_catalog_once(pair, tmp_path):
    """Each finished export is also a catalog entry (keyed by what determines it); a rerun adds nothing."""
    from edgekv.kv.catalog import Catalog

    cfg = _cfg(tmp_path, system_prompt=None, prompts=_two_prompts(tmp_path), steps=2, catalog=str(tmp_path / "cat"))
    run_distill(cfg, models=pair)
    rows = Catalog(cfg.catalog).entries()
    assert sorted(r["name"] for r in rows) == ["a", "b"] and len({r["key"] for r in rows}) == 2
    for r in rows:  # the entry is the export, verified like any export
        KVExport(str(tmp_path / "cat" / r["key"])).verify_all()
    run_distill(cfg, models=pair)
    assert Catalog(cfg.catalog).entries() == rows
    other = _cfg(tmp_path, system_prompt=None, prompts=_two_prompts(tmp_path), steps=3, out=str(tmp_path / "d3"),
                 catalog=str(tmp_path / "cat"))
    run_distill(other, models=pair)  # another recipe is another key, never an overwrite
    assert len(Catalog(cfg.catalog).entries()) == 4


@pytest.mark.slow
def test_distill_on_ray_equals_in_process(tiny_models, tmp_path):
    """A local Ray cluster (2 actors, each loading both models once): the same exports as in this process."""
    base = dict(system_prompt=None, prompts=_two_prompts(tmp_path), steps=4, cloud=tiny_models["cloud"],
                edge=tiny_models["edge"])
    here = run_distill(_cfg(tmp_path, out=str(tmp_path / "here"), **base))
    there = run_distill(_cfg(tmp_path, out=str(tmp_path / "there"), ray="", workers=2, **base))
    assert there["done"] == 2 and not there["failed"]
    from safetensors.torch import load_file

    for name in ("a", "b"):  # Ray's actors run other thread counts: sums may differ in the last bits
        mine = load_file(str(tmp_path / "here" / name / "synthetic.safetensors"))
        theirs = load_file(str(tmp_path / "there" / name / "synthetic.safetensors"))
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if k.endswith((".user", ".answer")))
        assert here["reports"][name]["distilled"]["held_out_kl"] == pytest.approx(
            there["reports"][name]["distilled"]["held_out_kl"], rel=1e-4)
        a, b = KVExport(str(tmp_path / "here" / name / "kv")), KVExport(str(tmp_path / "there" / name / "kv"))
        assert a.layer_indices == b.layer_indices
        for i in a.layer_indices:
            for key, t in a.layer(i).items():
                torch.testing.assert_close(t, b.layer(i)[key], atol=1e-4, rtol=1e-4)


def test_the_planner_takes_distilled_exports_as_candidates(pair, tmp_path):
    """A distilled export is a candidate like any other (the planner reads its layers and bytes): every layer
    shipped from the cloud side, and a P/2 student half the bytes, picked on a slow link when within budget."""
    from edgekv.eval.network import candidate_from_export, plan, predict
    from edgekv.serve.pipeline import Link
    from tests.test_network import _profile

    run_distill(_cfg(tmp_path, steps=1, out=str(tmp_path / "full")), models=pair)
    run_distill(_cfg(tmp_path, steps=1, compress=2, out=str(tmp_path / "half")), models=pair)
    full = candidate_from_export(str(tmp_path / "full" / "prompt" / "kv"), "ce-lslm-distill", 0.01)
    half = candidate_from_export(str(tmp_path / "half" / "prompt" / "kv"), "ce-lslm-distill", 0.015,
                                 source="ce-lslm-distill@c2")
    assert full.start_layer == half.start_layer == 0 and set(full.layer_bytes) == set(range(3))
    p = json.loads((tmp_path / "full" / "prompt" / "kv" / "manifest.json").read_text())["kv_tokens"]
    assert (full.label, half.label) == (f"ce-lslm-distill P'={p} fp32", f"ce-lslm-distill@c2 P'={-(-p // 2)} fp32")
    assert half.bytes < 0.6 * full.bytes
    slow = Link(0.01, 20.0)  # 10 kbit/s: bytes decide
    assert predict(half, _profile(), slow) < predict(full, _profile(), slow)
    assert plan([full, half], _profile(), slow, max_quality_loss=0.02)[0] is half
    assert plan([full, half], _profile(), slow, max_quality_loss=0.012)[0] is full  # the budget rules half out


# ------------------------------------------------------------------------------------------- the batched teacher


def test_batched_teacher_equals_one_at_a_time(pair):
    """Eight sampled answers decoded together over one prefill = each alone on stock attention (the session's
    one-request path), token for token, and the targets kept while decoding = a separate scoring pass (float32)."""
    cloud, _ = pair
    tok = cloud.tokenizer
    system = torch.tensor(tok(PROMPT)["input_ids"])
    users = [torch.tensor(tok(f"\nQuestion {n}: what is cached?\nAnswer:", add_special_tokens=False)["input_ids"])
             for n in range(8)]
    seeds = [11 * n + 3 for n in range(8)]
    teacher = BatchedTeacher.of_prompt(cloud, system, max_batch=8)
    batched = teacher.generate(users, 10, 0.9, seeds, top_k=16)
    alone = EdgeSession(cloud, system_prompt=PROMPT)
    for user, seed, got in zip(users, seeds, batched):
        want = alone.complete(user, SamplingParams(10, 0.9, 1.0, seed))
        assert got.token_ids == want.token_ids and got.token_ids
        answer = torch.tensor(got.token_ids)
        with torch.no_grad():
            logits = continuation_logits(cloud.model, alone.system, torch.cat([user, answer[:-1]]))
        logp, ids = torch.log_softmax(logits.float(), -1).topk(16, dim=-1)
        assert got.targets[0].shape == (user.numel() + answer.numel() - 1, 16)
        assert torch.equal(got.targets[1], ids)
        torch.testing.assert_close(got.targets[0], logp, atol=1e-4, rtol=1e-4)
    # scoring a given answer in one batched pass gives the same targets as the ones kept while decoding
    samples = [Sample("x", u, torch.tensor(r.token_ids)) for u, r in zip(users, batched)]
    teacher.score(samples, 16)
    for s, r in zip(samples, batched):
        assert torch.equal(s.top_ids, r.targets[1])
        torch.testing.assert_close(s.top_logp, r.targets[0], atol=1e-4, rtol=1e-4)


def test_the_teacher_writes_queries_from_seed_types(pair):
    """Written queries come from every seed type in turn, put in the answer format; `instruction` is the fixed list;
    the same seed writes the same queries; a query answered in the same loop as it is written gets the answer (and
    targets) it gets alone."""
    cloud, _ = pair
    system = torch.tensor(cloud.tokenizer(PROMPT)["input_ids"])
    teacher = BatchedTeacher.of_prompt(cloud, system)
    plan = plan_seeds(["question", "creative", "instruction"], 6)
    assert plan == ["question", "creative", "instruction"] * 2
    args = (teacher, system, plan, [True] * 6, SEED_PROMPTS, INSTRUCTIONS, "\nQ: {query}\nA:", 16, 8, 1.0, 10, 0.9,
            16, 5)
    _, left = synthesize(*args)
    assert [(k, u.tolist()) for k, u in left] == [(k, u.tolist()) for k, u in synthesize(*args)[1]]
    kinds = [k for k, _ in left]
    assert kinds.count("instruction:0") == 1 and kinds.count("instruction:1") == 1
    for kind, user in left:
        text = cloud.tokenizer.decode(user)
        if not kind.startswith("instruction"):
            assert kind in ("question", "creative") and text.startswith("\nQ: ") and text.endswith("\nA:")
    # the teacher answering each query as it is written: the loop at batch 64 = the same loop one request at a time
    together, _ = synthesize(teacher, system, plan, [False] * 6, *args[4:])
    alone, _ = synthesize(BatchedTeacher.of_prompt(cloud, system, max_batch=1), system, plan, [False] * 6, *args[4:])
    assert len(together) == len(alone) >= 1
    for a, b in zip(together, alone):
        assert (a.seed, a.user.tolist(), a.answer.tolist()) == (b.seed, b.user.tolist(), b.answer.tolist())
        assert a.top_ids.shape[0] == a.user.numel() + a.answer.numel() - 1 and torch.equal(a.top_ids, b.top_ids)
        torch.testing.assert_close(a.top_logp, b.top_logp, atol=1e-4, rtol=1e-4)


def test_recall_quotes_a_window_of_the_prompt_and_the_teacher_goes_on(pair, tmp_path):
    """`recall` (issue 37): the user message is RECALL_FORMAT around the head of a random window of the prompt, no
    query is written for it, and the teacher's answer to it is a sample with targets; a distill run takes the type."""
    cloud, _ = pair
    system = torch.tensor(cloud.tokenizer(PROMPT)["input_ids"])
    teacher = BatchedTeacher.of_prompt(cloud, system)
    plan = plan_seeds(["recall", "question"], 4)
    samples, left = synthesize(teacher, system, plan, [False, True, False, True], SEED_PROMPTS, INSTRUCTIONS,
                               "\nQ: {query}\nA:", 16, 8, 1.0, 10, 0.9, 16, 5)
    recalled = [s for s in samples if s.seed == RECALL]
    assert len(recalled) == 2 and all(k == "question" for k, _ in left)
    prefix, suffix = RECALL_FORMAT.split("{head}")
    for s in recalled:
        text = cloud.tokenizer.decode(s.user)
        assert text.startswith(prefix) and text.endswith(suffix)
        head = text[len(prefix):-len(suffix)]
        assert head and head in cloud.tokenizer.decode(system, skip_special_tokens=True)
        assert s.top_ids.shape[0] == s.user.numel() + s.answer.numel() - 1
    run_distill(_cfg(tmp_path, seeds=["recall", "instruction"], queries=4, steps=1), models=pair)
    meta = json.loads((tmp_path / "d" / "prompt" / "synthetic.json").read_text())
    assert "recall" in meta["seed"] and meta["written"] == 0


def test_on_policy_samples_are_seeded_scored_and_resumable(pair, tmp_path):
    """With on_policy 0.5 half the answers are the student's, each scored by the teacher (its targets = the
    teacher reading that answer); two runs draw the same set, and a resumed run reads it back bit for bit."""
    from safetensors.torch import load_file

    cloud, edge = pair
    kw = dict(queries=6, seeds=["question", "instruction"], on_policy=0.5, steps=4)
    a = run_distill(_cfg(tmp_path / "a", **kw), models=pair)["reports"]["prompt"]["distilled"]
    assert a["on_policy_samples"] >= 1
    first = load_file(str(tmp_path / "a" / "d" / "prompt" / "synthetic.safetensors"))
    meta = json.loads((tmp_path / "a" / "d" / "prompt" / "synthetic.json").read_text())
    assert "student" in meta["policy"] and "teacher" in meta["policy"]
    run_distill(_cfg(tmp_path / "b", **kw), models=pair)
    again = load_file(str(tmp_path / "b" / "d" / "prompt" / "synthetic.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    # resumed: the report goes, the set and the checkpoint stay; the run reads the set back and ends where it was
    (tmp_path / "a" / "d" / "prompt" / "report.json").unlink()
    b = run_distill(_cfg(tmp_path / "a", **kw), models=pair)["reports"]["prompt"]["distilled"]
    assert b["held_out_kl"] == a["held_out_kl"]
    n = meta["policy"].index("student")
    user, answer = first[f"{n}.user"], first[f"{n}.answer"]
    ids = torch.tensor(cloud.tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        logits = continuation_logits(cloud.model, PrefixKV.of_model(cloud.model, ids), torch.cat([user, answer[:-1]]))
    assert torch.equal(first[f"{n}.top_ids"], torch.log_softmax(logits.float(), -1).topk(64, dim=-1)[1])


def test_students_of_other_lengths_reuse_the_teachers_share(pair, tmp_path):
    """Two on-policy students of one prompt (P' = P, then P/2) in one synthetic root: the second reads the teacher's
    share back instead of making it again, and its set is bit for bit the one it makes with nothing kept."""
    from safetensors.torch import load_file

    kw = dict(queries=6, seeds=["question", "instruction"], on_policy=0.5, steps=2)
    shared, alone = str(tmp_path / "shared"), str(tmp_path / "alone")
    run_distill(_cfg(tmp_path / "full", synthetic_dir=shared, **kw), models=pair)
    first = load_file(str(tmp_path / "shared" / "prompt" / "synthetic.safetensors"))
    run_distill(_cfg(tmp_path / "half", synthetic_dir=shared, compress=2, **kw), models=pair)
    meta = json.loads((tmp_path / "shared" / "prompt" / "synthetic.json").read_text())
    reused = load_file(str(tmp_path / "shared" / "prompt" / "synthetic.safetensors"))
    run_distill(_cfg(tmp_path / "fresh", synthetic_dir=alone, compress=2, **kw), models=pair)
    fresh = load_file(str(tmp_path / "alone" / "prompt" / "synthetic.safetensors"))
    assert meta["teacher_part_read_back"] and meta["teach_s"] > 0
    assert reused.keys() == fresh.keys() and all(torch.equal(reused[k], fresh[k]) for k in fresh)
    n_teacher = meta["policy"].index("student")  # the teacher's samples come first, the same for both students
    same = [f"{n}.{x}" for n in range(n_teacher) for x in ("user", "answer", "top_ids", "top_logp")]
    assert all(torch.equal(first[k], reused[k]) for k in same)


def test_first_token_freeze_keeps_its_kv_bit_equal(pair, tmp_path):
    """freeze_first 1: after training every layer's first token is the edge's own KV bit for bit, the rest moved;
    step 0 is still EdgePrompt exactly."""
    cloud, edge = pair
    report = run_distill(_cfg(tmp_path, freeze_first=1, steps=6, batch=2, query_loss=True), models=pair)
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    own = prefix_kv(edge.model, ids)
    served = EdgeSession(edge, report["reports"]["prompt"]["out"], cache_dir=tmp_path / "c").system  # decoded (fp32)
    moved = False
    for i, (k, v) in enumerate(own):
        got_k, got_v = served.layer(i)
        assert torch.equal(got_k[:, :, :1], k[:, :, :1]) and torch.equal(got_v[:, :, :1], v[:, :, :1])
        moved |= not torch.equal(got_k[:, :, 1:], k[:, :, 1:])
    assert moved
    student, _ = initial_student(edge, ids, ids.numel(), "all", freeze_first=1)
    for i, (k, v) in enumerate(own):
        assert all(torch.equal(a, b) for a, b in zip(student.prefix().layer(i), (k, v)))


@pytest.mark.parametrize("bad", ["2/2", "1", "a/b", "-1/2"])
def test_sweep_shard_bad_input_is_one_line(bad):
    """`bench.distill_sweep --shard` takes I/N with 0 ≤ I < N; anything else is a one-line error, exit ≠ 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "bench.distill_sweep", "--report-only", f"--shard={bad}"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().startswith("error: --shard") and "\n" not in done.stderr.strip()


def test_a_student_trained_through_its_codec_ships_what_it_was_trained_on(pair, tmp_path):
    """train_codec: the edge reads the student through ThinK + int2 (straight-through: the float KV beneath gets the
    gradient as is), and the export decodes to exactly the coded KV of the kept float state."""
    cloud, edge = pair
    ids = torch.tensor(edge.tokenizer(PROMPT)["input_ids"])
    queries = same_model_layers(edge, ids, 0, 32, 0)
    codec = lambda i, k, v: coded(k, v, queries[i].q_obs, 0.3, "int2")  # noqa: E731
    student, _ = initial_student(edge, ids, ids.numel(), "all", codec=codec)
    for t in student.parameters():
        t.requires_grad_(True)
    k0, v0 = student.prefix().layer(0)
    want_k, want_v = codec(0, *(t[0] for t in student.layer(0)))
    assert torch.equal(k0[0], want_k) and torch.equal(v0[0], want_v) and not torch.equal(k0, student.layer(0)[0])
    (k0.sum() + 2 * v0.sum()).backward()
    assert torch.equal(student.tensors["0.k"].grad, torch.ones_like(k0))
    assert bool((student.tensors["0.v"].grad == 2).all())
    cfg = _cfg(tmp_path, quant="int2", prune_ratio=0.3, train_codec=True, steps=6)
    report = run_distill(cfg, models=pair)["reports"]["prompt"]
    assert report["distilled"]["train_codec"] is True
    kept = load_file(str(tmp_path / "d" / "prompt" / "train" / "best.safetensors"))
    export = KVExport(report["out"])
    for i in export.layer_indices:
        k, v = codec(i, kept[f"{i}.k"][0], kept[f"{i}.v"][0])
        got_k, got_v = edge_kv(decode_layer(export, i), edge.model)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert export.manifest["quant"] == "int2"
