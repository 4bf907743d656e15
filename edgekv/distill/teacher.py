"""The batched teacher (issue 34): one prefill of a system prompt, then every synthetic query written, answered and
scored from that one KV, as batches through the serving engine (`edgekv.serve.engine`: relay attention over the
shared prefix, one decode loop for the project).

Cartridges' self-study (Eyuboglu et al. 2025) with the cloud as the teacher: the teacher writes the user messages
itself from seed types while it reads a random window of the prompt, then answers them; the top-k log-probs of
every answer token are kept *as the answer is decoded* (the rows the engine computed to pick each token), so a
teacher answer costs no second pass. Answers the student samples instead (GKD, Agarwal et al. 2023: on-policy
distillation) are scored by the teacher in one batched pass over the same prefix. A dataset's own user prompt or
reference is never a seed: the writer sees only the system prompt and a seed instruction.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgekv import EdgeKVError
from edgekv.attention.prefix_kv import PrefixKV, read_after
from edgekv.models.loading import LoadedModel, eos_ids
from edgekv.serve.engine import Engine
from edgekv.serve.requests import GenRequest, Result
from edgekv.serve.sampling import SamplingParams

# Cartridges' five seed types, in the plain-text form our prompts take; the writer reads the window quoted
# after the system prompt, then one of these. `instruction` (a fixed instruction, no writing) is the sixth type.
SEED_PROMPTS = {
    "structuring": "Write one request that asks to organise the information in that part as a list, a table or an "
                   "outline.\nRequest:",
    "summarization": "Write one request that asks for a short summary of that part.\nRequest:",
    "question": "Write one question about a specific detail in that part.\nQuestion:",
    "use-case": "Write one request that a reader of the text could make and that needs the information in that "
                "part.\nRequest:",
    "creative": "Write one creative request (a headline, a poem, a short story) about that part.\nRequest:",
}
WRITER = "\n\nA part of the text above:\n\"{window}\"\n\n{seed}"
INSTRUCTION = "instruction"
# `recall` (a seventh type, issue 37): the prompt's own words. None of the six asks for them, and a student of P/8
# tokens kept what a prompt is about but not its text (requests whose answer repeats the prompt lost > 1 nat/token).
# The query quotes the first RECALL_HEAD tokens of a random window; the teacher, reading the prompt, goes on from
# there. Not written by the teacher: there is nothing to write.
RECALL = "recall"
RECALL_FORMAT = "\nRepeat the text above word for word, starting from \"{head}\".\n"
RECALL_HEAD = 8
UNWRITTEN = (INSTRUCTION, RECALL)  # the seed types whose user message the teacher does not write


@dataclass
class Sample:
    """One synthetic exchange about the prompt: its seed type, the user message's ids (continuing the system
    prompt), the answer, and the teacher's top-k log-probs of the rows predicting tokens 1.. of user + answer
    (U + A − 1 rows: the query's own tokens, then the answer's)."""

    seed: str
    user: torch.Tensor
    answer: torch.Tensor
    top_ids: torch.Tensor | None = None  # (U + A − 1, k)
    top_logp: torch.Tensor | None = None
    policy: str = "teacher"  # who sampled the answer: teacher | student

    @property
    def answer_from(self) -> int:
        """The first target row that predicts an answer token."""
        return self.user.numel() - 1


class BatchedTeacher:
    """A model over one system prompt's KV, prefilled once: `generate` and `score` run batches of requests on it."""

    def __init__(self, model: LoadedModel, prefix: PrefixKV, max_batch: int = 64, max_step_tokens: int = 1024):
        self.model, self.prefix = model, prefix
        self.engine = Engine(model.model, model.tokenizer, prefix, eos_ids(model), max_batch=max_batch,
                             max_step_tokens=max_step_tokens, background=False)

    @classmethod
    def of_prompt(cls, model: LoadedModel, system_ids: torch.Tensor, after: PrefixKV | None = None,
                  **kw) -> BatchedTeacher:
        """The model's own prefill of the system prompt (the one prefill), read after `after` when given."""
        # no graph: a self-teacher is the freshly loaded edge, whose parameters require grad; its KV would keep
        # the graph alive, and the prefill took 20 % longer (measured; the KV itself came out bitwise the same)
        with torch.no_grad():
            prefix = PrefixKV.of_model(model.model, system_ids) if after is None else \
                read_after(model.model, after, system_ids)
        return cls(model, prefix, **kw)

    def generate(self, prompts: list[torch.Tensor], max_tokens: int, temperature: float, seeds: list[int],
                 top_k: int | None = None, stop: list[str] | None = None,
                 on_done: Callable[[], None] | None = None) -> list[Result]:
        """One answer per prompt, all decoded together; each request sampled from its own seeded generator, so an
        answer does not depend on the batch it ran in. `top_k`: keep the targets of every row."""
        reqs = [GenRequest(p, SamplingParams(max_tokens, temperature, 1.0, s), list(stop or []), score_top_k=top_k)
                for p, s in zip(prompts, seeds)]
        return self.engine.generate_all(reqs, on_done)

    def score(self, samples: list[Sample], top_k: int, on_done: Callable[[], None] | None = None) -> None:
        """Fill each sample's targets: the teacher reads user + answer (one batched pass, no token generated)."""
        reqs = [GenRequest(torch.cat([s.user, s.answer]), SamplingParams(0, 0.0), score_top_k=top_k)
                for s in samples]
        for s, r in zip(samples, self.engine.generate_all(reqs, on_done)):
            if r.error is not None:
                raise EdgeKVError(f"scoring failed: {r.error}")
            s.top_logp, s.top_ids = (t.clone() for t in r.targets)  # out of the engine's inference mode


def windows(n_tokens: int, count: int, size: int, rng: random.Random) -> list[tuple[int, int]]:
    """`count` random [start, end) windows of `size` tokens of a prompt of `n_tokens` (the whole prompt when it is
    shorter)."""
    size = min(size, n_tokens)
    return [(s, s + size) for s in (rng.randrange(0, n_tokens - size + 1) for _ in range(count))]


def plan_seeds(seeds: list[str], count: int) -> list[str]:
    """The seed type of each of `count` exchanges: round robin, so every type gets its share."""
    if not seeds:
        raise EdgeKVError("distill needs at least one seed type")
    return [seeds[n % len(seeds)] for n in range(count)]


def synthesize(teacher: BatchedTeacher, system_ids: torch.Tensor, plan: list[str], student: list[bool],
               seed_prompts: dict[str, str], instructions: list[str], answer_format: str, window_tokens: int,
               max_query_tokens: int, query_temperature: float, max_answer_tokens: int, temperature: float,
               top_k: int, seed: int, on_done: Callable[[], None] | None = None
               ) -> tuple[list[Sample], list[tuple[str, torch.Tensor]]]:
    """The planned exchanges in one engine loop: a fixed instruction (cycled) for `instruction`, `RECALL_FORMAT`
    quoting a random window's head for `recall`, else a query the teacher writes reading a random window of the
    prompt, put in `answer_format`; the teacher answers each query the moment it is written (so writers and
    answerers share every step's batch), with its targets. Returns the teacher's samples and the (seed type, user
    ids) of the queries whose answer is the student's (`student[n]`). A written query that comes out empty and an
    answer shorter than 2 tokens are dropped."""
    tok = teacher.model.tokenizer
    spans = windows(system_ids.numel(), len(plan), window_tokens, rng=random.Random(seed))
    encode = lambda text: torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa
    users: dict[int, torch.Tensor] = {}  # the user message of each exchange once it is known
    answering: set[int] = set()  # the exchanges the teacher answers
    label = lambda n: f"{INSTRUCTION}:{n % len(instructions)}" if plan[n] == INSTRUCTION else plan[n]  # noqa: E731

    def answer_request(n: int, text: str) -> GenRequest | None:
        users[n] = encode(text)
        if not users[n].numel() or student[n]:
            return None
        answering.add(n)
        return GenRequest(users[n], SamplingParams(max_answer_tokens, temperature, 1.0, seed * 1_000_003 + n),
                          score_top_k=top_k)

    first: list[GenRequest | None] = []
    for n, kind in enumerate(plan):
        if kind == INSTRUCTION:
            first.append(answer_request(n, instructions[n % len(instructions)]))
            continue
        start, end = spans[n]
        if kind == RECALL:
            head = tok.decode(system_ids[start:start + RECALL_HEAD].tolist(), skip_special_tokens=True).strip()
            first.append(answer_request(n, RECALL_FORMAT.format(head=head)))
            continue
        if kind not in seed_prompts:
            raise EdgeKVError(f"unknown seed type '{kind}' (choose from {', '.join([*seed_prompts, *UNWRITTEN])})")
        window = tok.decode(system_ids[start:end].tolist(), skip_special_tokens=True).strip()
        first.append(GenRequest(encode(WRITER.format(window=window, seed=seed_prompts[kind])),
                                SamplingParams(max_query_tokens, query_temperature, 1.0, seed * 1_000_003 + 7919 * n),
                                ["\n"]))

    def follow(n: int, written: Result) -> GenRequest | None:
        if n in users:  # an answer, or a query left to the student: nothing follows
            return None
        query = written.text.strip()
        return answer_request(n, answer_format.format(query=query)) if query else None

    live = [n for n, r in enumerate(first) if r is not None]
    results = teacher.engine.generate_all([first[n] for n in live], on_done,
                                          follow=lambda k, r: follow(live[k], r)) if live else []
    samples = []
    for n, r in zip(live, results):
        if n not in answering:
            continue
        if r.error is not None:
            raise EdgeKVError(f"the teacher failed to answer: {r.error}")
        if len(r.token_ids) >= 2:
            logp, ids = (t.clone() for t in r.targets)  # out of the engine's inference mode
            samples.append(Sample(label(n), users[n], torch.tensor(r.token_ids, dtype=torch.long), ids, logp))
    theirs = [(label(n), users[n]) for n in sorted(users) if student[n] and users[n].numel()]
    return samples, theirs


def student_answers(student: BatchedTeacher, queries: list[tuple[str, torch.Tensor]], max_tokens: int,
                    temperature: float, seed: int, on_done: Callable[[], None] | None = None) -> list[Sample]:
    """The student's sampled answer to each query (no targets yet: the teacher scores them), seeded per query;
    answers shorter than 2 tokens are dropped."""
    results = student.generate([u for _, u in queries], max_tokens, temperature,
                               [seed * 1_000_003 + n for n in range(len(queries))], on_done=on_done)
    out = []
    for (kind, user), r in zip(queries, results):
        if r.error is not None:
            raise EdgeKVError(f"the student failed to answer: {r.error}")
        if len(r.token_ids) >= 2:
            out.append(Sample(kind, user, torch.tensor(r.token_ids, dtype=torch.long), policy="student"))
    return out
