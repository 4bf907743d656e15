"""A session (DESIGN.md §1, §5): one edge model and one system prompt's KV (`SystemKV`), shared by every user
prompt it answers. Answers come from the one decode loop (`engine.py`, inline for a caller that wants one
answer); NLL scoring is `continuation_nll` over a request cache of the system KV. Positions continue after the
system prompt.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from edgekv import EdgeKVError
from edgekv.attention.fuse import enable_fusion
from edgekv.attention.prefix_kv import continuation_nll
from edgekv.kv.shared_prefix import SharedPrefix
from edgekv.models.loading import LoadedModel, eos_ids
from edgekv.models.structure import context_limit
from edgekv.serve.engine import Engine
from edgekv.serve.pipeline import Link
from edgekv.serve.requests import GenRequest, Result
from edgekv.serve.sampling import SamplingParams
from edgekv.serve.system_kv import SystemKV


class EdgeSession:
    """An edge model + one system prompt's `SystemKV`, which every request shares. Answers go through the one
    decode loop (`Engine`, run inline: a batch of one is a batch)."""

    def __init__(self, edge: LoadedModel, kv: str | None = None, system_prompt: str | None = None,
                 link: Link | None = None, cache_dir: str | Path | None = None, local_sink_tokens: int | None = None,
                 peer_kv: str | None = None, system: SystemKV | None = None, shared: SharedPrefix | None = None):
        """The system KV from an export `kv` (with its fallbacks) or the edge's own prefill of `system_prompt`
        (see SystemKV; under a `shared` prefix), or an already built `system`."""
        self.edge, self.model = edge, edge.model
        self.system = system if system is not None else SystemKV(edge, kv, system_prompt, link, cache_dir,
                                                                 local_sink_tokens, peer_kv, shared)
        self.eos_ids = eos_ids(edge)
        # edgekv's attention on the model itself: a full prefill of the same model (generate) then computes what
        # the session computes (decode steps and query blocks through the grouped flash path)
        enable_fusion(self.model)
        self._engine = None
        self._engine_lock = threading.Lock()

    @property
    def prefix_len(self) -> int:
        """System-prompt tokens."""
        return self.system.prefix_len

    @property
    def num_layers(self) -> int:
        """Decoder layers of the edge model."""
        return self.system.num_layers

    def describe(self) -> dict:
        """Where the system KV came from and what loading cost."""
        return self.system.describe()

    def wait_loaded(self) -> None:
        """Block until every layer of the system KV is in."""
        self.system.wait_loaded()

    def encode_user(self, prompt: str) -> torch.Tensor:
        """Token ids of a user prompt (no special tokens: it continues the system prompt)."""
        ids = self.edge.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise EdgeKVError("the prompt is empty")
        return torch.tensor(ids, dtype=torch.long)

    @property
    def max_context(self) -> int:
        """The model's context length (`max_position_embeddings`, or a smaller sliding window)."""
        return context_limit(self.model.config)

    def engine(self, **limits) -> Engine:
        """An engine decoding on this session's model and system KV (`limits`: Engine's max_batch, max_queue,
        max_step_tokens, background, relay)."""
        return Engine(self.model, self.edge.tokenizer, self.system, self.eos_ids, **limits)

    def complete(self, prompt: str | torch.Tensor, params: SamplingParams | None = None) -> Result:
        """Answer one user prompt on the shared system KV (the engine, inline, batch of one)."""
        params = params or SamplingParams()
        user = self.encode_user(prompt) if isinstance(prompt, str) else prompt
        with self._engine_lock:  # one caller drives the inline engine at a time
            if self._engine is None:
                self._engine = self.engine(max_batch=1, max_step_tokens=self.max_context, background=False,
                                           relay=False)
            done = self._engine.generate(GenRequest(user, params, first_logits=True))
        if done.error is not None:
            raise EdgeKVError(done.error)
        return done

    @torch.no_grad()
    def continuation_nll(self, user: torch.Tensor, continuation: torch.Tensor) -> float:
        """Mean NLL (nats/token) of `continuation` after the user prompt, on this session's system KV."""
        return float(continuation_nll(self.model, self.system, user, continuation))
