"""A cache layer that attends over a read-only prefix shared by many requests plus the request's own tokens."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from edgekv.models.structure import KVPair


class SharedPrefixLayer(DynamicLayer):
    """A cache layer = a read-only prefix shared across requests (resolved on first use, so a layer still in
    transit is waited for only when attention needs it) + this request's own keys/values."""

    def __init__(self, prefix: Callable[[], KVPair], prefix_len: int, on_wait: Callable[[float], None] | None = None):
        super().__init__()
        self._prefix, self.prefix_len, self._on_wait = prefix, prefix_len, on_wait

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KVPair:
        """Append the request's new tokens; return prefix + own tokens for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        start = time.perf_counter()
        pk, pv = self._prefix()
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - start)
        return torch.cat([pk, self.keys], dim=-2), torch.cat([pv, self.values], dim=-2)

    def get_seq_length(self) -> int:
        """Prefix + own tokens."""
        own = self.keys.shape[-2] if self.is_initialized and self.keys.numel() else 0
        return self.prefix_len + own

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """(kv length, offset) for mask creation."""
        return self.get_seq_length() + query_length, 0
