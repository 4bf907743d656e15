"""The serving engine on tiny models: batched relay decoding equals one-at-a-time decoding token for token."""

import threading

import pytest
import torch

from edgekv.attention.merge import segment_attention
from edgekv.attention.relay import RelayBatch, relay_attention
from edgekv.serve.requests import EngineBusy, GenRequest
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from tests.helpers import USERS, cyclic_sessions, make_export

PROMPTS = USERS + ["User: a much longer question about caches, layers, heads and the way the edge decodes " * 2,
                   "Hi", "User: 12345"]


@pytest.fixture()
def session(edge, edge_dir, tmp_path):  # noqa: F811 (the imported fixtures)
    s = EdgeSession(edge, str(make_export(edge_dir, tmp_path / "kv", 1)), cache_dir=tmp_path / "c")
    s.eos_ids = set()  # compare every token even past an EOS
    return s


def test_relay_attention_equals_one_softmax_over_system_and_own_keys():
    """A packed step of two decode rows and a 3-token prefill chunk = per request, one causal softmax over
    [system keys; its own keys] (float64)."""
    torch.manual_seed(0)
    heads, kv_heads, d, s = 4, 2, 8, 11
    f64 = dict(dtype=torch.float64)
    sys_k, sys_v = torch.randn(1, kv_heads, s, d, **f64), torch.randn(1, kv_heads, s, d, **f64)
    own_lens, q_lens = [3, 1, 5], [1, 1, 3]  # own lengths after the step, the new tokens last
    own = [[torch.randn(1, kv_heads, n, d, **f64), torch.randn(1, kv_heads, n, d, **f64)] for n in own_lens]
    q = torch.randn(1, heads, sum(q_lens), d, **f64)

    class Layer(torch.nn.Module):
        layer_idx = 0

    out = relay_attention(Layer(), q, RelayBatch(lambda i: (sys_k, sys_v), own, q_lens))  # (1, ΣT, heads, d)
    row = 0
    for (k, v), n, t in zip(own, own_lens, q_lens):
        keys, values = torch.cat([sys_k, k], 2), torch.cat([sys_v, v], 2)
        visible = torch.arange(s + n)[None, :] <= torch.arange(s + n - t, s + n)[:, None]
        want, _ = segment_attention(q[:, :, row:row + t], keys, values, visible[None, None])
        assert (out[0, row:row + t].transpose(0, 1) - want[0]).abs().max() < 1e-12
        row += t


def test_batched_greedy_equals_one_at_a_time(session):
    one = session.engine(max_batch=1)
    try:
        want = {p: one.generate(GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=16))).token_ids
                for p in PROMPTS}
    finally:
        one.close()
    for p in PROMPTS:  # the engine at batch size 1 is the session's own decoding
        assert session.complete(p, SamplingParams(max_new_tokens=16)).token_ids == want[p]
    engine = session.engine(max_batch=8)
    results, lock = {}, threading.Lock()
    try:
        threads = []
        for n, p in enumerate(PROMPTS * 2):  # mixed lengths, arriving while others decode
            def run(p=p, n=n):
                r = engine.generate(GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=16 - n % 3)))
                with lock:
                    results[(p, n)] = r
            threads.append(threading.Thread(target=run))
            threads[-1].start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    for (p, n), r in results.items():
        assert r.token_ids == want[p][:16 - n % 3]
        assert r.finish_reason == "length"
    inline = session.engine(max_batch=8, background=False)  # no thread: the caller's thread runs the steps
    done = []
    try:
        assert inline.thread is None
        got = inline.generate_all([GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=16 - n % 3))
                                   for n, p in enumerate(PROMPTS * 2)], on_done=lambda: done.append(1))
    finally:
        inline.close()
    assert [r.token_ids for r in got] == [want[p][:16 - n % 3] for n, p in enumerate(PROMPTS * 2)]
    assert len(done) == 2 * len(PROMPTS) and inline.stats["steps"] > 1
    assert engine.stats["batched_tokens"] > engine.stats["steps"]  # some steps carried several requests


def test_stop_strings_logprobs_echo_and_a_full_queue(session):
    engine = session.engine(max_batch=4, max_queue=2)
    try:
        full = engine.generate(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=12),
                                          logprobs=2, echo=True))
        assert len(full.tokens) == 12 and all(len(t.top) == 2 and t.logprob <= 0 for t in full.tokens)
        assert all(t.logprob >= min(t.top.values()) - 1e-6 for t in full.tokens)  # greedy: the top-1 token
        assert full.prompt[0].logprob is None and all(t.logprob <= 0 for t in full.prompt[1:])
        stop = full.text[3:5]
        cut = engine.generate(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=12),
                                         stop=[stop]))
        assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
        scored = engine.generate(GenRequest(session.encode_user(USERS[1]), SamplingParams(max_new_tokens=0),
                                            logprobs=0, echo=True))
        assert scored.token_ids == [] and len(scored.prompt) == len(session.encode_user(USERS[1]))
        gate = threading.Event()
        with engine.cv:  # the loop cannot admit while we hold its lock (a Condition's RLock: we may submit)
            engine.submit(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=4)),
                          lambda kind, payload: None)
            engine.submit(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=4)),
                          lambda kind, payload: gate.set() if kind == "done" else None)
            with pytest.raises(EngineBusy, match="at capacity"):
                engine.submit(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=4)),
                              lambda kind, payload: None)
        gate.wait(60)
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_batch(session):
    engine = session.engine(max_batch=4)
    events, box = [], []
    done = threading.Event()

    def on_event(kind, payload):
        events.append(kind)
        if kind == "text" and events.count("text") == 1:
            engine.cancel(box[0])  # the client goes away after its first piece of text
        if kind == "done":
            box.append(payload)
            done.set()

    try:
        with engine.cv:
            box.append(engine.submit(GenRequest(session.encode_user(USERS[0]), SamplingParams(max_new_tokens=300)),
                                     on_event))
        assert done.wait(60)
        result = box[1]
        assert result.finish_reason == "cancelled" and len(result.token_ids) <= 2
        assert engine.load() == {"waiting": 0, "running": 0} and engine.stats["cancelled"] == 1
    finally:
        engine.close()


def test_chunked_prefill_equals_one_chunk(session):
    """Prompts longer than the step's token budget are prefilled over several steps: same tokens, same echo."""
    whole, chunked = session.engine(max_step_tokens=512), session.engine(max_batch=4, max_step_tokens=5)
    try:
        for p in PROMPTS:
            req = lambda: GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=8), logprobs=1,  # noqa
                                     echo=True)
            a, b = whole.generate(req()), chunked.generate(req())
            assert a.token_ids == b.token_ids
            assert [t.logprob for t in a.prompt[1:]] == pytest.approx([t.logprob for t in b.prompt[1:]], abs=1e-5)
        assert chunked.stats["steps"] > whole.stats["steps"]
    finally:
        whole.close()
        chunked.close()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_flash_kernel_segment_equals_the_reference(dtype, tol):
    from edgekv.attention.merge import fast_segment_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 14, 1, 64, dtype=dtype), torch.randn(3, 2, 9, 64, dtype=dtype),
               torch.randn(3, 2, 9, 64, dtype=dtype))
    valid = (torch.arange(9)[None] < torch.tensor([4, 9, 1])[:, None])[:, None, None, :]
    with torch.no_grad():
        for args in ((q, k, v, valid), (q, k, v, None), (torch.randn(1, 14, 5, 64, dtype=dtype), k[:1], v[:1])):
            causal = args[0].shape[2] > 1
            got, got_lse = fast_segment_attention(*args[:3], args[3] if len(args) > 3 else None, causal=causal)
            want, want_lse = segment_attention(*args[:3], args[3] if len(args) > 3 else None, causal=causal)
            assert (got.float() - want.float()).abs().max() < tol and (got_lse - want_lse).abs().max() < 1e-4


def test_the_flash_path_with_no_keys_has_zero_weight():
    from edgekv.attention.merge import fast_segment_attention, merge_attention

    q, none = torch.randn(1, 4, 3, 8), torch.zeros(1, 2, 0, 8)
    with torch.no_grad():
        out, lse = fast_segment_attention(q, none, none)
        own, own_lse = fast_segment_attention(q, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), causal=True)
    assert torch.isneginf(lse).all() and torch.equal(merge_attention(out, lse, own, own_lse), own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_block_over_a_cache_equals_stock_sdpa_with_grouped_heads_folded(dtype):
    """The edgekv attention's path without a cloud segment (a splice, a prompt chunk over a cache) folds the
    grouped-query heads into the query axis instead of repeating the keys: the same numbers as transformers'."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from edgekv.attention import merge
    from edgekv.attention.fuse import fused_attention

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=7, is_causal=True, layer_idx=0, training=False)
    b, t, s = 2, 6, 15  # 9 cached tokens, then a block of 6 new ones; the second row left-padded by 3
    q = torch.randn(b, 14, t, 64, dtype=dtype)
    k, v = torch.randn(b, 2, s, 64, dtype=dtype), torch.randn(b, 2, s, 64, dtype=dtype)
    mask = (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None])[None, None].repeat(b, 1, 1, 1)
    mask[1, ..., :3] = False
    with torch.no_grad():
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
        got, _ = fused_attention(module, q, k, v, mask, scaling=0.125)
        assert got.shape == want.shape == (b, t, 14, 64)
        assert torch.equal(got, want)
        cached = merge._LAST_MASK[2]
        again, _ = fused_attention(module, q, k, v, mask, scaling=0.125)  # the next layer: the same mask object
        assert merge._LAST_MASK[2] is cached and torch.equal(again, want)
        other = mask.clone()
        other[0, ..., :2] = False
        fresh, _ = fused_attention(module, q, k, v, other, scaling=0.125)  # a new mask is never served stale
        assert torch.equal(fresh, sdpa_attention_forward(module, q, k, v, other, scaling=0.125)[0])


def test_on_fresh_thread_returns_or_raises_what_the_function_did_on_another_thread():
    from edgekv import EdgeKVError
    from edgekv.runtime import on_fresh_thread

    me = threading.get_ident()
    assert on_fresh_thread(lambda a, b=0: (a + b, threading.get_ident()), 2, b=3)[0] == 5
    assert on_fresh_thread(threading.get_ident) != me
    with pytest.raises(EdgeKVError, match="bad export"):
        on_fresh_thread(lambda: (_ for _ in ()).throw(EdgeKVError("bad export")))


def test_the_engines_step_without_the_wrapper_equals_the_models_forward(session):
    """Relay steps (prompt chunks and decode tokens of many requests) and one-request decode tokens through
    `DecodeStep` give the model's own forward's tokens and log-probs exactly."""
    def run(fast: bool, relay: bool) -> list:
        engine = session.engine(max_batch=8 if relay else 1, max_step_tokens=7, background=False, relay=relay)
        assert engine._decode_step is not None  # the tiny edge is a Qwen2
        if not fast:
            engine._decode_step = None
        reqs = [GenRequest(session.encode_user(p), SamplingParams(max_new_tokens=6), logprobs=2, echo=True)
                for p in (PROMPTS if relay else PROMPTS[:2])]
        try:
            out = engine.generate_all(reqs)
        finally:
            engine.close()
        return [(r.token_ids, [(t.logprob, t.top) for t in r.tokens], [t.logprob for t in r.prompt[1:]]) for r in out]

    for relay in (True, False):
        assert run(True, relay) == run(False, relay)


def test_a_follow_up_that_cannot_be_queued_ends_its_place_with_the_error(edge, export, tmp_path):
    """generate_all(follow=…): a follow-up the engine refuses (here: beyond the context) ends that place with the
    error instead of leaving the call waiting; the other places get their follow-ups' results."""
    session = EdgeSession(edge, str(export), cache_dir=tmp_path / "c")
    engine = session.engine(max_batch=4, background=False)
    first = [GenRequest(session.encode_user(u), SamplingParams(max_new_tokens=2)) for u in ("a", "b")]
    too_long = torch.ones(session.max_context, dtype=torch.long)

    def follow(n, result):
        if result.prompt_tokens > 8:  # a follow-up's own result: nothing more
            return None
        return GenRequest(too_long if n == 0 else session.encode_user("more text here"), SamplingParams(2))

    got = engine.generate_all(first, follow=follow)
    assert got[0].finish_reason == "error" and "context" in got[0].error
    assert got[1].finish_reason in ("length", "stop") and got[1].prompt_tokens == len("more text here")


class _Stop(Exception):
    pass


def test_a_caller_that_raises_leaves_no_cycle_holding_the_engine(edge, export, tmp_path):
    """generate_all whose progress callback raises after the last request (a Ctrl-C in the eval's bar), with
    follow-ups resubmitted on the way: the engine and its session are freed by reference counting alone, with no
    reference cycle left for the cyclic collector."""
    session = EdgeSession(edge, str(export), cache_dir=tmp_path / "c")
    engine = session.engine(max_batch=4, background=False)
    reqs = [GenRequest(session.encode_user(u), SamplingParams(max_new_tokens=2)) for u in ("a", "b", "c")]
    more = GenRequest(session.encode_user("more"), SamplingParams(max_new_tokens=2))
    follow_ups, done = [], []

    def follow(n, result):
        if n == 1 and not follow_ups:  # one place is resubmitted through its handler
            follow_ups.append(n)
            return more
        return None

    def on_done():
        done.append(1)
        if len(done) == 3:  # the last request
            raise _Stop

    cyclic_sessions()  # what earlier tests left
    with pytest.raises(_Stop):
        engine.generate_all(reqs, on_done=on_done, follow=follow)
    assert follow_ups == [1] and engine.load() == {"waiting": 0, "running": 0}
    del engine, session
    assert cyclic_sessions() == []
