"""Network conditions: the TTFT model per strategy, the planner, Pareto fronts, and `edgekv plan` on tiny models."""

import json

import pytest
from typer.testing import CliRunner

from cli.main import app
from edgekv import EdgeKVError
from edgekv.eval.network import Candidate, Profile, pareto, plan, predict
from edgekv.serve.pipeline import Link, pipeline_ttft
from tests.helpers import ARTICLE

runner = CliRunner()


def _profile() -> Profile:
    return Profile(system_tokens=400, user_tokens=20, system_layer_s=[0.1] * 4, user_layer_s=[0.01] * 4,
                   head_s=0.02, edge_only_s=0.5, cloud_only_s=2.0, user_bytes=1000,
                   decode_s={"fp16": 0.0, "int8": 0.001, "int4": 0.002}, overhead_s={"ce-lslm": 0.05})


def test_pipeline_model_by_hand():
    # shallow 1 s; layers 1 and 3 shipped (2 s, 1 s); compute 1 s per layer: layer 0 done at 2; layer 1 ready at
    # 2 → done 3; layer 2 done 4; layer 3 ready at 3 → done 5; head 0.5
    p = pipeline_ttft(1.0, [1, 1, 1, 1], {1: 2.0, 3: 1.0}, head_s=0.5)
    assert p["predicted_s"] == 5.5 and p["serial_s"] == 1 + 4 + 0.5 + 3 and p["bound_s"] == 5.5


def test_predict_per_strategy_by_hand():
    p = _profile()
    link = Link(8.0, 10.0)  # 1 MB/s, 10 ms per file
    assert predict(Candidate("edge-only"), p, link) == 0.5
    assert predict(Candidate("cloud-only"), p, link) == pytest.approx(2.0 + (0.01 + 0.001) + 0.01)
    # edgeprompt m=2: shallow 0.2 s; layers 2, 3 of 100 kB each arrive at 0.11 and 0.22 s (fp16: no decode):
    # user layers 0, 1 done at 0.21, 0.22; layer 2 (ready 0.11) at 0.23; layer 3 (ready 0.22) at 0.24; head 0.02
    c = Candidate("edgeprompt", 2, 0.0, "fp16", {2: 100_000, 3: 100_000})
    assert predict(c, p, link) == pytest.approx(0.26)
    # fuse: own prefill of all 4 layers (0.4 s) vs one 1 MB layer (1.01 s + 0.001 decode), then the user forward
    f = Candidate("ce-lslm-fuse", 3, 0.5, "int8", {3: 1_000_000})
    assert predict(f, p, link) == pytest.approx(1.011 + 0.04 + 0.02)
    s = Candidate("ce-lslm", 3, 0.5, "int8", {3: 1_000_000})  # with its overhead constant
    assert predict(s, p, link) == pytest.approx(max(0.3 + 0.03, 1.011) + 0.01 + 0.02 + 0.05)


def test_planner_picks_the_cheapest_setting_within_the_budget():
    p = _profile()
    cands = [Candidate("edge-only"),
             Candidate("edgeprompt", 0, 0.0, "fp16", {i: 400_000 for i in range(4)}, 0.0),
             Candidate("edgeprompt", 0, 0.5, "int4", {i: 50_000 for i in range(4)}, 0.08),
             Candidate("edgeprompt", 0, 0.25, "int8", {i: 150_000 for i in range(4)}, 0.01),
             Candidate("edgeprompt", 2, 0.25, "int8", {i: 150_000 for i in range(2, 4)}, 0.01)]
    fast, slow = Link(1000.0, 1.0), Link(1.0, 20.0)
    best, table = plan(cands, p, fast, max_quality_loss=0.02)
    within = [c for c, t in zip(cands, table) if t["within_budget"]]
    assert best in within and predict(best, p, fast) == min(predict(c, p, fast) for c in within)
    assert best.label == "edgeprompt m=0 λ=0.25 int8"  # int4 would be faster but loses 0.08 nats
    best, _ = plan(cands, p, fast, max_quality_loss=0.1)  # compute-bound: int4's slower decode does not pay
    assert best.quant == "int8"
    mid = Link(20.0, 1.0)
    best, _ = plan(cands, p, mid, max_quality_loss=0.1)  # 20 Mbit/s: bytes matter, int4 wins
    assert best.quant == "int4"
    best, _ = plan(cands, p, mid, max_quality_loss=0.02)  # without int4: ship fewer layers, prefill two
    assert best.label == "edgeprompt m=2 λ=0.25 int8"
    best, _ = plan(cands, p, slow, max_quality_loss=0.1)  # 1 Mbit/s: shipping anything is slower than prefill
    assert best.strategy == "edge-only"
    with pytest.raises(EdgeKVError, match="no candidate"):
        plan(cands[1:], p, fast, max_quality_loss=-1.0)


def test_pareto_front():
    pts = [(1.0, 0.5), (2.0, 0.1), (3.0, 0.2), (0.5, 0.9), (2.0, 0.3)]
    assert pareto(pts) == [3, 0, 1]


@pytest.fixture(scope="module")
def qpb_run(tiny_models, tmp_path_factory):
    from edgekv.align.align_job import AlignConfig, run_align
    from edgekv.eval.eval_config import EvalConfig
    from edgekv.eval.eval_job import run_eval

    root = tmp_path_factory.mktemp("qpb")
    xsum = root / "xsum.jsonl"
    xsum.write_text("".join(json.dumps({"id": str(i), "document": ARTICLE * 2 + f"Item {i}.",
                                        "summary": f"A cycle lane was approved, item {i}."}) + "\n" for i in range(3)))
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": ARTICLE + f" number {i}"}) + "\n" for i in range(6)))
    run_align(AlignConfig(out=str(root / "align"), cloud=tiny_models["cloud"], edge=tiny_models["edge"],
                          dtype="float32", texts=str(calib), max_tokens=40, start_layer=1, outlier_ratio=None))
    strategies = ["edge-only", "edgeprompt", "ce-lslm", "edgeprompt@0/fp16", "edgeprompt@0.5/int4",
                  "ce-lslm@0/fp16", "ce-lslm@0.5/int8"]
    cfg = EvalConfig(out=str(root / "eval"), cloud=tiny_models["cloud"], edge=tiny_models["edge"], dtype="float32",
                     datasets=["xsum"], strategies=strategies, limit=2, max_new_tokens=3, xsum_source=str(xsum),
                     align_dir=str(root / "align"), align_config=None, calib=str(calib), calib_tokens=40,
                     max_system_tokens=300, min_system_tokens=8, bandwidth_mbps=None, latency_ms=0.0)
    return root, run_eval(cfg)


def test_quality_per_byte_report(qpb_run):
    root, result = qpb_run
    rows = {r["strategy"]: r for r in result["quality_per_byte"]}
    assert set(rows) == {"edgeprompt@0/fp16", "edgeprompt@0.5/int4", "ce-lslm@0/fp16", "ce-lslm@0.5/int8"}
    assert rows["edgeprompt@0/fp16"]["d_nll"] == 0.0 and rows["edgeprompt@0/fp16"]["ratio_vs_cloud_fp16"] == \
        pytest.approx(1.0, rel=0.01)  # fp16 of every layer: what the "cloud" (the edge model itself) holds
    # half the key channels, 4-bit: keys 1/8, values 1/4 of fp16, plus per-channel/token scales (tiny heads)
    assert rows["edgeprompt@0.5/int4"]["mb_sent"] < rows["edgeprompt@0/fp16"]["mb_sent"] / 3
    assert rows["edgeprompt@0.5/int4"]["ratio_vs_cloud_fp16"] > 3
    for name in ("quality_per_byte.csv", "quality_per_byte.png"):
        assert (root / "eval" / name).exists()
    assert "## Quality per byte" in (root / "eval" / "report.md").read_text()


def test_plan_command_picks_and_measures(qpb_run, tmp_path):
    root, _ = qpb_run
    out = tmp_path / "plan"
    result = runner.invoke(app, ["plan", "--qpb", str(root / "eval"), "--link", "0.05,1", "--link", "1000,1",
                                 "--max-quality-loss", "100", "--sweep-mbps", "0.2,1000", "--reps", "1",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan_ = json.loads((out / "plan.json").read_text())
    slow, fast = plan_["picks"]
    assert slow["strategy"] == "edge-only"  # 50 kbit/s: any export costs more than the tiny edge's prefill
    assert all(p["measured_s"] > 0 for p in plan_["picks"])
    assert (out / "ttft_vs_bandwidth.png").exists() and "Planner" in (out / "plan.md").read_text()
    # planning into an eval report adds its sections (and the Pareto plot) to report.md
    import shutil

    shutil.copytree(root / "eval", tmp_path / "report", ignore=shutil.ignore_patterns("work"))
    result = runner.invoke(app, ["plan", "--qpb", str(root / "eval"), "--no-measure", "--max-quality-loss", "100",
                                 "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Planner" in report and "## Quality per byte" in report and "| xsum | edge-only |" in report
    # at 0.2 Mbit/s the link dominates a splice's TTFT: the emulated transfer is a floor no machine beats, so the
    # measurement is within 15 % below the prediction; above it, a busy machine adds its compute delay (the
    # model's accuracy on a quiet machine is a bench figure: reports/eval-n50/plan.md)
    splices = [r for r in plan_["sweep"] if r["mbps"] == 0.2 and r["strategy"] not in ("edge-only", "cloud-only")]
    assert {r["strategy"] for r in splices} == {"edgeprompt@0/fp16", "ce-lslm@0.5/int8"}
    for r in splices:
        assert 0.85 < r["measured_s"] / r["predicted_s"] < 3.0, r


def test_plan_bad_input(tmp_path):
    result = runner.invoke(app, ["plan", "--qpb", str(tmp_path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "no results.jsonl" in result.output
    (tmp_path / "results.jsonl").write_text("")
    result = runner.invoke(app, ["plan", "--qpb", str(tmp_path), "--link", "fast"])
    assert result.exit_code == 1 and "a link is MBPS[,MS]" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_quality_per_byte_falls_back_to_the_bare_family():
    """Without `family@0/fp16` a variant is paired with the family as the run configured it (edgeprompt-shared)."""
    from edgekv.eval.quality_per_byte import quality_per_byte

    rows = [{"dataset": "sharegpt", "id": str(i), "strategy": s, "ref_nll": 2.0 + 0.01 * i + dv,
             "bertscore_f1": 0.5, "bytes_cloud_to_edge": b, "cloud_fp16_bytes": 800}
            for i in range(5) for s, dv, b in (("edgeprompt-shared", 0.0, 800),
                                               ("edgeprompt-shared@0.35/int2", 0.1, 100), ("edgeprompt", -0.5, 800))]
    (row,) = quality_per_byte(rows)
    assert row["strategy"] == "edgeprompt-shared@0.35/int2" and row["family"] == "edgeprompt-shared"
    assert row["d_nll"] == pytest.approx(0.1) and row["ratio_vs_cloud_fp16"] == pytest.approx(8.0)
