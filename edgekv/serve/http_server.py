"""Running the OpenAI-compatible app (`openai_api.py`) on uvicorn over an engine (`engine.py`) of one session.

`EdgeServer` binds its socket at construction (a port in use fails at once; port 0 picks a free one, read from
`server_address`), then `serve_forever()` runs uvicorn until `shutdown()`; the engine thread owns the model.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import uvicorn

from edgekv.serve.api_schema import APISettings
from edgekv.serve.engine import MAX_BATCH, MAX_QUEUE, Engine
from edgekv.serve.openai_api import build_app
from edgekv.serve.pool import ExportPool, export_id
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession

log = logging.getLogger("edgekv")


def model_id(session: EdgeSession, name: str | None = None) -> str:
    """The id /v1/models shows for a session: `name`, else the export's folder name, else 'edge-local'."""
    if name:
        return name
    return export_id(str(session.system.export.path)) if session.system.export is not None else "edge-local"


class EdgeServer:
    """uvicorn + the FastAPI app over one session's engine, or over a pool of exports."""

    def __init__(self, session: EdgeSession | ExportPool, host: str = "127.0.0.1", port: int = 8000,
                 max_body: int = 1 << 20, max_tokens_limit: int = 512, defaults: SamplingParams | None = None,
                 api_key: str | None = None, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
                 name: str | None = None):
        if isinstance(session, ExportPool):
            self.pool, self.session = session, None
        else:
            self.pool = ExportPool.of_session(model_id(session, name), session, max_batch, max_queue)
            self.session = session
        self.model_id = self.pool.ids()[0]
        self.settings = APISettings(api_key, max_body, max_tokens_limit, defaults or SamplingParams())
        self.app = build_app(self.pool, self.settings)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            self.pool.close()
            raise
        self.sock.listen(2048)  # clients connecting before uvicorn starts wait in the backlog
        self.server_address = self.sock.getsockname()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                                limit_concurrency=None)
        self.server = uvicorn.Server(config)
        self.running, self.stopped = threading.Event(), threading.Event()

    def serve_forever(self) -> None:
        """Serve until `shutdown` (or Ctrl-C)."""
        self.running.set()
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        finally:
            self.stopped.set()

    def shutdown(self) -> None:
        """Ask uvicorn to stop (returns at once)."""
        self.server.should_exit = True

    def server_close(self) -> None:
        """Stop the engine and release the socket (after uvicorn has let go of it)."""
        if self.running.is_set():
            self.server.should_exit = True
            self.stopped.wait(10)
        self.pool.close()
        self.sock.close()

    @property
    def engine(self) -> Engine:
        """The engine of the first model (the only one of a single-session server)."""
        return self.pool.get(self.model_id)


def serve(server: EdgeServer) -> None:
    """Serve until interrupted."""
    try:
        server.serve_forever()
    finally:
        server.server_close()
