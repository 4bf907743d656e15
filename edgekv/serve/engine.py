"""The serving engine: one thread owns the model and steps every active request together (vLLM's split: the HTTP
layer only queues requests and relays their events).

Each step admits new requests up to `max_batch` and runs ONE forward over the step's tokens, packed: one decode
token of every running request, then chunks of new requests' user prompts up to `max_step_tokens` (a long prompt
is prefilled over several steps). Relay attention (`edgekv.attention.relay`) attends all the step's queries to
the one shared system KV as a single product and each request's own tokens separately, merged exactly by
log-sum-exp, so the system KV is never copied per request or per step. `max_batch=1` is the one-at-a-time
baseline through the same code. A request's events (text deltas with
log-probs, then `done`) go to its callback from the engine thread; a cancelled request leaves the batch at the
next step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from edgekv import EdgeKVError
from edgekv.attention.decode_step import DecodeStep
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.relay import RelayBatch, relay_cache
from edgekv.models.structure import attn_shape, model_device

if TYPE_CHECKING:  # the session imports the engine (it decodes through it); the engine only reads a session
    from edgekv.serve.session import EdgeSession

log = logging.getLogger("edgekv")
T = TypeVar("T")


TRIM_EVERY = 128  # steps between returning freed heap pages to the OS
ONEDNN_CACHE = 16  # oneDNN primitives kept for reuse (its default, 1,024, grows RSS with every new step shape)


def limit_onednn_cache(capacity: int = ONEDNN_CACHE) -> None:
    """Bound oneDNN's primitive cache for a long-running server: each step's packed token count is a new GEMM
    shape, and the default cache keeps 1,024 of them (with their scratch), which a soak sees as RSS creeping up
    (measured: reports/README). oneDNN reads the variable when it creates its first
    primitive, so call this before the process's first matmul; a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


def _libc_trim():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc.malloc_trim if os.environ.get("EDGEKV_NO_MALLOC_TRIM") is None else None
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _libc_trim()


def _trim_heap() -> None:
    """glibc keeps freed blocks of the steps' varying-size tensors in its heaps; a long-running server's RSS then
    creeps up though nothing leaks. malloc_trim gives the free pages back (a few ms)."""
    if _TRIM is not None:
        _TRIM(0)


@dataclass
class SamplingParams:
    """How to pick tokens: greedy at temperature 0, else temperature + nucleus (top_p) sampling, seeded."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def from_request(self, data: dict, limit: int, min_tokens: int = 1) -> SamplingParams:
        """A request's own values ("max_tokens", "temperature", "top_p", "seed") over these defaults, validated;
        ValueError/TypeError for values of the wrong type, EdgeKVError for out-of-range ones."""
        params = SamplingParams(int(data.get("max_tokens", self.max_new_tokens)),
                                float(data.get("temperature", self.temperature)),
                                float(data.get("top_p", self.top_p)), int(data.get("seed", self.seed)))
        params.validate(limit, min_tokens)
        return params

    def validate(self, limit: int, min_tokens: int = 1) -> None:
        """One-line errors for out-of-range values (`min_tokens` 0: a prompt scored, nothing generated)."""
        if not min_tokens <= self.max_new_tokens <= limit:
            raise EdgeKVError(f"max_tokens must be in [{min_tokens}, {limit}], got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise EdgeKVError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgeKVError(f"top_p must be in (0, 1], got {self.top_p}")


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Greedy (temperature 0) or temperature + top-p sampling from one position's logits."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # the smallest set whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    # inverse CDF with one uniform draw: the same distribution as torch.multinomial, which draws an exponential per
    # vocabulary entry (2.9 ms a token on a 152k vocabulary, 15 % of a batch-64 decode step, measured)
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u[None], right=True).clamp(max=probs.numel() - 1))


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


def _top_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, ids) of the k most likely tokens of each row (float32 log-softmax)."""
    return torch.log_softmax(logits.float(), -1).topk(k, dim=-1)


def on_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends with it; its result, or its exception re-raised here. Model
    work done this way (loading, a session's prefill) leaves no OpenMP pool behind on the calling thread, so a
    serving engine's thread keeps the process's only one (see `Engine`)."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as is
            box["exc"] = exc

    thread = threading.Thread(target=run, name="edgekv-setup")
    thread.start()
    thread.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


class Engine:
    """Owns the session's model on one thread; `submit` queues a request, `cancel` drops one."""

    def __init__(self, session: EdgeSession, max_batch: int = 32, max_queue: int = 256, max_step_tokens: int = 512,
                 background: bool = True, relay: bool = True):
        """`relay=False` (one request at a time, `max_batch=1`): each step attends over the request's own cache of the
        system KV (`PrefixKV.request_cache`: one softmax over [system; own], stock SDPA numerics) instead of
        relay attention's two merged segments — the numbers a plain transformers forward gives, which
        `EdgeSession.complete` keeps for scoring and benches.
        `background=False`: no thread of its own; `generate`/`generate_all` run the steps on the caller's thread. On a
        machine with as many cores as torch threads, every thread that has run a forward keeps an OpenMP pool,
        and two live pools make libgomp throttle its spin-waits to ~100 spins: each of the hundreds of parallel
        regions of a forward then pays a futex wake-up (measured: `bench.omp_pools`, reports/README). A process
        that computes on one thread anyway (a batch file, a bench) drives the engine inline and keeps one pool."""
        if max_batch < 1 or max_queue < 1 or max_step_tokens < 1:
            raise EdgeKVError("max_batch, max_queue and max_step_tokens must be ≥ 1")
        if not relay and max_batch != 1:
            raise EdgeKVError("relay=False serves one request at a time (max_batch=1)")
        self.relay = relay
        self.session, self.max_batch, self.max_queue = session, max_batch, max_queue
        self.max_step_tokens = max_step_tokens
        self.model, self.tokenizer, self.system = session.model, session.edge.tokenizer, session.system
        # the attention function that runs relay steps and decode steps (grouped heads folded, keys never
        # repeated per head); a fuse SystemKV and the session have enabled it already
        enable_fusion(self.model)
        # relay steps and one-request decode tokens skip transformers' wrapper where the layout allows (the same
        # logits, bit for bit)
        self._decode_step = DecodeStep.for_model(self.model)
        _, kv_heads, head_dim = attn_shape(self.model)
        self.device = model_device(self.model)
        self._empty = torch.zeros(1, kv_heads, 0, head_dim, dtype=self.system.dtype, device=self.device)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cv = threading.Condition()
        self.stats = {"requests": 0, "finished": 0, "cancelled": 0, "errors": 0, "prompt_tokens": 0,
                      "completion_tokens": 0, "steps": 0, "batched_tokens": 0, "ttft_s": deque(maxlen=10_000)}
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="edgekv-engine", daemon=True) if background else None
        if self.thread is not None:
            self.thread.start()

    # ----------------------------------------------------------------------------------------- the API side

    def submit(self, req: GenRequest, on_event: Callable[[str, object], None]) -> Sequence:
        """Queue a request; EngineBusy when the queue is full; EdgeKVError if it cannot fit the context."""
        self.session.check_fits(req.user_ids.numel(), req.params.max_new_tokens)
        if req.user_ids.numel() == 0:
            raise EdgeKVError("the prompt is empty")
        with self.cv:
            if len(self.waiting) + self._running() >= self.max_queue:
                raise EngineBusy(f"the server is at capacity ({self.max_queue} requests in flight); retry later")
            seq = Sequence(req, on_event)
            self.waiting.append(seq)
            self.stats["requests"] += 1
            self.cv.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a request (its client went away); it leaves the batch at the next step."""
        seq.cancelled.set()
        with self.cv:
            self.cv.notify()

    def generate(self, req: GenRequest) -> Result:
        """Submit one request and wait for it."""
        return self.generate_all([req])[0]

    def generate_all(self, reqs: list[GenRequest], on_done: Callable[[], None] | None = None,
                     follow: Callable[[int, Result], GenRequest | None] | None = None) -> list[Result]:
        """Submit every request (they decode together) and wait for all (inline: run them); results in input
        order. `on_done` is called once per finished request, on the caller's thread (a progress bar).
        `follow(n, result)` may return the next request of place n (a query's answer after the query is written):
        it joins the running batch at once, and its result stands in place n instead."""
        results: list[Result | None] = [None] * len(reqs)
        finished = threading.Semaphore(0)

        def on_event(n: int):
            def handle(kind: str, payload) -> None:
                if kind == "done":
                    after = follow(n, payload) if follow and payload.finish_reason not in ("error", "cancelled") \
                        else None
                    if after is not None:
                        try:
                            self.submit(after, on_event(n))
                            return
                        except EdgeKVError as exc:  # the place ends with the error (never a wait that never ends)
                            payload = replace(payload, finish_reason="error", error=str(exc))
                    results[n] = payload
                    finished.release()
            return handle

        for n, req in enumerate(reqs):
            self.submit(req, on_event(n))
        pending = len(reqs)

        def collect(block: bool) -> None:
            nonlocal pending
            while pending and finished.acquire(blocking=block):
                pending -= 1
                if on_done is not None:
                    on_done()

        if self.thread is None:  # inline: this thread runs the steps until every request is done
            while self._advance(wait=False):
                collect(False)
        collect(True)
        return results

    def load(self) -> dict[str, int]:
        """Requests waiting and running."""
        with self.cv:
            return {"waiting": len(self.waiting), "running": self._running()}

    def _running(self) -> int:
        return sum(s.finish is None for s in self.running)  # a finished one leaves the list at its step's end

    def close(self) -> None:
        """Stop the loop (requests in flight end as cancelled)."""
        with self.cv:
            self._stop = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    # ----------------------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while self._advance(wait=True):
            pass

    def _advance(self, wait: bool) -> bool:
        """Admit what fits and run one step; False when the loop should end (stopped, or nothing left inline)."""
        with self.cv:
            while wait and not self._stop and not self.waiting and not self.running:
                self.cv.wait()
            if self._stop:
                for seq in [*self.waiting, *self.running]:
                    self._finish(seq, "cancelled")
                return False
            if not self.waiting and not self.running:
                return False
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                admitted.append(self.waiting.popleft())
        try:
            self._step(admitted)
            if self.stats["steps"] % TRIM_EVERY == 0:
                _trim_heap()
        except Exception as exc:  # keep serving: the step's requests fail, the engine lives
            log.exception("engine step failed")
            self.stats["errors"] += 1
            for seq in [*admitted, *self.running]:
                if seq.finish is None:
                    self._finish(seq, "error", f"internal error: {type(exc).__name__}: {exc}")
            self.running = []
        return True

    @torch.inference_mode()  # every tensor a step makes stays with the engine (its requests' caches, its logits):
    # no autograd bookkeeping per op (~1 ms a decode token on the 0.5B edge, measured)
    def _step(self, admitted: list[Sequence]) -> None:
        """One forward over the step's tokens: one decode token per running request, then prompt chunks of
        prefilling requests (oldest first) up to `max_step_tokens`."""
        for seq in [s for s in [*self.running, *admitted] if s.cancelled.is_set()]:
            self._finish(seq, "cancelled")
        for seq in admitted:
            if seq.finish is None:
                seq.own = [self._empty] * (2 * self.system.num_layers)
                if not self.relay:
                    seq.cache = self.system.request_cache(on_wait=lambda t, q=seq: setattr(q, "layer_wait",
                                                                                         q.layer_wait + t))
                seq.pending = seq.req.user_ids
                seq.position = self.system.next_position
                self.running.append(seq)
        self.running = [s for s in self.running if s.finish is None]
        work: list[tuple[Sequence, torch.Tensor]] = [(s, torch.tensor([s.next_input])) for s in self.running
                                                     if s.next_input is not None]
        budget = max(self.max_step_tokens - len(work), 1)
        for seq in self.running:
            if seq.pending is not None and budget > 0:
                chunk = seq.pending[:budget]
                work.append((seq, chunk))
                budget -= chunk.numel()
        if work:
            self._forward(work)
        self.running = [s for s in self.running if s.finish is None]
        self.stats["steps"] += 1

    def _forward(self, work: list[tuple[Sequence, torch.Tensor]]) -> None:
        s = self.system
        ids = torch.cat([t for _, t in work])[None].to(self.device)
        positions = torch.cat([torch.arange(q.position, q.position + t.numel()) for q, t in work])[None].to(self.device)
        q_lens = [t.numel() for _, t in work]
        scored = [self._wants_prompt_logits(seq) for seq, _ in work]  # echo + logprobs: every row of the chunk
        keep, end = [], 0  # packed rows whose logits are needed: each request's last row, or all of a scored chunk
        for n, all_rows in zip(q_lens, scored):
            end += n
            keep += list(range(end - n, end)) if all_rows else [end - 1]
        keep_rows = torch.tensor(keep, device=self.device)
        waited = [0.0]

        def shared(i: int):
            start = time.perf_counter()
            kv = s.layer(i)  # may wait for a layer still in transit
            waited[0] += time.perf_counter() - start
            return kv

        if self.relay:
            batch = RelayBatch(shared, [q.own for q, _ in work], q_lens, s.segments)
            cache = relay_cache(batch, s.num_layers, s.prefix_len)
            logits = self._decode_step(ids, positions, cache, keep_rows, relay=batch) if self._decode_step else \
                self.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True,
                           logits_to_keep=keep_rows, relay=batch).logits[0]
        elif self._decode_step is not None and ids.shape[1] == 1 and not s.attention_kwargs():  # one decode token
            logits = self._decode_step(ids, positions, work[0][0].cache)
        else:  # one request over its own cache of the system KV (waits are counted by the cache itself)
            last_only = keep == [ids.shape[1] - 1]
            logits = self.model(input_ids=ids, cache=work[0][0].cache, position_ids=positions,
                                use_cache=True, logits_to_keep=1 if last_only else keep_rows,
                                **s.attention_kwargs()).logits[0]
        self.stats["batched_tokens"] += ids.shape[1]
        row = 0
        for (seq, _), n, all_rows in zip(work, q_lens, scored):
            width = n if all_rows else 1
            mine, row = logits[row:row + width], row + width
            seq.position += n
            if seq.next_input is not None and seq.pending is None:  # a decode token
                self._accept(seq, mine[-1])
                continue
            seq.layer_wait += waited[0]
            self.stats["prompt_tokens"] += n
            if all_rows and seq.req.score_top_k is not None:
                seq.top.append(_top_rows(mine, seq.req.score_top_k))
            if all_rows and seq.req.echo:
                seq.prompt_logits.append(mine)
            seq.pending = seq.pending[n:] if n < seq.pending.numel() else None
            if seq.pending is None:  # the prompt is in: its first token
                if seq.req.echo:
                    logits_all = torch.cat(seq.prompt_logits) if seq.prompt_logits else None
                    seq.prompt_infos = self._prompt_infos(seq.req.user_ids, logits_all, seq.req.logprobs)
                if seq.req.params.max_new_tokens == 0:
                    seq.ttft = time.perf_counter() - seq.submitted
                    self._finish(seq, "length")
                else:
                    self._accept(seq, mine[-1])

    def _wants_prompt_logits(self, seq: Sequence) -> bool:
        return seq.pending is not None and (seq.req.echo and seq.req.logprobs is not None
                                            or seq.req.score_top_k is not None)

    # ----------------------------------------------------------------------------------------- tokens

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Pick the next token from one position's logits; stream it; end on EOS, a stop string or length."""
        if seq.ttft is None:
            seq.ttft = time.perf_counter() - seq.submitted
            self.stats["ttft_s"].append(seq.ttft)
            if seq.req.first_logits:
                seq.first_logits = logits.float()
        token = pick_token(logits, seq.req.params, seq.generator)
        if token in self.session.eos_ids:  # read per token: a caller may change the session's set
            return self._finish(seq, "stop")
        logp, top = None, None
        if seq.req.logprobs is not None:
            lp = torch.log_softmax(logits.float(), -1)
            logp = float(lp[token])
            top = self._top(lp, seq.req.logprobs)
        seq.tokens.append(token)
        if seq.req.score_top_k is not None and len(seq.tokens) > 1:  # the first token's row is the prompt's last
            seq.top.append(_top_rows(logits[None], seq.req.score_top_k))
        seq.infos.append(TokenInfo(token, self.tokenizer.decode([token]), logp, top))
        seq.next_input = token
        self.stats["completion_tokens"] += 1
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        for stop in seq.req.stop:
            at = text.find(stop)
            if at >= 0:
                seq.text = text[:at]
                return self._finish(seq, "stop")
        seq.text = text
        if len(seq.tokens) >= seq.req.params.max_new_tokens:
            return self._finish(seq, "length")
        hold = max((len(s) - 1 for s in seq.req.stop), default=0)  # a stop string may still be forming
        safe = len(text) - hold
        if safe > seq.sent and not text[:safe].endswith("\ufffd"):
            self._emit(seq, text[seq.sent:safe])
            seq.sent = safe

    def _emit(self, seq: Sequence, delta: str) -> None:
        """A text delta with the tokens it completes (their log-probs travel with it)."""
        seq.on_event("text", (delta, seq.infos[seq.unsent:]))
        seq.unsent = len(seq.infos)

    def _top(self, logp: torch.Tensor, k: int) -> dict[int, float]:
        if k <= 0:
            return {}
        values, ids = logp.topk(k)
        return {int(i): float(v) for i, v in zip(ids, values)}

    def _prompt_infos(self, ids: torch.Tensor, logits: torch.Tensor | None, k: int | None) -> list[TokenInfo]:
        """The prompt's tokens; with logits, each one's log-prob given the ones before (the first: None, as
        OpenAI's echo; the system prompt before it is not scored)."""
        out = [TokenInfo(int(ids[0]), self.tokenizer.decode([int(ids[0])]), None, None)]
        lp = torch.log_softmax(logits[:-1].float(), -1) if logits is not None else None
        for n in range(1, ids.numel()):
            t = int(ids[n])
            out.append(TokenInfo(t, self.tokenizer.decode([t]), None if lp is None else float(lp[n - 1, t]),
                                 None if lp is None else self._top(lp[n - 1], k)))
        return out

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        if reason != "cancelled" and len(seq.text) > seq.sent:
            self._emit(seq, seq.text[seq.sent:])
            seq.sent = len(seq.text)
        self.stats["cancelled" if reason == "cancelled" else "finished"] += 1
        # an errored request may have failed on the system KV itself: do not read it again for its size
        own = seq.own if seq.cache is None else [t for layer in seq.cache.layers if layer.is_initialized
                                                 for t in (layer.keys, layer.values)]
        kv_bytes = 0 if reason in ("error", "cancelled") else self.system.nbytes + sum(
            t.numel() * t.element_size() for t in own)
        seq.own, seq.cache = [], None
        targets = None
        if seq.req.score_top_k is not None and reason not in ("error", "cancelled") and seq.top:
            rows = int(seq.req.user_ids.numel()) + len(seq.tokens) - 1  # an EOS row predicts no kept token
            targets = tuple(torch.cat([t[n] for t in seq.top])[:rows] for n in (0, 1))
        result = Result(seq.text, list(seq.tokens), reason, int(seq.req.user_ids.numel()), seq.ttft or 0.0,
                        time.perf_counter() - seq.submitted, seq.infos, seq.prompt_infos, error, seq.layer_wait,
                        seq.first_logits, kv_bytes, targets)
        try:
            seq.on_event("done", result)
        except Exception:  # a caller's callback must never take the engine down
            log.exception("request callback failed")
