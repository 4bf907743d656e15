"""Serve: the edge answering user prompts over a system prompt's KV. The session and decoding
(`session.py`), layer-by-layer loading with the link emulator and TTFT model (`pipeline.py`), the HTTP server
(`http_server.py`), JSONL batch mode (`batch.py`) and the `serve-edge` config (`serve_job.py`).

May import: the shared helpers, `models/`, `attention/`, `align/`, `kv/`. Never `eval/`.
"""
