"""One (strategy, request) of an eval answered and measured: latency, bytes, memory, upload ratio, reference NLL,
MMLU choice, ROUGE-L and BERTScore, as one row of results.jsonl."""

from __future__ import annotations

import os

from edgekv.eval.artefacts import Artefacts
from edgekv.eval.datasets import Request
from edgekv.eval.metrics import BertScore, option_choice, rouge_l, upload_ratio
from edgekv.eval.strategies import parse_strategy
from edgekv.models.loading import LoadedModel
from edgekv.serve.sampling import SamplingParams
from edgekv.texts import reference_ids


class Scorer:
    """BERTScore, its model loaded on the first answer it scores."""

    def __init__(self, model: str):
        self.model, self._scorer = model, None

    @property
    def name(self) -> str | None:
        """The scoring model's name (None before the first score)."""
        return self._scorer.name if self._scorer is not None else None

    def f1(self, answers: list[str], references: list[str]) -> list[float]:
        """BERTScore F1 of each answer against its reference."""
        if self._scorer is None:
            self._scorer = BertScore(self.model)
        return self._scorer.f1(answers, references)


def _model_bytes(m: LoadedModel) -> int:
    """The weights' bytes: parameters and buffers (GGUF blocks and int4 packs are buffers)."""
    held = [*m.model.parameters(), *m.model.buffers()]
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in held}.values())


def _rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def answer_row(artefacts: Artefacts, strategy: str, req: Request, scorer: Scorer, index: int = 0) -> dict:
    """Answer one request (at `index` of its dataset's sample) with one strategy and measure it: one row."""
    cfg = artefacts.cfg
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    a = parse_strategy(strategy).answering(artefacts, req)
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
    ref_ids = reference_ids(model.tokenizer, scored, cfg.reference_tokens)
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
    row["bertscore_f1"] = scorer.f1([answer], [req.reference])[0]
    row["bertscore_model"] = scorer.name
    return row


