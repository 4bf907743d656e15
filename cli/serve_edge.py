"""`edgekv serve-edge`: answer user prompts on the edge over a system-prompt KV export (HTTP or batch)."""

from __future__ import annotations

from cli.common import config_command, console, progress_bar
from edgekv.serve.batch import run_batch
from edgekv.serve.http_server import serve
from edgekv.serve.pool import ExportPool
from edgekv.serve.serve_job import ServeConfig, open_server, open_session


@config_command(ServeConfig, "serve_edge")
def serve_edge(cfg: ServeConfig) -> None:
    """Serve the edge model over a system-prompt KV export: HTTP (OpenAI-style, SSE) or a JSONL batch."""
    session = open_session(cfg)
    if isinstance(session, ExportPool):
        console.print(f"edge {cfg.edge}: {len(session.ids())} exports ({', '.join(session.ids())}), "
                      f"{session.held_bytes() / 2**20:.1f} MiB of system KV loaded")
    else:
        info = session.describe()
        console.print(f"edge {session.edge.spec}: system prompt {info['system_prompt_tokens']} tokens, layers "
                      f"< {info['start_layer']} local, the rest from {info['source']}")
    if cfg.batch:
        with progress_bar() as progress:
            rows = run_batch(cfg, session, progress)
        ttft = sorted(r["ttft_s"] for r in rows)
        console.print(f"{len(rows)} answers → {cfg.output}; median TTFT {ttft[len(ttft) // 2] * 1e3:.1f} ms; "
                      f"{session.describe()['bytes_loaded']:,} bytes loaded; layer sources "
                      f"{', '.join(session.describe()['layer_sources'])}")
        return
    server = open_server(cfg, session)
    console.print(f"listening on http://{cfg.host}:{server.server_address[1]} as {', '.join(server.pool.ids())} "
                  "(POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics); Ctrl-C stops")
    serve(server)
