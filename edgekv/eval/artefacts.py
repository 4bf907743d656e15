"""What the strategies of an eval run receive (`Artefacts`): models, link, mappings, translators and exports."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from edgekv.align.mapping import MappingParams, build_mapping, layer_pairs
from edgekv.atomic import write_text_atomic
from edgekv.kv.cloud_kv import calibration, get_translator
from edgekv.kv.compress_job import CompressConfig, run_compress
from edgekv.kv.registry import save_translator
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.models.loading import LoadedModel, check_tokenizers, load_pair
from edgekv.progress import Tasks
from edgekv.serve.pipeline import Link

log = logging.getLogger("edgekv")


class ShipsKV(Protocol):
    """What the artefacts need of a strategy that ships KV (`strategies.KVStrategy`)."""

    name: str
    base: str
    variant: str

    def prepare(self, a: Artefacts) -> None: ...

    def make_export(self, a: Artefacts, work: Path, prompt_file: Path) -> tuple[Path, dict]: ...

    def cloud_model(self, a: Artefacts) -> LoadedModel: ...


def prompt_key(system: str) -> str:
    """The folder a system prompt's exports and synthetic sets are kept under (`work/exports/<strategy>/<key>`)."""
    return hashlib.sha256(system.encode()).hexdigest()[:16]


class Artefacts:
    """What the strategies of one eval run share: the loaded models, the link, layer mappings, fitted translators
    and the exports of system prompts (each made once). `cfg` is the run's EvalConfig."""

    def __init__(self, cfg: Any, out: Path, tasks: Tasks, models: tuple[LoadedModel, LoadedModel] | None = None):
        self.cfg, self.out, self.tasks = cfg, out, tasks
        if models is not None:
            self.cloud, self.edge = models
        else:
            self.cloud, self.edge = load_pair(cfg.cloud, cfg.edge, cfg.dtype, device=cfg.device,
                                              edge_weights=cfg.weights)
        check_tokenizers(self.cloud.tokenizer, self.edge.tokenizer)
        self.link = Link(cfg.bandwidth_mbps, cfg.latency_ms)
        self.translators: dict[str, str] = {}
        self.exports: dict[tuple[str, str], tuple[Path, dict]] = {}
        self._layers_family: tuple | None = None
        self._layers_cache: dict = {}
        self._shared: dict[str, SharedPrefix] = {}

    def shared_prefix(self, path: str) -> SharedPrefix:
        """A shared prefix for the edge, loaded and verified once per run."""
        if path not in self._shared:
            self._shared[path] = SharedPrefix(path, self.edge)
        return self._shared[path]

    # ------------------------------------------------------------------------------------------- preparation

    def mapping_path(self, variant: str) -> str:
        """mapping.json for the similarity mapping (align's output, made if missing) or a baseline variant."""
        align_dir = Path(self.cfg.align_dir)
        if not (align_dir / "mapping.json").exists():
            from edgekv.align.align_job import AlignConfig, run_align
            from edgekv.config import load_config

            log.info("no %s/mapping.json: running `edgekv align` first", align_dir)
            c = self.cfg  # the eval's models, dtype and device, whatever the align config names: the mapping is theirs
            models = {"cloud": c.cloud, "edge": c.edge, "dtype": c.dtype, "device": c.device}
            acfg = load_config(AlignConfig, "align", c.align_config, {"out": str(align_dir), **models})
            run_align(acfg, self.tasks.progress)
        if variant in ("", "similarity"):
            return str(align_dir / "mapping.json")
        sim = json.loads((align_dir / "similarity.json").read_text())
        base = json.loads((align_dir / "mapping.json").read_text())
        matrices = {k: torch.tensor(v, dtype=torch.float64) for k, v in sim["metrics"].items()}
        mapping = build_mapping(variant, matrices, MappingParams(int(base["start_layer"])))
        mapping.update(num_cloud_layers=base["num_cloud_layers"], num_edge_layers=base["num_edge_layers"])
        path = self.out / "work" / f"mapping-{variant}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(mapping))
        return str(path)

    def translator_path(self, variant: str, ccfg: CompressConfig) -> str:
        """A saved translator for the variant's mapping (`ccfg`: the compress settings that use it):
        --translator-path, else fitted once and kept."""
        if self.cfg.translator_path and variant in ("", "similarity"):
            self.translators[variant] = self.cfg.translator_path
        if variant in self.translators:
            return self.translators[variant]
        path = self.out / "work" / f"translator-{self.cfg.translator}-{variant or 'similarity'}"
        if not (path / "translator.json").exists():
            ccfg = replace(ccfg, translator_path=None)
            pairs, _ = layer_pairs(ccfg.mapping, ccfg.start_layer, self.cloud.num_layers, self.edge.num_layers)
            translator, _ = get_translator(ccfg, self.cloud, self.edge, pairs, calibration(ccfg, self.edge.tokenizer),
                                           self.tasks)
            save_translator(translator, path, self.cloud.fingerprint, self.edge.fingerprint)
        self.translators[variant] = str(path)
        return str(path)

    def export(self, st: ShipsKV, system: str) -> tuple[Path, dict]:
        """The KV export of a system prompt for a strategy that ships KV (made once per distinct prompt; the cloud
        side sees only the system prompt)."""
        key = (st.name, prompt_key(system))
        if key not in self.exports:
            st.prepare(self)
            work = self.out / "work" / "exports" / st.name.replace(":", "-").replace("@", "-").replace("/", "-") \
                / key[1]
            work.mkdir(parents=True, exist_ok=True)
            prompt_file = work / "system_prompt.txt"
            write_text_atomic(prompt_file, system)
            self.exports[key] = st.make_export(self, work, prompt_file)
            self.exports[key][1]["cloud_input"] = system
        return self.exports[key]

    def export_at_split(self, st: ShipsKV, system: str, start_layer: int) -> Path:
        """The strategy's export of a system prompt with only layers ≥ `start_layer` shipped (made once; the
        planner's splits of a same-model export)."""
        kv, _ = self.export(st, system)
        out = Path(kv).parent.parent / f"split-{start_layer}"
        if not (out / "manifest.json").exists():
            cfg = replace(st.compress_config(self), out=str(out), start_layer=start_layer,
                          system_prompt=f"@{Path(kv).parent / 'system_prompt.txt'}")
            run_compress(cfg, models=(self.edge, self.edge))
        return out

    def compress(self, st: ShipsKV, cfg: CompressConfig, system_sha: str) -> dict:
        """run_compress for a strategy's export; variants of one strategy that differ only in ratio/codec share
        the cloud-side KV of the prompt, strategies that read the same cloud features share its forward (cloud_s
        still counts that computation once for each)."""
        family = (st.base, st.variant, system_sha)
        if self._layers_family != family:
            self._layers_family, self._layers_cache = family, {}
        start = time.perf_counter()
        report = run_compress(cfg, models=(st.cloud_model(self), self.edge), layers_cache=self._layers_cache,
                              teacher=self.cloud if cfg.shared_gate == self.cfg.cloud else None)
        reused = report["timings"].get("cached_cloud_kv_s", 0.0) + report["timings"].get("cached_cloud_forward_s", 0.0)
        report["cloud_s"] = time.perf_counter() - start + reused
        return report
