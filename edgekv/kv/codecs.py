"""KV quantization codecs (DESIGN.md §3): symmetric int8 / packed int4, or asymmetric packed int2, per channel
(keys) or per token (values).

A codec turns a float tensor into named plain tensors (safetensors-ready) plus JSON-ready parameters, and back.
int2 has four levels, too few for a symmetric grid around 0 to spend well: each row gets its own low end and step
(KIVI's asymmetric 2-bit, Liu et al. 2024), and its range is clipped where that lowers the row's squared error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv import EdgeKVError

SCHEMES = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
QMAX = {"int8": 127, "int4": 7}
PASSTHROUGH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # fp32: lossless


@dataclass
class Quantized:
    """Encoded tensor: `data` (and `scale` for integer schemes: int2's holds (step, low) in its last dim) plus
    what decoding needs."""

    scheme: str
    data: torch.Tensor
    scale: torch.Tensor | None
    shape: tuple[int, ...]
    axis: str  # "channel": one scale per last-dim channel; "token": one scale per row

    @property
    def nbytes(self) -> int:
        """Bytes that go on disk / on the wire."""
        return self.data.numel() * self.data.element_size() + (
            0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def params(self) -> dict:
        """JSON-ready description (for the manifest)."""
        return {"scheme": self.scheme, "shape": list(self.shape), "axis": self.axis}


def _scale(x: torch.Tensor, axis: str, qmax: int) -> torch.Tensor:
    """fp16 scales max|x|/qmax, rounded up so that |x/scale| ≤ qmax always holds after rounding."""
    dim = -2 if axis == "channel" else -1  # channel: over tokens (rows); token: over channels
    amax = x.abs().amax(dim=dim, keepdim=True).to(torch.float32)
    exact = (amax / qmax).clamp_min(torch.finfo(torch.float16).tiny)
    scale = exact.to(torch.float16)
    low = scale.to(torch.float32) < exact
    return torch.where(low, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed values in [-7, 7] → uint8, two per byte along the last dim (low nibble first; odd dims padded)."""
    u = (q + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.nn.functional.pad(u, (0, 1), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_int4(packed: torch.Tensor, last: int) -> torch.Tensor:
    low, high = (packed & 0x0F).to(torch.int16), (packed >> 4).to(torch.int16)
    both = torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)[..., :last]
    return both - 8


def check_scheme(scheme: str) -> None:
    """One-line error for a --quant that names no codec (before any model loads)."""
    if scheme not in SCHEMES:
        raise EdgeKVError(f"unknown --quant '{scheme}' (choose from {', '.join(SCHEMES)})")


CLIPS = torch.linspace(1.0, 0.3, 15)  # int2: the share of a row's half-range kept, searched per row


def _pack_int2(q: torch.Tensor) -> torch.Tensor:
    """Values in [0, 3] → uint8, four per byte along the last dim (lowest bits first; padded to a multiple of 4)."""
    u = q.to(torch.uint8)
    if u.shape[-1] % 4:
        u = torch.nn.functional.pad(u, (0, 4 - u.shape[-1] % 4))
    return u[..., 0::4] | (u[..., 1::4] << 2) | (u[..., 2::4] << 4) | (u[..., 3::4] << 6)


def _unpack_int2(packed: torch.Tensor, last: int) -> torch.Tensor:
    parts = [(packed >> s) & 0x03 for s in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)[..., :last].to(torch.int16)


def _int2(x: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in [0, 3], fp16 (step, low) per row): per row, the clip of its [min, max] (around the middle) whose
    four levels low + q·step reconstruct the row with the least squared error."""
    dim = -2 if axis == "channel" else -1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    mid, half = (lo + hi) / 2, ((hi - lo) / 2).clamp_min(torch.finfo(torch.float16).tiny)
    best_err, best = None, None
    for c in CLIPS.tolist():
        step = (2 * half * c / 3).to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)
        low = (mid - half * c).to(torch.float16)
        s32, l32 = step.to(torch.float32), low.to(torch.float32)
        q = torch.round((x - l32) / s32).clamp_(0, 3)
        err = ((l32 + q * s32 - x) ** 2).sum(dim=dim, keepdim=True)
        if best is None:
            best_err, best = err, (q, step, low)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = tuple(torch.where(better, new, old) for new, old in zip((q, step, low), best))
    q, step, low = best
    return q, torch.stack([step, low], dim=-1)


def quantize(x: torch.Tensor, scheme: str, axis: str) -> Quantized:
    """Encode `x` (…, tokens, channels) with `scheme`; `axis` is "channel" (keys) or "token" (values)."""
    if scheme not in SCHEMES:
        raise EdgeKVError(f"unknown quantization '{scheme}' (choose from {', '.join(SCHEMES)})")
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    shape = tuple(x.shape)
    if scheme in PASSTHROUGH:
        return Quantized(scheme, x.to(PASSTHROUGH[scheme]).contiguous(), None, shape, axis)
    xf = x.to(torch.float32)
    if scheme == "int2":
        q, scale = _int2(xf, axis)
        return Quantized(scheme, _pack_int2(q).contiguous(), scale.contiguous(), shape, axis)
    scale = _scale(xf, axis, QMAX[scheme])
    q = torch.round(xf / scale.to(torch.float32)).clamp_(-QMAX[scheme], QMAX[scheme])
    data = q.to(torch.int8) if scheme == "int8" else _pack_int4(q.to(torch.int16))
    return Quantized(scheme, data.contiguous(), scale.contiguous(), shape, axis)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode back to floats of `dtype`."""
    if q.scheme in PASSTHROUGH:
        return q.data.to(dtype)
    if q.scheme == "int8":
        values = q.data.to(torch.float32)
    else:
        values = (_unpack_int4 if q.scheme == "int4" else _unpack_int2)(q.data, q.shape[-1]).to(torch.float32)
    if tuple(values.shape) != q.shape:
        raise EdgeKVError(f"quantized data has shape {tuple(values.shape)}, expected {q.shape}")
    if q.scheme == "int2":
        if q.scale is None or q.scale.shape[-1] != 2:
            raise EdgeKVError(f"int2 data needs a (step, low) pair per row, got scales of shape "
                              f"{None if q.scale is None else tuple(q.scale.shape)}")
        step, low = q.scale[..., 0].to(torch.float32), q.scale[..., 1].to(torch.float32)
        return (low + values * step).to(dtype)
    return (values * q.scale.to(torch.float32)).to(dtype)
