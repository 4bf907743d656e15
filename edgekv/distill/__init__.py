"""Distill: the cloud teaches the edge's system-prompt KV offline (Cartridges with the cloud as teacher). The batched
teacher (`teacher.py`: one prefill, queries written from seed types, answers and scores as engine batches), the
synthetic set kept per teacher (`synthetic.py`), the trainable student prefix, its loss and training
(`student.py`), and the `edgekv distill` job (`distill_job.py`).

May import: the shared helpers, `models/`, `attention/`, `align/`, `kv/`, `serve/` (the engine decodes the teacher's
batches). Knows nothing of `eval/`.
"""
