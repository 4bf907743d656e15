"""The OpenAI-compatible HTTP layer (FastAPI): it validates requests, queues them on an engine and relays the
engine's events back as JSON or server-sent events. It never runs the model (vLLM's split of engine and server).

POST /v1/completions · POST /v1/chat/completions · GET /v1/models · GET /health · GET /metrics (Prometheus).
Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 invalid request, 401 bad
or missing key (`api_key`), 404 unknown model or path, 413 body too large, 429 queue full, 500 internal.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgekv import EdgeKVError
from edgekv.serve.engine import Engine
from edgekv.serve.pool import ExportPool
from edgekv.serve.requests import EngineBusy, GenRequest, Result, TokenInfo
from edgekv.serve.sampling import SamplingParams
from edgekv.summary import percentile

MAX_LOGPROBS = 5


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code if code else str(status)}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Generation(BaseModel):
    """What completions and chat requests share (fields OpenAI's API has and edgekv does not use are accepted
    and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=10)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class ChatRequest(_Generation):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class ServedModel:
    """The model a request picked: its id and the engine over its system-prompt export."""

    id: str
    engine: Engine


@dataclass
class APISettings:
    """What the server enforces."""

    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 512
    defaults: SamplingParams = field(default_factory=SamplingParams)  # what a request leaves out


def build_app(pool: ExportPool, settings: APISettings | None = None) -> FastAPI:
    """The FastAPI application over a pool of exports (model id → engine, loaded on demand)."""
    settings = settings or APISettings()
    created = int(time.time())
    app = FastAPI(title="edgekv serve-edge", version="1", docs_url=None, redoc_url=None)
    app.state.pool, app.state.settings = pool, settings
    app.state.http_errors = 0
    registry = CollectorRegistry()
    registry.register(_EngineCollector(app))

    def fail(status: int, message: str, **kw) -> JSONResponse:
        app.state.http_errors += 1
        return JSONResponse(error_body(status, message, **kw), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return fail(exc.status, exc.message, type_=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return fail(400, message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return fail(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_=kind)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return fail(500, f"internal error: {type(exc).__name__}", type_="server_error")

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, reject=fail)

    async def auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {settings.api_key}":
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "models": pool.ids(), "loaded": list(pool.loaded())}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def list_models() -> dict:
        return {"object": "list", "data": [{"id": k, "object": "model", "created": created, "owned_by": "edgekv"}
                                           for k in pool.ids()]}

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        model = await _pick_model(pool, body.model)
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", param="echo")
        prompts = _prompt_ids(model.engine, body.prompt)
        params = _sampling(settings, body.echo, max_tokens=body.max_tokens, temperature=body.temperature,
                           top_p=body.top_p, seed=body.seed)
        gens = [GenRequest(ids, params, _stops(body.stop), body.logprobs, body.echo) for ids in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_stream_completion(model, gens, rid, created, usage, request, _start(model.engine, gens)))
        results = await _run_all(model.engine, gens)
        choices = [_completion_choice(model.engine, i, g, r) for i, (g, r) in enumerate(zip(gens, results))]
        return {"id": rid, "object": "text_completion", "created": created, "model": model.id, "choices": choices,
                "usage": _usage(results)}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(body: ChatRequest, request: Request):
        model = await _pick_model(pool, body.model)
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        ids = chat_prompt_ids(model.engine, [m.model_dump() for m in body.messages])
        params = _sampling(settings, max_tokens=body.max_completion_tokens or body.max_tokens,
                           temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        k = (body.top_logprobs or 0) if body.logprobs else None
        gen = GenRequest(ids, params, _stops(body.stop), k)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_stream_chat(model, gen, rid, created, usage, request, _start(model.engine, [gen])))
        result = (await _run_all(model.engine, [gen]))[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": _chat_logprobs(result.tokens) if k is not None else None,
                  "finish_reason": _finish(result)}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model.id, "choices": [choice],
                "usage": _usage([result])}

    return app


class BodyLimit:
    """ASGI middleware: a declared Content-Length over the limit is answered 413 at once; a body without one
    (chunked) is counted as it is read and refused with 413 as soon as it passes the limit."""

    def __init__(self, app, limit: int, reject):
        self.app, self.limit, self.reject = app, limit, reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self.reject(413, f"request body exceeds the limit of {self.limit} bytes",
                                     code="request_too_large")(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # an HTTPException passes FastAPI's body parsing unchanged
                    raise StarletteHTTPException(413, f"request body exceeds the limit of {self.limit} bytes")
            return message

        return await self.app(scope, counted, send)


# ------------------------------------------------------------------------------------------- requests

async def _pick_model(pool: ExportPool, name: str | None) -> ServedModel:
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


def _prompt_ids(engine: Engine, prompt) -> list[torch.Tensor]:
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


def _sampling(settings: APISettings, allow_zero: bool = False, **given) -> SamplingParams:
    """The request's sampling values (None: left out) over serve-edge's defaults, validated."""
    try:
        return settings.defaults.from_request({k: v for k, v in given.items() if v is not None},
                                              settings.max_tokens_limit, min_tokens=0 if allow_zero else 1)
    except EdgeKVError as exc:
        hint = "" if allow_zero else " (0 only with echo)"
        raise APIError(400, f"{exc}{hint}", param="max_tokens") from exc


def _stops(stop) -> list[str]:
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


async def _run_all(engine: Engine, gens: list[GenRequest]) -> list[Result]:
    """Submit every prompt (they decode together) and wait for all of them."""
    seqs, queue = _start(engine, gens)
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

def _finish(r: Result) -> str:
    return "stop" if r.finish_reason == "stop" else "length"


def _usage(results: list[Result]) -> dict:
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


def _completion_choice(engine: Engine, index: int, gen: GenRequest, r: Result) -> dict:
    text, logprobs = r.text, None
    if gen.echo:
        prompt_text = engine.tokenizer.decode(gen.user_ids.tolist())
        text = prompt_text + r.text
    if gen.logprobs is not None:
        infos = (r.prompt or []) + r.tokens if gen.echo else r.tokens
        logprobs = _completion_logprobs(engine, infos)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(r)}


def _chat_logprobs(infos: list[TokenInfo]) -> dict:
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.text, t.logprob), "top_logprobs": [entry(str(k), v) for k, v in
                                                                         (t.top or {}).items()]} for t in infos]}


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _data(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _start(engine: Engine, gens: list[GenRequest]) -> tuple[list, asyncio.Queue]:
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


async def _stream_completion(model: ServedModel, gens: list[GenRequest], rid: str, created: int, usage: bool,
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
                                                  "finish_reason": _finish(payload)}]})
    if usage:
        yield _data({**base, "choices": [], "usage": _usage(results)})
    yield _data("[DONE]")


async def _stream_chat(model: ServedModel, gen: GenRequest, rid: str, created: int, usage: bool,
                       request: Request, started) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.id}
    yield _data({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]})
    results = []
    async for _, kind, payload in _events(model, started, request):
        if kind == "text":
            delta, infos = payload
            lp = _chat_logprobs(infos) if gen.logprobs is not None else None
            yield _data({**base, "choices": [{"index": 0, "delta": {"content": delta}, "logprobs": lp,
                                              "finish_reason": None}]})
        elif kind == "done":
            results.append(payload)
            yield _data({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                              "finish_reason": _finish(payload)}]})
    if usage:
        yield _data({**base, "choices": [], "usage": _usage(results)})
    yield _data("[DONE]")


# ------------------------------------------------------------------------------------------- metrics

class _EngineCollector:
    """Prometheus metrics read from the engines' counters at scrape time."""

    def __init__(self, app: FastAPI):
        self.app = app

    def collect(self):
        pool = self.app.state.pool
        served = pool.loaded()
        counters = {"requests": "Requests accepted", "finished": "Requests finished", "cancelled":
                    "Requests cancelled (client gone)", "errors": "Engine steps that failed", "prompt_tokens":
                    "User-prompt tokens prefilled", "completion_tokens": "Tokens generated", "steps":
                    "Engine steps", "batched_tokens": "Tokens processed by engine forwards"}
        for key, doc in counters.items():
            c = CounterMetricFamily(f"edgekv_{key}", doc, labels=["model"])
            for name, engine in served.items():
                c.add_metric([name], engine.stats[key])
            yield c
        for key in ("waiting", "running"):
            g = GaugeMetricFamily(f"edgekv_requests_{key}", f"Requests {key}", labels=["model"])
            for name, engine in served.items():
                g.add_metric([name], engine.load()[key])
            yield g
        g = GaugeMetricFamily("edgekv_ttft_seconds", "Time to first token, recent requests", labels=["model",
                                                                                                  "quantile"])
        for name, engine in served.items():
            ttfts = list(engine.stats["ttft_s"])
            for q in (0.5, 0.9, 0.99):
                if ttfts:
                    g.add_metric([name, str(q)], percentile(ttfts, q))
        yield g
        yield CounterMetricFamily("edgekv_http_errors", "Requests answered with an error",
                                  value=self.app.state.http_errors)
        for key in ("loads", "unloads"):
            yield CounterMetricFamily(f"edgekv_export_{key}", f"Export {key} (memory budget)", value=pool.stats[key])
        yield GaugeMetricFamily("edgekv_system_kv_bytes", "System KV held by loaded exports", value=pool.held_bytes())
