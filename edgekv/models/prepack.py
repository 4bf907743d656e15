"""Prepacked linear layers for CPU inference: oneDNN's weight layout made once at load, not once per call.

A bf16 `nn.Linear` on CPU already runs oneDNN's matmul, which reorders the weight into its blocked layout on
every call. At the splice's 64-row GEMMs that reorder is a visible share of the work (`python -m bench.prepack`;
figures in reports/README). `PackedLinear` holds the reordered weight and
calls the same kernel (`torch.ops.mkldnn._linear_pointwise`), so outputs are bit-identical (tested) and only
the per-call reorder goes away. This is the weight prepacking torch.compile's CPU freezing does, without a
compile. Inference only: the packed weight has no gradient and `weight` is gone, so code that reads or trains
the weights (translator fitting, fuser training) must keep an unpacked model.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from edgekv.models.structure import decoder_layers
from edgekv.runtime import libc, onednn_bf16


class PackedLinear(torch.nn.Module):
    """`nn.Linear` with its weight prepacked by oneDNN for CPU matmuls (bf16; inference only)."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # the hint picks the blocking oneDNN tunes for; the packed weight serves every row count
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x Wᵀ + b over the last axis, any leading shape."""
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


_MADV_PAGEOUT = 21  # Linux ≥ 5.4: reclaim these pages now; their contents stay (re-read from the file if touched)


_MADVISE = libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def page_out(tensor: torch.Tensor) -> None:
    """Hand the pages of a dropped weight back to the kernel. Weights loaded from safetensors are views of one
    file mapping that the embedding keeps alive, so dropping a `Linear` frees nothing and its pages would stay in
    RSS beside the packed copy (+0.66 GB on the default edge). Paging out never changes what the memory holds,
    so it is safe even if something still reads the tensor; anywhere else it is a silent no-op."""
    if _MADVISE is None:
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    start, end = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
    if end > start:
        _MADVISE(start, end - start, _MADV_PAGEOUT)  # an error (old kernel, no such pages) changes nothing


def can_prepack(model: torch.nn.Module) -> bool:
    """Whether this model's decoder weights can be prepacked: bf16 on a CPU whose oneDNN has bf16 kernels."""
    try:
        weight = next(decoder_layers(model).parameters())
    except StopIteration:
        return False
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and onednn_bf16()


def prepack_linears(model: torch.nn.Module, rows_hint: int = 64, head: bool = True) -> int:
    """Replace every `nn.Linear` inside the decoder layers (and, with `head`, the LM head) by a `PackedLinear`
    (in place); returns how many.

    The head computes one row per step (a splice's first token, every decode step), where the per-call reorder of
    its whole weight costs most (the default edge's 151,936 × 896 head; bit-identical). A tied head keeps the
    embedding as it was (the lookups read it); its pages, mapped from the weights file, are paged out, so RSS holds
    the packed copy in their place.
    A no-op (0) where `can_prepack` says no. Idempotent: packed layers are not packed again."""
    if not can_prepack(model):
        return 0
    count = 0
    with torch.no_grad():
        for block in decoder_layers(model):
            for parent in list(block.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is torch.nn.Linear:
                        setattr(parent, name, PackedLinear(child, rows_hint))
                        page_out(child.weight)
                        count += 1
        out = model.get_output_embeddings() if head and hasattr(model, "get_output_embeddings") else None
        if type(out) is torch.nn.Linear and out.weight.dtype == torch.bfloat16:
            model.set_output_embeddings(PackedLinear(out, rows_hint=1))
            page_out(out.weight)
            count += 1
    return count
