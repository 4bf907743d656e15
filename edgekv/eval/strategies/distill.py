"""Strategies whose export is a distilled, edge-native system-prompt KV (`edgekv distill`): EdgePrompt's format and
speed, trained so the edge reading it predicts what a teacher predicts reading the whole prompt.

- `ce-lslm-distill`: the cloud teaches a student of every prompt token (P' = P); `@c<N>`: of P/N tokens; `@s<S>`
  (alone or after c<N>): S training steps instead of the config's (recipe ablations share one synthetic set);
  `:nosum`: the seed instructions without the summarising one (a query type never in the synthetic set);
  `:v1`: the recipe shipped before issue 34 (`V1_RECIPE`), through today's teacher; `:recall`: the config's seed
  types and `recall` (the prompt's own words, `teacher.RECALL`). A `/RATIO/CODEC` suffix (`@0.3/int2`,
  `@c2/0/int4`) exports the student ThinK-pruned and quantized; `:qat` also trains it through that codec.
- `ce-lslm-distill-shared` (and its :recall, @c<N>, @s<S>): the same, on top of the run's shared prefix (issue 37).
- `oracle-kv` (a bound, never shipped): the request's EdgePrompt KV trained toward the cloud's distribution over
  that request's own reference (issue 37): what a per-prompt KV can carry at most.
- `edgeprompt-shared-selfdistill` (and its :qat): the edge reading [shared prefix | prompt] teaches the prompt's KV
  read after the prefix: with `:qat@R/CODEC`, the 2-bit student's codec learnt without the cloud's per-prompt targets.
- `edgeprompt-selfdistill@c<N>`: the edge teaches itself (Cartridges' self-study): what compression recovers
  without the cloud, at equal bytes.
- `edgeprompt-truncate@c<N>`: the same P/N-token student untrained (0 steps): EdgePrompt of the first P/N tokens.
The synthetic set of one teacher and prompt is made once and shared by that teacher's strategies; `cloud_s` is
generation + targets + training of the strategy's student (what it costs per system prompt on its own).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from edgekv import EdgeKVError
from edgekv.config import changed, load_config
from edgekv.distill.distill_job import V1_RECIPE, DistillConfig, run_distill, student_export
from edgekv.distill.student import initial_student, train_student
from edgekv.distill.teacher import RECALL, BatchedTeacher, Sample
from edgekv.eval.strategies.base import Answering, KVStrategy, Strategy, ratio_codec, register_strategy
from edgekv.serve.session import EdgeSession
from edgekv.texts import reference_ids


@dataclass(frozen=True)
class DistillStrategy(KVStrategy):
    """A KV strategy whose export `edgekv distill` makes."""

    train_steps: int | None = None  # @s<S>; None: the config's

    teacher: ClassVar[str] = "cloud"
    # variants that change only how the student trains or ships, not its queries: they reuse the plain synthetic set
    same_queries: ClassVar[tuple[str, ...]] = ("qat",)
    steps: ClassVar[int | None] = None  # fixed by the class (the untrained control); None: train_steps
    knobs: ClassVar[bool] = True

    @classmethod
    def with_knobs(cls, name, variant, knobs):
        """`@c<N>`, `@s<S>`, `@c<N>s<S>`, each optionally followed by `/RATIO/CODEC`, or `@RATIO/CODEC` alone."""
        m = re.fullmatch(r"(?:c([1-9][0-9]*))?(?:s([1-9][0-9]*))?(?:(?:^|/)([0-9.]+/[a-z0-9]+))?", knobs)
        if not knobs or m is None or knobs.startswith("/") or (m.group(2) and cls.steps is not None):
            return None
        ratio, quant = ratio_codec(m.group(3) or "") or (None, None)
        if m.group(3) and quant is None:
            return None
        return cls(name, variant, ratio, quant, factor=int(m.group(1)) if m.group(1) else None,
                   train_steps=int(m.group(2)) if m.group(2) else None)

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if self.variant == "qat" and self.quant is None:
            raise EdgeKVError(f"strategy {self.name}: :qat trains through a codec; give one, e.g. @0.3/int2")

    def cloud_model(self, a):
        return a.edge if self.teacher == "self" else a.cloud

    def distill_config(self, a, work: Path, prompt_file: Path) -> DistillConfig:
        """The run's distill config (configs/distill.yaml unless the eval config names another), for this prompt."""
        c = a.cfg
        cfg = load_config(DistillConfig, "distill", c.distill_config, {"system_prompt": f"@{prompt_file}"})
        if self.variant == "v1":
            cfg = replace(cfg, **V1_RECIPE)
        instructions, seeds = cfg.instructions, cfg.seeds
        if self.variant == "nosum":  # no summarising seed of any type
            instructions = [t for t in instructions if "summar" not in t.lower()]
            seeds = [s for s in seeds if s != "summarization"]
        if self.variant == "recall" and RECALL not in seeds:
            seeds = [*seeds, RECALL]
        if self.quant is not None:
            cfg = replace(cfg, prune_ratio=self.prune_ratio, quant=self.quant, train_codec=self.variant == "qat")
        seeds_of = "all" if not self.variant or self.variant in self.same_queries else self.variant
        return replace(cfg, out=str(work), system_prompt=f"@{prompt_file}", prompts=None, cloud=c.cloud, edge=c.edge,
                       dtype=c.dtype, teacher=self.teacher, compress=self.factor, length=None,
                       steps=self.steps if self.steps is not None else self.train_steps or cfg.steps,
                       instructions=instructions, seeds=seeds, shared=self.shared_path(a),
                       synthetic_dir=str(work.parent.parent / f"synthetic-{self.teacher}-{seeds_of}" / work.name))

    def make_export(self, a, work, prompt_file):
        cfg = self.distill_config(a, work, prompt_file)
        report = run_distill(cfg, models=(a.cloud, a.edge))["reports"]["prompt"]
        cloud_s = sum(report.get(k) or 0.0 for k in ("generate_s", "targets_s", "train_s"))
        return Path(report["out"]), {"cloud_s": cloud_s, "bytes": report["bytes_written"],
                                     "cloud_fp16_bytes": report["full_fp16_bytes"]}


@register_strategy
class CeLslmDistill(DistillStrategy):
    """The cloud teaches the edge's KV of the whole prompt (or of P/N tokens with @c<N>)."""

    base = "ce-lslm-distill"
    variants = ("nosum", "v1", "recall", "qat")


@register_strategy
class CeLslmDistillShared(DistillStrategy):
    """Per-prompt distillation on top of the run's shared prefix (issue 37): the student starts from the prompt's
    KV read after the prefix, and is read after it; the teacher's synthetic sets are ce-lslm-distill's."""

    base = "ce-lslm-distill-shared"
    variants = ("recall", "qat")
    prefix_setting = "shared"


@register_strategy
class EdgepromptSelfDistill(DistillStrategy):
    """The edge teaches its own shorter KV (the self-study control)."""

    base = "edgeprompt-selfdistill"
    teacher = "self"


@register_strategy
class EdgepromptSharedSelfDistill(DistillStrategy):
    """The edge on the shared prefix teaches its own KV of the prompt read after it (`:qat@R/CODEC`: through the
    codec): the control that says how much of a shipped 2-bit student's loss is the codec's and how much the
    cloud's per-prompt targets'; the cloud's only share is the prefix."""

    base = "edgeprompt-shared-selfdistill"
    variants = ("qat",)
    teacher = "self"
    prefix_setting = "shared"


@register_strategy
class EdgepromptTruncate(DistillStrategy):
    """The student untrained: EdgePrompt of the first P/N tokens."""

    base = "edgeprompt-truncate"
    teacher = "self"
    steps = 0


@register_strategy
class OracleKV(Strategy):
    """The bound of what a per-prompt KV can carry (never shipped): the edge's own KV of the system prompt,
    trained (distill's student, settings and loop) toward the cloud's top-k distribution over this request's user
    prompt and its own reference, the very tokens its reference NLL is scored on."""

    base = "oracle-kv"

    def answering(self, a, req):
        cfg = load_config(DistillConfig, "distill", a.cfg.distill_config, {"system_prompt": "unused"})
        key = hashlib.sha256(json.dumps([req.system, req.user, req.reference]).encode()).hexdigest()[:16]
        work = a.out / "work" / "oracle-kv" / key
        ids = torch.tensor(a.edge.tokenizer(req.system, add_special_tokens=True)["input_ids"], dtype=torch.long)
        start = time.perf_counter()
        if not (work / "kv" / "manifest.json").exists():
            user = torch.tensor(a.edge.tokenizer(req.user, add_special_tokens=False)["input_ids"], dtype=torch.long)
            ref = reference_ids(a.edge.tokenizer, req.scored or req.reference, a.cfg.reference_tokens)
            sample = Sample("oracle", user, ref)
            BatchedTeacher.of_prompt(a.cloud, ids).score([sample], cfg.top_k)
            student, index = initial_student(a.edge, ids, ids.numel(), "all", freeze_first=cfg.freeze_first)
            cfg = replace(cfg, batch=1, query_loss=False)
            log_, best = train_student(cfg, a.edge, student, [sample], [sample], work / "train", a.tasks)
            student_export(cfg, a.edge, a.cloud, student, ids, index, work, None, {
                "teacher": "cloud", "teacher_fingerprint": a.cloud.fingerprint, "oracle": True,
                "steps": log_[-1]["step"] if log_ else 0, "best_step": best["step"], "held_out_kl": best["kl"],
                **changed(cfg, "keep")})
        cloud_s = time.perf_counter() - start
        start = time.perf_counter()
        session = EdgeSession(a.edge, str(work / "kv"), cache_dir=a.out / "work" / "kvcache")
        return Answering(session, a.edge, time.perf_counter() - start, [("system", req.system), ("reference",
                         req.reference)], cloud_s=cloud_s)
