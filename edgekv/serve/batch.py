"""`edgekv serve-edge --batch`: JSONL requests in, JSONL results out, written atomically."""

from __future__ import annotations

import json
import time
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.progress import Steps
from edgekv.serve.serve_job import ServeConfig
from edgekv.serve.session import EdgeSession, SamplingParams


def read_batch(path: str | Path, cfg: ServeConfig) -> list[tuple[str, str, SamplingParams]]:
    """(id, prompt, params) per JSONL line; a bad line is a one-line error naming it."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict) or not isinstance(data.get("prompt"), str) or not data["prompt"]:
                raise ValueError("needs a non-empty 'prompt' string")
            params = cfg.sampling().from_request(data, cfg.max_tokens_limit)
        except (json.JSONDecodeError, ValueError, TypeError, EdgeKVError) as exc:
            raise EdgeKVError(f"{path}:{n}: {exc}") from exc
        rows.append((str(data.get("id", n)), data["prompt"], params))
    if not rows:
        raise EdgeKVError(f"{path}: no requests")
    return rows


def run_batch(cfg: ServeConfig, session: EdgeSession, progress=None) -> list[dict]:
    """Answer every line of cfg.batch; write cfg.output atomically (one JSON object per line)."""
    rows = read_batch(cfg.batch, cfg)
    advance = Steps(progress).task("requests", len(rows))
    out = []
    for request_id, prompt, params in rows:
        start = time.perf_counter()
        done = session.complete(prompt, params)
        kv = session.describe()
        out.append({"id": request_id, "text": done.text, "finish_reason": done.finish_reason,
                    "prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
                    "ttft_s": done.ttft_s, "total_s": time.perf_counter() - start,
                    "layer_wait_s": done.layer_wait_s, "bytes_loaded": kv["bytes_loaded"],
                    "upload_bytes_user": 0,  # the user prompt is tokenized and answered here; nothing is sent
                    "kv_source": kv["source"], "layer_sources": kv["layer_sources"],
                    "timings": {"shallow_prefill_s": kv["shallow_prefill_s"], "layers": kv["layers"]}})
        advance()
    write_text_atomic(cfg.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    return out
