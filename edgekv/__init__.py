"""edgekv: cloud-edge LLM inference through KV-cache reuse between heterogeneous models.

The package follows the data flow, one folder per stage, lowest first:

    text ─▶ models ─▶ attention ─▶ align ─▶ kv ─▶ serve ─▶ distill ─▶ eval
    (texts.py and the shared helpers: atomic, cluster (Ray), config, progress, plots, runtime, summary, this file's
    EdgeKVError)

- `models/`    loading any model, tokenizer checks, model structure (heads, rotary), per-layer capture
- `attention/` a prefix's KV as a read-only Cache and request caches over it, relay and fused attention, the
               exact log-sum-exp segment merge
- `align/`     similarity measures (CKA, RSA), layer-mapping strategies, the `edgekv align` job
- `kv/`        ThinK pruning, codecs, cross-model translators and fusers (one registry), the one training
               loop, the export format, the decoding of an exported layer, `edgekv compress` / `train-fuser`
- `serve/`     the system KV and its sources, pipelined layer loading and the link model, the one decode loop
               (engine), the OpenAI-style HTTP server, batch mode, `serve-edge`
- `distill/`   the cloud teaches the edge's system-prompt KV: the batched teacher (one prefill, engine batches),
               the trainable student prefix, `edgekv distill`
- `eval/`      datasets, metrics, strategies (one class each), the fidelity harness, load runs, reports, the
               network model and planner, the `edgekv eval` / `plan` jobs

Import direction: a module may import the shared helpers, its own stage and any stage to its left, never one
to its right (`kv/` knows nothing of `serve/` or `eval/`; `align/` and `kv/` never import `eval/`). No modules
import each other in a circle, not even under `if TYPE_CHECKING:`, and a command's job module (`*_job.py`) never
imports another job: what two commands share is a library module. `tests/test_layout.py` checks all three.
"""

__version__ = "0.1.0"


class EdgeKVError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""
