"""Activation capture on tiny models."""

import torch

from edgekv.align.similarity import linear_cka
from edgekv.models.capture import capture
from edgekv.models.structure import rotary_cos_sin, rotate_keys, unrotate_keys
from tests.helpers import tiny_opt, tiny_qwen2


def test_shapes_and_selection():
    model = tiny_qwen2(3, 32, 4, 2, seed=0)
    seqs = [torch.randint(0, 256, (10,)), torch.randint(0, 256, (7,))]
    acts = capture(model, seqs, ("hidden", "k", "v", "k_unrot"), select=lambda t, n: torch.arange(1, n))
    assert acts.num_tokens == 9 + 6
    assert acts.layers["hidden"][2].shape == (15, 32)
    assert acts.layers["k"][0].shape == (15, 2 * 8) and acts.layers["v"][0].shape == (15, 16)
    assert acts.positions.tolist() == list(range(1, 10)) + list(range(1, 7))
    assert acts.text_index.tolist() == [0] * 9 + [1] * 6
    assert all(t.dtype == torch.float32 for t in acts.layers["hidden"])


def test_hidden_states_are_block_outputs():
    model = tiny_qwen2(2, 32, 4, 2, seed=0)
    seq = torch.randint(0, 256, (6,))
    seen = []
    handle = model.model.layers[1].register_forward_hook(
        lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
    acts = capture(model, [seq], ("hidden",))
    handle.remove()
    assert torch.allclose(acts.layers["hidden"][1], seen[0][0].float())


def test_unrotated_keys_equal_k_proj_output():
    model = tiny_qwen2(2, 32, 4, 2, seed=0).float()
    seq = torch.randint(0, 256, (12,))
    raw = []
    handle = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: raw.append(o))
    acts = capture(model, [seq], ("k", "k_unrot"))
    handle.remove()
    assert torch.allclose(acts.layers["k_unrot"][1], raw[0][0], atol=1e-5)
    assert not torch.allclose(acts.layers["k"][1], raw[0][0], atol=1e-3)  # rotary did change them


def test_rotate_unrotate_roundtrip():
    model = tiny_qwen2(1, 32, 4, 2, seed=0).float()
    keys = torch.randn(1, 2, 9, 8)
    cs = rotary_cos_sin(model, torch.arange(5, 14)[None], keys)
    assert torch.allclose(unrotate_keys(rotate_keys(keys, *cs), *cs), keys, atol=1e-6)


def test_opt_has_no_rotary():
    model = tiny_opt(2, 32, 4, seed=0)
    acts = capture(model, [torch.randint(0, 256, (8,))], ("k", "k_unrot"))
    assert torch.equal(acts.layers["k"][0], acts.layers["k_unrot"][0])


def test_model_against_itself_has_unit_diagonal():
    model = tiny_qwen2(3, 32, 4, 2, seed=0)
    seqs = [torch.randint(0, 256, (20,)) for _ in range(3)]
    a = capture(model, seqs, ("hidden",))
    b = capture(model, seqs, ("hidden",))
    for i in range(3):
        assert abs(linear_cka(a.layers["hidden"][i], b.layers["hidden"][i]) - 1.0) < 1e-9


def test_queries_match_attention_internals():
    # rotated queries · rotated keys, scaled, must reproduce the model's own attention logits
    model = tiny_qwen2(1, 32, 4, 2, seed=0).float()
    model.config._attn_implementation = "eager"
    seq = torch.randint(0, 256, (9,))
    out = model(seq[None], output_attentions=True)
    acts = capture(model, [seq], ("q", "k"))
    q = acts.layers["q"][0].reshape(9, 4, 8).transpose(0, 1)
    k = acts.layers["k"][0].reshape(9, 2, 8).transpose(0, 1).repeat_interleave(2, dim=0)
    logits = (q @ k.transpose(1, 2)) / 8 ** 0.5
    logits = logits + torch.triu(torch.full((9, 9), float("-inf")), diagonal=1)
    assert torch.allclose(torch.softmax(logits, -1), out.attentions[0][0], atol=1e-5)


def test_head_runs_on_one_row_unless_the_logits_are_read():
    """The LM head is 15-28 % of a prefill over a real vocabulary: capture asks for one row of logits unless an
    `on_output` caller reads them, and then for every row."""
    model = tiny_qwen2(2, 32, 4, 2, seed=0)
    seq = torch.randint(0, 256, (9,))
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    plain = capture(model, [seq], ("hidden",))
    seen = []
    read = capture(model, [seq], ("hidden",), on_output=lambda t, out: seen.append(out.logits[0]))
    handle.remove()
    assert rows == [1, 9]
    assert seen[0].shape == (9, model.config.vocab_size)
    assert torch.equal(plain.layers["hidden"][1], read.layers["hidden"][1])
