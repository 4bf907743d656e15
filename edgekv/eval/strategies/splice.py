"""Strategies that answer on a KV export of the system prompt: EdgePrompt (one model on both sides, every
layer's KV, exact), CE-LSLM (the cloud's deep layers through the align mapping and a translator, ThinK-pruned and
quantized; `ce-lslm:<mapping>` swaps the mapping for align's baselines) and CE-LSLM with a trained fuser (the
cloud KV of the fuser's open layers beside the edge's own prefill)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import MAPPINGS
from edgekv.atomic import write_text_atomic
from edgekv.distill.teacher import BatchedTeacher
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
class EdgePromptShared(EdgePrompt):
    """EdgePrompt under the run's shared prefix (issue 37): the prompt's KV is the edge's own, read after the
    prefix's K tokens; the export holds the prompt's tokens only (the prefix ships once per model pair)."""

    base = "edgeprompt-shared"
    prefix_setting = "shared"

    def _compress_config(self, a):
        return replace(super()._compress_config(a), shared=self.shared_path(a))


@register_strategy
class EdgePromptSharedGated(EdgePromptShared):
    """EdgePrompt under the shared prefix where the cloud's check of each system prompt says the prefix brings the
    edge closer to the cloud on it, plain EdgePrompt elsewhere (`compress --shared-gate`): the prefix's "never
    worse" guard, decided on the system prompt alone."""

    base = "edgeprompt-shared-gated"

    def _compress_config(self, a):
        return replace(super()._compress_config(a), shared_gate=a.cfg.cloud)


@register_strategy
class PrefixSft(EdgePromptShared):
    """EdgePrompt under a prefix of the same K tokens trained on the training prompts' own labels (`shared_sft`:
    `edgekv distill --train-shared --shared-targets labels`): what labels would give, beside what the cloud gives."""

    base = "prefix-sft"
    prefix_setting = "shared_sft"


@register_strategy
class Notes(EdgePrompt):
    """The text baseline (issue 37): the cloud writes notes on the system prompt (greedy, `notes_instruction`,
    never the eval's own instruction) and the edge reads prompt + notes, shipped as EdgePrompt's export of both (the
    notes' KV counted in the bytes, the cloud's writing in cloud_s)."""

    base = "notes"

    def make_export(self, a, work, prompt_file):
        start = time.perf_counter()
        system = prompt_file.read_text(encoding="utf-8")
        tok = a.cloud.tokenizer
        ids = torch.tensor(tok(system, add_special_tokens=True)["input_ids"], dtype=torch.long)
        ask = torch.tensor(tok(a.cfg.notes_instruction, add_special_tokens=False)["input_ids"], dtype=torch.long)
        notes = BatchedTeacher.of_prompt(a.cloud, ids).generate([ask], a.cfg.notes_tokens, 0.0, [0])[0].text
        with_notes = work / "system_with_notes.txt"
        write_text_atomic(with_notes, f"{system}{a.cfg.notes_instruction}{notes.rstrip()}\n\n")
        written_s = time.perf_counter() - start
        kv, info = super().make_export(a, work, with_notes)
        return kv, {**info, "cloud_s": info["cloud_s"] + written_s}


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
        super().validate(cfg)
        if not cfg.fuser_path:
            raise EdgeKVError("strategy ce-lslm-fuse needs fuser_path (a trained fuser, e.g. from "
                              "`edgekv train-fuser`)")

    def _compress_config(self, a):
        c = a.cfg  # the fuser's own pairs and open gates decide which layers ship
        name = json.loads((Path(c.fuser_path) / "translator.json").read_text())["name"]
        return CompressConfig(cloud=c.cloud, edge=c.edge, dtype=c.dtype, prune_ratio=c.prune_ratio, quant=c.quant,
                              translator=name,
                              translator_path=c.fuser_path, splice="fuse")


@register_strategy
class CeLslmFuseShared(CeLslmFuse):
    """CE-LSLM with the fuser, the edge's own KV read after the run's shared prefix (issue 37): whether the fuser's
    gain stacks on the prefix's. Its gates were trained without the prefix; the cloud's KV is the same export's."""

    base = "ce-lslm-fuse-shared"
    prefix_setting = "shared"

    def _compress_config(self, a):
        return replace(super()._compress_config(a), shared=self.shared_path(a))

