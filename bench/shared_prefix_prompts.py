"""The shared prefix's training prompts (issue 37), never any eval sample's: XSum records 107.. (the eval samples
records 0..106), ShareGPT conversations from record 8,000 (the eval scans 5,000..7,999), and the MMLU 5-shot system
prompts of subjects the eval's seeded draw does not pick; with `--news N`, also the first N articles of
data/news/lee_background.jsonl (unlabelled news text no eval reads, in XSum's system prompt format: text targets
need no labels). One {"name", "system_prompt", "source", "labels"} per line, the sources interleaved, system
prompts cut to the eval's 512 tokens. `labels` are the prompt's own (user, reference) pairs (MMLU: up to 5 of the
subject's questions with the gold letter; news: none): only `prefix-sft` reads them; the cloud-distilled prefix
never does.

    python -m bench.shared_prefix_prompts --per-source 16 --out reports/shared-prefix/train.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgekv.atomic import write_text_atomic
from edgekv.eval.datasets import ROOT, load_requests, mmlu, truncate_prompt
from edgekv.models.loading import load_tokenizer
from edgekv.texts import jsonl_records, read_text

EVAL = dict(max_system_tokens=512, min_system_tokens=32, max_user_tokens=192)
NEWS = ROOT / "data/news/lee_background.jsonl"


def news_prompts(tok, n: int) -> list[tuple[str, str, list]]:
    """The first `n` news articles as (id, system prompt in XSum's format, no labels)."""
    rows = [data for _, data in jsonl_records(read_text(str(NEWS), "news").splitlines(), str(NEWS))][:n]
    return [(r["id"], truncate_prompt(tok, f"Article:\n{r['document'].strip()}\n", EVAL["max_system_tokens"]), [])
            for r in rows]


def training_prompts(tok, per_source: int, sources: list[str], seed: int = 0, news: int = 0) -> list[dict]:
    """`per_source` prompts of each source (and `news` news articles), interleaved, none from an eval sample."""
    label = lambda r: {"user": r.user, "reference": r.scored or r.reference}  # noqa: E731
    lists = {}
    if "xsum" in sources:
        lists["xsum"] = [(r.id, r.system, [label(r)]) for r in load_requests("xsum", tok, per_source, seed, None,
                                                                             **EVAL, xsum_from=107)]
    if "sharegpt" in sources:
        lists["sharegpt"] = [(r.id, r.system, [label(r)]) for r in load_requests("sharegpt", tok, per_source, seed,
                                                                                 None, **EVAL, sharegpt_offset=8000)]
    if "mmlu" in sources:  # the eval draws 4 subjects with its seed (0); their system prompts are never trained on
        taken = {r.id.rsplit("-", 1)[0] for r in load_requests("mmlu", tok, 10_000, 0, None, **EVAL)}
        by_subject: dict[str, tuple] = {}
        for r in mmlu():
            subject = r.id.rsplit("-", 1)[0]
            if subject not in taken:
                entry = by_subject.setdefault(subject, (subject, r.system, []))
                if len(entry[2]) < 5:
                    entry[2].append(label(r))
        lists["mmlu"] = list(by_subject.values())[:per_source]
    if news:
        lists["news"] = news_prompts(tok, news)
    out = []
    for k in range(max(map(len, lists.values()))):
        for source, rows in lists.items():
            if k < len(rows):
                name, system, labels = rows[k]
                out.append({"name": f"{source}-{name}", "system_prompt": system, "source": source,
                            "labels": labels})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-source", type=int, default=16)
    ap.add_argument("--sources", default="xsum,sharegpt,mmlu")
    ap.add_argument("--news", type=int, default=0, help="also the first N news articles (data/news/)")
    ap.add_argument("--edge", default="default-edge")
    ap.add_argument("--out", type=Path, default=Path("reports/shared-prefix/train.jsonl"))
    args = ap.parse_args()
    rows = training_prompts(load_tokenizer(args.edge), args.per_source, args.sources.split(","), news=args.news)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} training prompts → {args.out}")


if __name__ == "__main__":
    main()
