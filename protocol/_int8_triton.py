"""The int8 encoder as one Triton kernel, for CUDA tensors: each program reads one block of x once and writes
its scale and codes into the payload, so encoding costs what reading x costs (docs/protocol.md's int8 rule,
byte for byte the CPU kernels' result).

Exactness: every division is `div_rn` (IEEE, round to nearest; Triton's `/` on float32 is an approximation);
the kernel is launched with `enable_fp_fusion=False`, so x · inv is rounded before anything is added to it
(an FMA would not round it, and would give other codes at ties); rint is `(v + 1.5·2²³) − 1.5·2²³`, which
rounds half to even for |v| < 2²², as `np.rint` does (a larger |v| stays beyond ±127 and is clamped). A
subnormal scale's block divides instead of multiplying (branch-free: both are computed, one is kept) and clamps
to ±127. A non-finite element sets `flag`; the caller refuses the tensor.

Imported only where Triton is (it ships with PyTorch's CUDA builds on Linux); `TRITON_INTERPRET=1` runs the
same kernel on CPU tensors, which is how the test suite checks it on a machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kernels import F32_MIN_NORMAL, INT8_MAX_SCALE


@triton.jit
def _rint(v):
    return (v + 12582912.0) - 12582912.0  # 1.5 · 2^23: the sum's last bit is the units digit


@triton.jit
def _encode_blocks(x_ptr, scales_ptr, codes_ptr, flag_ptr, n, BLOCK: tl.constexpr, MAX_SCALE: tl.constexpr,
                   MIN_NORMAL: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    ax = tl.abs(x)
    finite = ax < float("inf")  # (false for NaN too)
    bad = tl.max(tl.where(mask & ~finite, 1, 0), axis=0)
    absmax = tl.max(tl.where(finite, ax, 0.0), axis=0)
    scale = tl.minimum(tl.math.div_rn(absmax, 127.0), MAX_SCALE)
    safe = tl.where(scale > 0, scale, 1.0)  # (a zero block has only zeros: any finite inverse gives code 0)
    inv = tl.math.div_rn(1.0, safe)
    q = _rint(x * inv)
    q_sub = tl.minimum(tl.maximum(_rint(tl.math.div_rn(x, safe)), -127.0), 127.0)
    q = tl.where((scale > 0) & (scale < MIN_NORMAL), q_sub, q)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + b, scale)
    tl.atomic_max(flag_ptr, bad, mask=bad > 0)


def encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, flag) of flat float32 `x`: the payload (scales, then codes) as uint8 on x's device, and a
    one-element int32 tensor there, non-zero if x held a non-finite value. `block` is a power of two."""
    n, nblocks = x.numel(), -(-x.numel() // block)
    payload = torch.empty(4 * nblocks + n, dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        _encode_blocks[(nblocks,)](x, payload[: 4 * nblocks].view(torch.float32),
                                   payload[4 * nblocks:].view(torch.int8), flag, n, BLOCK=block,
                                   MAX_SCALE=float(INT8_MAX_SCALE), MIN_NORMAL=float(F32_MIN_NORMAL),
                                   enable_fp_fusion=False)
    return payload, flag
