"""The int8 codec on the tensor's own device, with torch operations: a GPU learner encodes its pseudo-gradient
where it lives and only the compressed bytes (a quarter of fp32) cross PCIe; an update is decoded there too.

Byte for byte the same as the CPU kernels (`_kernels.int8_encode` / `int8_decode`, docs/protocol.md's int8
rule): per block, scale = min(absmax / 127, float32_max / 127 rounded down) in float32; a scale of at least the
smallest normal float32 codes x as rint(x · (1 / scale)), a subnormal one as rint(x / scale) clamped to ±127,
a zero one as 0; decode is code · scale. Every step is one IEEE float32 operation, rounded to nearest even, in
the same order, so any device that computes IEEE float32 gives the CPU's bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kernels import F32_MIN_NORMAL, INT8_MAX_SCALE
from .errors import Malformed


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` (flat) as rows of `block` elements, the last row padded with zeros."""
    pad = -x.numel() % block
    return (F.pad(x, (0, pad)) if pad else x).view(-1, block)


def encode(x: torch.Tensor, block: int) -> torch.Tensor:
    """The int8 payload of flat float32 `x` (scales, then codes) as a uint8 tensor on x's device."""
    n = x.numel()
    if not bool(torch.isfinite(x).all()):
        raise Malformed("tensor contains non-finite values")
    rows = _blocks(x, block)
    scale = torch.clamp_max(rows.abs().amax(dim=1) / 127.0, float(INT8_MAX_SCALE))
    # (a zero block has only zeros: any finite inverse gives code 0)
    inv = torch.ones_like(scale).div_(torch.where(scale > 0, scale, torch.ones_like(scale)))
    q = torch.round(rows * inv[:, None])
    sub = (scale > 0) & (scale < float(F32_MIN_NORMAL))  # 1 / scale may overflow: divide instead
    if bool(sub.any()):
        q[sub] = torch.round(rows[sub] / scale[sub, None]).clamp_(-127.0, 127.0)
    codes = q.to(torch.int8).view(-1)[:n]
    return torch.cat([scale.view(torch.uint8), codes.view(torch.uint8)])


def decode(payload: torch.Tensor, numel: int, block: int, out: torch.Tensor) -> None:
    """Decode the int8 payload (uint8, already on `out`'s device, its scales checked) into flat `out`."""
    nblocks = -(-numel // block)
    scales = payload[: 4 * nblocks].view(torch.float32)
    codes = payload[4 * nblocks:4 * nblocks + numel].view(torch.int8)
    if numel and int(codes.min()) < -127:
        raise Malformed("int8 code -128 is not allowed (codes are in [-127, 127])")
    values = _blocks(codes.to(torch.float32), block) * scales[:, None]
    out.copy_(values.view(-1)[:numel])
