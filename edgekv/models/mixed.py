"""`--dtype mixed`: a float32 model whose linear weights are held in bf16, for CPUs without native bf16 (AVX2).

There, bf16 matmuls of many rows run on a slow path (a 256-token prefill 4.1–5.8× float32's time in three runs,
reports/dtype-speed/), but a decode step is memory-bound and bf16 reads half the bytes (0.45–0.57× float32's time).
A `MixedLinear` therefore multiplies a call of few rows (a decode step, of one sequence or a small batch) in bf16
with float32 accumulation, and more rows (a prefill, a scored continuation) in float32 on its weight upcast a tile
at a time for that call: prefill keeps float32's arithmetic (and speed, or better), decode gets bf16's bandwidth.
Activations, norms, attention and the KV cache stay float32. The weights lose nothing where they are bf16 values
already (the default pair: its cache is a bf16 copy of the GGUF); a float32 checkpoint is rounded to bf16 once, at
load.

A row's arithmetic depends on how many rows came with it: a decoded token is computed in bf16, the same token
prefilled with others in float32. Both paths of a splice (system KV + user prompt, or the whole prompt at once)
prefill their prompts and decode one token at a time, so they agree bit for bit when the user prompt has more
than BF16_ROWS tokens, and within bf16's rounding when it is shorter.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from edgekv.models.prepack import page_out
from edgekv.runtime import trim_heap

# Rows a call may have to take the bf16 path: a decode step of up to 16 sequences, or a prompt that short. Measured
# on eight 8960×1536 weights (AVX2, 2 threads, 2026-12-02, medians): bf16 17/30/53/101/202 ms at 1/2/4/8/16 rows,
# float32 45/92/159/156/178, the float32 upcast 73/120/152/168/202 and at 32 rows 227 against bf16's 384.
BF16_ROWS = 16
# More rows multiply in float32 on the weight upcast CHUNK output rows at a time into a small per-thread buffer: the
# tile is read back from cache, not memory. On eight 8960×1536 / 1536×8960 weights (AVX2, 2 threads, 2026-12-02,
# medians of 5) that took 0.53–1.05× float32's own time at 17–512 rows, bit for bit the same; the whole weight upcast
# into one work copy per shape (the rule before) took 1.00–1.49×, and the copies held 1.6 GB for the default pair.
CHUNK = 512


class _Tiles(threading.local):
    """Each thread's upcast tiles by (in_features, dtype, device): a server prefills off-thread, and a shared tile
    would need a lock."""

    def __init__(self):
        self.by_shape: dict[tuple, torch.Tensor] = {}


_TILES = _Tiles()


class _Scoring(threading.local):
    """Whether this thread is scoring (`float32_scoring`): every call takes the float32 path, however few rows."""

    on = False


_SCORING = _Scoring()


@contextlib.contextmanager
def float32_scoring():
    """Within it, a MixedLinear multiplies every call in float32: a score (a reference NLL) is then float32's to the
    bit whatever the row count (its head sees only the scored rows, one for an MMLU letter), not bf16's."""
    before, _SCORING.on = _SCORING.on, True
    try:
        yield
    finally:
        _SCORING.on = before


def _chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (rows, in) in x's dtype, `weight` (out, in) upcast CHUNK rows at a time."""
    key = (weight.shape[1], x.dtype, x.device)
    tile = _TILES.by_shape.get(key)
    if tile is None:
        tile = _TILES.by_shape[key] = torch.empty(CHUNK, weight.shape[1], dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for i in range(0, weight.shape[0], CHUNK):
        n = min(CHUNK, weight.shape[0] - i)
        w = tile[:n].copy_(weight[i:i + n]).t()
        if bias is None:
            torch.mm(x, w, out=out[:, i:i + n])
        else:  # addmm, as F.linear computes a biased call
            torch.addmm(bias[i:i + n], x, w, out=out[:, i:i + n])
    return out


class MixedLinear(torch.nn.Module):
    """A linear layer of a float32 model with its weight held in bf16 (≤ BF16_ROWS rows: bf16; more: float32)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = torch.float32  # what kv_from_hidden feeds it (its first float tensor is bf16)
        # buffers, not parameters: the model's own dtype (its first parameter) stays float32
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= BF16_ROWS * self.in_features and not _SCORING.on:
            y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if torch.is_grad_enabled() and x.requires_grad:  # autograd keeps the weight it multiplied: its own copy
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        y = _chunked_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 weight"


@torch.no_grad()
def hold_linears_in_bf16(model: torch.nn.Module) -> int:
    """Replace every dense nn.Linear of a float32 model (decoder and LM head) by a MixedLinear, in place; the
    number replaced. Quantized linears (`--weights`) are left as they are."""
    names = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    for name in names:
        linear = model.get_submodule(name)
        model.set_submodule(name, MixedLinear(linear))
        page_out(linear.weight)  # mapped from the weights file: hand its pages back (a tied head's too)
        del linear
        trim_heap()
    return len(names)
