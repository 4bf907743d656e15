"""The edge's linears in the GGUF file's own blocks: the bytes llama.cpp reads, the file's weights exactly.

A GGUF tensor of type Q4_K, Q5_0, Q6_K or Q8_0 keeps its blocks as they are in the file (uint8 rows; Q5_0 is 5.5
bits a weight, Q8_0 8.5), and `gguf_kernels.cpp`, compiled once per machine by torch's extension loader, multiplies
in the code domain (the weights used are d·q, never rounded; the bf16 model holds the same weights rounded to bf16,
checked at load, one row a tensor). Two arithmetics on the same blocks:
- `--weights gguf`: bf16 activations. Each 32-value chunk's integer codes (exact in bf16) meet the activations in
  one vdpbf16ps; the chunk's scale multiplies the partial sum (AVX-512 BF16). Exact but compute-bound.
- `--weights gguf-q8`: llama.cpp's arithmetic. Each activation row is rounded to int8 per 32 values (scale amax/127)
  and meets the unsigned codes in vpdpbusd integer dot products, exact in int32; one float scale per scale-group.
  The blocks are repacked once at load into panels of 16 rows (the file's bits and scales, rearranged so that one
  instruction adds 4 products to each of 16 outputs): the default edge's 169 linears took 146 ms at a 64-row
  prompt block and 23.9 ms at a decode step against 379 and 32.4 with the previous kernel (2 threads, quiet, side
  by side). The int8 rounding of the inputs is its only loss (the tests
  bound it per linear and on the real edge's logits; bench.weights_quality measures its NLL).
Elsewhere float32 FMAs on the row decoded as ggml and gguf-py decode it. Both are the file's model, so a gguf edge
keeps the bf16 model's fingerprint and takes its exports. Every row count takes the same arithmetic, so a spliced
prefix equals the model's own full prefill bit for bit, as with int4. A tensor of another type (F16/F32, other
quants), a model that is not a GGUF, a float32 model, rows gguf-q8 cannot step through (not a multiple of 64) or a
machine where the kernels cannot be built keeps its dense linears, with one log line.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("edgekv")
SOURCE = Path(__file__).with_name("gguf_kernels.cpp")
BLOCKS = {8: ("Q8_0", 32, 34), 6: ("Q5_0", 32, 22), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210)}  # ggml ids
GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def module_name(tensor: str) -> str | None:
    """The transformers module a Llama/Qwen-layout GGUF weight belongs to (`blk.3.ffn_up.weight` →
    `model.layers.3.mlp.up_proj`, `output.weight` → `lm_head`), None for anything that is not a linear."""
    parts = tensor.split(".")
    if tensor == "output.weight":
        return "lm_head"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{GGUF_NAMES[parts[2]]}"
    return None


def _machine_tag() -> str:
    """The build's key: the source, torch and this CPU (the kernels are compiled for the machine they run on)."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    key = f"{SOURCE.read_bytes().hex()}|{torch.__version__}|{platform.machine()}|{flags}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # OpenMP: at::parallel_for is a loop without it; no contraction:
# only the FMAs the source writes fuse


def build_kernels(directory: Path, tag: str, extra_flags: list[str] = ()):
    """Compile gguf_kernels.cpp into `directory` (raises where it cannot); `extra_flags` after -march=native."""
    from torch.utils.cpp_extension import load

    flags = list(FLAGS)
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-march=native", "-mprefer-vector-width=512"]
    directory.mkdir(parents=True, exist_ok=True)
    return load(name=f"edgekv_gguf_{tag}", sources=[str(SOURCE)], extra_cflags=flags + list(extra_flags),
                build_directory=str(directory), verbose=False)


@functools.cache
def kernels():
    """The compiled kernels (first use on a machine: ~1 min), or None with one log line where they cannot be built."""
    if os.environ.get("EDGEKV_NO_GGUF_KERNELS"):  # a switch to run (and test) the fallback
        log.warning("gguf kernels switched off (EDGEKV_NO_GGUF_KERNELS): the linears stay dense")
        return None
    from edgekv.models.packaged import cache_root

    tag = _machine_tag()
    try:
        return build_kernels(cache_root() / "kernels" / tag, tag)
    except Exception as exc:  # noqa: BLE001 - any build failure (no compiler, no ninja, odd CPU) means: fall back
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        log.warning("gguf kernels cannot be built here (%s): the linears stay dense", reason)
        return None


def read_blocks(gguf_path: str) -> dict[str, tuple[int, torch.Tensor]]:
    """Every linear weight of a GGUF whose type the kernels decode: module name → (ggml type, uint8 [N, row bytes])."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        name = module_name(t.name)
        if name is None or int(t.tensor_type) not in BLOCKS:
            continue
        n = int(t.shape[1])  # GGUF lists the row length first
        out[name] = (int(t.tensor_type), torch.from_numpy(np.ascontiguousarray(t.data).reshape(n, -1).copy()))
    return out


def _holds(rows: torch.Tensor, ggml_type: int, in_features: int, int8_activations: bool = False) -> bool:
    """Whether uint8 rows of `ggml_type` blocks hold `in_features` values each (the int8-activation kernels step
    64 values at a time)."""
    _, values, nbytes = BLOCKS[ggml_type]
    whole = in_features % values == 0 and (not int8_activations or in_features % 64 == 0)
    return whole and rows.shape[1] == in_features // values * nbytes


class GGUFLinear(torch.nn.Module):
    """A linear layer on its GGUF blocks (inference only): y = x Wᵀ + b with W the file's weights."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None,
                 dtype: torch.dtype, int8_activations: bool = False):
        super().__init__()
        if not _holds(blocks, ggml_type, in_features, int8_activations):
            raise ValueError(f"{BLOCKS[ggml_type][0]} rows of {blocks.shape[1]} bytes do not hold {in_features} values")
        # gguf-q8 keeps only its panels (the file's bytes rearranged for the VNNI product, packed once here)
        weights = kernels().gguf_pack_q8(blocks.contiguous(), ggml_type, in_features) if int8_activations else blocks
        self._hold(weights, ggml_type, in_features, blocks.shape[0], bias, dtype, int8_activations)

    def _hold(self, weights: torch.Tensor, ggml_type: int, in_features: int, out_features: int,
              bias: torch.Tensor | None, dtype: torch.dtype, int8_activations: bool) -> None:
        """The layer's fields and buffers, `weights` as its arithmetic reads them (blocks, or gguf-q8's panels)."""
        self.ggml_type, self.in_features, self.out_features, self.dtype = ggml_type, in_features, out_features, dtype
        self.int8_activations = int8_activations
        self.register_buffer("blocks", weights.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def concat(cls, parts: list[GGUFLinear]) -> GGUFLinear | None:
        """One linear computing `parts` side by side (their outputs concatenated: q/k/v, gate/up), or None when
        they differ in block type, row length, arithmetic or bias, or a part's rows do not fill its last panel.
        A row's product does not depend on its neighbours, so each output is bit-equal to its part's (checked on
        a random row before use)."""
        first = parts[0]
        if len({(m.ggml_type, m.in_features, m.int8_activations, m.dtype, m.bias is None) for m in parts}) != 1:
            return None
        if first.int8_activations and any(m.out_features % kernels().panel_rows for m in parts[:-1]):
            return None
        out = cls.__new__(cls)  # the parts' weights are already as the arithmetic reads them: no validation, no pack
        torch.nn.Module.__init__(out)
        bias = None if first.bias is None else torch.cat([m.bias for m in parts])
        out._hold(torch.cat([m.blocks for m in parts]), first.ggml_type, first.in_features,
                  sum(m.out_features for m in parts), bias, first.dtype, first.int8_activations)
        with torch.no_grad():
            x = torch.randn(1, out.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            if not torch.equal(out(x), torch.cat([m(x) for m in parts], -1)):
                return None
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the weights take (the file's blocks, or gguf-q8's panels of them)."""
        return self.blocks.numel()

    def weight_float(self) -> torch.Tensor:
        """The file's weights, float32 [out, in] (ggml's dequantization)."""
        if self.int8_activations:
            return kernels().gguf_unpack_q8(self.blocks, self.ggml_type, self.in_features, self.out_features)
        return kernels().gguf_dequantize(self.blocks, self.ggml_type, self.in_features)

    def weight_bf16(self) -> torch.Tensor:
        """The bf16 model's weights (the file's, rounded to bf16)."""
        return self.weight_float().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16 or not flat.is_contiguous():  # a decode step's rows are both already
            flat = flat.to(torch.bfloat16).contiguous()
        # the bias joins in float32, then one rounding
        if self.int8_activations:
            y = kernels().gguf_mm_q8(flat, self.blocks, self.ggml_type, self.out_features, self.bias, True)
        else:
            y = kernels().gguf_mm(flat, self.blocks, self.ggml_type, self.bias, True)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = ", int8 activations" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {BLOCKS[self.ggml_type][0]}{act}"


def why_not(linear: torch.nn.Linear, found: tuple[int, torch.Tensor] | None,
            int8_activations: bool = False) -> str | None:
    """Why `linear` cannot take the GGUF blocks `found` (type, rows), or None: a missing tensor, a dtype the
    kernels do not take, or rows that do not decode to the linear's own weights (checked on its first row)."""
    if found is None:
        return "no Q4_K/Q5_0/Q6_K/Q8_0 tensor for it in the GGUF"
    if linear.weight.dtype != torch.bfloat16:
        return f"the kernels take bf16 models, this one is {str(linear.weight.dtype).removeprefix('torch.')}"
    ggml_type, rows = found
    n, k = linear.weight.shape
    if rows.shape[0] != n or not _holds(rows, ggml_type, k, int8_activations):
        return f"its {BLOCKS[ggml_type][0]} tensor's shape does not match {n}×{k}" + (
            " (the int8-activation kernels take rows a multiple of 64 long)" if int8_activations else "")
    first = kernels().gguf_dequantize(rows[:1].contiguous(), ggml_type, k).bfloat16()
    if not torch.equal(first, linear.weight[:1].detach()):
        return "its GGUF rows do not decode to the loaded weights (a reordering loader?)"
    return None
