"""HTTP serving of an `EdgeSession` (stdlib threading HTTP server, OpenAI-style JSON and server-sent events).

POST /v1/completions {"prompt", "max_tokens", "temperature", "top_p", "seed", "stream"} · GET /healthz ·
GET /metrics. Bad requests get a JSON error with 400 (malformed), 413 (body too large) or 404, and the server
keeps running. Requests run on their own threads; the session interleaves their forward passes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from edgekv import EdgeKVError
from edgekv.serve.session import Completion, EdgeSession, SamplingParams

log = logging.getLogger("edgekv")


class RequestError(Exception):
    """A client error: HTTP status + message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, max_tokens_limit: int, defaults: SamplingParams | None = None
                  ) -> tuple[str, SamplingParams, bool]:
    """(prompt, sampling parameters, stream) from a completions request body; RequestError(400) if invalid."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError(400, "the body must be a JSON object")
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string")
    try:
        params = (defaults or SamplingParams()).from_request(data, max_tokens_limit)
    except (TypeError, ValueError) as exc:
        raise RequestError(400, f"bad parameter: {exc}") from exc
    except EdgeKVError as exc:
        raise RequestError(400, str(exc)) from exc
    return prompt, params, bool(data.get("stream", False))


def completion_json(c: Completion, model: str, request_id: str) -> dict:
    """An OpenAI-style text_completion object (plus edgekv timings)."""
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason}],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
                      "total_tokens": c.prompt_tokens + len(c.token_ids)},
            "edgekv": {"ttft_s": c.ttft_s, "total_s": c.total_s, "layer_wait_s": c.layer_wait_s}}


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class EdgeServer(ThreadingHTTPServer):
    """The HTTP server holding one session."""

    daemon_threads = True

    def __init__(self, session: EdgeSession, host: str = "127.0.0.1", port: int = 8000, max_body: int = 65536,
                 max_tokens_limit: int = 512, defaults: SamplingParams | None = None):
        self.session, self.max_body, self.max_tokens_limit = session, max_body, max_tokens_limit
        self.defaults = defaults or SamplingParams()  # what a request leaves out (serve-edge's flags)
        self.http_errors = 0
        self.stats_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    def metrics(self) -> dict:
        """Counters and TTFT percentiles."""
        s = self.session.stats
        ttfts = list(s["ttft_s"])
        return {"requests": s["requests"], "completion_tokens": s["tokens"], "errors": s["errors"],
                "http_errors": self.http_errors,
                "ttft_s": {"p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9),
                           "p99": percentile(ttfts, 0.99)},
                "kv": {k: v for k, v in self.session.describe().items() if k != "layers"}}


class _Handler(BaseHTTPRequestHandler):
    server: EdgeServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # the default writes every request to stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    def _json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        with self.server.stats_lock:
            self.server.http_errors += 1
        self._json(status, {"error": {"message": message, "code": status}})

    def do_GET(self):
        if self.path == "/healthz":
            self._json(200, {"status": "ok", "source": self.server.session.source})
        elif self.path == "/metrics":
            self._json(200, self.server.metrics())
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length is not None else -1
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            return self._error(411, "a Content-Length header is required")
        if n > self.server.max_body:
            self.close_connection = True  # the unread body must not be parsed as the next request
            return self._error(413, f"body of {n} bytes exceeds the limit of {self.server.max_body}")
        body = self.rfile.read(n)
        if self.path != "/v1/completions":
            return self._error(404, f"no such endpoint: POST {self.path}")
        try:
            prompt, params, stream = parse_request(body, self.server.max_tokens_limit, self.server.defaults)
        except RequestError as exc:
            return self._error(exc.status, str(exc))
        request_id = f"cmpl-{uuid.uuid4().hex[:12]}"
        model = self.server.session.edge.spec
        try:
            if stream:
                return self._stream(prompt, params, request_id, model)
            done = self.server.session.complete(prompt, params)
        except EdgeKVError as exc:
            return self._error(400, str(exc))
        except Exception as exc:  # keep serving; report it
            with self.server.stats_lock:
                self.server.session.stats["errors"] += 1
            log.exception("request failed")
            return self._error(500, f"internal error: {type(exc).__name__}")
        self._json(200, completion_json(done, model, request_id))

    def _stream(self, prompt: str, params: SamplingParams, request_id: str, model: str) -> None:
        """Server-sent events: one `data:` chunk per text piece, then the final object and [DONE]."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(payload) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def piece(text: str) -> None:
            send({"id": request_id, "object": "text_completion", "model": model,
                  "choices": [{"index": 0, "text": text, "finish_reason": None}]})

        try:
            done = self.server.session.complete(prompt, params, on_text=piece)
            final = completion_json(done, model, request_id)
            final["choices"][0]["text"] = ""
            send(final)
        except EdgeKVError as exc:
            send({"error": {"message": str(exc), "code": 400}})
        send("[DONE]")


def serve(server: EdgeServer) -> None:
    """Serve until interrupted."""
    try:
        server.serve_forever()
    finally:
        server.server_close()
