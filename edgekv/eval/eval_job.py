"""`edgekv eval`: every strategy × dataset, per-request metrics, resumable (DESIGN.md §6; the paper's Table II).

Strategies run through the code users run: `cloud-only` and `edge-only` are `EdgeSession`s that prefill the
whole prompt themselves (timed from the start, so TTFT includes the system prompt); `edgeprompt` (one model on
both sides, every layer's system KV from the "cloud", exact) and `ce-lslm` (the cloud model's KV for the deep
layers through the align mapping and a translator, ThinK-pruned and quantized) build a KV export with
`run_compress` and answer on a cold `EdgeSession` that loads it through the emulated link. `ce-lslm:<mapping>`
variants swap the similarity mapping for align's baselines (uniform, last-aligned, dissimilar). `ce-lslm-fuse`
ships the cloud KV of a trained fuser's open layers and the edge fuses it with its own prefill (`--splice fuse`).
`edge-naive` is CE-LSLM's naive edge-only baseline: the edge alone on a system prompt truncated to
`context_budget` tokens. A `@RATIO/CODEC` suffix on a splice strategy (`ce-lslm@0.25/int4`, `edgeprompt@0/fp16`)
overrides its ThinK ratio and codec: the quality-per-byte sweep; the cloud-side KV of one system prompt is computed
once for all such variants of a strategy.

Requests are answered one system prompt at a time (`prompt_groups`), and `--shard i/n` runs every n-th system
prompt's requests (deterministic, by first appearance in the seeded sample); `merge_runs` joins the shards' rows into
one report and refuses shards made with other settings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.eval.artefacts import Artefacts
from edgekv.eval.datasets import Request, record_of_request, record_of_training_prompt
from edgekv.eval.eval_config import EvalConfig, eval_requests
from edgekv.eval.load_runs import load_curves, reusable_load
from edgekv.eval.report import write_report
from edgekv.eval.runs import canonical, check_resumable, in_shard, merge_runs, prompt_groups, read_results, run_settings
from edgekv.eval.scoring import Scorer, answer_row
from edgekv.eval.strategies import KVStrategy, parse_strategy
from edgekv.models.loading import load_pair
from edgekv.models.structure import check_context
from edgekv.progress import Tasks
from edgekv.runtime import trim_heap

log = logging.getLogger("edgekv")


def check_lengths(requests: list[Request], a: Artefacts, cfg: EvalConfig) -> None:
    """Before any forward: every request's system + user prompt + the longest continuation (answer or scored
    reference) fits both models' context; else one line naming the request and both lengths."""
    tok = a.edge.tokenizer
    tail = max(cfg.max_new_tokens, cfg.reference_tokens)
    for req in requests:
        n = len(tok(req.system, add_special_tokens=True)["input_ids"]) + len(tok(req.user, add_special_tokens=False)[
            "input_ids"]) + tail
        for m in (a.cloud, a.edge):
            check_context(m.model.config, n, f"{req.id}: system + user prompt + {tail} continuation tokens")


def check_held_out(requests: list[Request], a: Artefacts, cfg: EvalConfig) -> None:
    """Before any forward: no request comes from a record a shared prefix of the run trained on (an XSum document,
    a conversation, an MMLU subject's dev prompt or test shots), else one line naming both: its gain there would be
    memory, not transfer."""
    paths = {p for s in map(parse_strategy, cfg.strategies) if isinstance(s, KVStrategy) and (p := s.shared_path(a))}
    for path in sorted(paths):
        seen = {record_of_training_prompt(n): n for n in a.shared_prefix(path).trained_on()}
        for req in requests:
            if (name := seen.get(record_of_request(req.dataset, req.id))) is not None:
                raise EdgeKVError(f"{req.dataset} request {req.id}: the shared prefix {path} trained on its record "
                                  f"({name}); evaluate a prefix on records its training never read")


class ShardWorker:
    """One Ray actor's eval: the models loaded once, then `run_eval` of the shards it is given."""

    def __init__(self, cfg: EvalConfig):
        self.cfg = cfg
        self.models = load_pair(cfg.cloud, cfg.edge, cfg.dtype, device=cfg.device, edge_weights=cfg.weights)

    def __call__(self, shard: str) -> dict:
        """Run one shard ("i/n") into cfg.out/shards/i; the row count."""
        out = Path(self.cfg.out) / "shards" / shard.split("/")[0]
        one = replace(self.cfg, shard=shard, out=str(out), ray=None)
        return {"rows": run_eval(one, None, self.models)["rows"], "out": str(out)}


def run_eval_on_ray(cfg: EvalConfig, progress=None) -> dict:
    """`--ray`: the requests split into `workers` shards, one per actor (resumable: each shard resumes from its
    own results), then merged by `merge_runs` into cfg.out exactly as `edgekv report` merges hand-run shards."""
    from edgekv.cluster import run_items

    n = cfg.workers
    shards = [f"{i}/{n}" for i in range(1, n + 1)]
    advance = Tasks(progress).task(f"eval shards on Ray ({n} actors)", n)
    results = run_items(lambda: ShardWorker(cfg), shards, address=cfg.ray or None, workers=n,
                        on_done=lambda r: advance())
    failed = [f"{r['item']}: {r['error']}" for r in results if "error" in r]
    if failed:
        raise EdgeKVError(f"eval shards failed on Ray ({'; '.join(failed)}); rerun to resume them")
    return merge_runs([Path(cfg.out) / "shards" / s.split("/")[0] for s in shards], Path(cfg.out))


def run_eval(cfg: EvalConfig, progress=None, models=None) -> dict:
    """Run (resuming), then write summary.csv, report.md, plots and config.json into cfg.out."""
    cfg.validate()
    if cfg.ray is not None:
        return run_eval_on_ray(cfg, progress)
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EdgeKVError(f"cannot write {out}: {exc.strerror or exc}") from exc
    if (out / "results.jsonl").exists():
        check_resumable(out, cfg)
    earlier_load = reusable_load(out, cfg)
    write_text_atomic(out / "config.json", json.dumps(run_settings(cfg), indent=1))
    tasks = Tasks(progress)
    artefacts, scorer = Artefacts(cfg, out, tasks, models), Scorer(cfg.bertscore)
    requests = {d: eval_requests(cfg, d, artefacts.edge.tokenizer) for d in cfg.datasets}
    for d in cfg.datasets:
        check_lengths(requests[d], artefacts, cfg)
    check_held_out([r for d in cfg.datasets for r in requests[d]], artefacts, cfg)
    results = out / "results.jsonl"
    rows = read_results(results)
    if rows:  # rewrite without a torn line, so appends start on a fresh line
        write_text_atomic(results, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    done = {(r["dataset"], r["strategy"], r["id"]) for r in rows}
    groups = {d: prompt_groups([r.system for r in requests[d]]) for d in cfg.datasets}
    todo = [(d, s, k, requests[d][k]) for d in cfg.datasets
            for k in sorted(range(len(requests[d])), key=lambda k: (groups[d][k], k))  # a prompt's requests together
            if in_shard(groups[d][k], cfg.shard) for s in cfg.strategies if (d, s, requests[d][k].id) not in done]
    advance = tasks.task(f"eval ({len(done)} done before)", len(todo))
    with results.open("a", encoding="utf-8") as f:
        for dataset, strategy, index, req in todo:
            row = answer_row(artefacts, strategy, req, scorer, index)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            rows.append(row)
            advance()
            # glibc keeps what a request's export, cloud forward and session freed (measured on the real pair: RSS
            # 0.6 GB higher without this); each row's rss_mb is then its own, not the heap's high-water mark
            trim_heap()
    order = {(d, r.id): (i, k) for i, d in enumerate(cfg.datasets) for k, r in enumerate(requests[d])
             if in_shard(groups[d][k], cfg.shard)}
    rows = canonical([r for r in rows if (r["dataset"], r["id"]) in order and r["strategy"] in cfg.strategies],
                     order, cfg.strategies)
    load = load_curves(artefacts, requests[cfg.load_dataset], tasks, earlier_load) if cfg.load_rates else []
    return write_report(out, rows, run_settings(cfg), scorer.name, {"cloud": artefacts.cloud.spec,
                                                               "edge": artefacts.edge.spec}, load)
