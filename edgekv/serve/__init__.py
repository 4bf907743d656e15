"""Serve: the edge answering user prompts over a system prompt's KV. Where each layer of that KV comes from
(`system_kv.py`: export, fallbacks, peer, sinks, fusion), layer-by-layer loading with the link emulator and TTFT
model (`pipeline.py`), a session = an edge model + its system KV (`session.py`), the one decode loop
(`engine.py`: scheduler and relay-batched forward; `sampling.py`: picking tokens; `requests.py`: a request's
tokens, stop strings, log-probs and result), the OpenAI-compatible HTTP app (`openai_api.py`: routes;
`api_schema.py`: bodies and errors; `api_responses.py`: JSON and SSE; `api_metrics.py`: Prometheus) and its server
(`http_server.py`), the LRU pool of exports a server holds (`pool.py`), JSONL
batch mode (`batch.py`) and the `serve-edge` config (`serve_job.py`).

May import: the shared helpers, `models/`, `attention/`, `align/`, `kv/`. Never `eval/`.
"""
