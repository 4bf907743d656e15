"""Weight-only quantized linears for the edge (`--weights gguf|gguf-q8|int8|int4`): the GGUF's own blocks on
edgekv's kernels (models/gguf_linear.py), or int8/int4 on torch's own CPU kernels.

Decode at batch 1 is memory-bound: the edge reads every weight once per token. int4 (group-32 asymmetric,
w = (q − 8)·scale + zero, q ∈ 0..15) and int8 (per-output-channel symmetric) read 4× / 2× fewer bytes than bf16
through `torch._weight_int4pack_mm_for_cpu` / `torch._weight_int8pack_mm`. Every row count takes the kernel:
each row's result is then the same function of that row whatever the batch, so a spliced prefix is exact against
the quantized model's own full prefill. (Dequantizing for one dense GEMM would prefill a thousand rows about 2×
faster, but a row's arithmetic would then depend on how many rows came with it; measured by hand, not shipped.)

A GGUF's Q4_K tensors (super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale and min; value =
d·sc·q − dmin·m) are exactly group-32 asymmetric int4: `q4k_to_int4` loads them with their own scales and zero
points; every other tensor (and any model from safetensors or the hub) is quantized round-to-nearest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from edgekv import EdgeKVError
from edgekv.models.fused_norm import fuse_norms
from edgekv.models.gguf_linear import GGUFLinear, kernels, module_name, why_not
from edgekv.models.prepack import page_out
from edgekv.models.structure import model_device
from edgekv.runtime import trim_heap

log = logging.getLogger("edgekv")
WEIGHTS = ("gguf", "gguf-q8", "bf16", "int8", "int4")
GGUF_WEIGHTS = ("gguf", "gguf-q8")  # the file's own blocks: bf16 or int8 activations
GROUP = 32
CPU_PACK_ROWS = 64  # output channels per block of torch's packed CPU int4 layout


@dataclass
class Int4Weight:
    """Group-wise asymmetric int4: w[n, k] = (q[n, k] − 8)·scale[n, k // g] + zero[n, k // g]."""

    q: torch.Tensor  # (N, K) uint8, 0..15
    scale: torch.Tensor  # (N, K / g) float32
    zero: torch.Tensor  # (N, K / g) float32

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, k = self.q.shape
        groups = self.q.reshape(n, self.scale.shape[1], -1).float() - 8
        return (groups * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


def int4_rtn(weight: torch.Tensor, group: int = GROUP, rows: int = 8192) -> Int4Weight:
    """Round-to-nearest group-wise int4 of a (N, K) weight: each group's min and max span the 16 levels (in
    chunks of `rows`, so a 151,936-row head never needs a float32 copy of itself)."""
    n, k = weight.shape
    parts = []
    for start in range(0, n, rows):
        w = weight[start:start + rows].float().reshape(-1, k // group, group)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(-1, k)
        parts.append((q, scale, lo + 8 * scale))
    return Int4Weight(*(torch.cat(t) for t in zip(*parts)))


def _q4k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and mins of each super-block from its 12 packed bytes (ggml's
    get_scale_min_k4): (blocks, 8) each."""
    p = packed.astype(np.uint8)
    sc = np.empty((p.shape[0], 8), np.uint8)
    mn = np.empty((p.shape[0], 8), np.uint8)
    sc[:, :4], mn[:, :4] = p[:, 0:4] & 63, p[:, 4:8] & 63
    sc[:, 4:] = (p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc, mn


def q4k_to_int4(raw: np.ndarray, out_features: int, in_features: int) -> Int4Weight:
    """A GGUF Q4_K tensor's bytes `(N, K / 256 · 144)` as exact group-32 int4: scale = d·sc, zero = 8·scale − dmin·m."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    sc, mn = _q4k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 64 values: low nibbles then high nibbles
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 256)  # sub-block j = 2·chunk + (0 low, 1 high)
    scale = d[:, None] * sc.astype(np.float32)
    zero = 8 * scale - dmin[:, None] * mn.astype(np.float32)
    n, g = out_features, in_features // GROUP
    return Int4Weight(torch.from_numpy(q.astype(np.uint8)).reshape(n, in_features),
                      torch.from_numpy(scale).reshape(n, g), torch.from_numpy(zero).reshape(n, g))


class Int4Linear(torch.nn.Module):
    """A linear layer on torch's packed CPU int4 layout."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self._hold(torch._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1),
                   torch.stack([weight.scale, weight.zero], -1).transpose(0, 1).contiguous().to(dtype),
                   None if bias is None else bias.detach().to(dtype), weight.q.shape[1], dtype)

    def _hold(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, in_features: int,
              dtype: torch.dtype) -> None:
        """The kernel's operands: packed rows (one per output channel), (K/g, N, 2) scales and zeros, bias."""
        self.in_features, self.out_features, self.dtype = in_features, packed.shape[0], dtype
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def concat(cls, parts: list[Int4Linear]) -> Int4Linear | None:
        """One linear computing `parts` side by side (their outputs concatenated), or None when they cannot be
        joined. torch's CPU layout packs output channels in blocks of 64, so parts whose rows fill whole blocks
        (all but the last) join as their own bytes, and each output column is the same product as in its part;
        the join is checked on a random row (bit-equal) before it is used."""
        if len({(m.in_features, m.dtype, m.bias is None) for m in parts}) != 1 or \
                any(m.out_features % CPU_PACK_ROWS for m in parts[:-1]):
            return None
        out = cls.__new__(cls)
        torch.nn.Module.__init__(out)
        out._hold(torch.cat([m.packed for m in parts]), torch.cat([m.scales_zeros for m in parts], 1),
                  None if parts[0].bias is None else torch.cat([m.bias for m in parts]), parts[0].in_features,
                  parts[0].dtype)
        with torch.no_grad():
            x = torch.randn(1, out.in_features, generator=torch.Generator().manual_seed(0)).to(out.dtype)
            if not torch.equal(out(x), torch.cat([m(x) for m in parts], -1)):
                return None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(torch.nn.Module):
    """A linear layer with per-output-channel symmetric int8 weights (`torch._weight_int8pack_mm` at decode)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.in_features, self.out_features, self.dtype = w.shape[1], w.shape[0], dtype
        self.register_buffer("q", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = torch._weight_int8pack_mm(flat, self.q, self.scale)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _fits(weights: str, n: int, k: int) -> str | None:
    """Why the kernel cannot take an (N, K) weight, or None."""
    if weights == "int4" and (n % 16 or k % GROUP):
        return f"int4 needs out_features % 16 == 0 and in_features % {GROUP} == 0, got {n}×{k}"
    return None


def check_weights(weights: str) -> None:
    """One line for a `--weights` value that is not one of WEIGHTS."""
    if weights not in WEIGHTS:
        raise EdgeKVError(f"unknown --weights '{weights}' (choose from {', '.join(WEIGHTS)})")


@torch.no_grad()  # the weights are parameters: an autograd graph would keep every float32 work copy alive
def quantize_linears(model: torch.nn.Module, weights: str, exact: dict | None = None) -> dict:
    """Replace every nn.Linear of the decoder and the LM head by its gguf/int8/int4 form (in place); a layer the
    kernel cannot take stays as it is, with one log line. `exact` supplies, by module name, int4 weights (Q4_K from
    a GGUF) for int4 and the GGUF's (type, blocks) for gguf. Returns counts: quantized, exact, kept, and the bytes
    of the linear weights before and after."""
    check_weights(weights)
    report = {"weights": weights, "quantized": 0, "exact_from_gguf": 0, "kept": [], "bytes_before": 0,
              "bytes_after": 0}
    if weights == "bf16":
        return report
    targets = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    gguf = weights in GGUF_WEIGHTS
    device = model_device(model).type
    if gguf and device != "cpu":  # the default: a GPU user gets the GGUF's numbers as dense linears, not an error
        log.warning("--weights %s computes with CPU kernels: on %s the linears stay dense (the GGUF dequantized)",
                    weights, device)
        report["kept"] = targets
        return report
    if device != "cpu":
        raise EdgeKVError(f"--weights {weights} uses CPU kernels: run it with --device cpu")
    exact = exact or {}
    if gguf:
        if not exact:
            log.warning("--weights %s: the model is not a GGUF, so there are no blocks: the linears stay dense",
                        weights)
        if not exact or kernels() is None:  # the kernels say why themselves
            report["kept"] = targets
            return report
    dtype = next(model.parameters()).dtype
    if gguf and dtype != torch.bfloat16:  # one line for the model, not one per linear
        log.info("--weights %s: the GGUF kernels take bf16 models, this one is %s: its linears stay dense", weights,
                 str(dtype).removeprefix("torch."))
        report["kept"] = targets
        return report
    for name in targets:
        linear = model.get_submodule(name)
        n, k = linear.weight.shape
        dense_bytes = linear.weight.numel() * linear.weight.element_size()
        report["bytes_before"] += dense_bytes
        found = exact.get(name)  # int4: a Q4_K tensor as Int4Weight; gguf: (type, blocks)
        why = why_not(linear, found, weights == "gguf-q8") if gguf else _fits(weights, n, k)
        if why is not None:
            log.info("%s stays %s: %s", name, "dense" if gguf else str(dtype).removeprefix("torch."), why)
            report["kept"].append(name)
            report["bytes_after"] += dense_bytes
            continue
        if gguf:
            new = GGUFLinear(found[1], found[0], k, linear.bias, linear.weight.dtype, weights == "gguf-q8")
            report["bytes_after"] += new.nbytes
        elif weights == "int4":
            new = Int4Linear(found if found is not None else int4_rtn(linear.weight), linear.bias, dtype)
            report["bytes_after"] += new.packed.numel() + new.scales_zeros.numel() * new.scales_zeros.element_size()
        else:
            new = Int8Linear(linear.weight, linear.bias, dtype)
            report["bytes_after"] += new.q.numel() + new.scale.numel() * new.scale.element_size()
        report["exact_from_gguf"] += found is not None
        model.set_submodule(name, new)
        page_out(linear.weight)  # mapped from the weights file: hand its pages back (a tied head's too)
        del linear
        trim_heap()  # the float32 work copies of this layer
        report["quantized"] += 1
    if gguf:  # the norms too: one kernel call each instead of seven aten calls (models/fused_norm.py)
        report["fused_norms"] = fuse_norms(model)
    return report


def gguf_q4k_weights(gguf_path: str) -> dict[str, Int4Weight]:
    """Every Q4_K tensor of a Llama/Qwen-layout GGUF as exact int4, keyed by the transformers module name."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        name = module_name(t.name)
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_K or name is None:
            continue
        k, n = (int(x) for x in t.shape)  # GGUF lists the row length first
        out[name] = q4k_to_int4(np.asarray(t.data), n, k)
    return out
