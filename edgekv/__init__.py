"""edgekv: cloud-edge LLM inference through KV-cache reuse between heterogeneous models.

The package follows the data flow, one folder per stage, lowest first:

    text ─▶ models ─▶ attention ─▶ align ─▶ kv ─▶ serve ─▶ eval
    (texts.py and the shared helpers: atomic, config, progress, plots, this file's EdgeKVError)

- `models/`    loading any model, tokenizer checks, model structure (heads, rotary), per-layer capture
- `attention/` spliced caches, the shared-prefix cache layer, the exact log-sum-exp segment merge
- `align/`     similarity measures (CKA, RSA), layer-mapping strategies, the `edgekv align` job
- `kv/`        ThinK pruning, codecs, cross-model translators and their training, the export format, the
               decoding of an exported layer, the `edgekv compress` job
- `serve/`     the edge session, pipelined layer loading and the link model, HTTP, batch mode, `serve-edge`
- `eval/`      datasets, metrics, the fidelity harness, load runs, reports, the `edgekv eval` job

Import direction: a module may import the shared helpers, its own stage and any stage to its left, never one
to its right (`kv/` knows nothing of `serve/` or `eval/`; `align/` and `kv/` never import `eval/`).
`tests/test_layout.py` checks it. `edgekv.similarity` and `edgekv.pruning` are re-exports kept for callers
outside the project; code inside it imports the stage modules.
"""

__version__ = "0.1.0"


class EdgeKVError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""
