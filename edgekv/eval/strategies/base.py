"""What an eval strategy is: a name in the registry, what it ships, and how it answers one request.

A strategy is written `base[:variant][@RATIO/CODEC]` (`ce-lslm:uniform@0.25/int4`); `parse_strategy` reads that
form once into an instance of the class registered under `base`. Classes say which variants and knobs they
accept; everything else about them (the compress config of their export, the session they answer on) is theirs.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from edgekv import EdgeKVError
from edgekv.eval.artefacts import Artefacts
from edgekv.eval.datasets import Request
from edgekv.kv.codecs import SCHEMES
from edgekv.kv.compress_job import CompressConfig
from edgekv.models.loading import LoadedModel
from edgekv.serve.session import EdgeSession

STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class under its `base` name (one-line error on a duplicate)."""
    if cls.base in STRATEGIES:
        raise ValueError(f"strategy '{cls.base}' is registered twice")
    STRATEGIES[cls.base] = cls
    return cls


def ratio_codec(knobs: str) -> tuple[float, str] | None:
    """`RATIO/CODEC` → (ThinK ratio in [0, 1), codec), or None when it is not one."""
    ratio, _, quant = knobs.partition("/")
    try:
        r = float(ratio)
    except ValueError:
        return None
    return (r, quant) if quant in SCHEMES and 0.0 <= r < 1.0 else None


@dataclass
class Answering:
    """A strategy's session for one request and what it cost to get there."""

    session: EdgeSession
    model: LoadedModel
    built_s: float  # building the session (TTFT includes it)
    sent: list[tuple[str, str]] = field(default_factory=list)  # what reached the cloud side: (kind, text)
    cloud_s: float = 0.0
    bytes_down: int = 0
    cloud_fp16_bytes: int | None = None
    network_s: float = 0.0  # modelled link time added to TTFT (cloud-only's prompt upload)
    answer_down: bool = False  # the answer's text comes down the link (it is the bytes sent to the edge)


@dataclass(frozen=True)
class Strategy(ABC):
    """One strategy as named in a run; subclasses set `base` and implement `answering`."""

    name: str
    variant: str = ""
    prune_ratio: float | None = None  # @RATIO/CODEC overrides (the quality-per-byte sweep)
    quant: str | None = None
    factor: int | None = None  # @c<N>: a distilled student of ceil(P / N) tokens

    base: ClassVar[str] = "?"
    variants: ClassVar[tuple[str, ...]] = ()  # accepted `:variant`s
    knobs: ClassVar[bool] = False  # accepts an @RATIO/CODEC suffix
    ships_kv: ClassVar[bool] = False  # answers on a KV export made by the cloud side

    @classmethod
    def with_knobs(cls, name: str, variant: str, knobs: str) -> Strategy | None:
        """The strategy with an `@…` suffix (None: this class takes no such suffix): `@RATIO/CODEC`."""
        codec = ratio_codec(knobs)
        if not cls.knobs or codec is None:
            return None
        return cls(name, variant, *codec)

    def validate(self, cfg) -> None:
        """One-line errors for settings this strategy needs (before any model loads)."""

    @abstractmethod
    def answering(self, a: Artefacts, req: Request) -> Answering:
        """The session that answers `req`, timed from the start of its construction."""

    def model(self, a: Artefacts) -> LoadedModel:
        """The model that answers."""
        return a.edge

    def load_session(self, a: Artefacts, system: str) -> tuple[EdgeSession, bool]:
        """A warm session for Poisson load runs on one system prompt; True when prompts are user prompts only
        (the system KV is reused), False when each prompt must carry the system prompt."""
        return EdgeSession(self.model(a), None, system_prompt=""), False


class KVStrategy(Strategy):
    """A strategy that answers on a KV export of the system prompt, made on the cloud side by `make_export`."""

    ships_kv: ClassVar[bool] = True
    # the eval setting naming the shared prefix its export is made and read under (None: no prefix)
    prefix_setting: ClassVar[str | None] = None

    def validate(self, cfg) -> None:
        if self.prefix_setting and not getattr(cfg, self.prefix_setting):
            raise EdgeKVError(f"strategy {self.name} needs {self.prefix_setting} (a shared prefix of `edgekv distill "
                              "--train-shared`)")

    def shared_path(self, a: Artefacts) -> str | None:
        """The shared prefix this strategy's exports are made and read under (None: none)."""
        return getattr(a.cfg, self.prefix_setting) if self.prefix_setting else None

    def _shared(self, a: Artefacts):
        path = self.shared_path(a)
        return a.shared_prefix(path) if path else None

    def cloud_model(self, a: Artefacts) -> LoadedModel:
        """The model that computes the export's KV."""
        return a.cloud

    def prepare(self, a: Artefacts) -> None:
        """Work done once per run before the first export (e.g. fitting a translator)."""

    @abstractmethod
    def make_export(self, a: Artefacts, work: Path, prompt_file: Path) -> tuple[Path, dict]:
        """(the export of the system prompt in `prompt_file`, made in `work`; {cloud_s, bytes, cloud_fp16_bytes})."""

    def answering(self, a: Artefacts, req: Request) -> Answering:
        export, info = a.export(self, req.system)
        start = time.perf_counter()
        session = EdgeSession(a.edge, str(export), link=a.link, cache_dir=a.out / "work" / "kvcache",
                              shared=self._shared(a))
        return Answering(session, a.edge, time.perf_counter() - start, [("system", info["cloud_input"])],
                         info["cloud_s"], info["bytes"], info["cloud_fp16_bytes"])

    def load_session(self, a: Artefacts, system: str) -> tuple[EdgeSession, bool]:
        export, _ = a.export(self, system)
        return EdgeSession(a.edge, str(export), cache_dir=a.out / "work" / "kvcache", shared=self._shared(a)), True


class CompressStrategy(KVStrategy):
    """A KV strategy whose export `edgekv compress` makes."""

    def compress_config(self, a: Artefacts) -> CompressConfig:
        """The `edgekv compress` settings of this strategy's exports (ratio/codec overrides applied; no `out` or
        system prompt yet)."""
        cfg = self._compress_config(a)
        if self.prune_ratio is not None:
            cfg = replace(cfg, prune_ratio=self.prune_ratio, quant=self.quant)
        return cfg

    @abstractmethod
    def _compress_config(self, a: Artefacts) -> CompressConfig:
        """The strategy's own compress settings, before the ratio/codec overrides."""

    def make_export(self, a: Artefacts, work: Path, prompt_file: Path) -> tuple[Path, dict]:
        cfg = replace(self.compress_config(a), out=str(work / "kv"), system_prompt=f"@{prompt_file}")
        report = a.compress(self, cfg, work.name)
        return work / "kv", {"cloud_s": report["cloud_s"], "bytes": report["bytes_written"],
                             "cloud_fp16_bytes": report["raw_fp16_cloud_bytes"]}


def parse_strategy(name: str) -> Strategy:
    """`base[:variant][@RATIO/CODEC]` → the registered strategy; one-line error for anything else."""
    head, _, knobs = name.partition("@")
    base, _, variant = head.partition(":")
    cls = STRATEGIES.get(base)
    with_variants = ", ".join(f"{b}:<{'|'.join(c.variants)}>" for b, c in STRATEGIES.items() if c.variants)
    with_knobs = "/".join(b for b, c in STRATEGIES.items() if c.knobs)
    usage = (f"unknown strategy '{name}' (choose from {', '.join(STRATEGIES)}, {with_variants}, and for "
             f"{with_knobs}[:variant] an @RATIO/CODEC suffix such as ce-lslm@0.25/int4; distilled ones take "
             "@c<N> (a student of P/N tokens) and/or s<S> (S training steps), e.g. @c8s120, and/or /RATIO/CODEC, "
             "e.g. @c2/0/int4 or @0.3/int2)")
    if cls is None or (variant and variant not in cls.variants):
        raise EdgeKVError(usage)
    if not knobs:
        return cls(name, variant)
    st = cls.with_knobs(name, variant, knobs)
    if st is None:
        raise EdgeKVError(usage)
    return st
