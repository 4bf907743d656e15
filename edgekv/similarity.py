"""Re-export of `edgekv.align.similarity` at its former path, for callers outside the project."""

from edgekv.align.similarity import *  # noqa: F401,F403
from edgekv.align.similarity import debiased_cka, linear_cka, rsa  # noqa: F401  (named: the promised API)
