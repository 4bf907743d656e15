"""The trained translator on a tiny model pair: training lowers held-out KL, and resuming is exact."""

import json

import torch

from bench.translator_training import kl_loss, prepare, train
from edgekv.kv.translators import HiddenTranslator, TrainedTranslator
from edgekv.models.capture import capture
from edgekv.models.loading import load_model
from edgekv.texts import HeldOutText
from tests.helpers import byte_tokenizer, save_model, tiny_qwen2


def _setup(tmp_path, calib_file):
    # initializer_range 0.2: at the usual 0.02 a random tiny model's outputs barely depend on its deep KV
    cloud_dir = save_model(tiny_qwen2(4, 64, 4, 2, seed=1, init=0.2), byte_tokenizer(), tmp_path / "cloud")
    edge_dir = save_model(tiny_qwen2(3, 32, 4, 2, seed=2, init=0.2), byte_tokenizer(), tmp_path / "edge")
    cloud, edge = load_model(cloud_dir, "float32"), load_model(edge_dir, "float32")
    texts = calib_file.read_text().splitlines()
    seqs = [torch.tensor(edge.tokenizer(t)["input_ids"][:70]) for t in texts]
    pairs = [(1, 2), (2, 3)]
    hidden = HiddenTranslator().fit(capture(cloud.model, seqs, ("hidden_in",)),
                                    capture(edge.model, seqs, ("hidden_in",)), pairs, edge.model)
    examples = [HeldOutText("t", s[:40], s[40:70]) for s in seqs]
    return cloud, edge, hidden, examples


def test_training_lowers_heldout_kl(calib_file, tmp_path):
    cloud, edge, hidden, texts = _setup(tmp_path, calib_file)
    trained = TrainedTranslator.from_hidden(hidden)
    train_ex = prepare(edge, cloud, texts[:5], trained, "edge")
    held = prepare(edge, cloud, texts[5:], trained, "edge")[0]
    with torch.no_grad():
        before = float(kl_loss(edge, trained, held, 1, 1))
        assert float(kl_loss(edge, hidden, held, 1, 1)) == before  # same start
    log = train(edge, trained, train_ex, m=1, steps=60, lr=3e-3, sink=1)
    with torch.no_grad():
        after = float(kl_loss(edge, trained, held, 1, 1))
    assert len(log) == 60
    assert after < 0.9 * before, (before, after)
    assert not torch.equal(trained.maps[1].weight, hidden.maps[1].weight)  # the hidden maps were copied


def test_resume_is_exact(calib_file, tmp_path):
    cloud, edge, hidden, texts = _setup(tmp_path, calib_file)
    straight = TrainedTranslator.from_hidden(hidden)
    examples = prepare(edge, cloud, texts[:4], straight, "cloud")
    train(edge, straight, examples, m=1, steps=8, lr=1e-3)
    resumed = TrainedTranslator.from_hidden(hidden)
    train(edge, resumed, examples, m=1, steps=4, lr=1e-3, checkpoint=tmp_path / "ck", every=2)
    again = TrainedTranslator.from_hidden(hidden)  # a fresh process: state comes from the checkpoint only
    first = json.loads((tmp_path / "ck" / "progress.json").read_text())["seconds"]
    log = train(edge, again, examples, m=1, steps=8, lr=1e-3, checkpoint=tmp_path / "ck", every=2)
    assert [e["step"] for e in log] == list(range(1, 9))
    for i in straight.maps:
        assert torch.equal(again.maps[i].weight, straight.maps[i].weight)
    # the seconds go on from the first process's: a report of the resumed run counts both
    assert log[3]["seconds"] == first > 0 and log[-1]["seconds"] > first
    assert json.loads((tmp_path / "ck" / "progress.json").read_text())["seconds"] == log[-1]["seconds"]


def test_a_checkpoint_from_before_the_seconds_were_kept_says_none(calib_file, tmp_path):
    cloud, edge, hidden, texts = _setup(tmp_path, calib_file)
    trained = TrainedTranslator.from_hidden(hidden)
    examples = prepare(edge, cloud, texts[:4], trained, "cloud")
    train(edge, trained, examples, m=1, steps=2, lr=1e-3, checkpoint=tmp_path / "ck", every=2)
    progress = json.loads((tmp_path / "ck" / "progress.json").read_text())
    del progress["seconds"]
    (tmp_path / "ck" / "progress.json").write_text(json.dumps(progress))
    log = train(edge, trained, examples, m=1, steps=4, lr=1e-3, checkpoint=tmp_path / "ck", every=2)
    assert log[-1]["step"] == 4 and log[-1]["seconds"] is None


def test_an_early_stop_hears_the_evaluation_of_its_own_step():
    """Patience counts evaluations without improvement: an evaluation that improves at the step where the patience
    would run out keeps training going (it once stopped there, evaluated after the stop was decided)."""
    from edgekv.kv.train_loop import Trainee, train_loop

    w = torch.zeros(1, requires_grad=True)
    held = {0: 5.0, 2: 4.0, 4: 4.5, 6: 3.0, 8: 4.5, 10: 4.5, 12: 4.5}  # improves at 6: patience 2 evals from 2
    best = {"step": 0, "kl": float("inf")}

    def evaluate(step: int) -> dict:
        if held[step] < best["kl"]:
            best.update(step=step, kl=held[step])
        return {"kl": held[step]}

    trainee = Trainee([{"params": [w]}], lambda step: (w - 1).pow(2).sum(), evaluate=evaluate)
    log = train_loop(trainee, 12, 0.1, every=2, stop=lambda step: step - best["step"] >= 2 * 2)
    assert best["step"] == 6 and log[-1]["step"] == 10  # 6 improved; 8 and 10 did not: stop there


def test_a_schedule_sets_each_steps_rate_and_resumes_exactly(tmp_path):
    import math

    from edgekv.kv.train_loop import Trainee, cosine, train_loop

    assert cosine(8)(0) == 1.0 and cosine(8)(8) == 0.0 and math.isclose(cosine(8)(2), (1 + math.cos(math.pi / 4)) / 2)
    target = torch.tensor([3.0, -2.0, 0.5])

    def run(w, steps, schedule, checkpoint=None):
        trainee = Trainee([{"params": [w]}], lambda step: ((w - target) ** 2 * (1 + step % 3)).sum())
        return train_loop(trainee, steps, 0.1, checkpoint, every=2, schedule=schedule)

    # Adam's first update is lr · sign(grad): the full 0.1 at step 0; a rate of 0 from step 1 on moves nothing more
    w = torch.zeros(3)
    run(w, 5, lambda step: 1.0 if step == 0 else 0.0)
    assert torch.allclose(w, 0.1 * torch.sign(target))
    straight, half, again, constant = (torch.zeros(3) for _ in range(4))
    run(straight, 8, cosine(8))
    run(half, 4, cosine(8), tmp_path / "ck")
    run(again, 8, cosine(8), tmp_path / "ck")  # a fresh process: the state and the step come from the checkpoint
    assert torch.equal(again, straight)
    run(constant, 8, None)
    assert not torch.equal(constant, straight)  # the schedule changed the rates
    # a decay from step 4: constant until then (a constant run's first 4 steps exactly), half a cosine to 0 at 8
    late = cosine(8, 4)
    assert [late(s) for s in (0, 3, 4, 8)] == [1.0, 1.0, 1.0, 0.0] and math.isclose(late(6), 0.5)
    four_late, four_constant, eight_late = torch.zeros(3), torch.zeros(3), torch.zeros(3)
    run(four_late, 4, late)
    run(four_constant, 4, None)
    run(eight_late, 8, late)
    assert torch.equal(four_late, four_constant) and not torch.equal(eight_late, constant)
