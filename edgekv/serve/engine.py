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

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from edgekv import EdgeKVError
from edgekv.attention.decode_step import DecodeStep
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.prefix_kv import PrefixKV
from edgekv.attention.relay import RelayBatch, relay_cache
from edgekv.models.structure import attn_shape, check_context, model_device
from edgekv.models.targets import top_targets
from edgekv.runtime import trim_heap
from edgekv.serve.requests import EngineBusy, GenRequest, Result, Sequence, add_token, prompt_infos, result_of
from edgekv.serve.sampling import pick_token

log = logging.getLogger("edgekv")
TRIM_EVERY = 128  # steps between returning freed heap pages to the OS
MAX_BATCH, MAX_QUEUE = 32, 256  # requests decoded together per step; requests in flight (serve-edge's defaults)


class Engine:
    """Owns a model on one thread and decodes every request over one shared system KV; `submit` queues a
    request, `cancel` drops one. `eos_ids` is read per token (a caller may change the set it passed)."""

    def __init__(self, model, tokenizer, system: PrefixKV, eos_ids: set[int], max_batch: int = MAX_BATCH,
                 max_queue: int = MAX_QUEUE, max_step_tokens: int = 512, background: bool = True, relay: bool = True):
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
        self.max_batch, self.max_queue, self.max_step_tokens = max_batch, max_queue, max_step_tokens
        self.model, self.tokenizer, self.system, self.eos_ids = model, tokenizer, system, eos_ids
        # the attention function that runs relay steps and decode steps (grouped heads folded, keys never
        # repeated per head); a fuse SystemKV and a session have enabled it already
        enable_fusion(self.model)
        # relay steps and one-request steps (decode tokens, prompt blocks) skip transformers' wrapper where the
        # layout allows (the same logits, bit for bit)
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
        check_context(self.model.config, self.system.next_position + req.user_ids.numel() + req.params.max_new_tokens,
                      "system + user prompt + max_tokens")
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
        for n, req in enumerate(reqs):
            self.submit(req, _Place(self, n, results, finished, follow))
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
                trim_heap()
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
        elif self._decode_step is not None and not s.attention_kwargs():  # one request: a token or a prompt block
            logits = self._decode_step(ids, positions, work[0][0].cache, keep_rows)
        else:  # one request over its own cache, with cloud segments (waits are counted by the cache itself)
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
                seq.top.append(top_targets(mine, seq.req.score_top_k))
            if all_rows and seq.req.echo:
                seq.prompt_logits.append(mine)
            seq.pending = seq.pending[n:] if n < seq.pending.numel() else None
            if seq.pending is None:  # the prompt is in: its first token
                if seq.req.echo:
                    logits_all = torch.cat(seq.prompt_logits) if seq.prompt_logits else None
                    seq.prompt_infos = prompt_infos(self.tokenizer, seq.req.user_ids, logits_all, seq.req.logprobs)
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
        if token in self.eos_ids:
            return self._finish(seq, "stop")
        self.stats["completion_tokens"] += 1
        reason = add_token(seq, token, logits, self.tokenizer)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        self.stats["cancelled" if reason == "cancelled" else "finished"] += 1
        result = result_of(seq, reason, error, self.system.nbytes)
        try:
            seq.on_event("done", result)
        except Exception:  # a caller's callback must never take the engine down
            log.exception("request callback failed")


@dataclass(eq=False)
class _Place:
    """Where one of generate_all's requests lands: its result, or a follow-up resubmitted through this same handler.
    An object rather than a closure, because a closure that resubmits itself is a reference cycle that held the
    engine and its system KV until the cyclic collector ran (on every path, a caller's exception included)."""

    engine: Engine
    n: int
    results: list
    finished: threading.Semaphore
    follow: Callable[[int, Result], GenRequest | None] | None

    def __call__(self, kind: str, payload) -> None:
        if kind != "done":
            return
        after = self.follow(self.n, payload) if self.follow and payload.finish_reason not in ("error", "cancelled") \
            else None
        if after is not None:
            try:
                self.engine.submit(after, self)
                return
            except EdgeKVError as exc:  # the place ends with the error (never a wait that never ends)
                payload = replace(payload, finish_reason="error", error=str(exc))
        self.results[self.n] = payload
        self.finished.release()
