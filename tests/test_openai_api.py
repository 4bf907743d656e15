"""The OpenAI-compatible server with real clients: the official `openai` package against tiny models."""

import json
import threading
import urllib.request

import openai
import pytest

from edgekv.serve.http_server import EdgeServer
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from tests.helpers import USERS, make_export

KEY = "sk-test-edgekv"


@pytest.fixture(scope="module")
def served(edge, edge_dir, tmp_path_factory):  # noqa: F811 (the imported fixtures)
    tmp = tmp_path_factory.mktemp("api")
    session = EdgeSession(edge, str(make_export(edge_dir, tmp / "kv", 1)), cache_dir=tmp / "c")
    srv = EdgeServer(session, "127.0.0.1", 0, max_body=4096, max_tokens_limit=64, api_key=KEY, max_batch=8)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield url, srv
    srv.server_close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_auth(served, client):
    url, srv = served
    assert [m.id for m in client.models.list().data] == ["kv"]
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with urllib.request.urlopen(url + "/health") as r:  # health and metrics are not behind the key
        assert json.loads(r.read())["status"] == "ok"


def test_completions_plain_streamed_stop_and_token_ids(client, served):
    srv = served[1]
    plain = client.completions.create(model="kv", prompt=USERS[0], max_tokens=12, temperature=0)
    text = plain.choices[0].text
    assert plain.object == "text_completion" and plain.usage.completion_tokens == 12 and len(text) > 0
    pieces = [c.choices[0].text for c in client.completions.create(model="kv", prompt=USERS[0], max_tokens=12,
                                                                   stream=True) if c.choices]
    assert "".join(pieces) == text
    stop = text[4:6]
    cut = client.completions.create(model="kv", prompt=USERS[0], max_tokens=12, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(stop)]
    ids = srv.session.encode_user(USERS[0]).tolist()
    by_ids = client.completions.create(model="kv", prompt=ids, max_tokens=12)
    assert by_ids.choices[0].text == text
    many = client.completions.create(model="kv", prompt=[USERS[0], USERS[1]], max_tokens=5)
    twice = client.completions.create(model="kv", prompt=[ids, ids], max_tokens=5)
    assert twice.choices[1].text == many.choices[0].text
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == text[:len(many.choices[0].text)]
    usage = [c for c in client.completions.create(model="kv", prompt=USERS[1], max_tokens=3, stream=True,
                                                  stream_options={"include_usage": True})]
    assert usage[-1].usage.completion_tokens == 3


def test_logprobs_and_echo(client, served):
    srv = served[1]
    got = client.completions.create(model="kv", prompt=USERS[0], max_tokens=6, logprobs=3)
    lp = got.choices[0].logprobs
    # keyed by token text, as OpenAI's: ids that decode alike (stray bytes → '�') share one key
    assert len(lp.tokens) == 6 and all(0 < len(t) <= 3 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v, abs=1e-6) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == got.choices[0].text
    echo = client.completions.create(model="kv", prompt=USERS[1], max_tokens=0, logprobs=1, echo=True)
    n = len(srv.session.encode_user(USERS[1]))
    e = echo.choices[0].logprobs
    assert echo.choices[0].text == USERS[1] and len(e.tokens) == n
    assert e.token_logprobs[0] is None and all(v <= 0 for v in e.token_logprobs[1:])
    one = client.completions.create(model="kv", prompt=USERS[1], max_tokens=1, logprobs=1, echo=True)
    assert one.choices[0].logprobs.token_logprobs[:n] == pytest.approx(e.token_logprobs[:n], abs=1e-5)
    assert len(one.choices[0].logprobs.tokens) == n + 1


def test_chat_plain_and_streamed(client):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    plain = client.chat.completions.create(model="kv", messages=messages, max_tokens=10)
    answer = plain.choices[0].message
    assert plain.object == "chat.completion" and answer.role == "assistant" and plain.usage.completion_tokens == 10
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="kv", messages=messages, max_tokens=10, stream=True) if c.choices]
    assert "".join(pieces) == answer.content
    scored = client.chat.completions.create(model="kv", messages=messages, max_tokens=4, logprobs=True,
                                            top_logprobs=2)
    assert len(scored.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in scored.choices[0].logprobs.content)


def test_bad_requests_answer_in_openais_shape(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="kv", prompt="hi", max_tokens=1000)
    assert "max_tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kv", prompt=[10 ** 9], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kv", prompt="hi", n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="kv", messages=[], max_tokens=2)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="kv", prompt="x" * 5000, max_tokens=2)
    assert err.value.status_code == 413


def test_a_client_that_leaves_mid_stream_frees_its_slot(client, served, monkeypatch):
    import time

    srv = served[1]
    engine = srv.engine
    step = engine._step
    monkeypatch.setattr(engine, "_step", lambda admitted: (time.sleep(0.03), step(admitted)))  # 64 steps ≈ 2 s
    before = engine.stats["cancelled"]
    stream = client.completions.create(model="kv", prompt=USERS[0], max_tokens=64, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away
    deadline = time.monotonic() + 120  # generous: a busy machine only makes it take longer, never pass wrongly
    while engine.load()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.load() == {"waiting": 0, "running": 0}
    assert engine.stats["cancelled"] == before + 1  # dropped, not run to its 64 tokens


def test_many_exports_per_server_and_a_memory_budget(edge, edge_dir, tmp_path):  # noqa: F811
    from edgekv.serve.serve_job import ServeConfig, open_server, open_session

    folder = tmp_path / "exports"
    make_export(edge_dir, folder / "support", 1)
    make_export(edge_dir, folder / "legal", 1, system="System: you answer questions about contracts, tersely. ")
    one = EdgeSession(edge, str(folder / "support"), cache_dir=tmp_path / "c")
    budget_mb = one.system.nbytes * 1.5 / 2**20  # room for one export's system KV, not two
    cfg = ServeConfig(edge=edge_dir, kv=str(folder), dtype="float32", port=1, max_kv_mb=budget_mb,
                      cache_dir=str(tmp_path / "c"), max_tokens_limit=16, max_new_tokens=8)
    pool = open_session(cfg)
    assert pool.ids() == ["legal", "support"] and len(pool.loaded()) == 1  # both verified at start, one kept
    cfg.port = 0
    srv = open_server(cfg, pool)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="none",
                               max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["legal", "support"]
        ask = lambda m: client.completions.create(model=m, prompt=USERS[0], max_tokens=8).choices[0].text  # noqa
        support, legal = ask("support"), ask("legal")
        assert support == one.complete(USERS[0], SamplingParams(max_new_tokens=8)).text
        assert support != legal  # another system prompt, another answer
        assert list(pool.loaded()) == ["legal"] and pool.stats["unloads"] >= 2
        assert ask("support") == support  # reloaded (verified again) on demand, same answer
        with pytest.raises(openai.NotFoundError):
            ask("nope")
    finally:
        srv.server_close()


def test_a_chunked_body_over_the_limit_is_refused(served):
    import http.client

    url, _ = served
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    body = iter([b'{"prompt": "', b"x" * 3000, b"y" * 3000, b'", "max_tokens": 2}'])
    conn.request("POST", "/v1/completions", body=body, encode_chunked=True,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    error = json.loads(resp.read())["error"]
    assert resp.status == 413 and "exceeds the limit" in error["message"]
    conn.close()
