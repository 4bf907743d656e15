"""A request's life in the engine: what it asks (`GenRequest`), its state in flight (`Sequence`), the tokens it
produces and streams (stop strings, log-probs, echo), and the `Result` it ends with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edgekv import EdgeKVError
from edgekv.models.targets import top_targets
from edgekv.serve.sampling import SamplingParams, top_alternatives


class EngineBusy(EdgeKVError):
    """The request queue is full (HTTP 429)."""


@dataclass
class GenRequest:
    """What to generate: user-prompt token ids, sampling, stop strings, log-probs and echo."""

    user_ids: torch.Tensor
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token (0..5); None: no log-probs
    echo: bool = False  # also score the prompt's own tokens (first one: None)
    first_logits: bool = False  # keep the next-token logits after the prompt (option scoring)
    score_top_k: int | None = None  # keep the top-k log-probs of every row (a teacher's targets, `Result.targets`)


@dataclass
class TokenInfo:
    """One token of a prompt or answer, with its log-prob and the top alternatives (None when not scored)."""

    token_id: int
    text: str
    logprob: float | None
    top: dict[int, float] | None


@dataclass
class Result:
    """A finished request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | cancelled | error
    prompt_tokens: int
    ttft_s: float
    total_s: float
    tokens: list[TokenInfo]  # the answer's tokens (with log-probs when asked)
    prompt: list[TokenInfo] | None = None  # echo: the prompt's tokens
    error: str | None = None
    layer_wait_s: float = 0.0  # time the prefill waited for system-KV layers still in transit
    first_logits: torch.Tensor | None = None  # next-token logits after the prompt (GenRequest.first_logits)
    kv_bytes: int = 0  # the request's cache at the end: shared system KV + its own tokens
    # GenRequest.score_top_k: (log-probs, ids), each (U + A − 1, k), of the rows predicting tokens 1.. of
    # prompt + answer (the model's distribution at every position after the first, float32)
    targets: tuple[torch.Tensor, torch.Tensor] | None = None


class Sequence:
    """A request in flight: its own KV (every layer), tokens, text, and the events it owes its caller."""

    def __init__(self, req: GenRequest, on_event: Callable[[str, object], None]):
        self.req, self.on_event = req, on_event
        self.own: list[torch.Tensor] = []  # [k_0, v_0, k_1, v_1, …], each (1, kv_heads, own tokens, d)
        self.cache = None  # relay=False: the request's own cache over the system KV
        self.tokens: list[int] = []
        self.infos: list[TokenInfo] = []
        self.text, self.sent = "", 0  # decoded answer; characters already streamed
        self.unsent = 0  # tokens not yet covered by a streamed event
        self.generator = torch.Generator().manual_seed(req.params.seed)
        self.next_input: int | None = None
        self.pending: torch.Tensor | None = None  # prompt tokens not yet through the model
        self.prompt_logits: list[torch.Tensor] = []  # echo + logprobs: the prompt's logits, chunk by chunk
        self.position = 0
        self.submitted = time.perf_counter()
        self.ttft: float | None = None
        self.prompt_infos: list[TokenInfo] | None = None
        self.cancelled = threading.Event()
        self.finish: str | None = None
        self.layer_wait = 0.0
        self.first_logits: torch.Tensor | None = None
        self.top: list[tuple[torch.Tensor, torch.Tensor]] = []  # score_top_k: (log-probs, ids) of rows so far




def emit(seq: Sequence, delta: str) -> None:
    """A text delta with the tokens it completes (their log-probs travel with it)."""
    seq.on_event("text", (delta, seq.infos[seq.unsent:]))
    seq.unsent = len(seq.infos)


def add_token(seq: Sequence, token: int, logits: torch.Tensor, tokenizer) -> str | None:
    """Append a picked (non-EOS) token; stream the text no stop string can still claim; the finish reason
    ("stop" on a stop string, "length") or None."""
    logp, top = None, None
    if seq.req.logprobs is not None:
        lp = torch.log_softmax(logits.float(), -1)
        logp = float(lp[token])
        top = top_alternatives(lp, seq.req.logprobs)
    seq.tokens.append(token)
    if seq.req.score_top_k is not None and len(seq.tokens) > 1:  # the first token's row is the prompt's last
        seq.top.append(top_targets(logits[None], seq.req.score_top_k))
    seq.infos.append(TokenInfo(token, tokenizer.decode([token]), logp, top))
    seq.next_input = token
    text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
    for stop in seq.req.stop:
        at = text.find(stop)
        if at >= 0:
            seq.text = text[:at]
            return "stop"
    seq.text = text
    if len(seq.tokens) >= seq.req.params.max_new_tokens:
        return "length"
    hold = max((len(s) - 1 for s in seq.req.stop), default=0)  # a stop string may still be forming
    safe = len(text) - hold
    if safe > seq.sent and not text[:safe].endswith("\ufffd"):
        emit(seq, text[seq.sent:safe])
        seq.sent = safe
    return None


def prompt_infos(tokenizer, ids: torch.Tensor, logits: torch.Tensor | None, k: int | None) -> list[TokenInfo]:
    """The prompt's tokens; with logits, each one's log-prob given the ones before (the first: None, as
    OpenAI's echo; the system prompt before it is not scored)."""
    out = [TokenInfo(int(ids[0]), tokenizer.decode([int(ids[0])]), None, None)]
    lp = torch.log_softmax(logits[:-1].float(), -1) if logits is not None else None
    for n in range(1, ids.numel()):
        t = int(ids[n])
        out.append(TokenInfo(t, tokenizer.decode([t]), None if lp is None else float(lp[n - 1, t]),
                             None if lp is None else top_alternatives(lp[n - 1], k)))
    return out


def result_of(seq: Sequence, reason: str, error: str | None, system_nbytes: int) -> Result:
    """The finished request's `Result` (the rest of its text streamed first); frees its own KV."""
    if reason != "cancelled" and len(seq.text) > seq.sent:
        emit(seq, seq.text[seq.sent:])
        seq.sent = len(seq.text)
    # an errored request may have failed on the system KV itself: do not read it again for its size
    own = seq.own if seq.cache is None else [t for layer in seq.cache.layers if layer.is_initialized
                                             for t in (layer.keys, layer.values)]
    kv_bytes = 0 if reason in ("error", "cancelled") else system_nbytes + sum(
        t.numel() * t.element_size() for t in own)
    seq.own, seq.cache = [], None
    targets = None
    if seq.req.score_top_k is not None and reason not in ("error", "cancelled") and seq.top:
        rows = int(seq.req.user_ids.numel()) + len(seq.tokens) - 1  # an EOS row predicts no kept token
        targets = tuple(torch.cat([t[n] for t in seq.top])[:rows] for n in (0, 1))
    return Result(seq.text, list(seq.tokens), reason, int(seq.req.user_ids.numel()), seq.ttft or 0.0,
                  time.perf_counter() - seq.submitted, seq.infos, seq.prompt_infos, error, seq.layer_wait,
                  seq.first_logits, kv_bytes, targets)
