"""The OpenAI-compatible HTTP layer (FastAPI): it validates requests, queues them on an engine and relays the
engine's events back as JSON or server-sent events. It never runs the model (vLLM's split of engine and server).

POST /v1/completions · POST /v1/chat/completions · GET /v1/models · GET /health · GET /metrics (Prometheus).
Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 invalid request, 401 bad
or missing key (`api_key`), 404 unknown model or path, 413 body too large, 429 queue full, 500 internal.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgekv.serve import api_responses as responses
from edgekv.serve.api_metrics import EngineCollector
from edgekv.serve.api_schema import APIError, APISettings, ChatRequest, CompletionRequest, error_body
from edgekv.serve.pool import ExportPool
from edgekv.serve.requests import GenRequest


def build_app(pool: ExportPool, settings: APISettings | None = None) -> FastAPI:
    """The FastAPI application over a pool of exports (model id → engine, loaded on demand)."""
    settings = settings or APISettings()
    created = int(time.time())
    app = FastAPI(title="edgekv serve-edge", version="1", docs_url=None, redoc_url=None)
    app.state.pool, app.state.settings = pool, settings
    app.state.http_errors = 0
    registry = CollectorRegistry()
    registry.register(EngineCollector(app))

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
        model = await responses.pick_model(pool, body.model)
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        if body.stream and body.echo:
            raise APIError(400, "echo is not supported with stream", param="echo")
        prompts = responses.prompt_ids(model.engine, body.prompt)
        params = responses.sampling(settings, body.echo, max_tokens=body.max_tokens, temperature=body.temperature,
                                    top_p=body.top_p, seed=body.seed)
        gens = [GenRequest(ids, params, responses.stops(body.stop), body.logprobs, body.echo) for ids in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            started = responses.start(model.engine, gens)
            return responses.sse(responses.stream_completion(model, gens, rid, created, usage, request, started))
        results = await responses.run_all(model.engine, gens)
        choices = [responses.completion_choice(model.engine, i, g, r) for i, (g, r) in enumerate(zip(gens, results))]
        return {"id": rid, "object": "text_completion", "created": created, "model": model.id, "choices": choices,
                "usage": responses.usage_of(results)}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(body: ChatRequest, request: Request):
        model = await responses.pick_model(pool, body.model)
        if body.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        ids = responses.chat_prompt_ids(model.engine, [m.model_dump() for m in body.messages])
        params = responses.sampling(settings, max_tokens=body.max_completion_tokens or body.max_tokens,
                                    temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        k = (body.top_logprobs or 0) if body.logprobs else None
        gen = GenRequest(ids, params, responses.stops(body.stop), k)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            started = responses.start(model.engine, [gen])
            return responses.sse(responses.stream_chat(model, gen, rid, created, usage, request, started))
        result = (await responses.run_all(model.engine, [gen]))[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": responses.chat_logprobs(result.tokens) if k is not None else None,
                  "finish_reason": responses.finish_reason(result)}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model.id, "choices": [choice],
                "usage": responses.usage_of([result])}

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
