"""Numba kernels behind the tensor codecs (blockwise absmax quantization and 4-bit packing) and the owner's
outer momentum step (`momentum_update`).

Every loop here is a single pass over flat, contiguous numpy arrays that the caller has already sized and
validated (`codecs.py` checks every length before it calls in). Kernels are single-threaded (no
`parallel=True`) and release the GIL. They must never allocate in proportion to their input, read
outside the arrays they are given, or trust a length they did not receive from the caller.

No fast-math in the codecs: their arithmetic is strict IEEE (so an encoding does not depend on the CPU), and
the loops still vectorise because their reductions are over integers. The one exception is `sum_squares`, a
norm, whose float reduction vectorises only when LLVM may reassociate it (its docstring says why that is
safe). Non-finite detection uses the bit pattern: for a float32 `v`, `bits(v) & 0x7FFFFFFF >= 0x7F800000`
exactly when `v` is inf or NaN, and an integer max reduction vectorises where a float max with NaN does not.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np

log = logging.getLogger(__name__)

F32_ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000
INT8_MAX_SCALE = np.float32(np.nextafter(np.float32(np.finfo(np.float32).max / 127.0), np.float32(0)))
F32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)
BF16_MAX_BITS = 0x7F7F  # largest finite bfloat16, as the upper 16 bits of a float32

# NF4 levels (QLoRA, Dettmers et al. 2023, appendix E): 16 quantiles of N(0, 1) rescaled to [-1, 1],
# with an exact zero. Code k decodes to NF4_LEVELS[k] * scale.
NF4_LEVELS = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)  # fmt: skip
NF4_MIDPOINTS = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2).astype(np.float32)
NF4_ZERO_CODE = 7


@contextlib.contextmanager
def without_scipy_blas() -> Iterator[None]:
    """numba's first kernel call loads its typing registries, and one of them imports scipy.linalg (0.13-0.15 s
    of a learner's start, when scipy is installed) only to learn whether its `np.correlate` and `np.convolve`
    may call BLAS. No kernel here calls them: while the kernels load, that import fails fast (numba then uses
    its own loop for those two in this process); scipy stays importable afterwards."""
    name = "scipy.linalg.cython_blas"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]  # `import` raises ImportError for a None entry
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]


def _jit(fn: Callable[..., Any] | None = None, *, fastmath: frozenset[str] = frozenset()) -> Any:
    """`numba.njit` with an on-disk cache; without the cache when no cache directory is writable. `fastmath`:
    LLVM's fast-math flags for this kernel only (`@_jit(fastmath=...)`)."""
    if fn is None:
        return lambda f: _jit(f, fastmath=fastmath)
    flags = set(fastmath) or False
    try:
        return numba.njit(cache=True, nogil=True, fastmath=flags)(fn)
    except RuntimeError as err:  # numba: "cannot cache function ...: no locator available"
        log.warning("numba cache unavailable (%s); kernels will compile on every start", err)
        return numba.njit(cache=False, nogil=True, fastmath=flags)(fn)


@_jit
def abs_max_bits(xi: np.ndarray) -> int:
    """Largest `bits & 0x7FFFFFFF` over float32 bit patterns `xi` (int32); >= 0x7F800000 means inf/NaN."""
    m = 0
    for i in range(xi.size):
        b = xi[i] & F32_ABS_MASK
        m = max(m, b)
    return m


@_jit
def _bits_to_f32(bits: int, scratch: np.ndarray) -> np.float32:
    scratch[0] = bits
    return scratch.view(np.float32)[0]


# Loops below index per-block slices from 0: numba then knows the index is non-negative and LLVM
# vectorises them (a `range(lo, hi)` loop over the whole array does not vectorise, ~6x slower).


@_jit
def _block_abs_max_bits(xi: np.ndarray) -> int:
    m = 0
    for i in range(xi.size):
        m = max(m, xi[i] & F32_ABS_MASK)
    return m


@_jit(fastmath=frozenset({"reassoc", "contract"}))
def sum_squares(x: np.ndarray) -> float:
    """Σ x_i² of float32 `x`, accumulated in float64 (no overflow or underflow for any finite float32; inf
    or NaN in, inf or NaN out: no flag that assumes finite values). Reassociation and fused multiply-adds let
    LLVM vectorise the sum, about 4x faster than eight scalar accumulators in a fixed order: the same input
    gives the same bits on one machine, possibly not across CPUs of different vector widths, which nothing
    needs (norms feed the owner's math, which peers only recompute to a tolerance: docs/protocol.md §7, §7.19)."""
    s = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        s += v * v
    return s


@_jit
def int8_encode(x: np.ndarray, block: int, scales: np.ndarray, codes: np.ndarray) -> bool:
    """Blockwise absmax int8: scale = absmax/127 (float32), code = rint(x/scale). False if x is non-finite."""
    xi_all = x.view(np.int32)
    scratch = np.empty(1, np.int32)
    n = x.size
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        xs = x[lo:hi]
        cs = codes[lo:hi]
        m = _block_abs_max_bits(xi_all[lo:hi])
        if m >= F32_INF_BITS:
            return False
        scale = min(_bits_to_f32(m, scratch) / np.float32(127.0), INT8_MAX_SCALE)
        scales[b] = scale
        if scale == 0:
            for i in range(cs.size):
                cs[i] = 0
        elif scale >= F32_MIN_NORMAL:
            # |x| <= absmax, so |x * inv| <= 127 * (1 + 3 ulp) and rint never leaves [-127, 127].
            inv = np.float32(1.0) / scale
            for i in range(xs.size):
                cs[i] = np.int8(np.rint(xs[i] * inv))
        else:  # subnormal scale: 1/scale may overflow and absmax/scale may exceed 127
            for i in range(xs.size):
                q = np.rint(xs[i] / scale)
                q = np.float32(127.0) if q > np.float32(127.0) else q
                q = np.float32(-127.0) if q < np.float32(-127.0) else q
                cs[i] = np.int8(q)
    return True


@_jit
def int8_decode(scales: np.ndarray, codes: np.ndarray, block: int, out: np.ndarray) -> int:
    """out = code * scale per block. Returns the smallest code seen (the encoder never writes -128)."""
    n = out.size
    lowest = 0
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        cs = codes[lo:hi]
        os = out[lo:hi]
        scale = scales[b]
        for i in range(cs.size):
            c = cs[i]
            lowest = min(lowest, c)
            os[i] = np.float32(c) * scale
    return lowest


@_jit
def int4_encode(x: np.ndarray, block: int, scales: np.ndarray, packed: np.ndarray) -> bool:
    """Blockwise NF4 with a bfloat16 scale rounded up from absmax; two codes per byte, low nibble first.

    `block` is even, so every block starts on a byte boundary. False if x is non-finite.
    """
    xi_all = x.view(np.int32)
    scratch = np.empty(1, np.int32)
    codes = np.empty(block + 1, np.uint8)
    t = NF4_MIDPOINTS
    n = x.size
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        xs = x[lo:hi]
        ps = packed[lo >> 1 : (hi + 1) >> 1]
        m = _block_abs_max_bits(xi_all[lo:hi])
        if m >= F32_INF_BITS:
            return False
        s16 = m >> 16
        if m & 0xFFFF:
            s16 += 1  # round the scale up so that |x| / scale <= 1
        s16 = min(s16, BF16_MAX_BITS)
        scales[b] = s16
        if s16 == 0:
            for j in range(ps.size):
                ps[j] = NF4_ZERO_CODE | (NF4_ZERO_CODE << 4)
            if xs.size & 1:
                ps[ps.size - 1] = NF4_ZERO_CODE
            continue
        scale = _bits_to_f32(s16 << 16, scratch)
        # code = number of midpoints below x: nearest NF4 level, compared in x's units (no division).
        t0, t1, t2, t3, t4 = t[0] * scale, t[1] * scale, t[2] * scale, t[3] * scale, t[4] * scale
        t5, t6, t7, t8, t9 = t[5] * scale, t[6] * scale, t[7] * scale, t[8] * scale, t[9] * scale
        t10, t11, t12, t13, t14 = t[10] * scale, t[11] * scale, t[12] * scale, t[13] * scale, t[14] * scale
        for i in range(xs.size):
            v = xs[i]
            # fmt: off
            codes[i] = (
                (v > t0) + (v > t1) + (v > t2) + (v > t3) + (v > t4) + (v > t5) + (v > t6) + (v > t7)
                + (v > t8) + (v > t9) + (v > t10) + (v > t11) + (v > t12) + (v > t13) + (v > t14)
            )
            # fmt: on
        codes[xs.size] = 0  # the high nibble of an odd tail (last block only) stays zero
        for j in range(ps.size):
            ps[j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return True


@_jit
def int4_decode(scales: np.ndarray, packed: np.ndarray, block: int, out: np.ndarray) -> None:
    """out[i] = NF4_LEVELS[code_i] * scale of its block; scales are bfloat16 bit patterns (uint16)."""
    scratch = np.empty(1, np.int32)
    table = np.empty(16, np.float32)
    n = out.size
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        os = out[lo:hi]
        ps = packed[lo >> 1 : (hi + 1) >> 1]
        scale = _bits_to_f32(np.int32(scales[b]) << 16, scratch)
        for k in range(16):
            table[k] = NF4_LEVELS[k] * scale
        for j in range(os.size >> 1):
            byte = ps[j]
            os[2 * j] = table[byte & 15]
            os[2 * j + 1] = table[byte >> 4]
        if os.size & 1:
            os[os.size - 1] = table[ps[ps.size - 1] & 15]


@_jit
def bf16_decode(src: np.ndarray, out_bits: np.ndarray) -> int:
    """Widen bfloat16 bit patterns (uint16) to float32 bits (uint32). Returns max `bits & 0x7FFF`."""
    m = np.uint32(0)
    for i in range(src.size):
        s = np.uint32(src[i])
        m = max(m, s & np.uint32(0x7FFF))
        out_bits[i] = s << np.uint32(16)
    return m


@_jit
def f32_copy(src: np.ndarray, out: np.ndarray) -> int:
    """Copy float32 bit patterns (uint32) and return the max `bits & 0x7FFFFFFF` (finite check)."""
    m = np.uint32(0)
    for i in range(src.size):
        s = src[i]
        m = max(m, s & np.uint32(0x7FFFFFFF))
        out[i] = s
    return m


@_jit
def momentum_update(momentum: np.ndarray, delta: np.ndarray, out: np.ndarray, mu: np.float32, neg_lr: np.float32,
                    nesterov: bool) -> None:
    """The outer SGD step in one pass (coordinator/outer.py `update_into`): b = μ·m + Δ into `out`, then
    Δ := −lr·(Δ + μ·b) with Nesterov, Δ := −lr·b without. Each product and sum is rounded on its own (strict
    IEEE, no fused multiply-add), so the result does not depend on the CPU; torch's four passes over the
    fragment took 2–3× as long. float32 arrays of one length; `out` may be `momentum` (an in-place step),
    `delta` may overlap neither."""
    for i in range(delta.size):
        d = delta[i]
        b = mu * momentum[i] + d
        out[i] = b
        delta[i] = neg_lr * (d + mu * b) if nesterov else neg_lr * b


F16_TO_F32_MAGIC = np.float32(2.0**112)  # rebias exponent 15 -> 127; also turns half subnormals exact
DECODE_CHUNK = 2048


@_jit
def f16_decode(src: np.ndarray, out_bits: np.ndarray, out: np.ndarray) -> int:
    """Widen float16 bit patterns (uint16) into `out` (float32, with `out_bits` its uint32 view).

    Exact for finite values (shift into a float32, multiply by 2**112, restore the sign). Returns the
    max `bits & 0x7FFF`; >= 0x7C00 means the payload held inf/NaN (the output is then meaningless).
    """
    m = np.uint32(0)
    n = src.size
    for lo in range(0, n, DECODE_CHUNK):
        hi = min(lo + DECODE_CHUNK, n)
        s = src[lo:hi]
        ob = out_bits[lo:hi]
        of = out[lo:hi]
        for i in range(s.size):
            h = np.uint32(s[i]) & np.uint32(0x7FFF)
            m = max(m, h)
            ob[i] = h << np.uint32(13)
        for i in range(of.size):
            of[i] *= F16_TO_F32_MAGIC
        for i in range(s.size):
            ob[i] |= (np.uint32(s[i]) & np.uint32(0x8000)) << np.uint32(16)
    return m
