"""Synthetic tokens per cloud-second: today's (v1) teacher path against the batched teacher, side by side on the same
system prompts, in one run (issue 34).

    python -m bench.distill_teacher --prompts PROMPTS.jsonl [--limit 6] [--recipe configs/distill.yaml]
        [--out reports/distill-teacher]

- `v1`: the path and recipe of `edgekv distill` before issue 34, kept here as the baseline: transformers' `generate`
  once per fixed instruction (2 sampled answers each, so the system prompt is prefilled again for each of the 4
  instructions), then the teacher's top-k targets scored one answer at a time over one prefill.
- `batched`: `edgekv distill`'s synthetic stage with the recipe's settings (`--recipe`): one prefill, queries
  written by the teacher from seed types over windows of the prompt, answers decoded as one batch through the
  engine with their targets kept while decoding, on-policy answers scored in one batched pass.
Supervised tokens = answer tokens with targets (+ the query's own tokens when the recipe's loss covers them).
Cloud seconds = the teacher's (prefill, writing, answering, scoring; the student's on-policy sampling counted too,
since it runs on the cloud side). Training is measured by `edgekv distill` itself (report.json `train_s`); this
bench leaves it out. Run it with nothing else on the machine: the seconds are what it is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from edgekv.atomic import write_text_atomic
from edgekv.attention.prefix_kv import PrefixKV, continuation_logits
from edgekv.config import load_config
from edgekv.distill.distill_job import INSTRUCTIONS, DistillConfig
from edgekv.distill.student import initial_student
from edgekv.distill.synthetic import clear_synthetic, synthetic_set
from edgekv.models.loading import eos_ids, load_model
from edgekv.progress import Tasks
from edgekv.texts import read_prompts

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ("queries", "seeds", "window_tokens", "max_query_tokens", "max_answer_tokens", "temperature", "on_policy",
          "top_k", "query_loss")


@torch.no_grad()
def v1_teacher(cloud, ids: torch.Tensor, samples: int = 2, max_tokens: int = 40, temperature: float = 0.8,
               top_k: int = 64, seed: int = 0) -> dict:
    """Today's path before issue 34, as `kv/distill.py` ran it: `generate` per instruction, then one scoring
    pass per answer. Returns its seconds and supervised tokens."""
    tok, ends = cloud.tokenizer, torch.tensor(sorted(eos_ids(cloud)))
    start = time.perf_counter()
    answers = []
    for k, text in enumerate(INSTRUCTIONS):
        user = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        full = torch.cat([ids, user])[None]
        torch.manual_seed(seed * 1_000_003 + k)
        got = cloud.model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=max_tokens,
                                   do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                   num_return_sequences=samples, pad_token_id=tok.eos_token_id)[:, full.shape[1]:]
        for row in got:
            eos = torch.isin(row, ends).nonzero()
            answer = row[: int(eos[0])] if eos.numel() else row
            if answer.numel() >= 2:
                answers.append((user, answer))
    generate_s = time.perf_counter() - start
    prefix = PrefixKV.of_model(cloud.model, ids)
    for user, answer in answers:
        logits = continuation_logits(cloud.model, prefix, torch.cat([user, answer[:-1]]))[user.numel() - 1:]
        torch.log_softmax(logits.float(), -1).topk(top_k, dim=-1)
    total = time.perf_counter() - start
    return {"cloud_s": total, "generate_s": generate_s, "targets_s": total - generate_s,
            "supervised_tokens": int(sum(a.numel() for _, a in answers)), "answers": len(answers)}


def batched_teacher(cfg: DistillConfig, cloud, edge, ids: torch.Tensor, work: Path) -> dict:
    """`edgekv distill`'s synthetic stage under `cfg`, made afresh in `work`."""
    student, _ = initial_student(edge, ids, ids.numel(), "all", freeze_first=cfg.freeze_first)
    clear_synthetic(work)  # nothing kept from an earlier run: the seconds are the point
    start = time.perf_counter()
    samples, meta = synthetic_set(cfg, cloud, edge, student, ids, work, Tasks(None), None)
    total = time.perf_counter() - start
    supervised = sum(s.answer.numel() + (s.user.numel() - 1) * cfg.query_loss for s in samples)
    return {"cloud_s": total, **{k: meta.get(k) for k in ("prefill_s", "teach_s", "student_s", "score_s")},
            "supervised_tokens": int(supervised), "answers": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, required=True, help="JSONL of {name, system_prompt}")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--recipe", type=Path, default=ROOT / "configs/distill.yaml")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="also measure the recipe with these settings changed (e.g. n40:queries=40)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/distill-teacher")
    args = ap.parse_args()
    cfg = load_config(DistillConfig, "distill", args.recipe, {"out": str(args.out / "work"),
                                                              "prompts": str(args.prompts)})
    variants = {}
    for spec in args.variant:
        name, _, changes = spec.partition(":")
        variants[name] = replace(cfg, **{k: type(getattr(cfg, k))(v) for k, v in
                                         (c.split("=", 1) for c in changes.split(","))})
    cloud, edge = load_model(cfg.cloud, cfg.dtype), load_model(cfg.edge, cfg.dtype)
    prompts = read_prompts(args.prompts)[:args.limit]
    rows = []
    for name, text in prompts:
        ids = torch.tensor(edge.tokenizer(text, add_special_tokens=True)["input_ids"])
        work = args.out / "work" / name
        work.mkdir(parents=True, exist_ok=True)
        row = {"name": name, "system_tokens": int(ids.numel()), "v1": v1_teacher(cloud, ids),
               "batched": batched_teacher(cfg, cloud, edge, ids, work)}
        for vname, vcfg in variants.items():
            row[vname] = batched_teacher(vcfg, cloud, edge, ids, work)
        for side in ("v1", "batched", *variants):
            row[side]["tokens_per_cloud_s"] = row[side]["supervised_tokens"] / row[side]["cloud_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    med = lambda side, key: statistics.median(r[side][key] for r in rows)  # noqa: E731
    summary = {
        "supervised_tokens_per_prompt": {s: med(s, "supervised_tokens") for s in ("v1", "batched")},
        "cloud_s_per_prompt": {s: med(s, "cloud_s") for s in ("v1", "batched")},
        "tokens_per_cloud_s": {s: med(s, "tokens_per_cloud_s") for s in ("v1", "batched")},
        "ratios": {"supervised_tokens": med("batched", "supervised_tokens") / med("v1", "supervised_tokens"),
                   "cloud_s": med("batched", "cloud_s") / med("v1", "cloud_s"),
                   "tokens_per_cloud_s": med("batched", "tokens_per_cloud_s") / med("v1", "tokens_per_cloud_s")},
        "variants": {v: {"settings": {k: getattr(c, k) for k in RECIPE},
                         **{key: med(v, key) for key in ("supervised_tokens", "cloud_s", "tokens_per_cloud_s")}}
                     for v, c in variants.items()},
        "prompts": len(rows), "recipe": args.recipe.name, "recipe_settings": {k: getattr(cfg, k) for k in RECIPE},
        "threads": torch.get_num_threads(), "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("supervised_tokens_per_prompt", "cloud_s_per_prompt", "ratios")}))


if __name__ == "__main__":
    main()
