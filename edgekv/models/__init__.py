"""Models: load any causal LM (alias, hub id, directory, .gguf), check tokenizers agree, know its structure
(decoder blocks, attention heads, rotary) and capture per-layer activations. The offline default pair
(`packaged.py`), the settings every two-model command shares (`settings.py`), a teacher's top-k targets and the
KL on them (`targets.py`), prepacked and quantized linears.

May import: the shared helpers at the package top. Nothing from the later stages.
"""
