"""Re-export of `edgekv.kv.pruning` at its former path, for callers outside the project."""

from edgekv.kv.pruning import *  # noqa: F401,F403
from edgekv.kv.pruning import think_scores, think_select  # noqa: F401  (named: the promised API)
