"""Layer-wise pipelined loading of a KV export (CE-LSLM §IV; EdgePrompt eqs. 6–14), with a link emulator.

A background thread fetches, verifies, decodes and translates the export's layers in order and resolves one
future per layer; the edge's forward waits on layer i's future only when its attention reaches layer i, so per
layer only max(compute, transfer) is paid. A layer that fails (unreachable, truncated, corrupt) is never used:
it and every later layer come from the fallback chain (the last verified local copy, then the edge's own
prefill), and the event log says which source served each layer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

import torch

from edgekv import EdgeKVError
from edgekv.kv.export import KVExport
from edgekv.kv.registry import TRANSLATOR_CONFIG, TRANSLATOR_TENSORS, translator_from_files
from edgekv.kv.unpack import decode_tensors, edge_kv
from edgekv.models.structure import KVPair

log = logging.getLogger("edgekv")


@dataclass
class Link:
    """Emulated cloud→edge link: each file costs latency + bytes·8 / bandwidth (None: unthrottled)."""

    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0

    def __post_init__(self):
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise EdgeKVError(f"--bandwidth-mbps must be > 0, got {self.bandwidth_mbps}")
        if self.latency_ms < 0:
            raise EdgeKVError(f"--latency-ms must be ≥ 0, got {self.latency_ms}")

    def seconds(self, nbytes: int) -> float:
        """Modelled transfer time of one file."""
        wire = 0.0 if self.bandwidth_mbps is None else nbytes * 8 / (self.bandwidth_mbps * 1e6)
        return self.latency_ms / 1e3 + wire

    def pace(self, nbytes: int, started: float) -> None:
        """Sleep until the modelled transfer of a file fetched from `started` on would have finished."""
        delay = started + self.seconds(nbytes) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


@dataclass
class LayerEvent:
    """How one layer reached the edge: source, bytes, fetch (incl. emulated link) and decode time, and when it
    was ready (seconds since the loader started)."""

    layer: int
    source: str
    bytes: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    ready_s: float = 0.0
    error: str | None = None


@dataclass
class Fallback:
    """A named way to get a layer's system-prompt KV when the export cannot give it."""

    name: str
    get: Callable[[int], KVPair]


@dataclass
class LayerLoader:
    """Loads `export`'s layers in order on a thread; `get(i)` blocks until layer i is ready."""

    export: KVExport
    edge_model: torch.nn.Module
    dtype: torch.dtype
    link: Link = field(default_factory=Link)
    fallbacks: list[Fallback] = field(default_factory=list)
    sink: dict[int, KVPair] | None = None  # layer → the edge's own KV (1, h, s, d) of the first s prompt tokens
    on_loaded: Callable[[dict[str, bytes]], None] | None = None  # every file verified: e.g. keep a local copy

    def __post_init__(self):
        self.layers = self.export.layer_indices
        self.futures: dict[int, Future] = {i: Future() for i in self.layers}
        self.events: list[LayerEvent] = []
        self.translator_bytes = 0
        self.started = 0.0
        self._thread = threading.Thread(target=self._run, name="edgekv-layer-loader", daemon=True)

    def start(self) -> "LayerLoader":
        """Begin loading (returns at once)."""
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def get(self, layer: int) -> KVPair:
        """Layer's (keys, values) as (1, kv_heads, tokens, head_dim) in the model dtype; waits if needed."""
        return self.futures[layer].result()

    def join(self) -> None:
        """Wait for every layer."""
        self._thread.join()

    @property
    def bytes_loaded(self) -> int:
        """Bytes fetched from the export (layers + translator)."""
        return self.translator_bytes + sum(e.bytes for e in self.events)

    def _fetch(self, read: Callable[[], bytes]) -> tuple[bytes, float]:
        start = time.perf_counter()
        blob = read()
        self.link.pace(len(blob), start)
        return blob, time.perf_counter() - start

    def _run(self) -> None:
        failure: str | None = None
        blobs: dict[str, bytes] = {}
        translator = None
        try:
            if self.export.manifest.get("translator", {}).get("applied_on") == "edge":

                files = {}
                for name in (TRANSLATOR_TENSORS, TRANSLATOR_CONFIG):
                    files[name], _ = self._fetch(lambda n=name: self.export.file(n))
                self.translator_bytes = sum(map(len, files.values()))
                m = self.export.manifest
                translator = translator_from_files(files, f"{self.export.path}/{TRANSLATOR_CONFIG}",
                                                   m["cloud"]["fingerprint"], m["edge"]["fingerprint"])
                blobs.update(files)
        except EdgeKVError as exc:
            failure = str(exc)
            log.warning("translator: %s; falling back for every layer", failure)
        except Exception as exc:  # never let the thread die with futures unresolved
            failure = f"{type(exc).__name__}: {exc}"
        for i in self.layers:
            event = LayerEvent(i, "export")
            kv = None
            if failure is None:
                try:
                    entry = self.export.entries[i]
                    blob, event.fetch_s = self._fetch(lambda: self.export.layer_bytes(i))
                    event.bytes = len(blob)
                    start = time.perf_counter()
                    layer = decode_tensors(entry, self.export.parse_layer(i, blob), str(self.export.path))
                    keys, values = edge_kv(layer, self.edge_model, translator)
                    kv = self._finish(i, keys, values)
                    event.decode_s = time.perf_counter() - start
                    blobs[entry["file"]] = blob
                except Exception as exc:  # EdgeKVError for bad data; anything else must not poison the layer
                    failure = str(exc) if isinstance(exc, EdgeKVError) else f"{type(exc).__name__}: {exc}"
                    event.error = failure
                    log.warning("layer %d: %s; falling back to %s for layers %d..", i, failure,
                                " → ".join(f.name for f in self.fallbacks) or "nothing", i)
            if kv is None:
                kv, event.source = self._fallback(i, event)
            event.ready_s = time.perf_counter() - self.started
            self.events.append(event)
            if isinstance(kv, BaseException):
                self.futures[i].set_exception(kv)
            else:
                self.futures[i].set_result(kv)
        if failure is None and self.on_loaded is not None:
            try:
                self.on_loaded(blobs)
            except Exception as exc:  # a copy that cannot be written is a lost convenience, not an error
                log.warning("could not keep a local copy of the export: %s", exc)
        # every layer is resolved: the callbacks (bound methods of the system KV that holds this loader) are done
        # with, and kept they are a cycle that holds the whole system KV until the cyclic collector runs
        self.fallbacks, self.on_loaded = [], None

    def _finish(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> KVPair:
        keys, values = keys.to(self.dtype)[None].contiguous(), values.to(self.dtype)[None].contiguous()
        if self.sink and i in self.sink:  # attention-sink tokens: the edge's own KV, not the translated one
            s = self.sink[i][0].shape[-2]
            keys[:, :, :s], values[:, :, :s] = self.sink[i][0], self.sink[i][1]
        return keys, values

    def _fallback(self, i: int, event: LayerEvent):
        for fb in self.fallbacks:
            try:
                keys, values = fb.get(i)
                return (keys.to(self.dtype), values.to(self.dtype)), fb.name
            except Exception as exc:
                log.warning("layer %d: fallback %s failed: %s", i, fb.name, exc)
        return EdgeKVError(f"layer {i}: the export failed ({event.error}) and no fallback could serve it"), "none"


def events_as_dicts(events: list[LayerEvent]) -> list[dict]:
    """JSON-ready layer events."""
    return [asdict(e) for e in events]


def pipeline_ttft(shallow_s: float, compute_s: list[float], transfer_s: dict[int, float], head_s: float = 0.0,
                  first_ready_s: float = 0.0) -> dict[str, float]:
    """The pipeline model of a cold request (CE-LSLM eq. 20; EdgePrompt eqs. 6–14, per layer).

    The loader delivers the shipped layers one after another on one link: layer i (a key of transfer_s) is ready
    at ready_i = first_ready_s + Σ_{shipped k ≤ i} transfer_k; the edge first computes its own system-prompt
    layers (shallow_s), then runs the user tokens through layer i once layer i−1 is done and, if shipped, layer i
    has arrived: t_i = max(t_{i−1}, ready_i) + compute_i. Returns the predicted TTFT, the serial time (no overlap)
    and the lower bound max(total compute, total transfer) that perfect overlap would reach.
    """
    t, ready = shallow_s, first_ready_s
    for i, c in enumerate(compute_s):
        if i in transfer_s:
            ready += transfer_s[i]
            t = max(t, ready)
        t += c
    compute = shallow_s + sum(compute_s) + head_s
    transfer = first_ready_s + sum(transfer_s.values())
    return {"predicted_s": t + head_s, "serial_s": compute + transfer, "bound_s": max(compute, transfer)}


def predict_ttft(shallow_s: float, compute_s: list[float], transfer_s: list[float], start_layer: int,
                 head_s: float = 0.0, first_ready_s: float = 0.0) -> dict[str, float]:
    """`pipeline_ttft` for a contiguous split: layers start_layer.. shipped, transfer_s in layer order."""
    return pipeline_ttft(shallow_s, compute_s, {start_layer + k: s for k, s in enumerate(transfer_s)}, head_s,
                         first_ready_s)


def overlap_efficiency(measured_s: float, serial_s: float, bound_s: float) -> float:
    """Share of the overlap perfect pipelining would win that was won: (serial − measured) / (serial − bound)."""
    return (serial_s - measured_s) / (serial_s - bound_s) if serial_s > bound_s else 1.0
