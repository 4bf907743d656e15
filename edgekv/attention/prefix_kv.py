"""A prefix's KV as a transformers `Cache(layers=…)` (DESIGN.md §1): what a system prompt's KV *is*, whatever
computed it. `PrefixKV` holds every layer's (1, kv_heads, P, d) keys and values read-only, plus the gated cloud
segments of a fusion; a request never writes into it but attends through `request_cache()`, whose
`SharedPrefixLayer`s reference the prefix (no copy) and store only the request's own tokens. Positions continue
after the prefix. Training (a batch packed into one forward: `packed_continuation_logits`), fidelity and the
server all read a prefix this way; where its layers come from (an export, a peer, the edge's own prefill) is
`edgekv.serve.system_kv`'s business.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from edgekv.attention.fuse import enable_fusion
from edgekv.attention.relay import RelayBatch, relay_cache
from edgekv.models.mixed import float32_scoring
from edgekv.models.structure import KVPair, decoder_layers, model_device


class _StopForward(Exception):
    """Raised by a hook to end a forward pass after the layers we need."""


@torch.no_grad()
def prefix_kv(model: torch.nn.Module, ids: torch.Tensor, layers: int | None = None) -> list[KVPair]:
    """The model's own KV (1, kv_heads, tokens, head_dim) of `ids` for layers 0..layers−1 only: the forward
    stops after the last needed layer (the shallow part of a split is all the edge computes)."""
    blocks = decoder_layers(model)
    n = len(blocks) if layers is None else layers
    if n == 0:
        return []
    cache = DynamicCache()
    me = threading.get_ident()

    def stop(module, args, output):
        if threading.get_ident() == me:  # hooks are global: never end another thread's forward of this model
            raise _StopForward

    handle = blocks[n - 1].register_forward_hook(stop) if n < len(blocks) else None
    try:
        model(input_ids=ids[None].to(model_device(model)), cache=cache, use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        if handle is not None:
            handle.remove()
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(n)]


class SharedPrefixLayer(DynamicLayer):
    """A request's cache layer = a read-only prefix shared across requests (resolved on first use, so a layer
    still in transit is waited for only when attention needs it) + this request's own keys/values."""

    def __init__(self, prefix: Callable[[], KVPair], prefix_len: int, on_wait: Callable[[float], None] | None = None):
        super().__init__()
        self.prefix, self.prefix_len, self._on_wait = prefix, prefix_len, on_wait
        self._buffer: tuple[torch.Tensor, torch.Tensor] | None = None  # [prefix | own | room], inference only
        self._used = 0

    def _shared(self) -> KVPair:
        start = time.perf_counter()
        pk, pv = self.prefix()
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - start)
        return pk, pv

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KVPair:
        """Append the request's new tokens; return prefix + own tokens for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_grad_enabled():  # training reads gradients through the prefix: plain concatenation
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            pk, pv = self._shared()
            return torch.cat([pk.to(self.keys.dtype), self.keys], dim=-2), torch.cat(
                [pv.to(self.values.dtype), self.values], dim=-2)
        # inference: the prefix is copied once into a buffer that grows by doubling, new tokens are written in
        # place; a decode step no longer copies the whole prefix of every layer
        new = key_states.shape[-2]
        if self._buffer is None:
            pk, pv = self._shared()
            self._used = pk.shape[-2]
            self._buffer = self._grow(pk.to(key_states.dtype), pv.to(value_states.dtype), self._used + 2 * new + 64)
        elif self._used + new > self._buffer[0].shape[-2]:
            bk, bv = self._buffer
            self._buffer = self._grow(bk[..., :self._used, :], bv[..., :self._used, :], 2 * (self._used + new))
        bk, bv = self._buffer
        bk[..., self._used:self._used + new, :] = key_states
        bv[..., self._used:self._used + new, :] = value_states
        self._used += new
        self.keys, self.values = bk[..., self.prefix_len:self._used, :], bv[..., self.prefix_len:self._used, :]
        return bk[..., :self._used, :], bv[..., :self._used, :]

    @staticmethod
    def _grow(keys: torch.Tensor, values: torch.Tensor, capacity: int) -> KVPair:
        """A buffer of `capacity` tokens holding keys/values at its start."""
        out = []
        for t in (keys, values):
            buf = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
            buf[..., :t.shape[-2], :] = t
            out.append(buf)
        return out[0], out[1]

    def get_seq_length(self) -> int:
        """Prefix + own tokens."""
        own = self.keys.shape[-2] if self.is_initialized and self.keys.numel() else 0
        return self.prefix_len + own

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        """(kv length, offset) for mask creation."""
        return self.get_seq_length() + query_length, 0


class PrefixLayer(CacheLayerMixin):
    """One read-only layer of a `PrefixKV`: `keys`/`values` resolve through the prefix on each read."""

    is_sliding = False
    is_compileable = False

    def __init__(self, prefix: PrefixKV, index: int):
        super().__init__()
        # a weak reference: a strong one is a cycle (prefix → layers → prefix) that only the cyclic collector frees,
        # and it runs by object counts, not bytes, so an eval's finished sessions (GBs each) piled up until OOM
        self._prefix, self.index, self.is_initialized = weakref.ref(prefix), index, True

    @property
    def prefix(self) -> PrefixKV:
        """The prefix this layer reads (alive as long as whoever holds the layer holds the prefix)."""
        prefix = self._prefix()
        if prefix is None:
            raise RuntimeError("a PrefixLayer outlived its PrefixKV: keep the PrefixKV, not only its layers")
        return prefix

    @property
    def keys(self) -> torch.Tensor:
        return self.prefix.layer(self.index)[0]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ assigns None; the tensors live in the PrefixKV
        pass

    @property
    def values(self) -> torch.Tensor:
        return self.prefix.layer(self.index)[1]

    @values.setter
    def values(self, value) -> None:
        pass

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("a prefix's KV is read-only: attend through PrefixKV.request_cache()")

    def update(self, key_states, value_states, *args, **kwargs) -> KVPair:
        raise RuntimeError("a prefix's KV is read-only: attend through PrefixKV.request_cache()")

    def get_seq_length(self) -> int:
        return self.prefix.prefix_len

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.prefix.prefix_len + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PrefixKV(Cache):
    """Every layer's KV of a prefix of `prefix_len` tokens (given as tensors, possibly trainable) and the gated
    cloud segments (layer → `CloudSegment`) that attend beside it. A request's positions start at
    `next_position` (default `prefix_len`; larger when the prefix keeps a subset of a longer prompt's tokens at
    their original positions: rotary attention only sees the gap as distance)."""

    def __init__(self, layers: list[KVPair] | None, prefix_len: int, segments: dict | None = None,
                 num_layers: int | None = None, next_position: int | None = None):
        """`layers` None: a subclass resolves `layer(i)` itself (then `num_layers` says how many there are)."""
        self._layers = list(layers) if layers is not None else None
        self.num_layers = len(self._layers) if layers is not None else int(num_layers)
        self.prefix_len, self._segments = int(prefix_len), dict(segments or {})
        self.next_position = int(prefix_len if next_position is None else next_position)
        if layers is not None and any(k.shape[-2] != self.prefix_len for k, _ in self._layers):
            raise ValueError(f"every layer must hold {self.prefix_len} prefix tokens")
        if layers:  # a subclass that resolves its layers later sets its dtype itself
            self.dtype = self._layers[0][0].dtype
        super().__init__(layers=[PrefixLayer(self, i) for i in range(self.num_layers)])

    @classmethod
    def of_model(cls, model: torch.nn.Module, ids: torch.Tensor) -> PrefixKV:
        """The model's own prefill of `ids`."""
        return cls(prefix_kv(model, ids), ids.numel())

    def layer(self, i: int) -> KVPair:
        """Layer i's (1, kv_heads, P, d) keys and values."""
        return self._layers[i]

    @property
    def nbytes(self) -> int:
        """Bytes of the prefix's KV as held (all layers; cloud segments included)."""
        own = sum(2 * k.numel() * k.element_size() for k, _ in (self.layer(i) for i in range(self.num_layers)))
        return own + sum(2 * s.keys.numel() * s.keys.element_size() for s in self.segments.values())

    @property
    def segments(self) -> dict:
        """Layer → gated cloud attention segment beside the layer's KV ({} without a fusion)."""
        return self._segments

    def attention_kwargs(self) -> dict:
        """What the model's forward needs besides the cache (the fusion segments, when there are any)."""
        return {"cloud_segments": self.segments} if self.segments else {}

    def request_cache(self, on_wait: Callable[[float], None] | None = None) -> Cache:
        """A request's own cache over this prefix (no copy); `on_wait` receives seconds spent waiting for a
        layer that is still in transit."""
        return Cache(layers=[SharedPrefixLayer(lambda i=i: self.layer(i), self.prefix_len, on_wait)
                             for i in range(self.num_layers)])

    def replaced(self, layers: dict[int, KVPair], keep_first: int = 0) -> PrefixKV:
        """A new prefix with layer i's KV replaced by `layers[i]` ((kv_heads, P, d) or (1, kv_heads, P, d), cast to
        the layer's dtype; differentiable), the first `keep_first` tokens keeping this prefix's KV (the
        attention-sink tokens the edge computes itself)."""
        out = []
        for i in range(self.num_layers):
            k, v = self.layer(i)
            if i in layers:
                nk, nv = (t if t.dim() == 4 else t[None] for t in layers[i])
                if nk.shape != k.shape or nv.shape != v.shape:
                    raise ValueError(f"layer {i}: replacement {tuple(nk.shape)}/{tuple(nv.shape)} does not fit "
                                     f"{tuple(k.shape)}/{tuple(v.shape)}")
                nk, nv = nk.to(k.dtype), nv.to(v.dtype)
                if keep_first:
                    nk = torch.cat([k[:, :, :keep_first], nk[:, :, keep_first:]], dim=2)
                    nv = torch.cat([v[:, :, :keep_first], nv[:, :, keep_first:]], dim=2)
                k, v = nk, nv
            out.append((k, v))
        return PrefixKV(out, self.prefix_len, self.segments, next_position=self.next_position)


def continuation_logits(model: torch.nn.Module, prefix: PrefixKV, ids: torch.Tensor, last: int = 0) -> torch.Tensor:
    """The model's logits (T, vocab) at each of `ids` read after `prefix` (positions from its `next_position`;
    `last` > 0: only the last `last` positions'); differentiable in the prefix's tensors (callers choose no_grad)."""
    device = model_device(model)
    positions = torch.arange(prefix.next_position, prefix.next_position + ids.numel(), device=device)[None]
    return model(input_ids=ids[None].to(device), cache=prefix.request_cache(), position_ids=positions,
                 use_cache=True, logits_to_keep=last, **prefix.attention_kwargs()).logits[0]


def packed_continuation_logits(model: torch.nn.Module, prefix: PrefixKV, seqs: list[torch.Tensor]
                               ) -> list[torch.Tensor]:
    """Each sequence's logits (T_i, vocab), every one read after `prefix` (positions from its `next_position`), in
    ONE forward: the sequences are packed and attended by relay attention (every query to the prefix's one copy,
    each sequence causally to its own tokens, merged exactly), so a batch of short sequences makes one pass of large
    matrix products instead of one small pass each; differentiable in the prefix's tensors."""
    enable_fusion(model)  # relay attention is a mode of the fused attention function
    device = model_device(model)
    lens = [s.numel() for s in seqs]
    ids = torch.cat([s.to(device) for s in seqs])[None]
    positions = torch.cat([torch.arange(prefix.next_position, prefix.next_position + n, device=device)
                           for n in lens])[None]
    k0 = prefix.layer(0)[0]
    empty = k0.new_zeros(1, k0.shape[1], 0, k0.shape[-1]).detach()
    batch = RelayBatch(prefix.layer, [[empty] * (2 * prefix.num_layers) for _ in seqs], lens, prefix.segments)
    cache = relay_cache(batch, prefix.num_layers, prefix.prefix_len)
    logits = model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, relay=batch).logits[0]
    return list(logits.split(lens))


def continuation_nll(model: torch.nn.Module, prefix: PrefixKV, user: torch.Tensor,
                     continuation: torch.Tensor) -> torch.Tensor:
    """Mean NLL (nats/token) of `continuation` after `user`, both read after `prefix`."""
    # the head on the scored rows only (the user prompt's rows would be a quarter of the forward's work), and in
    # float32 under --dtype mixed however few they are
    with float32_scoring():
        logits = continuation_logits(model, prefix, torch.cat([user, continuation[:-1]]), last=continuation.numel())
    target = continuation[:, None].to(logits.device)
    return -torch.log_softmax(logits.float(), dim=-1).gather(-1, target).mean()


def prefill_after(model: torch.nn.Module, prefix: PrefixKV, ids: torch.Tensor) -> list[KVPair]:
    """The model's own KV (1, kv_heads, tokens, d) of `ids` read after `prefix` (positions from its
    `next_position`), every layer; differentiable in the prefix's tensors when gradients are on. An empty prefix
    is the plain prefill (`prefix_kv`), bit for bit."""
    if prefix.prefix_len == 0 and prefix.next_position == 0:
        return prefix_kv(model, ids)
    cache = prefix.request_cache()
    device = model_device(model)
    positions = torch.arange(prefix.next_position, prefix.next_position + ids.numel(), device=device)[None]
    model(input_ids=ids[None].to(device), cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1,
          **prefix.attention_kwargs())
    return [(layer.keys.clone(), layer.values.clone()) if not torch.is_grad_enabled() else (layer.keys, layer.values)
            for layer in cache.layers]


def prepend(first: KVPair, then: KVPair) -> KVPair:
    """One layer's keys and values of `first`'s tokens followed by `then`'s (in `first`'s dtype)."""
    return torch.cat([first[0], then[0].to(first[0].dtype)], 2), torch.cat([first[1], then[1].to(first[1].dtype)], 2)


def joined(first: PrefixKV, then: list[KVPair], next_position: int | None = None) -> PrefixKV:
    """One prefix of `first`'s tokens followed by `then`'s (e.g. a shared prefix and a prompt read after it);
    differentiable in both."""
    layers = [prepend(first.layer(i), kv) for i, kv in enumerate(then)]
    n = first.prefix_len + then[0][0].shape[2]
    return PrefixKV(layers, n, next_position=n if next_position is None else next_position)


def read_after(model: torch.nn.Module, prefix: PrefixKV, ids: torch.Tensor) -> PrefixKV:
    """[prefix | `ids` read after it]: what the model reads for a prompt under a prefix (requests continue after
    both)."""
    return joined(prefix, prefill_after(model, prefix, ids))
