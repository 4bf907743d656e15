"""`edgekv serve-edge --batch`: JSONL requests in, all in flight together through the engine, JSONL results out
(written atomically)."""

from __future__ import annotations

import json
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.progress import Tasks
from edgekv.serve.requests import GenRequest
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.serve_job import ServeConfig
from edgekv.serve.session import EdgeSession
from edgekv.texts import jsonl_records, read_text


def read_batch(path: str | Path, cfg: ServeConfig) -> list[tuple[str, str, SamplingParams]]:
    """(id, prompt, params) per JSONL line; a bad line is a one-line error naming it."""
    rows = []
    for n, data in jsonl_records(read_text(path, "--batch").splitlines(), path):
        try:
            if not isinstance(data, dict) or not isinstance(data.get("prompt"), str) or not data["prompt"]:
                raise ValueError("needs a non-empty 'prompt' string")
            params = cfg.sampling().from_request(data, cfg.max_tokens_limit)
        except (ValueError, TypeError, EdgeKVError) as exc:
            raise EdgeKVError(f"{path}:{n}: {exc}") from exc
        rows.append((str(data.get("id", n)), data["prompt"], params))
    if not rows:
        raise EdgeKVError(f"{path}: no requests")
    return rows


def run_batch(cfg: ServeConfig, session: EdgeSession, progress=None) -> list[dict]:
    """Answer every line of cfg.batch, all in flight together through the engine; write cfg.output atomically
    (one JSON object per line, in input order)."""
    rows = read_batch(cfg.batch, cfg)
    advance = Tasks(progress).task("requests", len(rows))
    # inline: the steps run on this thread, which built the session (one OpenMP pool; see Engine)
    engine = session.engine(max_batch=cfg.max_batch, max_queue=max(len(rows), 1), background=False)
    try:
        done = engine.generate_all([GenRequest(session.encode_user(prompt), params) for _, prompt, params in rows],
                                   on_done=advance)
    finally:
        engine.close()
    kv = session.describe()
    out = []
    for n, (request_id, _, _) in enumerate(rows):
        r = done[n]
        if r.finish_reason == "error":
            raise EdgeKVError(f"request {request_id}: {r.error}")
        out.append({"id": request_id, "text": r.text, "finish_reason": "stop" if r.finish_reason == "stop" else
                    "length", "prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.token_ids),
                    "ttft_s": r.ttft_s, "total_s": r.total_s, "layer_wait_s": r.layer_wait_s,
                    "bytes_loaded": kv["bytes_loaded"],
                    "upload_bytes_user": 0,  # the user prompt is tokenized and answered here; nothing is sent
                    "kv_source": kv["source"], "layer_sources": kv["layer_sources"],
                    "timings": {"shallow_prefill_s": kv["shallow_prefill_s"], "layers": kv["layers"]}})
    write_text_atomic(cfg.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    return out
