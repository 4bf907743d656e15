"""Many system prompts per server: model id → an engine over one KV export, loaded on demand, and idle ones
unloaded (least recently used first) when the held system KV exceeds a memory budget; a reload opens and
verifies the export again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.runtime import on_fresh_thread
from edgekv.serve.engine import MAX_BATCH, MAX_QUEUE, Engine
from edgekv.serve.session import EdgeSession


def export_id(path: str) -> str:
    """The id of an export: its folder (or .tar) name."""
    name = Path(str(path).rstrip("/")).name
    return name.removesuffix(".tar") or "edge"


def expand_sources(sources: list[str]) -> list[str]:
    """`--kv` values; a directory without a manifest of its own stands for every export folder inside it."""
    out = []
    for s in sources:
        p = Path(s)
        if p.is_dir() and not (p / "manifest.json").exists():
            found = sorted(str(c) for c in p.iterdir() if (c / "manifest.json").exists() or c.suffix == ".tar")
            if not found:
                raise EdgeKVError(f"{s}: neither a KV export nor a directory of exports")
            out += found
        else:
            out.append(s)
    return out


@dataclass
class _Entry:
    source: str | None
    engine: Engine | None = None
    kv_bytes: int = 0
    last_used: float = field(default_factory=time.monotonic)


class ExportPool:
    """Engines by model id; `get` loads, `evict` keeps the loaded system KV within `max_kv_bytes`."""

    def __init__(self, open_session: Callable[[str], EdgeSession], sources: dict[str, str],
                 max_kv_bytes: int | None = None, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
                 aliases: dict[str, str] | None = None):
        self.open_session, self.max_kv_bytes = open_session, max_kv_bytes
        self.aliases = aliases or {}  # other names of a model id (a catalog entry's key and prompt hash)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.entries = {k: _Entry(v) for k, v in sources.items()}
        self.lock = threading.Lock()
        self.stats = {"loads": 0, "unloads": 0}

    @classmethod
    def of_session(cls, model_id: str, session: EdgeSession, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE
                   ) -> ExportPool:
        """A pool of one session already open."""
        pool = cls(lambda s: session, {}, None, max_batch, max_queue)
        pool.add(model_id, session.engine(max_batch=max_batch, max_queue=max_queue))
        return pool

    def add(self, model_id: str, engine: Engine) -> None:
        """An engine already open (never unloaded: there is no source to reload it from)."""
        self.entries[model_id] = _Entry(None, engine, engine.system.nbytes)

    def resolve(self, name: str | None) -> str | None:
        """The model id a request's name means (an id or one of its aliases), or None."""
        return name if name in self.entries else self.aliases.get(name)

    def ids(self) -> list[str]:
        """Every model id, loaded or not."""
        return list(self.entries)

    def loaded(self) -> dict[str, Engine]:
        """The engines in memory now."""
        with self.lock:
            return {k: e.engine for k, e in self.entries.items() if e.engine is not None}

    def get(self, model_id: str) -> Engine:
        """The engine of `model_id`, loading (and verifying) its export if it was unloaded; KeyError if unknown."""
        with self.lock:
            entry = self.entries[model_id]
            entry.last_used = time.monotonic()
            if entry.engine is None:
                # an HTTP worker thread lives on: the prefill runs on a thread that ends (one OpenMP pool per engine)
                session = on_fresh_thread(self.open_session, entry.source)
                entry.engine = session.engine(max_batch=self.max_batch, max_queue=self.max_queue)
                entry.kv_bytes = session.system.nbytes
                self.stats["loads"] += 1
                self._evict(keep=model_id)
            return entry.engine

    def held_bytes(self) -> int:
        """Bytes of system KV held by the loaded engines."""
        return sum(e.kv_bytes for e in self.entries.values() if e.engine is not None)

    def _evict(self, keep: str) -> None:
        if self.max_kv_bytes is None:
            return
        idle = sorted((e.last_used, k) for k, e in self.entries.items()
                      if k != keep and e.engine is not None and e.source is not None and e.engine.load() ==
                      {"waiting": 0, "running": 0})
        for _, k in idle:
            if self.held_bytes() <= self.max_kv_bytes:
                break
            self.entries[k].engine.close()
            self.entries[k].engine = None
            self.stats["unloads"] += 1

    def close(self) -> None:
        """Stop every engine."""
        with self.lock:
            for e in self.entries.values():
                if e.engine is not None:
                    e.engine.close()
                    e.engine = None
