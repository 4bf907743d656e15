"""`edgekv eval` on tiny models: every strategy × dataset fixture, resumption, metrics, bad input."""

import json
import math
import re
import shutil
import statistics
import warnings
from collections import Counter

import pytest
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.align.align_job import AlignConfig, run_align
from edgekv.eval.datasets import load_requests
from edgekv.eval.eval_config import EvalConfig
from edgekv.eval.eval_job import run_eval
from edgekv.eval.metrics import accuracy, lcs_length, rouge_l, upload_ratio
from edgekv.eval.runs import read_results
from tests.helpers import ARTICLE, byte_tokenizer, watch_rows

runner = CliRunner()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    xsum = root / "xsum.jsonl"
    xsum.write_text("".join(json.dumps({"id": str(i), "document": ARTICLE * (1 + i % 2) + f"Item {i}.",
                                        "summary": f"A cycle lane was approved, item {i}."}) + "\n" for i in range(4)))
    mmlu = root / "mmlu"
    mmlu.mkdir()
    rows = lambda op, n: [{"subject": "arithmetic", "question": f"What is {k} {op} {k}?",  # noqa: E731
                           "choices": [str(2 * k), str(k), str(k + 1), "0"], "answer": 0} for k in range(n)]
    (mmlu / "mmlu_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("plus", 3)))
    (mmlu / "mmlu_test_sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("+", 4)))
    share = root / "sharegpt.json"
    share.write_text(json.dumps([{"id": f"c{i}", "conversations": [
        {"from": "human", "value": "Tell me about caches in computer systems, please, in some detail."},
        {"from": "gpt", "value": "A cache keeps recently used data close to where it is needed."},
        {"from": "human", "value": f"And what is a KV cache, number {i}?"},
        {"from": "gpt", "value": "It stores attention keys and values of earlier tokens."}]} for i in range(3)]))
    return {"xsum": str(xsum), "mmlu": str(mmlu), "sharegpt": str(share)}


@pytest.fixture(scope="module")
def align_dir(tiny_models, tmp_path_factory):
    calib = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": ARTICLE + f" number {i}"}) + "\n" for i in range(6)))
    out = tmp_path_factory.mktemp("align") / "align"
    run_align(AlignConfig(out=str(out), cloud=tiny_models["cloud"], edge=tiny_models["edge"], dtype="float32",
                          texts=str(calib), max_tokens=40, start_layer=1, outlier_ratio=None))
    return out, calib


def _cfg(tiny_models, data, align_dir, out, **kw):
    align, calib = align_dir
    values = dict(out=str(out), cloud=tiny_models["cloud"], edge=tiny_models["edge"], dtype="float32", limit=2,
                  max_new_tokens=4, xsum_source=data["xsum"], mmlu_source=data["mmlu"],
                  sharegpt_source=data["sharegpt"], sharegpt_offset=0, align_dir=str(align), align_config=None,
                  calib=str(calib), calib_tokens=40, max_system_tokens=300, min_system_tokens=8, mmlu_subjects=1,
                  bandwidth_mbps=50.0, latency_ms=1.0, context_budget=24)
    values.update(kw)
    return EvalConfig(**values)


STRATEGIES = ["cloud-only", "edge-only", "edge-naive", "edgeprompt", "ce-lslm", "ce-lslm@0.5/int4"]


@pytest.fixture(scope="module")
def evaluated(tiny_models, data, align_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    result = run_eval(_cfg(tiny_models, data, align_dir, out, strategies=STRATEGIES))
    return out, result


def test_every_strategy_on_every_dataset(evaluated):
    out, result = evaluated
    rows = read_results(out / "results.jsonl")
    assert len(rows) == 3 * 2 * len(STRATEGIES) == result["rows"]
    by = {(r["dataset"], r["strategy"], r["id"]): r for r in rows}
    for (dataset, strategy, rid), r in by.items():
        assert r["ttft_s"] > 0 and r["total_s"] >= r["ttft_s"] and 0 <= r["bertscore_f1"] <= 1
        assert r["upload_ratio"] == (1.0 if strategy == "cloud-only" else 0.0)
        assert (r["bytes_cloud_to_edge"] > 0) == strategy.startswith(("edgeprompt", "ce-lslm")) or \
            strategy == "cloud-only"
        if strategy in ("edgeprompt", "ce-lslm", "ce-lslm@0.5/int4"):
            assert r["layer_sources"] == ["export"] and r["cloud_s"] > 0
        if strategy == "ce-lslm@0.5/int4":  # the same cloud KV, half the key channels, 4-bit: fewer bytes
            assert r["bytes_cloud_to_edge"] < by[(dataset, "ce-lslm", rid)]["bytes_cloud_to_edge"]
        if strategy == "edge-naive":  # truncated to the context budget, never longer than the full prompt
            full = by[(dataset, "edge-only", rid)]["system_tokens"]
            assert r["system_tokens"] <= min(24, full) and (full <= 24 or r["system_tokens"] >= 20)
        if dataset == "mmlu":
            assert r["correct"] in (0, 1) and r["choice"] in range(4)
        if strategy == "edgeprompt":  # exact split: the same tokens as the edge's own full prompt
            same = by[(dataset, "edge-only", rid)]
            assert r["answer"] == same["answer"] and r["ref_nll"] == pytest.approx(same["ref_nll"], abs=1e-4)
    for name in ("summary.csv", "paired.csv", "report.md", "ttft.png", "config.json"):
        assert (out / name).exists()
    report = (out / "report.md").read_text()
    assert "| xsum | ce-lslm |" in report and "MiniLM" in report
    import csv

    summary = list(csv.DictReader((out / "summary.csv").open()))
    assert {"dataset", "strategy", "n", "ref_nll_lo", "ref_nll_hi", "ttft_s_median_lo"} <= set(summary[0])
    for s in summary:
        assert s["n"] == "2" and float(s["ttft_s_median_lo"]) <= float(s["ttft_s_median"]) <= \
            float(s["ttft_s_median_hi"])


def test_mmlu_ref_nll_scores_the_gold_letter(evaluated, tiny_models, data):
    """MMLU's ref. NLL is the gold letter's after `Answer:`, not the option text's (which scores format)."""
    import torch

    from edgekv.models.loading import load_model
    from edgekv.serve.session import EdgeSession

    out, _ = evaluated
    edge = load_model(tiny_models["edge"], "float32")
    got = {r["id"]: r["ref_nll"] for r in read_results(out / "results.jsonl")
           if r["dataset"] == "mmlu" and r["strategy"] == "edge-only"}
    requests = load_requests("mmlu", edge.tokenizer, 2, 0, data["mmlu"], 300, 8, 192, 1, 0)
    assert {r.id for r in requests} == set(got)
    for req in requests:
        assert req.scored == "A" and req.reference.startswith("A. ")
        session = EdgeSession(edge, None, system_prompt=req.system)
        user = session.encode_user(req.user)
        ids = lambda text: torch.tensor(edge.tokenizer(" " + text, add_special_tokens=False)["input_ids"])  # noqa
        assert got[req.id] == pytest.approx(session.continuation_nll(user, ids("A")), abs=1e-5)
        assert abs(got[req.id] - session.continuation_nll(user, ids(req.reference))) > 1e-3


def test_resumption_runs_only_what_is_missing(evaluated, tiny_models, data, align_dir):
    out, _ = evaluated
    path = out / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # torn last line
    result = run_eval(_cfg(tiny_models, data, align_dir, out, strategies=STRATEGIES))
    again = path.read_text().splitlines()
    assert result["rows"] == len(lines) == len(again)
    assert again[:-1] == lines[:-1] and json.loads(again[-1])["id"] == json.loads(lines[-1])["id"]


def test_resumption_refuses_rows_made_with_other_settings(evaluated, tiny_models, data, align_dir):
    out, _ = evaluated
    before = (out / "results.jsonl").read_text()
    with pytest.raises(EdgeKVError, match=r"made with other settings \(max_new_tokens\)"):
        run_eval(_cfg(tiny_models, data, align_dir, out, max_new_tokens=5))
    assert (out / "results.jsonl").read_text() == before


def test_strategies_help_names_every_registered_strategy():
    """`edgekv eval --help` lists what the registry holds (it went stale once: the issue-37 strategies were missing)."""
    from dataclasses import fields

    from edgekv.eval.strategies.base import STRATEGIES

    help_text = next(f for f in fields(EvalConfig) if f.name == "strategies").metadata["help"]
    named = set(re.findall(r"[a-z][a-z0-9-]*[a-z0-9]", help_text))
    missing = [b for b in STRATEGIES if b not in named]
    assert not missing, f"--strategies help misses {missing}"


def test_metrics_by_hand():
    assert lcs_length("a b c d".split(), "a c d e".split()) == 3
    # candidate "the cat sat", reference "the cat was here": LCS 2, P 2/3, R 2/4 → F 4/7
    assert rouge_l("The cat sat", "the cat was here") == pytest.approx(4 / 7)
    assert rouge_l("", "x") == 0.0
    assert accuracy([0, 1, 2, 3], [0, 1, 0, 0]) == 0.5
    assert upload_ratio("my secret", [("system", "system only")]) == 0.0
    assert upload_ratio("my secret", [("system", "my secret, said before")]) == 0.0  # not passed: not sent
    assert upload_ratio("my secret", [("system", "s"), ("user", "my secret")]) == 1.0


def test_requests_are_seeded_and_filtered(data):
    tok = byte_tokenizer()
    a = load_requests("xsum", tok, 3, seed=1, source=data["xsum"], min_system_tokens=8)
    b = load_requests("xsum", tok, 3, seed=1, source=data["xsum"], min_system_tokens=8)
    assert [r.id for r in a] == [r.id for r in b]
    short = load_requests("xsum", tok, 3, seed=1, source=data["xsum"], min_system_tokens=8, max_system_tokens=50)
    assert all(len(tok(r.system)["input_ids"]) <= 50 for r in short)
    head = load_requests("xsum", tok, 4, source=data["xsum"], min_system_tokens=8, xsum_records=2)
    tail = load_requests("xsum", tok, 4, source=data["xsum"], min_system_tokens=8, xsum_from=2)
    assert sorted(r.id for r in head) == ["0", "1"] and sorted(r.id for r in tail) == ["2", "3"]  # a tuning split
    with pytest.raises(EdgeKVError, match="no rows left after filtering"):
        load_requests("xsum", tok, 3, source=data["xsum"], min_system_tokens=10_000)
    with pytest.raises(EdgeKVError, match="dataset file not found"):
        load_requests("xsum", tok, 3, source="missing/xsum.jsonl")


@pytest.mark.parametrize("args, message", [
    (["--dataset", "squad"], "unknown dataset 'squad'"),
    (["--strategies", "edge-only,magic"], "unknown strategy 'magic'"),
    (["--strategies", "ce-lslm@0.5/int3"], "unknown strategy 'ce-lslm@0.5/int3'"),
    (["--strategies", "edge-only@0.5/int8"], "unknown strategy 'edge-only@0.5/int8'"),
    (["--shard", "3/2"], "--shard i/n needs 1 ≤ i ≤ n"),
    (["--shard", "half"], "--shard must be i/n"),
    (["--limit", "0"], "--limit"),
    (["--translator", "magic"], "unknown translator 'magic'"),
    (["--translator", "trained"], "translator 'trained' needs translator_path"),
    (["--load-rates", "0.1,fast"], "expected comma-separated numbers"),
    (["--load-rates", "-1"], "load_rates and load_seconds must be > 0"),
])
def test_cli_bad_input(args, message, tmp_path):
    result = runner.invoke(app, ["eval", "--out", str(tmp_path / "r"), *args])
    assert result.exit_code == 1 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_config_typo_and_empty_dataset(tmp_path, tiny_models, data, align_dir):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("eval:\n  limt: 3\n")
    result = runner.invoke(app, ["eval", "--config", str(cfg)])
    assert result.exit_code == 1 and "did you mean 'limit'" in result.output
    cfg.write_text(f"eval:\n  cloud: {tiny_models['cloud']}\n  edge: {tiny_models['edge']}\n  dtype: float32\n"
                   f"  xsum_source: {data['xsum']}\n  min_system_tokens: 100000\n")
    result = runner.invoke(app, ["eval", "--config", str(cfg), "--dataset", "xsum", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "no rows left after filtering" in result.output, result.output


def test_load_curves(tiny_models, data, align_dir, tmp_path):
    cfg = _cfg(tiny_models, data, align_dir, tmp_path / "load", datasets=["mmlu"],
               strategies=["edge-only", "edgeprompt", "ce-lslm"], load_rates=[2.0, 6.0], load_seconds=1.5,
               load_dataset="mmlu", load_max_tokens=3)
    result = run_eval(cfg)
    load = result["load"]
    assert [(r["strategy"], r["rate"]) for r in load] == [(s, r) for s in cfg.strategies for r in (2.0, 6.0)]
    assert all(r["errors"] == 0 and r["requests"] >= 1 and r["latency_mean_s"] > 0 for r in load)
    assert (tmp_path / "load" / "load.png").exists() and "Latency under load" in (tmp_path / "load" /
                                                                                   "report.md").read_text()


def test_ce_lslm_fuse_with_shut_gates_answers_as_the_edge_alone_with_or_without_a_prefix(
        tiny_models, data, align_dir, tmp_path, monkeypatch):
    import torch

    from edgekv.kv.fusers import BiasFuser
    from edgekv.kv.registry import save_translator
    from edgekv.kv.translators import HiddenTranslator
    from edgekv.models.capture import capture
    from edgekv.models.loading import load_model

    cloud, edge = load_model(tiny_models["cloud"], "float32"), load_model(tiny_models["edge"], "float32")
    seqs = [torch.tensor(edge.tokenizer(ARTICLE + f" number {i}")["input_ids"][:40]) for i in range(6)]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), [(1, 2), (2, 3)], edge.model)
    fuser = BiasFuser.from_hidden(hidden, edge.model, init=-1e4)  # open hard gates, shut soft gates
    fuser.set_open([1, 2])
    save_translator(fuser, tmp_path / "fuser", cloud.fingerprint, edge.fingerprint)
    with pytest.raises(EdgeKVError, match="needs fuser_path"):
        _cfg(tiny_models, data, align_dir, tmp_path / "x", strategies=["ce-lslm-fuse"]).validate()
    cfg = _cfg(tiny_models, data, align_dir, tmp_path / "run", strategies=["edge-only", "ce-lslm-fuse"],
               datasets=["xsum", "mmlu"], fuser_path=str(tmp_path / "fuser"), quant="fp16", prune_ratio=0.0)
    run_eval(cfg, models=(cloud, edge))
    rows = read_results(tmp_path / "run" / "results.jsonl")
    by = {(r["strategy"], r["dataset"], r["id"]): r for r in rows}
    fused = [r for r in rows if r["strategy"] == "ce-lslm-fuse"]
    assert len(fused) == 4
    for r in fused:
        alone = by[("edge-only", r["dataset"], r["id"])]
        assert r["answer"] == alone["answer"] and r["upload_ratio"] == 0.0
        assert r["ref_nll"] == pytest.approx(alone["ref_nll"], abs=1e-4)
        assert r["bytes_cloud_to_edge"] > 0 and r["layer_sources"] == ["export"]
    # under a shared prefix (K = 3): the edge's own KV read after it, so with shut gates EdgePrompt under the prefix
    from tests.helpers import edge_prefix

    edge_prefix(edge, tmp_path / "k3", 3)
    shared = dict(strategies=["edgeprompt-shared", "ce-lslm-fuse-shared"], datasets=["xsum"],
                  fuser_path=str(tmp_path / "fuser"), quant="fp16", prune_ratio=0.0)
    with pytest.raises(EdgeKVError, match="needs shared"):
        _cfg(tiny_models, data, align_dir, tmp_path / "y", **shared).validate()
    seen = watch_rows(monkeypatch, tmp_path / "under")
    run_eval(_cfg(tiny_models, data, align_dir, tmp_path / "under", shared=str(tmp_path / "k3"), **shared),
             models=(cloud, edge))
    assert seen == [(n, []) for n in range(1, 5)]  # no session, fused or under a prefix, waits for the collector
    rows = read_results(tmp_path / "under" / "results.jsonl")
    by = {(r["strategy"], r["id"]): r for r in rows}
    assert len(rows) == 4
    for r in rows:
        if r["strategy"] == "ce-lslm-fuse-shared":
            ep = by[("edgeprompt-shared", r["id"])]
            assert r["answer"] == ep["answer"] and r["system_tokens"] == ep["system_tokens"]
            assert r["ref_nll"] == pytest.approx(ep["ref_nll"], abs=1e-4) and r["bytes_cloud_to_edge"] > 0


def test_each_request_is_freed_and_the_heap_trimmed_after_its_row(tiny_models, data, align_dir, tmp_path,
                                                                  monkeypatch):
    # a real eval held +2.7 GB a request until the OOM killer, live tensors flat: each finished session sat in
    # reference cycles (prefix ↔ its layers, the engine's callbacks, the loader's fallbacks) that the cyclic
    # collector, which counts objects not bytes, seldom ran for; and glibc kept the freed heap
    out = tmp_path / "run"
    seen = watch_rows(monkeypatch, out)
    strategies = ["edge-only", "edgeprompt", "ce-lslm", "cloud-only", "edge-naive"]
    run_eval(_cfg(tiny_models, data, align_dir, out, strategies=strategies, datasets=["xsum"]))
    assert seen == [(n, []) for n in range(1, 2 * len(strategies) + 1)]


def test_a_prefix_is_freed_without_the_cyclic_collector_and_its_layers_say_so_after():
    import gc
    import weakref

    import torch

    from edgekv.attention.prefix_kv import PrefixKV

    kv = torch.zeros(1, 2, 3, 4)
    prefix = PrefixKV([(kv, kv)] * 2, 3)
    layers, alive = list(prefix.layers), weakref.ref(prefix)
    assert torch.equal(layers[1].keys, kv)
    gc.disable()
    try:
        del prefix
        assert alive() is None  # no cycle through its layers
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="outlived its PrefixKV"):
        layers[0].keys


def test_paired_differences_to_edge_only():
    from edgekv.eval.stats import paired_to_edge

    rows = [{"dataset": "d", "strategy": s, "id": i, "ref_nll": v}
            for i, (e, x) in enumerate([(1.0, 0.5), (2.0, 1.9), (3.0, 2.6)])
            for s, v in (("edge-only", e), ("fuse", x))] + [{"dataset": "d", "strategy": "fuse", "id": 9,
                                                             "ref_nll": 0.0}]  # no edge-only partner: left out
    (p,) = paired_to_edge(rows)
    d = [-0.5, -0.1, -0.4]
    assert p["n"] == 3 and p["delta_mean"] == pytest.approx(sum(d) / 3)
    # every resample of three negative differences has a negative mean: the interval lies in [min, max] < 0
    assert min(d) <= p["ci95_lo"] < p["ci95_hi"] <= max(d) and p["excludes_zero"]
    assert paired_to_edge(rows) == [p]  # seeded: the same interval again


def test_bootstrap_is_seeded_and_covers():
    import numpy as np

    from edgekv.eval.stats import bootstrap_ci, cell_seed

    x = list(np.random.default_rng(0).normal(size=40))
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3) != bootstrap_ci(x, seed=4)
    assert cell_seed(0, "xsum", "ce-lslm") == cell_seed(0, "xsum", "ce-lslm") != cell_seed(0, "mmlu", "ce-lslm")
    assert bootstrap_ci([1.0]) == (None, None)
    lo, hi = bootstrap_ci(x, "median", seed=1)
    assert lo <= statistics.median(x) <= hi
    # coverage of the mean of N(0, 1) samples of 40: close to the nominal 95 % (bootstrap runs a little short)
    rng = np.random.default_rng(1)
    hits = sum(lo <= 0 <= hi for lo, hi in (bootstrap_ci(list(rng.normal(size=40)), seed=k, samples=1000)
                                              for k in range(300)))
    assert 0.89 <= hits / 300 <= 0.99


def test_shards_merged_equal_one_run(evaluated, tiny_models, data, align_dir, tmp_path):

    from edgekv.eval.runs import merge_runs

    out, _ = evaluated
    for i in (1, 2):
        run_eval(_cfg(tiny_models, data, align_dir, tmp_path / f"s{i}", strategies=STRATEGIES, shard=f"{i}/2"))
    # XSum's 2 requests have a system prompt each: one per shard; MMLU's 2 share their subject's and ShareGPT's 2
    # the fixture's first turns: both in shard 1
    ids = [{(r["dataset"], r["id"]) for r in read_results(tmp_path / f"s{i}" / "results.jsonl")} for i in (1, 2)]
    assert [sorted(Counter(d for d, _ in x).items()) for x in ids] == [[("mmlu", 2), ("sharegpt", 2), ("xsum", 1)],
                                                                       [("xsum", 1)]]
    merge_runs([tmp_path / "s2", tmp_path / "s1"], tmp_path / "merged")
    _same_report(out, tmp_path / "merged")


def test_a_system_prompts_requests_share_a_shard_and_run_together():
    """`prompt_groups` ranks system prompts by first appearance; a shard takes whole groups, every request once."""
    from edgekv.eval.runs import in_shard, prompt_groups

    groups = prompt_groups(["a", "b", "a", "c", "b", "a", "d"])
    assert groups == [0, 1, 0, 2, 1, 0, 3]
    shards = [[k for k, g in enumerate(groups) if in_shard(g, f"{i}/2")] for i in (1, 2)]
    assert shards == [[0, 2, 3, 5], [1, 4, 6]]
    assert all(in_shard(g, None) for g in groups)


def _same_report(out, merged_dir):
    """Row for row (timings aside) and summary.csv for summary.csv, a merged report equals the one run."""
    import csv

    timing = {"ttft_s", "total_s", "ms_per_token", "cloud_s", "layer_wait_s", "rss_mb"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    one, merged = read_results(out / "results.jsonl"), read_results(merged_dir / "results.jsonl")
    assert [(r["dataset"], r["strategy"], r["id"]) for r in merged] == [(r["dataset"], r["strategy"], r["id"])
                                                                         for r in one]
    for a, b in zip(strip(one), strip(merged)):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == (pytest.approx(b[k], abs=1e-5) if isinstance(a[k], float) else b[k]), k
    timing_cols = ("ttft", "total_s", "ms_per_token", "cloud_s")
    summary = [list(csv.DictReader((d / "summary.csv").open())) for d in (out, merged_dir)]
    for a, b in zip(*summary):
        for k in a:
            if not k.startswith(timing_cols):
                # csv cells are strings: numbers compare as floats (BERTScore differs in the 8th digit between a
                # Ray worker and this process)
                assert float(a[k]) == pytest.approx(float(b[k]), abs=1e-5) if a[k] and b[k] and k not in (
                    "dataset", "strategy") else a[k] == b[k], k


@pytest.mark.slow
def test_eval_on_ray_equals_the_unsharded_run(evaluated, tiny_models, data, align_dir, tmp_path):
    """A local Ray cluster, 2 actors (each loads the models once), one shard each, merged: the one run's rows."""
    out, _ = evaluated
    result = run_eval(_cfg(tiny_models, data, align_dir, tmp_path / "ray", strategies=STRATEGIES, ray="", workers=2))
    assert result["rows"] == len(read_results(out / "results.jsonl"))
    assert sorted(p.name for p in (tmp_path / "ray" / "shards").iterdir()) == ["1", "2"]
    _same_report(out, tmp_path / "ray")


def test_merge_refuses_other_settings_and_missing_shards(evaluated, tmp_path):
    import shutil

    out, _ = evaluated
    for i in (1, 2):  # two "shards" made from the unsharded run's files, one with another setting
        shutil.copytree(out, tmp_path / f"s{i}", ignore=shutil.ignore_patterns("work"))
        config = json.loads((tmp_path / f"s{i}" / "config.json").read_text())
        config.update(shard=f"{i}/2", max_new_tokens=4 + i - 1)
        (tmp_path / f"s{i}" / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["report", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 1 and "made with other settings" in result.output and "max_new_tokens" in \
        result.output and len(result.output.strip().splitlines()) == 1, result.output
    result = runner.invoke(app, ["report", str(tmp_path / "s1"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 1 and "do not cover 1/2..2/2" in result.output, result.output
    assert not (tmp_path / "m" / "report.md").exists()


def test_runs_split_by_dataset_merge_into_one_report(evaluated, tmp_path):
    """Runs made with --dataset xsum and --dataset mmlu,sharegpt merge into the one run's report; overlapping
    dataset lists are refused."""
    import shutil

    out, _ = evaluated
    rows = read_results(out / "results.jsonl")
    for name, datasets in (("a", ["xsum"]), ("b", ["mmlu", "sharegpt"]), ("c", ["sharegpt"])):
        shutil.copytree(out, tmp_path / name, ignore=shutil.ignore_patterns("work"))
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps(dict(config, datasets=datasets)))
        (tmp_path / name / "results.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows if r["dataset"] in datasets))
    result = runner.invoke(app, ["report", str(tmp_path / "b"), str(tmp_path / "a"), "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["datasets"] == ["mmlu", "sharegpt", "xsum"]
    assert sorted(map(json.dumps, read_results(tmp_path / "m" / "results.jsonl"))) == sorted(map(json.dumps, rows))
    result = runner.invoke(app, ["report", str(tmp_path / "b"), str(tmp_path / "c"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1 and "overlap" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_naive_truncation_respects_the_budget():
    from edgekv.eval.datasets import truncate_prompt

    tok = byte_tokenizer()
    text = "0123456789" * 5
    for keep, want in (("head", text[:12]), ("tail", text[-12:]), ("head-tail", text[:6] + text[-6:])):
        assert truncate_prompt(tok, text, 12, keep) == want
    assert truncate_prompt(tok, "short", 12) == "short"
    with pytest.raises(EdgeKVError, match="unknown truncation"):
        truncate_prompt(tok, text, 12, "middle")


@pytest.mark.slow
def test_naive_truncation_respects_the_budget_on_the_real_tokenizer():
    from edgekv.eval.datasets import truncate_prompt, xsum
    from edgekv.models.loading import load_tokenizer

    tok = load_tokenizer("default-edge")
    for req in xsum()[:20]:
        for keep in ("head", "tail", "head-tail"):
            cut = truncate_prompt(tok, req.system, 128, keep)
            assert 120 <= len(tok(cut)["input_ids"]) <= 128 and cut.strip() and cut != req.system


def test_load_rows_are_reused_only_under_the_same_load_settings(tmp_path):
    from types import SimpleNamespace

    from edgekv.eval.load_runs import load_curves, reusable_load
    from edgekv.progress import Tasks

    cfg = EvalConfig(out=str(tmp_path), strategies=["edge-only", "ce-lslm"], load_rates=[0.1, 0.5], load_seconds=30)
    (tmp_path / "config.json").write_text(json.dumps({"load_seconds": 30, "load_dataset": "mmlu",
                                                      "load_max_tokens": 16, "seed": 0}))
    (tmp_path / "load.csv").write_text(
        "strategy,rate,requests,errors,latency_mean_s,latency_p90_s,normalized_latency_s_per_token\n"
        "edge-only,0.1,3,0,1.5,2.0,0.1\nedge-only,0.5,9,1,,,\nce-lslm,0.1,3,0,1.0,1.2,0.05\n"
        "ce-lslm,0.5,9,0,1.1,1.3,0.06\n")
    rows = reusable_load(tmp_path, cfg)
    assert len(rows) == 4 and rows[1]["latency_mean_s"] is None and rows[0]["rate"] == 0.1
    runner = SimpleNamespace(cfg=cfg)  # every (strategy, rate) is kept: no session is opened, nothing is run
    assert load_curves(runner, [SimpleNamespace(system="s", user="u")], Tasks(), rows) == rows
    cfg.load_seconds = 10
    assert reusable_load(tmp_path, cfg) == []


def test_distilled_strategies_run_and_truncate_is_edgeprompt_of_the_head(tiny_models, data, align_dir, tmp_path,
                                                                       monkeypatch):
    distill = tmp_path / "distill.yaml"
    distill.write_text("distill:\n  queries: 4\n  max_answer_tokens: 6\n  steps: 2\n  eval_every: 1\n  quant: fp32\n")
    strategies = ["edgeprompt", "ce-lslm-distill", "ce-lslm-distill@c4", "edgeprompt-selfdistill@c4",
                  "edgeprompt-truncate@c4", "ce-lslm-distill:nosum@c4", "ce-lslm-distill@c4s3",
                  "ce-lslm-distill:v1@c4", "ce-lslm-distill:recall@c4", "ce-lslm-distill@c4/0/int4",
                  "ce-lslm-distill:qat@c4/0.3/int2"]
    for bad in ("ce-lslm-distill@c0", "ce-lslm-distill@/0.5/int8", "edgeprompt-truncate:nosum",
                "edgeprompt-truncate@c4s3", "ce-lslm-distill@s0", "ce-lslm-distill@s3c4", "ce-lslm-distill@c4/int8",
                "ce-lslm-distill@c4/1.5/int2"):
        with pytest.raises(EdgeKVError, match="unknown strategy"):
            _cfg(tiny_models, data, align_dir, tmp_path / "x", strategies=[bad]).validate()
    with pytest.raises(EdgeKVError, match=":qat trains through a codec"):
        _cfg(tiny_models, data, align_dir, tmp_path / "x", strategies=["ce-lslm-distill:qat@c4"]).validate()
    out = tmp_path / "run"
    seen = watch_rows(monkeypatch, out)
    run_eval(_cfg(tiny_models, data, align_dir, out, strategies=strategies, datasets=["xsum"],
                  distill_config=str(distill)))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["strategy"], r["id"]): r for r in rows}
    assert {r["strategy"] for r in rows} == set(strategies)
    assert seen == [(n, []) for n in range(1, len(rows) + 1)]  # no session waits for the cyclic collector
    for r in rows:
        if r["strategy"] != "edgeprompt":
            assert r["cloud_s"] > 0 and r["bytes_cloud_to_edge"] > 0 and r["ref_nll"] is not None
    for (s, i), r in by.items():
        if s.endswith("@c4"):  # a quarter of the tokens: about a quarter of EdgePrompt's bytes
            assert r["bytes_cloud_to_edge"] < 0.4 * by[("edgeprompt", i)]["bytes_cloud_to_edge"]
    # the codec on top: int4 about 1/8 of the fp32 student, int2 (ThinK 0.3) less (tiny heads: the scales weigh)
    for i in {i for _, i in by}:
        fp32, int4 = by[("ce-lslm-distill@c4", i)], by[("ce-lslm-distill@c4/0/int4", i)]
        assert int4["bytes_cloud_to_edge"] < 0.2 * fp32["bytes_cloud_to_edge"]
        assert by[("ce-lslm-distill:qat@c4/0.3/int2", i)]["bytes_cloud_to_edge"] < int4["bytes_cloud_to_edge"]
    # the untrained head equals an edge that reads only the first P/4 tokens of the system prompt
    exports = sorted((out / "work" / "exports" / "edgeprompt-truncate-c4").glob("*/prompt/kv/manifest.json"))
    manifest = json.loads(exports[0].read_text())
    assert manifest["kv_tokens"] == -(-manifest["system_prompt"]["num_tokens"] // 4) == manifest["next_position"]
    assert manifest["distilled"]["steps"] == 0
    steps = {p.parent.parent.parent.parent.name: json.loads(p.read_text())["distilled"]["steps"]
             for p in (out / "work" / "exports").glob("*/*/prompt/kv/manifest.json")}
    assert steps["ce-lslm-distill-c4s3"] == 3 and steps["ce-lslm-distill-c4"] == 2  # @s<S> overrides the config
    codecs = {p.parent.parent.parent.parent.name: json.loads(p.read_text())
              for p in (out / "work" / "exports").glob("*/*/prompt/kv/manifest.json")}
    assert codecs["ce-lslm-distill-qat-c4-0.3-int2"]["quant"] == "int2"
    assert codecs["ce-lslm-distill-qat-c4-0.3-int2"]["distilled"]["train_codec"] is True
    assert "train_codec" not in codecs["ce-lslm-distill-c4-0-int4"]["distilled"]
    seeds = {p.parent.parent.parent.name: json.loads(p.read_text())["seed"]  # the recall variant's own sets
             for p in (out / "work" / "exports").glob("synthetic-cloud-*/*/prompt/synthetic.json")}
    assert "recall" in seeds["synthetic-cloud-recall"] and "recall" not in seeds["synthetic-cloud-all"]
    from bench.distill_report import distill_costs

    costs = distill_costs([out], tmp_path / "report")  # per export, medians over the run's 2 prompts
    assert set(costs) == {f"xsum/{name}" for name in steps} and costs["xsum/ce-lslm-distill"]["n"] == 2
    assert costs["xsum/edgeprompt-truncate-c4"]["best_step_median"] == 0
    assert costs["xsum/ce-lslm-distill"]["train_s_median"] > 0
    assert (tmp_path / "report" / "loss_curves" / "xsum_ce-lslm-distill-c4.png").exists()
    # two shards of one source pool their prompts, a prompt both exported counting once
    shard = tmp_path / "shard"
    shutil.copytree(out, shard)
    for export in (shard / "work" / "exports").glob("*"):
        shutil.rmtree(sorted(p for p in export.iterdir() if p.is_dir())[0])
    pooled = distill_costs([out, shard])
    assert pooled["xsum/ce-lslm-distill"]["n"] == 2 and set(pooled) == set(costs)
    assert distill_costs([shard])["xsum/ce-lslm-distill"]["n"] == 1
    # a recipe recorded before a setting existed (its default keeps the old behaviour) resumes
    config = json.loads((out / "config.json").read_text())
    del config["distill_recipe"]["lr_schedule"]
    (out / "config.json").write_text(json.dumps(config))
    run_eval(_cfg(tiny_models, data, align_dir, out, strategies=strategies, datasets=["xsum"],
                  distill_config=str(distill)))
    # the recipe file changed under the same path: its rows are not resumed
    before = (out / "results.jsonl").read_text()
    distill.write_text(distill.read_text().replace("steps: 2", "steps: 5"))
    with pytest.raises(EdgeKVError, match=r"made with other settings \(distill_recipe\)"):
        run_eval(_cfg(tiny_models, data, align_dir, out, strategies=strategies, datasets=["xsum"],
                      distill_config=str(distill)))
    assert (out / "results.jsonl").read_text() == before


def test_a_clustered_interval_resamples_whole_system_prompts():
    """`clustered_mean_ci` draws whole clusters: one value each is the plain interval; equal-sized clusters are the
    plain interval of their means; requests that repeat their prompt's value add no information (wider)."""
    import numpy as np

    from edgekv.eval.stats import bootstrap_ci, clustered_mean_ci, paired_bootstrap

    rng = np.random.default_rng(0)
    x = list(rng.normal(size=30))
    assert clustered_mean_ci(x, [str(k) for k in range(30)], seed=5) == pytest.approx(bootstrap_ci(x, seed=5))
    means = list(rng.normal(size=6))
    y, prompts = [m for m in means for _ in range(5)], [str(k // 5) for k in range(30)]
    lo, hi = clustered_mean_ci(y, prompts, seed=1)
    assert (lo, hi) == pytest.approx(bootstrap_ci(means, seed=1))
    plain_lo, plain_hi = bootstrap_ci(y, seed=1)
    assert hi - lo > 1.8 * (plain_hi - plain_lo)  # ≈ √5 wider: 6 draws' worth, not 30
    assert clustered_mean_ci([1.0, 2.0], ["a", "a"]) == (None, None)
    # a pair with a missing side leaves with its label
    d = paired_bootstrap([1.0, None, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0], clusters=["a", "b", "c", "c"])
    assert d["n"] == 3 and d["delta_mean"] == pytest.approx(8 / 3)


def test_distill_summary_pairs_and_gap_closed():
    from bench.distill_report import distill_summary
    from edgekv.eval.stats import gap_closed

    rows = []
    for i in range(6):
        for strategy, nll in (("edgeprompt", 2.0 + i), ("edge-only", 2.0 + i), ("cloud-only", 1.0 + i),
                              ("ce-lslm-distill", 1.5 + i + 0.01 * i), ("ce-lslm-fuse", 1.9 + i),
                              ("ce-lslm-distill:v1", 1.8 + i)):
            rows.append({"dataset": "xsum", "strategy": strategy, "id": str(i), "ref_nll": nll,
                         "bytes_cloud_to_edge": 10, "cloud_s": 1.0})
    s = distill_summary(rows)["xsum"]
    assert s["distill"]["n"] == 6 and abs(s["distill"]["delta_mean"] - (-0.5 + 0.025)) < 1e-9
    assert s["distill - fuse"]["delta_ci95"][1] < 0 and s["cloud"]["delta_mean"] == pytest.approx(-1.0)
    g = s["gap_closed_by_distill"]
    assert g["fraction"] == pytest.approx(0.475) and g["ci95_lo"] <= 0.475 <= g["ci95_hi"]
    # the old recipe and the fuser against the new one, on the same requests (issue 34's table)
    assert s["distill - distill-v1"]["delta_mean"] == pytest.approx(-0.3 + 0.025)
    assert s["gap_closed_by_distill-v1"]["fraction"] == pytest.approx(0.2)
    assert s["gap_closed_by_fuse"]["fraction"] == pytest.approx(0.1)
    assert "delta_ci95_by_prompt" not in s["distill"]  # every XSum request its own prompt
    # MMLU's questions share their subject's prompt: the interval over subjects beside the one over requests
    mmlu = [{**r, "dataset": "mmlu", "id": f"subject{int(r['id']) // 2}-{r['id']}"} for r in rows]
    m = distill_summary(mmlu)["mmlu"]["distill"]
    assert m["n"] == 6 and m["delta_mean"] == pytest.approx(s["distill"]["delta_mean"])
    assert len(m["delta_ci95_by_prompt"]) == 2 and m["delta_ci95_by_prompt"] != m["delta_ci95"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no gap: undefined, with neither an error nor a numpy warning
        none = gap_closed([1.0, 2.0], [1.0, 2.0], [1.0, 2.0])
    assert all(math.isnan(none[k]) for k in ("fraction", "ci95_lo", "ci95_hi"))


def test_the_align_an_eval_runs_first_compares_its_models_in_its_dtype(tiny_models, data, align_dir, tmp_path):
    """An align config naming other models or another dtype does not decide the mapping the eval's pair uses."""
    _, calib = align_dir
    config = tmp_path / "align.yaml"
    config.write_text(f"cloud: default-cloud\nedge: default-edge\ndtype: bfloat16\nalign:\n  texts: {calib}\n"
                      "  max_tokens: 40\n  start_layer: 1\n  outlier_ratio: null\n")
    made = tmp_path / "align-made"
    cfg = _cfg(tiny_models, data, align_dir, tmp_path / "run", strategies=["ce-lslm"], datasets=["xsum"], limit=1,
               align_config=str(config))
    cfg.align_dir = str(made)
    run_eval(cfg)
    settings = json.loads((made / "config.json").read_text())
    assert (settings["cloud"], settings["edge"], settings["dtype"]) == (tiny_models["cloud"], tiny_models["edge"],
                                                                        "float32")


def test_a_long_figure_title_is_wrapped_inside_the_figure():
    """A one-panel forest plot (5.5 in) is narrower than the report's title: the title wraps and stays on the page."""
    import matplotlib.pyplot as plt

    from edgekv.plots import suptitle

    fig = plt.figure(figsize=(5.5, 3))
    text = suptitle(fig, "reference NLL vs EdgePrompt's exact KV (and contrasts), paired, 95 % bootstrap")
    fig.canvas.draw()
    box = text.get_window_extent()
    plt.close(fig)
    assert "\n" in text.get_text() and box.x0 >= 0 and box.x1 <= fig.bbox.width
