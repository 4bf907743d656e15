"""Decoding on spliced caches (DESIGN.md §1, §5): one edge session serves many user prompts over one system prompt.

The system prompt's KV is held once per session: layers < m computed by the edge itself, layers ≥ m from the
KV export (pipelined, see pipeline.py). Each request gets its own `DynamicCache` whose layers are
`SharedPrefixLayer`s: they reference the shared system KV read-only and store only the request's own tokens,
so concurrent requests never copy the system prompt's cache. Positions continue after the system prompt.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from edgekv import EdgeKVError
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.shared_prefix import SharedPrefixLayer
from edgekv.kv.decode import decode_layer, edge_kv
from edgekv.kv.export import (
    Expect,
    FetchError,
    KVExport,
    KVStoreError,
    is_url,
    token_ids_sha256,
    tokenizer_fingerprint,
    write_copy,
)
from edgekv.models.loading import LoadedModel
from edgekv.models.structure import attn_shape, decoder_layers
from edgekv.serve.pipeline import Fallback, LayerLoader, Link, events_as_dicts

log = logging.getLogger("edgekv")
KVPair = tuple[torch.Tensor, torch.Tensor]


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
        model(input_ids=ids[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    except _StopForward:
        pass
    finally:
        if handle is not None:
            handle.remove()
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(n)]


@dataclass
class SamplingParams:
    """How to pick tokens: greedy at temperature 0, else temperature + nucleus (top_p) sampling, seeded."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def from_request(self, data: dict, limit: int, min_tokens: int = 1) -> SamplingParams:
        """A request's own values ("max_tokens", "temperature", "top_p", "seed") over these defaults, validated;
        ValueError/TypeError for values of the wrong type, EdgeKVError for out-of-range ones."""
        params = SamplingParams(int(data.get("max_tokens", self.max_new_tokens)),
                                float(data.get("temperature", self.temperature)),
                                float(data.get("top_p", self.top_p)), int(data.get("seed", self.seed)))
        params.validate(limit, min_tokens)
        return params

    def validate(self, limit: int, min_tokens: int = 1) -> None:
        """One-line errors for out-of-range values (`min_tokens` 0: a prompt scored, nothing generated)."""
        if not min_tokens <= self.max_new_tokens <= limit:
            raise EdgeKVError(f"max_tokens must be in [{min_tokens}, {limit}], got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise EdgeKVError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgeKVError(f"top_p must be in (0, 1], got {self.top_p}")


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy (temperature 0) or temperature + top-p sampling from one position's logits."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass
class Completion:
    """One answered request."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    total_s: float
    layer_wait_s: float = 0.0  # time the first forward waited for layers in transit
    timings: dict = field(default_factory=dict)
    first_logits: torch.Tensor | None = None  # next-token logits after the prompt (option scoring)
    kv_bytes: int = 0  # the request's cache at the end: shared system KV + its own tokens


class EdgeSession:
    """An edge model + one system prompt whose KV (local shallow layers, exported deep layers) all requests share."""

    def __init__(self, edge: LoadedModel, kv: str | None = None, system_prompt: str | None = None,
                 link: Link | None = None, cache_dir: str | Path | None = None, local_sink_tokens: int | None = None,
                 peer_kv: str | None = None):
        self.edge, self.link = edge, link or Link()
        self.model = edge.model
        self.dtype = next(self.model.parameters()).dtype
        self.num_layers = len(decoder_layers(self.model))
        self.lock = threading.Lock()  # one forward at a time: requests interleave step by step
        self.started = time.perf_counter()
        self.stats = {"requests": 0, "errors": 0, "ttft_s": deque(maxlen=10_000), "tokens": 0}
        self.source, self.export, self.loader = "local-prefill", None, None
        self._own: list[KVPair] | None = None
        self._copy_dir = Path(cache_dir or Path.home() / ".cache/edgekv/exports") / (
            hashlib.sha256(str(kv).encode()).hexdigest()[:16] if kv else "none")
        if kv is not None:
            self.export = self._open(kv)
        if self.export is not None:
            self.system_ids = torch.tensor(self.export.manifest["system_prompt"]["token_ids"], dtype=torch.long)
            if system_prompt is not None:
                given = edge.tokenizer(system_prompt, add_special_tokens=True)["input_ids"]
                if given != self.system_ids.tolist():
                    raise EdgeKVError("--system-prompt differs from the prompt the KV export was made for")
        else:
            if system_prompt is None:
                raise EdgeKVError("no KV export could be read and no --system-prompt was given to prefill locally")
            # an empty system prompt is a session without reuse: every request prefills its whole prompt
            ids = edge.tokenizer(system_prompt, add_special_tokens=True)["input_ids"] if system_prompt else []
            self.system_ids = torch.tensor(ids, dtype=torch.long)
        self.prefix_len = int(self.system_ids.numel())
        self.splice = self.export.manifest.get("splice", "replace") if self.export is not None else "replace"
        self._fusion_lock = threading.Lock()
        self._fusion: tuple[dict[int, KVPair], dict] | None = None
        self.peer_kv, self.shallow_source = peer_kv, "local"
        self._build(local_sink_tokens)

    # ------------------------------------------------------------------------------------------- sources

    def _expect(self) -> Expect:
        return Expect(edge_fingerprint=self.edge.fingerprint, tokenizer_fingerprint=tokenizer_fingerprint(
            self.edge.tokenizer))

    def _open(self, kv: str) -> KVExport | None:
        """The export; a remote one that cannot be fetched falls back to the last verified local copy (or None:
        local prefill). An export for another model is refused outright."""
        try:
            export = KVExport(kv, self._expect())
            self.source = "remote" if is_url(kv) else "local"
            return export
        except FetchError as exc:
            log.warning("KV source unreachable (%s); trying the last verified local copy", exc)
        try:
            export = KVExport(self._copy_dir, self._expect())
            self.source = "local-copy"
            log.warning("serving from the last verified local copy %s", self._copy_dir)
            return export
        except KVStoreError as exc:
            log.warning("no usable local copy (%s); falling back to local full prefill", exc)
            return None

    def _build(self, local_sink_tokens: int | None) -> None:
        """Start the deep layers loading, then compute the shallow layers (overlapping the transfer)."""
        if self.splice == "fuse":
            return self._build_fused()
        self.start_layer = min(self.export.layer_indices) if self.export is not None else self.num_layers
        manifest = self.export.manifest if self.export is not None else {}
        if self.export is not None and self.export.layer_indices != list(range(self.start_layer, self.num_layers)):
            raise KVStoreError(f"{self.export.path}: layers {self.export.layer_indices} are not the deep layers "
                               f"{self.start_layer}..{self.num_layers - 1} of this edge model")
        sink = manifest.get("local_sink_tokens", 0) if local_sink_tokens is None else local_sink_tokens
        self.sink_tokens = min(int(sink), self.prefix_len)
        start = time.perf_counter()
        if self.export is not None:
            sink_kv = None
            if self.sink_tokens:
                own = prefix_kv(self.model, self.system_ids[: self.sink_tokens])
                sink_kv = {i: own[i] for i in self.export.layer_indices}
            fallbacks = [Fallback("local-copy", self._from_copy), Fallback("local-prefill", self._from_own)]
            if self.source == "local-copy":
                fallbacks = fallbacks[1:]
            self.loader = LayerLoader(self.export, self.model, self.dtype, self.link, fallbacks, sink_kv,
                                      on_loaded=self._keep_copy if self.source == "remote" else None).start()
        if self.prefix_len:
            peer = self._peer_shallow(self.start_layer) if self.peer_kv and self.start_layer else None
            self.shallow_source = "peer" if peer is not None else "local"
            self.shallow = peer if peer is not None else prefix_kv(self.model, self.system_ids, self.start_layer)
        else:
            _, kv_heads, head_dim = attn_shape(self.model)
            empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=self.dtype)
            self.shallow = [(empty, empty)] * self.num_layers
        self.timings = {"shallow_prefill_s": time.perf_counter() - start}

    def _peer_shallow(self, n: int) -> list[KVPair] | None:
        """Layers 0..n−1 from a same-model export of this system prompt made by a nearby edge (CE-LSLM: shallow
        layers "computed locally or reused from nearby peers"); None (computed locally) if it is unusable."""
        try:
            export = KVExport(self.peer_kv, self._expect())
            m = export.manifest
            if m.get("regime") != "same-model":
                raise KVStoreError("not a same-model export of this edge model")
            if m["system_prompt"]["token_ids_sha256"] != token_ids_sha256(self.system_ids.tolist()):
                raise KVStoreError("made for another system prompt")
            if not set(range(n)) <= set(export.layer_indices):
                raise KVStoreError(f"lacks some of layers 0..{n - 1}")
            out = []
            for i in range(n):
                keys, values = edge_kv(decode_layer(export, i), self.model)
                out.append((keys[None].to(self.dtype), values[None].to(self.dtype)))
            return out
        except EdgeKVError as exc:
            log.warning("peer KV %s unusable (%s); computing the shallow layers locally", self.peer_kv, exc)
            return None

    def _build_fused(self) -> None:
        """Fuse mode: the edge prefills its own KV of every layer while the cloud KV of the fuser's open layers
        loads; a cloud layer that fails verification keeps its gate closed (the edge's own KV alone)."""
        if any(not 0 <= i < self.num_layers for i in self.export.layer_indices):
            raise KVStoreError(f"{self.export.path}: layers {self.export.layer_indices} are not layers of this edge")
        self.fuser = self.export.shipped_translator()
        if self.fuser is None or getattr(self.fuser, "splice", None) != "fuse":
            raise KVStoreError(f"{self.export.path}: a fuse export without its fuser")
        enable_fusion(self.model)
        self.start_layer, self.sink_tokens = self.num_layers, 0
        self.loader = LayerLoader(self.export, self.model, self.dtype, self.link, [], None,
                                  on_loaded=self._keep_copy if self.source == "remote" else None).start()
        start = time.perf_counter()
        self.shallow = prefix_kv(self.model, self.system_ids)
        self.timings = {"shallow_prefill_s": time.perf_counter() - start}

    def fusion(self) -> tuple[dict[int, KVPair], dict]:
        """(own KV replaced by the fuser, cloud attention segments), made once when the cloud layers are in."""
        if self.splice != "fuse":
            return {}, {}
        with self._fusion_lock:
            if self._fusion is None:
                cloud = {}
                for i in self.loader.layers:
                    try:
                        k, v = self.loader.get(i)
                        cloud[i] = (k[0], v[0])
                    except EdgeKVError as exc:
                        log.warning("layer %d: no cloud KV (%s); its gate stays closed", i, exc)
                own = {i: (k[0], v[0]) for i, (k, v) in enumerate(self.shallow)}
                with torch.no_grad():
                    override, segments = self.fuser.fuse(self.model, own, cloud, sorted(cloud))
                self._fusion = ({i: (k[None], v[None]) for i, (k, v) in override.items()}, segments)
            return self._fusion

    def _forward_kwargs(self) -> dict:
        return {"cloud_segments": self.fusion()[1]} if self.splice == "fuse" else {}

    def _own_kv(self) -> list[KVPair]:
        if self._own is None and not self.prefix_len:
            self._own = self.shallow
        if self._own is None:
            self._own = prefix_kv(self.model, self.system_ids)
        return self._own

    def _from_own(self, i: int) -> KVPair:
        return self._own_kv()[i]

    def _from_copy(self, i: int) -> KVPair:
        copy = KVExport(self._copy_dir, self._expect())
        if copy.manifest.get("manifest_sha256") != self.export.manifest.get("manifest_sha256"):
            raise KVStoreError("the local copy is of another export")
        keys, values = edge_kv(decode_layer(copy, i), self.model, copy.translator())
        return keys[None], values[None]

    def _keep_copy(self, blobs: dict[str, bytes]) -> None:
        write_copy(self.export, self._copy_dir, blobs)

    # ------------------------------------------------------------------------------------------- decoding

    def layer_kv(self, i: int) -> KVPair:
        """The shared system-prompt KV of layer i (waits for a layer in transit)."""
        if self.splice == "fuse":
            return self.fusion()[0].get(i, self.shallow[i])
        if i < self.start_layer:
            return self.shallow[i]
        if self.loader is None:
            return self._from_own(i)
        return self.loader.get(i)

    def wait_loaded(self) -> None:
        """Block until every layer is in."""
        if self.loader is not None:
            self.loader.join()

    def new_cache(self, on_wait: Callable[[float], None] | None = None) -> DynamicCache:
        """A request's cache: every layer references the shared system KV (no copy)."""
        cache = DynamicCache()
        cache.layer_class_to_replicate = None
        cache.layers = [SharedPrefixLayer(lambda i=i: self.layer_kv(i), self.prefix_len, on_wait)
                        for i in range(self.num_layers)]
        return cache

    def encode_user(self, prompt: str) -> torch.Tensor:
        """Token ids of a user prompt (no special tokens: it continues the system prompt)."""
        ids = self.edge.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise EdgeKVError("the prompt is empty")
        return torch.tensor(ids, dtype=torch.long)

    @property
    def max_context(self) -> int:
        """The model's context length."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @torch.no_grad()
    def complete(self, prompt: str | torch.Tensor, params: SamplingParams | None = None,
                 on_text: Callable[[str], None] | None = None) -> Completion:
        """Answer one user prompt on the shared system cache; `on_text` receives the text as it streams."""
        params = params or SamplingParams()
        user = self.encode_user(prompt) if isinstance(prompt, str) else prompt
        total = self.prefix_len + user.numel() + params.max_new_tokens
        if total > self.max_context:
            raise EdgeKVError(f"system + user prompt + max_tokens = {total} tokens exceeds the model's context of "
                              f"{self.max_context}")
        waited = [0.0]
        cache = self.new_cache(on_wait=lambda s: waited.__setitem__(0, waited[0] + s))
        generator = torch.Generator().manual_seed(params.seed)
        eos = self._eos_ids()
        start = time.perf_counter()
        position = self.prefix_len
        ids = user[None]
        tokens: list[int] = []
        text, finish, ttft, first_logits = "", "length", 0.0, None
        while len(tokens) < params.max_new_tokens:
            positions = torch.arange(position, position + ids.shape[1])[None]
            extra = self._forward_kwargs()
            with self.lock:
                logits = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True,
                                    logits_to_keep=1, **extra).logits[0, -1]
            if not tokens and position == self.prefix_len:
                ttft = time.perf_counter() - start
                first_logits = logits.float()
            position += ids.shape[1]
            token = pick_token(logits, params, generator)
            if token in eos:
                finish = "stop"
                break
            tokens.append(token)
            ids = torch.tensor([[token]])
            if on_text is not None:
                new = self.edge.tokenizer.decode(tokens, skip_special_tokens=True)
                if not new.endswith("\ufffd") and len(new) > len(text):
                    on_text(new[len(text):])
                    text = new
        final = self.edge.tokenizer.decode(tokens, skip_special_tokens=True)
        if on_text is not None and len(final) > len(text):
            on_text(final[len(text):])
        done = Completion(final, tokens, finish, int(user.numel()), ttft, time.perf_counter() - start, waited[0],
                          first_logits=first_logits, kv_bytes=self.system_kv_bytes + sum(
                              layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers
                              if layer.is_initialized))
        self.stats["requests"] += 1
        self.stats["tokens"] += len(tokens)
        self.stats["ttft_s"].append(ttft)
        return done

    @property
    def system_kv_bytes(self) -> int:
        """Bytes of the shared system-prompt KV (all layers, as held; cloud segments included)."""
        own = sum(2 * k.numel() * k.element_size() for k, _ in (self.layer_kv(i) for i in range(self.num_layers)))
        return own + sum(2 * s.keys.numel() * s.keys.element_size() for s in self.fusion()[1].values())

    @torch.no_grad()
    def continuation_nll(self, user: torch.Tensor, continuation: torch.Tensor) -> float:
        """Mean NLL (nats/token) of `continuation` after the user prompt, on this session's system cache."""
        ids = torch.cat([user, continuation[:-1]])
        positions = torch.arange(self.prefix_len, self.prefix_len + ids.numel())[None]
        extra = self._forward_kwargs()
        with self.lock:
            logits = self.model(input_ids=ids[None], past_key_values=self.new_cache(), position_ids=positions,
                                use_cache=True, **extra).logits[0, user.numel() - 1:]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return float(-logp.gather(-1, continuation[:, None]).mean())

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        if self.edge.tokenizer.eos_token_id is not None:
            ids.add(self.edge.tokenizer.eos_token_id)
        return ids

    def describe(self) -> dict:
        """Where the system KV came from and what loading cost (for logs, /metrics and batch output)."""
        out = {"source": self.source, "shallow_source": self.shallow_source,
               "system_prompt_tokens": self.prefix_len, "start_layer": self.start_layer,
               "sink_tokens": self.sink_tokens, "splice": self.splice, **self.timings}
        if self.splice == "fuse":
            out["fused_layers"] = self.loader.layers
        if self.loader is not None:
            out.update(bytes_loaded=self.loader.bytes_loaded, layers=events_as_dicts(self.loader.events),
                       layer_sources=sorted({e.source for e in self.loader.events}))
        else:
            out.update(bytes_loaded=0, layers=[], layer_sources=["local-prefill"])
        return out
