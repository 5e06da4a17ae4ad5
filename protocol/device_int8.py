"""The int8 codec on the tensor's own device, with torch operations: a GPU learner encodes its pseudo-gradient
where it lives and only the compressed bytes (a quarter of fp32) cross PCIe; an update is decoded there too.

Byte for byte the same as the CPU kernels (`_kernels.int8_encode` / `int8_decode`, docs/protocol.md's int8
rule): per block, scale = min(absmax / 127, float32_max / 127 rounded down) in float32; a scale of at least the
smallest normal float32 codes x as rint(x · (1 / scale)), a subnormal one as rint(x / scale) clamped to ±127,
a zero one as 0; decode is code · scale. Every step is one IEEE float32 operation, rounded to nearest even, in
the same order, so any device that computes IEEE float32 gives the CPU's bytes. One trap: on CUDA, dividing a
tensor by a Python number multiplies by its reciprocal (not the same float), so every division here divides
by a tensor (seen on an H200: absmax / 127.0 gave other scales than the CPU's).

Written for memory traffic, the bound on a GPU: the whole blocks are encoded as a view of `x` (no padded copy;
the short last block apart), absmax is one min-max pass, and codes and scales are written straight into the
payload. On CUDA, where Triton is (PyTorch's CUDA builds bring it), encoding is one kernel instead
(protocol/_int8_triton.py: x read once); measured on an H200 (benchmarks/gpu.py), the operations one by one
spend most of their time launching kernels. Decode reads the codes once and writes `out` once.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

import torch

from ._kernels import F32_MIN_NORMAL, INT8_MAX_SCALE
from .errors import Malformed

log = logging.getLogger(__name__)


def _rows(x: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Flat `x` as its whole blocks (rows of `block`) and its short last block (one row), each a view."""
    full = x.numel() // block * block
    parts = [x[:full].view(-1, block)] if full else []
    return parts + ([x[full:].view(1, -1)] if full < x.numel() else [])


_triton: ModuleType | None = None  # protocol/_int8_triton.py, once imported and launched without error
_triton_tried = False
_triton_lock = threading.Lock()


def _encode_triton(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """The payload from the one-kernel encoder, or None where it cannot run (then the torch operations do)."""
    global _triton, _triton_tried
    if x.device.type != "cuda" or block & (block - 1):
        return None
    with _triton_lock:
        if not _triton_tried:
            _triton_tried = True
            try:
                from . import _int8_triton

                _int8_triton.encode(torch.zeros(block + 1, device=x.device), block)  # (compiles it, once)
                _triton = _int8_triton
            except Exception as e:  # no Triton, no C compiler for its launcher, ...
                log.warning("int8 on CUDA: the Triton encoder cannot run (%s: %s); using torch operations",
                            type(e).__name__, (str(e).splitlines() or [""])[0])
    if _triton is None:
        return None
    payload, flag = _triton.encode(x, block)
    if int(flag.item()):
        raise Malformed("tensor contains non-finite values")
    return payload


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    lo, hi = torch.aminmax(rows, dim=1)  # (NaN propagates; one pass, nothing written)
    return torch.maximum(hi, lo.neg()).abs()  # (abs: an all -0.0 block gives +0.0, as on the CPU)


def encode(x: torch.Tensor, block: int) -> torch.Tensor:
    """The int8 payload of flat float32 `x` (scales, then codes) as a uint8 tensor on x's device."""
    fast = _encode_triton(x, block)
    if fast is not None:
        return fast
    n, nblocks = x.numel(), -(-x.numel() // block)
    parts = _rows(x, block)
    payload = torch.empty(4 * nblocks + n, dtype=torch.uint8, device=x.device)
    if not parts:
        return payload
    absmax = torch.cat([_absmax(r) for r in parts])
    divisor = torch.full_like(absmax, 127.0)
    scale = torch.clamp_max(absmax / divisor, float(INT8_MAX_SCALE))
    # (a zero block has only zeros: any finite inverse gives code 0)
    inv = torch.ones_like(scale).div_(torch.where(scale > 0, scale, torch.ones_like(scale)))
    sub = (scale > 0) & (scale < float(F32_MIN_NORMAL))  # 1 / scale may overflow: divide instead
    bad, any_sub = torch.stack([~torch.isfinite(absmax).all(), sub.any()]).tolist()  # (one wait)
    if bad:
        raise Malformed("tensor contains non-finite values")
    payload[: 4 * nblocks].view(torch.float32).copy_(scale)
    codes, row0, at = payload[4 * nblocks:].view(torch.int8), 0, 0
    for rows in parts:
        k = rows.shape[0]
        q = torch.round(rows * inv[row0:row0 + k, None]).to(torch.int8)  # (whole numbers: the cast is exact)
        if any_sub:
            s = sub[row0:row0 + k]
            q[s] = torch.round(rows[s] / scale[row0:row0 + k][s, None]).clamp_(-127.0, 127.0).to(torch.int8)
        codes[at:at + rows.numel()].view(k, -1).copy_(q)
        row0, at = row0 + k, at + rows.numel()
    return payload


def decode(payload: torch.Tensor, numel: int, block: int, out: torch.Tensor) -> None:
    """Decode the int8 payload (uint8, already on `out`'s device, its scales checked) into flat `out`."""
    nblocks = -(-numel // block)
    scales = payload[: 4 * nblocks].view(torch.float32)
    codes = payload[4 * nblocks:4 * nblocks + numel].view(torch.int8)
    if numel and int(codes.min()) < -127:
        raise Malformed("int8 code -128 is not allowed (codes are in [-127, 127])")
    row0 = 0
    for c, o in zip(_rows(codes, block), _rows(out, block), strict=True):
        torch.mul(c, scales[row0:row0 + c.shape[0], None], out=o)  # (int8 · float32 in float32, exact)
        row0 += c.shape[0]
