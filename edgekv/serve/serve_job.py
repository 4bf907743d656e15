"""`edgekv serve-edge`: its config and opening the session (the model, the KV source, the link)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.config import (
    command_config,
    device_setting,
    dtype_setting,
    edge_setting,
    seed_setting,
    setting,
    weights_setting,
)
from edgekv.kv.catalog import Catalog
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.models.loading import load_model, resolve_dtype
from edgekv.models.prepack import prepack_linears
from edgekv.runtime import limit_onednn_cache, on_fresh_thread
from edgekv.serve.engine import MAX_BATCH, MAX_QUEUE
from edgekv.serve.http_server import EdgeServer
from edgekv.serve.pipeline import Link
from edgekv.serve.pool import ExportPool, expand_sources, export_id
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.session import EdgeSession
from edgekv.texts import read_system_prompt


@command_config("serve_edge")
@dataclass
class ServeConfig:
    """Everything `edgekv serve-edge` needs."""

    edge: str = edge_setting("Edge model: alias, hub id, directory or .gguf.")
    catalog: str | None = setting(None, "Serve every entry of a catalog (folder or URL) by name/hash.")
    kv: str | list[str] | None = setting(
        None, "KV export: directory, .tar, or URL (http(s)://, s3://, …); repeat it (or give a folder of exports) to "
        "serve one model per export.", repeat=True,
        parse=lambda v: v[0] if len(v) == 1 else v)
    system_prompt: str | None = setting(None, "TEXT or @FILE; used for local prefill if no export.")
    dtype: str = dtype_setting()
    device: str = device_setting()
    weights: str = weights_setting()
    host: str = setting("127.0.0.1", "Bind address.")
    port: int = setting(8000, "Port.")
    batch: str | None = setting(None, "Batch mode: JSONL of {\"prompt\", …} requests.")
    output: str | None = setting(None, "Batch mode: JSONL results (written atomically).")
    bandwidth_mbps: float | None = setting(None, "Link emulator: bandwidth in Mbit/s.", shown="unthrottled")
    latency_ms: float = setting(0.0, "Link emulator: latency per file in ms.")
    max_new_tokens: int = setting(64, "Default max tokens per answer.")
    max_tokens_limit: int = setting(512, "Largest max_tokens a request may ask.")
    max_body_bytes: int = setting(1 << 20, "Largest request body (larger → 413).")
    temperature: float = setting(0.0, "Default temperature (0 = greedy).")
    top_p: float = setting(1.0, "Default nucleus top-p.")
    seed: int = seed_setting("Default sampling seed.")
    local_sink_tokens: int | None = setting(None, "Override the export's local sink tokens.")
    cache_dir: str | None = setting(None, "Verified copies of remote exports.", shown="~/.cache/edgekv")
    api_key: str | None = setting(None, "Bearer key required on /v1/*.", shown="EDGEKV_API_KEY; none: open")
    max_batch: int = setting(MAX_BATCH, "Requests decoded together per engine step.")
    max_queue: int = setting(MAX_QUEUE, "Requests in flight; beyond it → 429.")
    served_model_name: str | None = setting(None, "Model id in /v1/models.", shown="the export's name")
    peer_kv: str | None = setting(
        None, "Same-model export of the system prompt from a nearby edge: its layers < m replace the local shallow "
        "prefill.")
    shared: str | None = setting(None, "A shared prefix (distill --train-shared): every system prompt is read after "
                                       "it; exports must have been made under it.")
    max_kv_mb: float | None = setting(
        None, "System KV held in memory; idle exports beyond it are unloaded and reloaded on demand.",
        shown="no limit")
    prepack: bool = setting(
        True, "bf16 on CPU: prepack the linear weights for oneDNN.", toggle="--prepack/--no-prepack")

    def validate(self) -> None:
        """One-line errors for out-of-range values, before any model is loaded."""
        if self.catalog is not None and (self.kv is not None or self.batch or self.system_prompt):
            raise EdgeKVError("--catalog serves its entries over HTTP (no --kv, --batch or --system-prompt)")
        if self.kv is None and self.system_prompt is None and self.catalog is None:
            raise EdgeKVError("--kv is required (an export directory, .tar or URL)")
        self.dtype = resolve_dtype(self.dtype, self.device)  # auto: what it stands for here, as the run records it
        if not 0 < self.port < 65536:
            raise EdgeKVError(f"--port must be in 1..65535, got {self.port}")
        if (self.batch is None) != (self.output is None):
            raise EdgeKVError("--batch and --output go together")
        if self.batch is not None and not Path(self.batch).is_file():
            raise EdgeKVError(f"batch file not found: {self.batch}")
        if self.output is not None and not Path(self.output).resolve().parent.is_dir():
            raise EdgeKVError(f"cannot write {self.output}: its directory does not exist")
        if self.max_body_bytes < 64 or self.max_tokens_limit < 1:
            raise EdgeKVError("--max-body-bytes must be ≥ 64 and --max-tokens-limit ≥ 1")
        if len(self.kv_list()) > 1 and (self.batch or self.served_model_name or self.system_prompt):
            raise EdgeKVError("several --kv exports serve over HTTP only, each named by its folder (no --batch, "
                              "--served-model-name or --system-prompt)")
        if self.max_kv_mb is not None and self.max_kv_mb <= 0:
            raise EdgeKVError(f"--max-kv-mb must be > 0, got {self.max_kv_mb}")
        if self.max_batch < 1 or self.max_queue < self.max_batch:
            raise EdgeKVError(f"--max-batch must be ≥ 1 and --max-queue ≥ --max-batch, got {self.max_batch}, "
                              f"{self.max_queue}")
        if self.local_sink_tokens is not None and self.local_sink_tokens < 0:
            raise EdgeKVError(f"--local-sink-tokens must be ≥ 0, got {self.local_sink_tokens}")
        self.link()
        self.sampling().validate(self.max_tokens_limit)

    def kv_list(self) -> list[str]:
        """The --kv sources, a folder of exports expanded."""
        if self.kv is None:
            return []
        return expand_sources([self.kv] if isinstance(self.kv, str) else list(self.kv))

    def link(self) -> Link:
        """The emulated link."""
        return Link(self.bandwidth_mbps, self.latency_ms)

    def sampling(self) -> SamplingParams:
        """Default sampling parameters (requests may override them)."""
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.seed)


def open_session(cfg: ServeConfig) -> EdgeSession | ExportPool:
    """Load the edge model and open the KV source (pipelined loading starts at once); with several exports, a
    pool that opens (and verifies) each one now and keeps within --max-kv-mb. The work runs on a thread that
    ends, so the thread that then computes (an engine's, or the caller's for --batch) keeps the process's only
    OpenMP pool (see `Engine`)."""
    cfg.validate()
    return on_fresh_thread(_open, cfg)


def _open(cfg: ServeConfig) -> EdgeSession | ExportPool:
    limit_onednn_cache()  # before the first matmul of this process (the session's prefill)
    edge = load_model(cfg.edge, cfg.dtype, device=cfg.device, weights=cfg.weights)
    if cfg.prepack:
        prepack_linears(edge.model)  # serving never trains or reads the weights; a no-op where unsupported
    system = read_system_prompt(cfg.system_prompt) if cfg.system_prompt else None
    shared = SharedPrefix(cfg.shared, edge) if cfg.shared else None
    if cfg.catalog:  # every entry a model id, loaded (fetched and verified) on first use
        catalog = Catalog(cfg.catalog)
        rows = catalog.entries()
        if not rows:
            raise EdgeKVError(f"--catalog {cfg.catalog}: no entries (its index.jsonl lists none)")
        budget = None if cfg.max_kv_mb is None else int(cfg.max_kv_mb * 2**20)
        aliases = catalog.names()
        return ExportPool(lambda kv: EdgeSession(edge, kv, None, cfg.link(), cfg.cache_dir, cfg.local_sink_tokens,
                                                 shared=shared),
                          {r["name"]: catalog.source(r["key"]) for r in rows}, budget, cfg.max_batch, cfg.max_queue,
                          aliases)
    sources = cfg.kv_list()
    if len(sources) <= 1 and cfg.max_kv_mb is None:
        return EdgeSession(edge, sources[0] if sources else None, system, cfg.link(), cfg.cache_dir,
                           cfg.local_sink_tokens, cfg.peer_kv, shared=shared)
    ids = [export_id(s) for s in sources]
    if len(set(ids)) < len(ids):
        raise EdgeKVError(f"two exports share a name ({', '.join(ids)}); model ids are folder names")
    budget = None if cfg.max_kv_mb is None else int(cfg.max_kv_mb * 2**20)
    pool = ExportPool(lambda kv: EdgeSession(edge, kv, None, cfg.link(), cfg.cache_dir, cfg.local_sink_tokens,
                                                 shared=shared),
                      dict(zip(ids, sources)), budget, cfg.max_batch, cfg.max_queue)
    for k in ids:  # a bad export is refused at start
        pool.get(k)
    return pool


def open_server(cfg: ServeConfig, session: EdgeSession | ExportPool) -> EdgeServer:
    """Bind the HTTP server of a session (a port in use is a one-line error)."""
    api_key = cfg.api_key or os.environ.get("EDGEKV_API_KEY") or None
    try:
        return EdgeServer(session, cfg.host, cfg.port, cfg.max_body_bytes, cfg.max_tokens_limit, cfg.sampling(),
                          api_key, cfg.max_batch, cfg.max_queue, cfg.served_model_name)
    except OSError as exc:
        raise EdgeKVError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
