"""`edgekv serve-edge`: answer user prompts on the edge over a system-prompt KV export (HTTP or batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.common import console, one_line_errors, progress_bar
from edgekv.config import load_config
from edgekv.serve.batch import run_batch
from edgekv.serve.http_server import serve
from edgekv.serve.pool import ExportPool
from edgekv.serve.serve_job import ServeConfig, open_server, open_session


@one_line_errors
def serve_edge(
    edge: Optional[str] = typer.Option(None, help="Edge model: alias, hub id, directory or .gguf [default-edge]."),
    kv: Optional[list[str]] = typer.Option(None, help="KV export: directory, .tar, or URL (http(s)://, s3://, …); "
                                         "repeat it (or give a folder of exports) to serve one model per export."),
    system_prompt: Optional[str] = typer.Option(None, help="TEXT or @FILE; used for local prefill if no export."),
    host: Optional[str] = typer.Option(None, help="Bind address [127.0.0.1]."),
    port: Optional[int] = typer.Option(None, help="Port [8000]."),
    batch: Optional[Path] = typer.Option(None, help="Batch mode: JSONL of {\"prompt\", …} requests."),
    output: Optional[Path] = typer.Option(None, help="Batch mode: JSONL results (written atomically)."),
    bandwidth_mbps: Optional[float] = typer.Option(None, help="Link emulator: bandwidth in Mbit/s [unthrottled]."),
    latency_ms: Optional[float] = typer.Option(None, help="Link emulator: latency per file in ms [0]."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Default max tokens per answer [64]."),
    max_tokens_limit: Optional[int] = typer.Option(None, help="Largest max_tokens a request may ask [512]."),
    max_body_bytes: Optional[int] = typer.Option(None, help="Largest request body (larger → 413) [1 MiB]."),
    api_key: Optional[str] = typer.Option(None, help="Bearer key required on /v1/* [EDGEKV_API_KEY; none: open]."),
    max_batch: Optional[int] = typer.Option(None, help="Requests decoded together per engine step [32]."),
    max_queue: Optional[int] = typer.Option(None, help="Requests in flight; beyond it → 429 [256]."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id in /v1/models [the export's name]."),
    peer_kv: Optional[str] = typer.Option(None, help="Same-model export of the system prompt from a nearby edge: "
                                                     "its layers < m replace the local shallow prefill."),
    max_kv_mb: Optional[float] = typer.Option(None, help="System KV held in memory; idle exports beyond it are "
                                                         "unloaded and reloaded on demand [no limit]."),
    temperature: Optional[float] = typer.Option(None, help="Default temperature (0 = greedy) [0]."),
    top_p: Optional[float] = typer.Option(None, help="Default nucleus top-p [1]."),
    seed: Optional[int] = typer.Option(None, help="Default sampling seed [0]."),
    local_sink_tokens: Optional[int] = typer.Option(None, help="Override the export's local sink tokens."),
    cache_dir: Optional[Path] = typer.Option(None, help="Verified copies of remote exports [~/.cache/edgekv]."),
    catalog: Optional[str] = typer.Option(None, help="Serve every entry of a catalog (folder or URL) by name/hash."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 [bfloat16]."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or auto (CUDA when torch sees a GPU) [cpu]."),
    weights: Optional[str] = typer.Option(None, help="The edge's linears: bf16, int8 or int4 (weight-only) [bf16]."),
    prepack: Optional[bool] = typer.Option(None, "--prepack/--no-prepack",
                                           help="bf16 on CPU: prepack the linear weights for oneDNN [on]."),
    config: Optional[Path] = typer.Option(None, help="YAML config (flags override it)."),
) -> None:
    """Serve the edge model over a system-prompt KV export: HTTP (OpenAI-style, SSE) or a JSONL batch."""
    kv_value = (kv[0] if len(kv) == 1 else list(kv)) if kv else None
    overrides = dict(edge=edge, kv=kv_value, system_prompt=system_prompt, host=host, port=port,
                     batch=str(batch) if batch else None, output=str(output) if output else None,
                     bandwidth_mbps=bandwidth_mbps, latency_ms=latency_ms, max_new_tokens=max_new_tokens,
                     max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes, temperature=temperature,
                     top_p=top_p, seed=seed, local_sink_tokens=local_sink_tokens,
                     cache_dir=str(cache_dir) if cache_dir else None, dtype=dtype, catalog=catalog, device=device,
                     weights=weights,
                     api_key=api_key,
                     max_batch=max_batch, max_queue=max_queue, served_model_name=served_model_name,
                     max_kv_mb=max_kv_mb, peer_kv=peer_kv, prepack=prepack)
    cfg = load_config(ServeConfig, "serve_edge", config, overrides)
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
