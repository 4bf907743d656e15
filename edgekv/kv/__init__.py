"""KV: what is done to a system prompt's KV on its way from the cloud to the edge. ThinK pruning (`pruning.py`),
int8/int4 codecs (`codecs.py`), cross-model translators (`translators.py`: the `Translator` interface and
ridge/hidden/trained) and fusers (`fusers.py`), every kind registered and saved/loaded by name (`registry.py`),
the one training loop (`train_loop.py`) and the fuser training it runs (`fuser_training.py`: cached features,
gates, hard-gate choice), the export format (`export.py`), one layer's encoding (`encode.py`), turning an exported
layer back into edge KV (`unpack.py`), the cloud's side of an export (`cloud_kv.py`: same-model or translated KV,
calibration, translator fitting), the catalog (`catalog.py`), and the jobs `edgekv compress` (`compress_job.py`,
`batch_compress.py`) and `edgekv train-fuser` (`fuser_job.py`). Distillation, whose teacher decodes through the
engine, is a stage of its own (`distill/`).

May import: the shared helpers, `models/`, `attention/`, `align/`. Knows nothing of `serve/` or `eval/`.
"""
