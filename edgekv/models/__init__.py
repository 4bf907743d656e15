"""Models: load any causal LM (alias, hub id, directory, .gguf), check tokenizers agree, know its structure
(decoder blocks, attention heads, rotary) and capture per-layer activations.

May import: the shared helpers at the package top. Nothing from the later stages.
"""
