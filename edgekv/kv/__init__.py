"""KV: what is done to a system prompt's KV on its way from the cloud to the edge. ThinK pruning
(`pruning.py`), int8/int4 codecs (`codecs.py`), cross-model translators (`translators.py`) and their training
(`training.py`), the export format (`export.py`), turning an exported layer back into edge KV (`decode.py`),
and the `edgekv compress` job (`compress_job.py`).

May import: the shared helpers, `models/`, `attention/`, `align/`. Knows nothing of `serve/` or `eval/`.
"""
