"""edgekv: cloud-edge LLM inference through KV-cache reuse between heterogeneous models."""

__version__ = "0.1.0"


class EdgeKVError(Exception):
    """An error the user can fix; the CLI prints its message on one line and exits non-zero."""
