"""serve-edge's engine and API on the real default edge (Qwen2.5-Coder 0.5B): batched decoding equals
one-at-a-time, and lm-evaluation-harness (`local-completions`) runs against it with local tasks; its
multiple-choice log-likelihoods equal edgekv's own option scoring."""

import json
import threading

import pytest
import torch

from edgekv.eval.datasets import load_requests
from edgekv.eval.metrics import option_choice
from edgekv.models.loading import load_model
from edgekv.serve.http_server import EdgeServer
from edgekv.serve.requests import GenRequest
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession

pytestmark = pytest.mark.slow
LETTERS = "ABCD"


@pytest.fixture(scope="module")
def edge():
    return load_model("default-edge", "float32")


@pytest.fixture(scope="module")
def mmlu(edge):
    """Eight MMLU questions of one subject: its dev shots are the system prompt."""
    rows = load_requests("mmlu", edge.tokenizer, 40, seed=0, mmlu_subjects=1)
    system = rows[0].system
    return system, [r for r in rows if r.system == system][:8]


def test_batched_greedy_equals_one_at_a_time_on_the_real_edge(edge, mmlu, tmp_path):
    system, rows = mmlu
    session = EdgeSession(edge, None, system, cache_dir=tmp_path)
    session.eos_ids = set()
    prompts = [r.user for r in rows[:4]] + ["Why?", rows[0].user + " Explain the answer in detail."]
    one = session.engine(max_batch=1)
    want = {p: one.generate(GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=12))).token_ids
            for p in prompts}
    one.close()
    engine = session.engine(max_batch=8)
    got = {}
    threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, engine.generate(GenRequest(
        session.encode_user(p), SamplingParams(max_new_tokens=12))).token_ids)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    assert got == want
    assert engine.stats["batched_tokens"] > engine.stats["steps"]


def test_lm_eval_local_completions_against_serve_edge(edge, mmlu, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    system, rows = mmlu
    data = tmp_path / "mmlu_local.jsonl"
    data.write_text("".join(json.dumps({"text": r.user, "answer": r.answer, "letter": LETTERS[r.answer]}) + "\n"
                            for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n" \
             "doc_to_text: \"{{text}}\"\n"
    (tmp_path / "edgekv_mmlu_mc.yaml").write_text(
        "task: edgekv_mmlu_mc\noutput_type: multiple_choice\n" + common +
        "doc_to_choice: [\" A\", \" B\", \" C\", \" D\"]\ntarget_delimiter: \"\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (tmp_path / "edgekv_mmlu_gen.yaml").write_text(
        "task: edgekv_mmlu_gen\noutput_type: generate_until\n" + common +
        "doc_to_target: \" {{letter}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    session = EdgeSession(edge, None, system, cache_dir=tmp_path)
    srv = EdgeServer(session, "127.0.0.1", 0, max_tokens_limit=64, name="edge-mmlu")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1/completions"
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=edge-mmlu,base_url={url},tokenizer={edge.tokenizer.name_or_path},"
                       "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,tokenized_requests=True",
            tasks=["edgekv_mmlu_mc", "edgekv_mmlu_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True, limit=None)
    finally:
        srv.server_close()
    assert out["results"]["edgekv_mmlu_gen"]["exact_match,none"] >= 0
    samples = sorted(out["samples"]["edgekv_mmlu_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(rows)
    worst = 0.0
    for s, r in zip(samples, rows):
        lm = [float(resp[0][0]) for resp in s["resps"]]  # one (loglikelihood, is_greedy) per option
        done = session.complete(r.user, SamplingParams(max_new_tokens=1))
        _, ours = option_choice(done.first_logits, edge.tokenizer, 4)
        worst = max(worst, max(abs(a - b) for a, b in zip(lm, ours)))
    print(f"lm-eval acc {out['results']['edgekv_mmlu_mc']['acc,none']:.3f}, exact_match "
          f"{out['results']['edgekv_mmlu_gen']['exact_match,none']:.3f}; max |Δ loglik| vs edgekv {worst:.2e}")
    assert worst < 1e-3  # float32, the same forward with all prompt logits kept vs the last one only
    gen = out["samples"]["edgekv_mmlu_gen"]
    assert len(gen) == len(rows) and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert torch.isfinite(torch.tensor(worst))
