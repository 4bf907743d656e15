"""Strategies that answer on a KV export of the system prompt: EdgePrompt (one model on both sides, every
layer's KV, exact), CE-LSLM (the cloud's deep layers through the align mapping and a translator, ThinK-pruned and
quantized; `ce-lslm:<mapping>` swaps the mapping for align's baselines) and CE-LSLM with a trained fuser (the
cloud KV of the fuser's open layers beside the edge's own prefill)."""

from __future__ import annotations

import json
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.align.mapping import MAPPINGS
from edgekv.eval.strategies.base import CompressStrategy, register_strategy
from edgekv.kv.compress_job import CompressConfig


@register_strategy
class EdgePrompt(CompressStrategy):
    """Every layer's prompt KV from the "cloud" running the edge model itself, stored losslessly."""

    base = "edgeprompt"
    knobs = True

    def cloud_model(self, a):
        return a.edge

    def _compress_config(self, a):
        c = a.cfg
        return CompressConfig(cloud=c.edge, edge=c.edge, dtype=c.dtype, start_layer=0,
                              quant="bf16" if c.dtype == "bfloat16" else "fp32")


@register_strategy
class CeLslm(CompressStrategy):
    """The cloud model's KV for the deep layers, mapped by similarity (or a baseline mapping) and translated."""

    base = "ce-lslm"
    variants = tuple(MAPPINGS)
    knobs = True

    def prepare(self, a):
        a.translator_path(self.variant, self._compress_config(a))

    def _compress_config(self, a):
        c = a.cfg
        return CompressConfig(cloud=c.cloud, edge=c.edge, dtype=c.dtype, mapping=a.mapping_path(self.variant),
                              prune_ratio=c.prune_ratio, quant=c.quant,
                              translator=c.translator, translator_path=a.translators.get(self.variant),
                              local_sink_tokens=c.local_sink_tokens, calib=c.calib, calib_texts=c.calib_texts,
                              calib_tokens=c.calib_tokens)


@register_strategy
class CeLslmFuse(CompressStrategy):
    """The cloud KV of a trained fuser's open layers, fused with the edge's own prefill (`--splice fuse`)."""

    base = "ce-lslm-fuse"

    def validate(self, cfg):
        if not cfg.fuser_path:
            raise EdgeKVError("strategy ce-lslm-fuse needs fuser_path (a trained fuser, e.g. from "
                              "`edgekv train-fuser`)")

    def _compress_config(self, a):
        c = a.cfg  # the fuser's own pairs and open gates decide which layers ship
        name = json.loads((Path(c.fuser_path) / "translator.json").read_text())["name"]
        return CompressConfig(cloud=c.cloud, edge=c.edge, dtype=c.dtype, prune_ratio=c.prune_ratio, quant=c.quant,
                              translator=name,
                              translator_path=c.fuser_path, splice="fuse")
