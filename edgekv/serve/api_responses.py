"""From requests to the engine and back: prompt token ids (completions and chat), sampling and stops, the
engine's events relayed as OpenAI JSON or server-sent events (with log-probs and usage)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse

from edgekv import EdgeKVError
from edgekv.serve.api_schema import APIError, APISettings, ServedModel, error_body
from edgekv.serve.engine import Engine
from edgekv.serve.pool import ExportPool
from edgekv.serve.requests import EngineBusy, GenRequest, Result, TokenInfo
from edgekv.serve.sampling import SamplingParams


async def pick_model(pool: ExportPool, name: str | None) -> ServedModel:
    """The request's model (the only one when it names none); an unloaded export is loaded off the event loop."""
    ids = pool.ids()
    if name is None and len(ids) == 1:
        name = ids[0]
    name = pool.resolve(name) or name
    if name not in ids:
        raise APIError(404, f"the model '{name}' does not exist (GET /v1/models lists them)", param="model",
                       code="model_not_found")
    try:
        return ServedModel(name, await asyncio.to_thread(pool.get, name))
    except EdgeKVError as exc:
        raise APIError(503, f"the model '{name}' could not be loaded: {exc}", type_="server_error",
                       code="model_unavailable") from exc


def prompt_ids(engine: Engine, prompt) -> list[torch.Tensor]:
    """One id tensor per prompt: a string, a list of strings, token ids or a list of token-id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    vocab = len(engine.tokenizer)
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = engine.tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            if any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def chat_prompt_ids(engine: Engine, messages: list[dict]) -> torch.Tensor:
    """The conversation's tokens after the export's system prompt (which stands for the system turn).

    With a chat template, the turns are rendered as they follow a system turn (the template's own default
    system message is not added; a request's own system/developer messages become system turns here, computed
    locally like the rest); without one, 'Role: content' lines and an 'Assistant:' cue."""
    tok = engine.tokenizer
    turns = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
             for m in messages]
    if getattr(tok, "chat_template", None):
        sentinel = [{"role": "system", "content": "\x00edgekv-system\x00"}]
        head = tok.apply_chat_template(sentinel, tokenize=False)
        full = tok.apply_chat_template(sentinel + turns, tokenize=False, add_generation_prompt=True)
        text = full[len(head):] if full.startswith(head) else full
    else:
        text = "".join(f"\n{m['role'].capitalize()}: {m['content']}" for m in turns) + "\nAssistant:"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise APIError(400, "the conversation is empty", param="messages")
    return torch.tensor(ids, dtype=torch.long)


def sampling(settings: APISettings, allow_zero: bool = False, **given) -> SamplingParams:
    """The request's sampling values (None: left out) over serve-edge's defaults, validated."""
    try:
        return settings.defaults.from_request({k: v for k, v in given.items() if v is not None},
                                              settings.max_tokens_limit, min_tokens=0 if allow_zero else 1)
    except EdgeKVError as exc:
        hint = "" if allow_zero else " (0 only with echo)"
        raise APIError(400, f"{exc}{hint}", param="max_tokens") from exc


def stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
    return stops


def _submit(engine: Engine, gen: GenRequest, queue: asyncio.Queue, index: int):
    loop = asyncio.get_running_loop()

    def on_event(kind: str, payload) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, kind, payload))

    try:
        return engine.submit(gen, on_event)
    except EngineBusy as exc:
        raise APIError(429, str(exc), type_="rate_limit_error", code="rate_limit_exceeded") from exc
    except EdgeKVError as exc:
        raise APIError(400, str(exc), param="prompt") from exc


async def run_all(engine: Engine, gens: list[GenRequest]) -> list[Result]:
    """Submit every prompt (they decode together) and wait for all of them."""
    seqs, queue = start(engine, gens)
    try:
        results: dict[int, Result] = {}
        while len(results) < len(gens):
            i, kind, payload = await queue.get()
            if kind == "done":
                results[i] = payload
    finally:
        _cancel_unfinished(engine, seqs)
    for r in results.values():
        if r.finish_reason == "error":
            raise APIError(500, r.error or "internal error", type_="server_error")
    return [results[i] for i in range(len(gens))]


# ------------------------------------------------------------------------------------------- responses

def finish_reason(r: Result) -> str:
    return "stop" if r.finish_reason == "stop" else "length"


def usage_of(results: list[Result]) -> dict:
    p, c = sum(r.prompt_tokens for r in results), sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _top_by_text(engine: Engine, top: dict[int, float] | None) -> dict[str, float] | None:
    if top is None:
        return None
    out: dict[str, float] = {}
    for t, lp in top.items():
        key = engine.tokenizer.decode([t])
        out[key] = max(lp, out.get(key, float("-inf")))
    return out


def _completion_logprobs(engine: Engine, infos: list[TokenInfo], start: int = 0) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = start
    for t in infos:
        tokens.append(t.text)
        lps.append(t.logprob)
        tops.append(_top_by_text(engine, t.top))
        offsets.append(pos)
        pos += len(t.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def completion_choice(engine: Engine, index: int, gen: GenRequest, r: Result) -> dict:
    text, logprobs = r.text, None
    if gen.echo:
        prompt_text = engine.tokenizer.decode(gen.user_ids.tolist())
        text = prompt_text + r.text
    if gen.logprobs is not None:
        infos = (r.prompt or []) + r.tokens if gen.echo else r.tokens
        logprobs = _completion_logprobs(engine, infos)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(r)}


def chat_logprobs(infos: list[TokenInfo]) -> dict:
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(str(k), v) for k, v in
                                                                         (t.top or {}).items()]} for t in infos]}


def sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def start(engine: Engine, gens: list[GenRequest]) -> tuple[list, asyncio.Queue]:
    """Submit every prompt, all or none (a stream's before its 200 is sent: a full queue is still a 429);
    their events arrive on the queue as (index, kind, payload)."""
    queue: asyncio.Queue = asyncio.Queue()
    seqs = []
    try:
        for i, g in enumerate(gens):
            seqs.append(_submit(engine, g, queue, i))
    except APIError:
        _cancel_unfinished(engine, seqs)
        raise
    return seqs, queue


def _cancel_unfinished(engine: Engine, seqs: list) -> None:
    for s in seqs:
        if s.finish is None:
            engine.cancel(s)


async def _events(model: ServedModel, started: tuple[list, asyncio.Queue], request: Request):
    """(index, kind, payload) events of all prompts until each is done; cancels them if the client leaves."""
    seqs, queue = started
    left = len(seqs)
    try:
        while left:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            left -= item[1] == "done"
            yield item
    finally:
        _cancel_unfinished(model.engine, seqs)


async def stream_completion(model: ServedModel, gens: list[GenRequest], rid: str, created: int, usage: bool,
                             request: Request, started) -> AsyncIterator[str]:
    base = {"id": rid, "object": "text_completion", "created": created, "model": model.id}
    results: list[Result] = []
    offsets = [0] * len(gens)
    async for i, kind, payload in _events(model, started, request):
        if kind == "text":
            delta, infos = payload
            lp = None
            if gens[i].logprobs is not None:
                lp = _completion_logprobs(model.engine, infos, offsets[i])
                offsets[i] += sum(len(t.text) for t in infos)
            yield _data({**base, "choices": [{"index": i, "text": delta, "logprobs": lp, "finish_reason": None}]})
        elif kind == "done":
            results.append(payload)
            if payload.finish_reason == "error":
                yield _data(error_body(500, payload.error or "internal error", type_="server_error"))
            else:
                yield _data({**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                                  "finish_reason": finish_reason(payload)}]})
    if usage:
        yield _data({**base, "choices": [], "usage": usage_of(results)})
    yield _data("[DONE]")


async def stream_chat(model: ServedModel, gen: GenRequest, rid: str, created: int, usage: bool,
                       request: Request, started) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.id}
    yield _data({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]})
    results = []
    async for _, kind, payload in _events(model, started, request):
        if kind == "text":
            delta, infos = payload
            lp = chat_logprobs(infos) if gen.logprobs is not None else None
            yield _data({**base, "choices": [{"index": 0, "delta": {"content": delta}, "logprobs": lp,
                                              "finish_reason": None}]})
        elif kind == "done":
            results.append(payload)
            yield _data({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                              "finish_reason": finish_reason(payload)}]})
    if usage:
        yield _data({**base, "choices": [], "usage": usage_of(results)})
    yield _data("[DONE]")
