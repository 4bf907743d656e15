"""Align: which cloud layer matches which edge layer. Similarity measures (linear/debiased CKA, RSA) on
captured activations, layer-mapping strategies, and the `edgekv align` job (`align_job.py`).

May import: the shared helpers, `models/`, `attention/`. Never `kv/`, `serve/` or `eval/`.
"""
