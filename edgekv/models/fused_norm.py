"""The decoder's RMSNorm in one kernel call for the GGUF edge (`--weights gguf|gguf-q8`).

transformers' Llama/Qwen2/Mistral norm is seven aten calls (cast, square, mean = sum and divide, add, rsqrt,
multiply, cast, scale); 49 of them a token took ≈ 4 ms of a 44 ms decode step at 2 threads (measured by switching
them off). `gguf_kernels.cpp`'s `rms_norm` computes the same formula in one call, each operation rounded as the
aten ops round it and the sum of squares in ATen's own order (SumKernel's cascade over 8- or 16-float vectors:
`aten_width` finds which reproduces ATen's sum here, 8 on this project's machine although ATen reports AVX-512),
so its outputs are the aten ops' bit for bit (tested on random rows and on the real edge's logits).
A first version summed in its own order: one bf16 step off at rare rounding edges, and on the real edge that
changed ~99 % of the logit rows of a 1,024-token text and some greedy tokens. The swap is model-wide, so the
model's forward, `DecodeStep` and a spliced prefix compute with the same norm whatever ATen does elsewhere.
Anything the kernel does not take (another dtype, autograd) runs the reference formula.
"""

from __future__ import annotations

import functools
import logging

import torch

from edgekv.models.gguf_linear import kernels

log = logging.getLogger("edgekv")

# the norms whose forward is exactly weight · (x · rsqrt(mean(x²) + eps)).to(dtype)
REFERENCE = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


@functools.cache
def aten_width(n: int) -> int | None:
    """The float vector width (8 or 16) whose summation order gives ATen's own `pow(2).sum(-1)` on rows of `n` here,
    checked on 64 random rows of varied scale; None if neither does (then the norms stay aten's)."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(1, 64, n, generator=g) * torch.logspace(-2, 3, 64)[None, :, None]).bfloat16()
    want = x.float().pow(2).sum(-1).flatten()
    for width in (8, 16):
        if torch.equal(kernels().sum_of_squares(x[0], width), want):
            return width
    return None


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm whose bf16 inference path is one kernel call (same weight, same eps)."""

    def __init__(self, norm: torch.nn.Module, width: int):
        super().__init__()
        self.weight, self.variance_epsilon, self.width = norm.weight, norm.variance_epsilon, width
        self.reference = type(norm).forward  # transformers' own forward, for what the kernel does not take

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return kernels().rms_norm(x.contiguous(), self.weight.detach(), self.variance_epsilon, self.width)
        return self.reference(self, x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


def fuse_norms(model: torch.nn.Module) -> int:
    """Replace every Llama/Qwen2/Mistral RMSNorm of `model` by its fused form (in place; the kernels must be
    built); returns how many. Where ATen's sum order is not reproduced here they stay aten's, with one log line."""
    found = [name for name, m in model.named_modules() if type(m).__name__ in REFERENCE]
    if not found:
        return 0
    width = aten_width(model.get_submodule(found[0]).weight.numel())
    if width is None:
        log.warning("the norms stay aten's: the fused kernel does not reproduce ATen's sum order on this machine")
        return 0
    for name in found:
        model.set_submodule(name, FusedRMSNorm(model.get_submodule(name), width))
    return len(found)
