"""Attention over KV that came from elsewhere: a prefix's KV as a read-only transformers `Cache` and the request
cache layer that reads it (`prefix_kv.py`), relay attention for a packed batch over one shared prefix
(`relay.py`), gated cloud segments of a fusion (`fuse.py`) and the exact log-sum-exp merge of attention over
disjoint key segments (`merge.py`).

Pure tensor code over transformers' cache classes. May import: the shared helpers and `models/`.
"""
