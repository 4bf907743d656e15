"""Calibration text sources and the config loader."""

import json
from pathlib import Path

import pytest

from edgekv import EdgeKVError
from edgekv.align.align_job import AlignConfig
from edgekv.config import load_config
from edgekv.texts import iter_json_array, iter_sharegpt, load_text_file, render_conversation, sharegpt_texts

ROOT = Path(__file__).resolve().parents[1]


def test_truncated_array_yields_complete_records_only():
    text = '[\n {"a": 1},\n {"b": [2, 3]},\n {"c": "unfinish'
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [2, 3]}]
    assert list(iter_json_array('[{"a": 1}, {"b": 2}]')) == [{"a": 1}, {"b": 2}]


def test_shipped_sharegpt_is_read_record_by_record():
    assert sum(1 for _ in iter_sharegpt()) == 17671  # the truncated file's complete conversations
    source = sharegpt_texts(5, offset=10)
    assert len(source.texts) == 5 and "read" in source.description
    assert all(len(t) >= 200 for t in source.texts)


def test_render_conversation():
    rec = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": " Hello "}]}
    assert render_conversation(rec) == "User: Hi\n\nAssistant: Hello"


def test_text_files(tmp_path):
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps("two") + "\n")
    assert load_text_file(jl).texts == ["one", "two"]
    txt = tmp_path / "a.txt"
    txt.write_text("first\n\nsecond\n")
    assert load_text_file(txt).texts == ["first", "second"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(EdgeKVError, match=r"b.jsonl:2: invalid JSON"):
        load_text_file(bad)
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(EdgeKVError, match="unsupported text file type"):
        load_text_file(csv)


@pytest.mark.parametrize("name", ["default.yaml", "opt-6.7b_1.3b.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(AlignConfig, "align", ROOT / "configs" / name, {"out": "x"})
    assert cfg.cloud and cfg.edge


@pytest.mark.parametrize("name", ["distill.yaml", "distill-data.yaml"])
def test_shipped_distill_configs_load(name):
    """Every key of a shipped distill config is a setting, and its values pass validation."""
    from edgekv.distill.distill_job import DistillConfig

    cfg = load_config(DistillConfig, "distill", ROOT / "configs" / name, {"system_prompt": "x"})
    assert cfg.queries >= 2 and cfg.seeds


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("distill-shared*.yaml")), ids=lambda p: p.name)
def test_every_shared_prefix_recipe_loads_and_names_its_prompts(path):
    """Each shared-prefix recipe (shipped or reported beside) is valid, and the training prompts it names are in the
    repository, so its report's reproduce command runs."""
    from edgekv.distill.distill_job import DistillConfig

    cfg = load_config(DistillConfig, "distill", path, {})
    cfg.validate()
    assert cfg.train_shared and (ROOT / cfg.prompts).is_file()


def test_shipped_shared_prefix_configs_load():
    """The shared prefix's training config and its eval config are valid (issue 37)."""
    from edgekv.distill.distill_job import DistillConfig
    from edgekv.eval.eval_config import EvalConfig

    cfg = load_config(DistillConfig, "distill", ROOT / "configs/distill-shared-news.yaml", {})
    cfg.validate()
    assert cfg.train_shared and cfg.shared_tokens > 0 and (ROOT / cfg.prompts).exists()
    ev = load_config(EvalConfig, "eval", ROOT / "configs/eval/shared-prefix.yaml", {})
    ev.validate()
    assert "edgeprompt-shared" in ev.strategies and ev.shared


def test_the_shipped_shared_prefix_is_what_its_config_trains():
    """prefixes/default-k32's manifest records the recipe of configs/distill-shared-no-mmlu.yaml
    (targets, replies, K, sink freeze, optimiser, seed, init text, the state kept, the training prompts' hash): the file
    states the recipe the shipped prefix was trained with."""
    from edgekv.distill.distill_job import DistillConfig
    from edgekv.distill.shared import prompts_hash
    from edgekv.texts import read_prompts

    cfg = load_config(DistillConfig, "distill", ROOT / "configs/distill-shared-no-mmlu.yaml", {})
    info = json.loads((ROOT / "prefixes/default-k32/manifest.json").read_text(encoding="utf-8"))["shared_prefix"]
    assert info["prompts_sha256"] == prompts_hash(read_prompts(ROOT / cfg.prompts))
    assert info["steps"] <= cfg.steps and info["targets"] == cfg.shared_targets and info["teacher"] == cfg.teacher
    setting = {"tokens": "shared_tokens", "init_text": "shared_init"}  # manifest keys named apart from the config's
    recipe = ("tokens", "freeze_first", "lr", "batch", "query_loss", "grad_through_prompt", "init_text", "seed",
              "reply_sources", "reply_weight", "reply_step_weight")
    assert {k: info[k] for k in recipe} == {k: getattr(cfg, setting.get(k, k)) for k in recipe}
    assert info.get("lr_schedule", "constant") == cfg.lr_schedule  # recorded only when not constant
    assert info.get("lr_decay_from", 0) == cfg.lr_decay_from
    assert info.get("label_tokens", 64) == cfg.label_tokens  # a reply's tokens learnt; recorded when not 64
    assert info.get("keep", "best") == cfg.keep == "last" and info["best_step"] == info["steps"] == cfg.steps


def test_shipped_config_pairs():
    default = load_config(AlignConfig, "align", ROOT / "configs/default.yaml", {"out": "x"})
    paper = load_config(AlignConfig, "align", ROOT / "configs/opt-6.7b_1.3b.yaml", {"out": "x"})
    assert (default.cloud, default.edge) == ("default-cloud", "default-edge")
    assert (paper.cloud, paper.edge) == ("facebook/opt-6.7b", "facebook/opt-1.3b")


def test_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cloud: [unclosed\n")
    with pytest.raises(EdgeKVError, match="invalid YAML"):
        load_config(AlignConfig, "align", bad, {"out": "x"})
    typo = tmp_path / "typo.yaml"
    typo.write_text("clod: x\n")
    with pytest.raises(EdgeKVError, match="did you mean 'cloud'"):
        load_config(AlignConfig, "align", typo, {"out": "x"})
    with pytest.raises(EdgeKVError, match="--tau-cka must be in"):
        load_config(AlignConfig, "align", None, {"out": "x", "tau_cka": 2.0})


def test_a_config_extends_another(tmp_path):
    """`extends:` reads the base first; the file's own top-level keys win and a section merges key by key."""
    from edgekv.distill.distill_job import DistillConfig

    (tmp_path / "base.yaml").write_text("cloud: a\nedge: b\ndistill:\n  prompts: p.jsonl\n  steps: 7\n  lr: 0.1\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ncloud: c\ndistill:\n  steps: 9\n")
    cfg = load_config(DistillConfig, "distill", tmp_path / "child.yaml", {})
    assert (cfg.cloud, cfg.edge, cfg.prompts, cfg.steps, cfg.lr) == ("c", "b", "p.jsonl", 9, 0.1)
    (tmp_path / "loop.yaml").write_text("extends: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("extends: loop.yaml\n")
    for text, message in [("extends: nowhere.yaml\n", "config file not found: .*nowhere.yaml"),
                          ("extends: [base.yaml]\n", "'extends' must name one config file"),
                          ("extends: loop.yaml\n", "'extends' comes back to a file it started from")]:
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(EdgeKVError, match=message):
            load_config(DistillConfig, "distill", tmp_path / "bad.yaml", {})


def test_changed_names_only_the_settings_off_their_defaults():
    from edgekv.config import changed
    from edgekv.distill.distill_job import DistillConfig

    cfg = DistillConfig(prompts="p.jsonl", keep="last", reply_sources=[])
    assert changed(cfg, "keep", "lr_schedule", "reply_sources") == {"keep": "last"}
    assert changed(DistillConfig(prompts="p.jsonl", reply_sources=["sharegpt"]), "reply_sources") == {
        "reply_sources": ["sharegpt"]}  # a list's default comes from its factory


def test_shared_prefix_training_prompts_hold_no_eval_text():
    """The shared prefix's newest training prompts quote no request the eval could draw (ShareGPT repeats
    conversations under new ids: 7 of the first 120 from record 8,000 did), and the check sees such a repeat."""
    from bench.shared_prefix_prompts import eval_pool, eval_quotes, quotes_eval
    from edgekv.models.loading import load_tokenizer
    from edgekv.texts import jsonl_records, read_text

    quotes = eval_quotes(eval_pool(load_tokenizer("default-edge")))
    path = ROOT / "reports/shared-prefix/train-948.jsonl"
    records = [r for _, r in jsonl_records(read_text(str(path), "prompts").splitlines(), str(path))]
    assert len(records) == 948 and not [r["name"] for r in records if quotes_eval(r, quotes)]
    old = ROOT / "reports/shared-prefix/train-509.jsonl"  # made before the check: its leaks are named in its README
    leaks = {r["name"] for _, r in jsonl_records(read_text(str(old), "prompts").splitlines(), str(old))
             if quotes_eval(r, quotes)}
    assert leaks == {"sharegpt-bpxAZiq_9", "sharegpt-IL8zzNA_0", "sharegpt-hQzbwdG_13", "sharegpt-Zomqrzj_5",
                     "sharegpt-tn1RADp_0", "sharegpt-dAhCOSi_15", "sharegpt-i66WgfA_0"}
    clean = records[0]
    assert quotes_eval({**clean, "system_prompt": clean["system_prompt"] + quotes[len(quotes) // 2]}, quotes)
