"""The decoder's RMSNorm in one kernel call for the GGUF edge (`--weights gguf|gguf-q8`).

transformers' Llama/Qwen2/Mistral norm is seven aten calls (cast, square, mean = sum and divide, add, rsqrt,
multiply, cast, scale); 49 of them a token took ≈ 4 ms of a 44 ms decode step at 2 threads (measured by switching
them off). `gguf_kernels.cpp`'s `rms_norm` computes the same formula in one pass; only the order of its sum of
squares is its own, so an output may differ from the aten ops' by one bf16 step (tested). The swap is model-wide,
so the model's forward, `DecodeStep` and a spliced prefix all compute with the same norm and stay equal to each
other bit for bit. Anything the kernel does not take (another dtype, autograd) runs the reference formula.
"""

from __future__ import annotations

import torch

from edgekv.models.gguf_linear import kernels

# the norms whose forward is exactly weight · (x · rsqrt(mean(x²) + eps)).to(dtype)
REFERENCE = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm whose bf16 inference path is one kernel call (same weight, same eps)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return kernels().rms_norm(x.contiguous(), self.weight.detach(), self.variance_epsilon)
        dtype = x.dtype  # the reference formula (transformers'), for what the kernel does not take
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


def fuse_norms(model: torch.nn.Module) -> int:
    """Replace every Llama/Qwen2/Mistral RMSNorm of `model` by its fused form (in place; the kernels must be
    built); returns how many."""
    found = [name for name, m in model.named_modules() if type(m).__name__ in REFERENCE]
    for name in found:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, FusedRMSNorm(owner.get_submodule(child)))
    return len(found)
