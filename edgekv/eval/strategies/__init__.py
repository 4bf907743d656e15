"""Eval strategies: one small class each, registered by base name (`base.py` holds the registry and the name
grammar). Importing this package registers every kind; a new strategy is one class in one file here, plus its
import below."""

# registering every kind, in the order the usage message lists them
from edgekv.eval.strategies import local, splice  # noqa: F401, I001  # isort: skip
from edgekv.eval.strategies import distill  # noqa: F401, E402  # isort: skip
from edgekv.eval.strategies.base import (
    STRATEGIES,
    Answering,
    CompressStrategy,
    KVStrategy,
    Strategy,
    parse_strategy,
)

__all__ = ["STRATEGIES", "Answering", "CompressStrategy", "KVStrategy", "Strategy", "parse_strategy"]
