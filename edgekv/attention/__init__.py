"""Attention over KV that came from elsewhere: spliced `DynamicCache`s, the cache layer that reads a shared
read-only prefix, and the exact log-sum-exp merge of attention over disjoint key segments.

Pure tensor code over transformers' cache classes. May import: the shared helpers and `models/`.
"""
