"""Where a request's reference repeats its system prompt, against how a P/N student did on it (issue 37): per
request of an eval run, a condition's Δ reference NLL vs EdgePrompt beside text-only measures (tokens, no model):
where in the prompt the reference's verbatim n-grams sit, how much of the teacher's synthetic answers repeat the
prompt, and how much of the user's message does. A reading aid for one run's rows, not a result of its own.

    python -m bench.copy_spans ROWS.jsonl SYNTHETIC_DIR [--config configs/eval/shared-prefix.yaml]
        [--dataset sharegpt] [--limit 24] [--condition ce-lslm-distill-shared@c8]
        [--out reports/shared-prefix/copy-spans]

ROWS.jsonl: a report's rows (edgeprompt and the condition); SYNTHETIC_DIR: the eval's `work/exports/synthetic-*`
folder (one folder per system prompt, named by the prompt's hash, as `edgekv eval` keeps them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.numpy import load_file

from edgekv import EdgeKVError
from edgekv.atomic import write_text_atomic
from edgekv.config import load_config
from edgekv.eval.artefacts import prompt_key
from edgekv.eval.eval_config import EvalConfig, eval_requests
from edgekv.models.loading import load_tokenizer


def ngrams(ids: list[int], n: int) -> dict[tuple[int, ...], int]:
    """Each n-gram of `ids` with its first position."""
    out: dict[tuple[int, ...], int] = {}
    for i in range(len(ids) - n + 1):
        out.setdefault(tuple(ids[i:i + n]), i)
    return out


def matches(ids: list[int], index: dict[tuple[int, ...], int], n: int) -> list[tuple[int, int]]:
    """(position in `ids`, first position in the indexed text) of each n-gram of `ids` that `index` holds."""
    return [(i, index[g]) for i in range(len(ids) - n + 1) if (g := tuple(ids[i:i + n])) in index]


def covered(ids: list[int], index: dict[tuple[int, ...], int], n: int) -> float:
    """Share of `ids` inside some n-gram that `index` holds."""
    hit = {j for i, _ in matches(ids, index, n) for j in range(i, i + n)}
    return len(hit) / max(1, len(ids))


def teacher_answers(folder: Path) -> list[list[int]]:
    """The teacher's own answers in a kept synthetic set (the student's on-policy answers left out)."""
    meta = json.loads((folder / "synthetic.json").read_text(encoding="utf-8"))
    tensors = load_file(str(folder / "synthetic.safetensors"))
    return [tensors[f"{k}.answer"].tolist() for k, who in enumerate(meta["policy"])
            if who == "teacher" and f"{k}.answer" in tensors]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=Path)
    ap.add_argument("synthetic", type=Path)
    ap.add_argument("--config", default="configs/eval/shared-prefix.yaml")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--condition", default="ce-lslm-distill-shared@c8")
    ap.add_argument("--out", type=Path, default=Path("reports/shared-prefix/copy-spans"))
    args = ap.parse_args()
    try:
        rows = [json.loads(line) for line in args.rows.read_text(encoding="utf-8").splitlines() if line]
        cfg = load_config(EvalConfig, "eval", args.config, {"limit": args.limit})
        tok = load_tokenizer(cfg.edge)  # the weights are never loaded
        requests = eval_requests(cfg, args.dataset, tok)
    except (EdgeKVError, OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"error: {exc}") from None
    nll = {(r["strategy"], r["id"]): r["ref_nll"] for r in rows if r.get("dataset") == args.dataset}
    table = []
    for req in requests:
        if (args.condition, req.id) not in nll or ("edgeprompt", req.id) not in nll:
            continue
        system = tok(req.system, add_special_tokens=True)["input_ids"]
        ref = tok(req.reference, add_special_tokens=False)["input_ids"][:cfg.reference_tokens]  # what the eval scores
        user = tok(req.user, add_special_tokens=False)["input_ids"]
        by8 = ngrams(system, 8)
        folder = args.synthetic / prompt_key(req.system) / "prompt"
        answers = teacher_answers(folder) if folder.exists() else []
        table.append({
            "id": req.id, "delta": nll[(args.condition, req.id)] - nll[("edgeprompt", req.id)],
            "system_tokens": len(system), "reference_share_8gram": covered(ref, by8, 8),
            "reference_8gram_positions": sorted({at for _, at in matches(ref, by8, 8)}),
            "teacher_share_8gram": (sum(covered(a, by8, 8) * len(a) for a in answers)
                                    / max(1, sum(len(a) for a in answers))) if answers else None,
            "user_share_3gram": covered(user, ngrams(system, 3), 3)})
    table.sort(key=lambda t: t["delta"])
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "copy_spans.json", json.dumps(
        {"condition": args.condition, "dataset": args.dataset, "requests": table}, indent=1))
    for t in table:
        pos = f"{t['reference_8gram_positions'][0]}–{t['reference_8gram_positions'][-1]}" \
            if t["reference_8gram_positions"] else "–"
        teach = "–" if t["teacher_share_8gram"] is None else f"{t['teacher_share_8gram']:.2f}"
        print(f"{t['id']:14s} Δ {t['delta']:+.3f}  reference 8-grams {t['reference_share_8gram']:.2f} at {pos:9s}"
              f"  teacher {teach}  user 3-grams {t['user_share_3gram']:.2f}")


if __name__ == "__main__":
    main()
