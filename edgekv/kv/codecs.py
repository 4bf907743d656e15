"""KV quantization codecs (DESIGN.md §3): symmetric int8 / packed int4, per channel (keys) or per token (values).

A codec turns a float tensor into named plain tensors (safetensors-ready) plus JSON-ready parameters, and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv import EdgeKVError

SCHEMES = ("fp32", "fp16", "bf16", "int8", "int4")
QMAX = {"int8": 127, "int4": 7}
PASSTHROUGH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # fp32: lossless


@dataclass
class Quantized:
    """Encoded tensor: `data` (and `scale` for integer schemes) plus what decoding needs."""

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
    scale = _scale(xf, axis, QMAX[scheme])
    q = torch.round(xf / scale.to(torch.float32)).clamp_(-QMAX[scheme], QMAX[scheme])
    data = q.to(torch.int8) if scheme == "int8" else _pack_int4(q.to(torch.int16))
    return Quantized(scheme, data.contiguous(), scale.contiguous(), shape, axis)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode back to floats of `dtype`."""
    if q.scheme in PASSTHROUGH:
        return q.data.to(dtype)
    values = q.data.to(torch.float32) if q.scheme == "int8" else _unpack_int4(q.data, q.shape[-1]).to(torch.float32)
    if tuple(values.shape) != q.shape:
        raise EdgeKVError(f"quantized data has shape {tuple(values.shape)}, expected {q.shape}")
    return (values * q.scale.to(torch.float32)).to(dtype)
