"""The system prompt's KV for one edge model and one export (DESIGN.md §1, §5): what the serving engine and eval
answer on.

`SystemKV` is a `PrefixKV` (a transformers `Cache(layers=…)`, `edgekv.attention.prefix_kv`) whose layers resolve on
first read. Where each layer comes from is decided once, here: the edge's own prefill (layers < m, or all of them),
the export (pipelined, see pipeline.py) behind the fallback chain (last verified local copy, then local prefill), a
nearby peer's same-model export for the shallow layers, the edge's own KV for the first `sink` tokens, or — for a
fuse export — the edge's own KV changed by the fuser plus gated cloud segments. A request never writes into it: it
gets its own cache from `request_cache()`, whose `SharedPrefixLayer`s reference these tensors (no copy per
request).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.prefix_kv import PrefixKV, prefill_after, prefix_kv, prepend
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
from edgekv.kv.fusers import Fuser
from edgekv.kv.shared_prefix import SharedPrefix, read_under
from edgekv.kv.unpack import decode_layer, edge_kv
from edgekv.models.loading import LoadedModel
from edgekv.models.structure import KVPair, attn_shape, check_context, decoder_layers, model_device
from edgekv.serve.pipeline import Fallback, LayerLoader, Link, events_as_dicts

log = logging.getLogger("edgekv")


class SystemKV(PrefixKV):
    """The system prompt's KV of every layer of one edge model, from wherever it comes (see the module doc)."""

    def __init__(self, edge: LoadedModel, kv: str | None = None, system_prompt: str | None = None,
                 link: Link | None = None, cache_dir: str | Path | None = None, local_sink_tokens: int | None = None,
                 peer_kv: str | None = None, shared: SharedPrefix | None = None):
        """From an export `kv` (with the fallbacks), or the edge's own prefill of `system_prompt`; under a
        `shared` prefix, its K tokens come first and the prompt is read after them (an export must have been made
        under the same prefix)."""
        self.edge, self.model, self.link = edge, edge.model, link or Link()
        self.dtype = next(self.model.parameters()).dtype
        super().__init__(None, 0, num_layers=len(decoder_layers(self.model)))
        self.source, self.export, self.loader, self.peer_kv, self.shallow_source = "local-prefill", None, None, \
            peer_kv, "local"
        self._own: list[KVPair] | None = None
        self._fusion_lock = threading.Lock()
        self._fusion: tuple[dict[int, KVPair], dict] | None = None
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
        # a distilled export holds KV of kv_tokens ≠ the prompt's tokens; requests continue at next_position
        manifest = self.export.manifest if self.export is not None else {}
        self.prefix_len = int(manifest.get("kv_tokens", self.system_ids.numel()))
        self.next_position = int(manifest.get("next_position", self.prefix_len))
        self.distilled = "distilled" in manifest
        if self.export is not None:  # a gated export that declined this prefix is read without it
            shared = read_under(shared, manifest, f"the KV export {kv}")
        self.shared, self._joined = shared, {}
        if shared is not None:
            self.prefix_len += shared.tokens
            self.next_position += shared.tokens
        check_context(self.model.config, max(self.next_position, self.prefix_len), "the system prompt")
        self.splice = self.export.manifest.get("splice", "replace") if self.export is not None else "replace"
        if self.splice == "fuse":
            self._build_fused()
        else:
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
            if self.distilled:  # the edge's own prefill is the whole prompt, not the distilled tokens
                fallbacks = fallbacks[:1]
            if self.source == "local-copy":
                fallbacks = fallbacks[1:]
            self.loader = LayerLoader(self.export, self.model, self.dtype, self.link, fallbacks, sink_kv,
                                      on_loaded=self._keep_copy if self.source == "remote" else None).start()
        if self.prefix_len:
            peer = self._peer_shallow(self.start_layer) if self.peer_kv and self.start_layer else None
            self.shallow_source = "peer" if peer is not None else "local"
            if self.shared is not None:  # the prompt's own tokens read after the prefix (layer() puts it in front)
                self.shallow = self._prompt_kv()[: self.start_layer] if self.start_layer else []
            else:
                self.shallow = peer if peer is not None else prefix_kv(self.model, self.system_ids, self.start_layer)
        else:
            _, kv_heads, head_dim = attn_shape(self.model)
            empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=self.dtype, device=model_device(self.model))
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
        if not isinstance(self.fuser, Fuser):
            raise KVStoreError(f"{self.export.path}: a fuse export without its fuser")
        enable_fusion(self.model)
        self.start_layer, self.sink_tokens = self.num_layers, 0
        self.loader = LayerLoader(self.export, self.model, self.dtype, self.link, [], None,
                                  on_loaded=self._keep_copy if self.source == "remote" else None).start()
        start = time.perf_counter()
        self.shallow = self._prompt_kv()  # after the shared prefix, when there is one
        self.timings = {"shallow_prefill_s": time.perf_counter() - start}

    def _fused(self) -> tuple[dict[int, KVPair], dict]:
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
                    override, segments = self.fuser.fuse(self.model, own, cloud, sorted(cloud), offset=(
                        self.shared.prefix.next_position if self.shared is not None else 0))
                self._fusion = ({i: (k[None], v[None]) for i, (k, v) in override.items()}, segments)
            return self._fusion

    def _own_kv(self) -> list[KVPair]:
        if self._own is None and not self.prefix_len:
            self._own = self.shallow
        if self._own is None:
            self._own = self._prompt_kv()
        return self._own

    @torch.no_grad()  # prefill_after is differentiable for training: served, it built a graph the KV then held
    def _prompt_kv(self) -> list[KVPair]:
        """The edge's own prefill of the system prompt, every layer (after the shared prefix, when there is one)."""
        if self.shared is None:
            return prefix_kv(self.model, self.system_ids)
        if not self.system_ids.numel():
            return [(k[:, :, :0], v[:, :, :0]) for k, v in map(self.shared.prefix.layer, range(self.num_layers))]
        return prefill_after(self.model, self.shared.prefix, self.system_ids)

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

    # ------------------------------------------------------------------------------------------- reading

    def layer(self, i: int) -> KVPair:
        """Layer i's (1, kv_heads, P, d) keys and values (waits for a layer in transit); under a shared prefix,
        its K tokens first (joined once per layer)."""
        if self.shared is None:
            return self._prompt_layer(i)
        if i not in self._joined:
            self._joined[i] = prepend(self.shared.prefix.layer(i), self._prompt_layer(i))
        return self._joined[i]

    def _prompt_layer(self, i: int) -> KVPair:
        if self.splice == "fuse":
            return self._fused()[0].get(i, self.shallow[i])
        if i < self.start_layer:
            return self.shallow[i]
        if self.loader is None:
            return self._from_own(i)
        return self.loader.get(i)

    @property
    def segments(self) -> dict:
        """Layer → gated cloud attention segment (`CloudSegment`) beside the own KV; {} unless a fuse export."""
        return self._fused()[1]

    def wait_loaded(self) -> None:
        """Block until every layer is in."""
        if self.loader is not None:
            self.loader.join()

    def describe(self) -> dict:
        """Where the system KV came from and what loading cost (for logs, /metrics and batch output)."""
        out = {"source": self.source, "shallow_source": self.shallow_source,
               "system_prompt_tokens": self.prefix_len, "start_layer": self.start_layer,
               "sink_tokens": self.sink_tokens, "splice": self.splice, **self.timings}
        if self.shared is not None:
            out["shared_prefix"] = self.shared.describe()
        if self.splice == "fuse":
            out["fused_layers"] = self.loader.layers
        if self.loader is not None:
            out.update(bytes_loaded=self.loader.bytes_loaded, layers=events_as_dicts(self.loader.events),
                       layer_sources=sorted({e.source for e in self.loader.events}))
        else:
            out.update(bytes_loaded=0, layers=[], layer_sources=["local-prefill"])
        return out
