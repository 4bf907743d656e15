"""The shared prefix's training prompts (issue 37), never any eval sample's: XSum records 107.. (the eval samples
records 0..106), ShareGPT conversations from record 8,000 (the eval scans 5,000..7,999), and the MMLU 5-shot system
prompts of subjects the eval's seeded draw does not pick; with `--news N`, also the first N articles of
data/news/lee_background.jsonl (unlabelled news text no eval reads, in XSum's system prompt format: text targets
need no labels). One {"name", "system_prompt", "source", "labels"} per line, the sources interleaved, system
prompts cut to the eval's 512 tokens. `labels` are the prompt's own (user, reference) pairs (MMLU: up to 5 of the
subject's questions with the gold letter; news: none): only `prefix-sft` reads them; the cloud-distilled prefix
never does. With `--mmlu-test N`, also up to N 5-shot prompts per unused subject from its test sample. A record that
quotes any request the eval could draw (`quotes_eval`: ShareGPT repeats conversations under new ids) is dropped
before each source is cut; train-216 and train-509 were made before that check (reports/shared-prefix/README.md).

    python -m bench.shared_prefix_prompts --per-source 16 --out reports/shared-prefix/train.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from edgekv.atomic import write_text_atomic
from edgekv.eval.datasets import (
    ROOT,
    load_requests,
    mmlu,
    mmlu_system,
    record_of_request,
    training_prompt_name,
    truncate_prompt,
)
from edgekv.models.loading import load_tokenizer
from edgekv.texts import jsonl_records, read_text

EVAL = dict(max_system_tokens=512, min_system_tokens=32, max_user_tokens=192)
QUOTE_CHARS = 40  # an eval text at least this long found inside a training record is a leak, not a coincidence
NEWS = ROOT / "data/news/lee_background.jsonl"


def news_prompts(tok, n: int) -> list[tuple[str, str, list]]:
    """The first `n` news articles as (id, system prompt in XSum's format, no labels)."""
    rows = [data for _, data in jsonl_records(read_text(str(NEWS), "news").splitlines(), str(NEWS))][:n]
    return [(r["id"], truncate_prompt(tok, f"Article:\n{r['document'].strip()}\n", EVAL["max_system_tokens"]), [])
            for r in rows]


def mmlu_test_prompts(tok, taken: set[str], per_subject: int) -> list[tuple[str, str, list]]:
    """Up to `per_subject` more 5-shot prompts per subject the eval never draws, their shots from the subject's test
    sample (no eval reads those subjects), in the dev prompts' format; no labels."""
    by_subject: dict[str, list[dict]] = {}
    path = str(ROOT / "data/mmlu/mmlu_test_sample.jsonl")
    for _, row in jsonl_records(read_text(path, "mmlu").splitlines(), path):
        if row["subject"] not in taken:
            by_subject.setdefault(row["subject"], []).append(row)
    return [(f"{subject}-{k}", truncate_prompt(tok, mmlu_system(subject, rows[5 * k:5 * k + 5]),
                                                     EVAL["max_system_tokens"]), [])
            for k in range(per_subject) for subject, rows in by_subject.items() if len(rows) >= 5 * k + 5]


def eval_pool(tok) -> list:
    """Every request the eval could draw (XSum records 0..106, ShareGPT's scan from record 5,000, MMLU's 4 seeded
    subjects), at any limit."""
    return [r for d in ("xsum", "sharegpt", "mmlu") for r in load_requests(d, tok, 10_000, 0, None, **EVAL,
                                                                           xsum_records=107)]


def eval_quotes(pool: list) -> list[str]:
    """The texts of the eval's requests (`eval_pool`): each system prompt, user turn and reference of at least
    QUOTE_CHARS characters. ShareGPT repeats conversations under other ids, so a record from 8,000 on may still hold
    an eval request's turns."""
    user = Counter(r.user.removeprefix("User: ").removesuffix("\nAssistant:").strip() for r in pool)
    # a user turn that several requests share is the dataset's template (XSum's instruction), not a request's text
    texts = [t.strip() for r in pool for t in (r.system, r.reference)] + [u for u, n in user.items() if n == 1]
    return sorted({t for t in texts if len(t) >= QUOTE_CHARS})


def quotes_eval(record: dict, quotes: list[str]) -> bool:
    """Whether a training record's system prompt or labels hold one of the eval's texts (`eval_quotes`)."""
    text = "\n".join([record["system_prompt"], *(x[k] for x in record["labels"] for k in ("user", "reference"))])
    return any(q in text for q in quotes)


def training_prompts(tok, per_source: int, sources: list[str], seed: int = 0, news: int = 0,
                     mmlu_test: int = 0) -> list[dict]:
    """`per_source` prompts of each source (and `news` news articles, `mmlu_test` test-shot MMLU prompts per unused
    subject), interleaved, none holding an eval request's text (`quotes_eval`: dropped before each source is cut)."""
    label = lambda r: {"user": r.user, "reference": r.scored or r.reference}  # noqa: E731
    lists, pool = {}, eval_pool(tok)
    if "xsum" in sources:
        lists["xsum"] = [(r.id, r.system, [label(r)]) for r in load_requests("xsum", tok, 10_000, seed, None,
                                                                             **EVAL, xsum_from=107)]
    if "sharegpt" in sources:
        lists["sharegpt"] = [(r.id, r.system, [label(r)]) for r in load_requests("sharegpt", tok, 10_000, seed,
                                                                                 None, **EVAL, sharegpt_offset=8000)]
    if "mmlu" in sources:  # the eval draws 4 subjects with its seed (0); their system prompts are never trained on
        taken = {record_of_request(r.dataset, r.id)[1] for r in pool if r.dataset == "mmlu"}
        by_subject: dict[str, tuple] = {}
        for r in mmlu():
            subject = record_of_request(r.dataset, r.id)[1]
            if subject not in taken:
                entry = by_subject.setdefault(subject, (subject, r.system, []))
                if len(entry[2]) < 5:
                    entry[2].append(label(r))
        lists["mmlu"] = list(by_subject.values())
        if mmlu_test:
            lists["mmlu-test"] = mmlu_test_prompts(tok, taken, mmlu_test)
    if news:
        lists["news"] = news_prompts(tok, news)
    quotes = eval_quotes(pool)
    for source, rows in lists.items():
        keep = [row for row in rows if not quotes_eval({"system_prompt": row[1], "labels": row[2]}, quotes)]
        lists[source] = keep if source in ("news", "mmlu-test") else keep[:per_source]
    out = []
    for k in range(max(map(len, lists.values()))):
        for source, rows in lists.items():
            if k < len(rows):
                name, system, labels = rows[k]
                out.append({"name": training_prompt_name(source, name),
                            "system_prompt": system, "source": source.removesuffix("-test"), "labels": labels})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-source", type=int, default=16)
    ap.add_argument("--sources", default="xsum,sharegpt,mmlu")
    ap.add_argument("--news", type=int, default=0, help="also the first N news articles (data/news/)")
    ap.add_argument("--mmlu-test", type=int, default=0,
                    help="also up to N 5-shot prompts per MMLU subject the eval never draws, from its test sample")
    ap.add_argument("--edge", default="default-edge")
    ap.add_argument("--out", type=Path, default=Path("reports/shared-prefix/train.jsonl"))
    args = ap.parse_args()
    rows = training_prompts(load_tokenizer(args.edge), args.per_source, args.sources.split(","), news=args.news,
                            mmlu_test=args.mmlu_test)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} training prompts → {args.out}")


if __name__ == "__main__":
    main()
