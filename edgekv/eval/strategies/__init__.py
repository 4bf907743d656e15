"""Eval strategies: one small class each, registered by base name (`base.py` holds the registry and the name
grammar). Importing this package registers every kind; a new strategy is one class in one file here, plus its
import below."""

from edgekv.eval.strategies import distill, local, splice  # noqa: F401  (registers every kind)
from edgekv.eval.strategies.base import (
    STRATEGIES,
    Answering,
    CompressStrategy,
    KVStrategy,
    Strategy,
    parse_strategy,
)

__all__ = ["STRATEGIES", "Answering", "CompressStrategy", "KVStrategy", "Strategy", "parse_strategy"]
