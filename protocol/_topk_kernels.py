"""Numba kernels of the `topk` codec's sparse form (docs/protocol.md §6, `topk`): chunked top-k selection,
a per-chunk codebook of magnitudes, and the bit-packed entries (each index as the Rice-coded gap since the one
before it: about log2(chunk / k) + 2 bits instead of log2(chunk)).

The same contract as `_kernels.py`: single-threaded, GIL released, flat arrays the caller sized and checked,
no allocation beyond scratch bounded by one chunk (at most 2^16 elements), strict IEEE arithmetic. The decoder
only copies codebook values into place (no arithmetic on them), so every receiver decodes the same bits.

Selection is a radix select on the float32 magnitude bits (`bits & 0x7FFFFFFF`, whose integer order is the
order of |x|): a histogram of the 8 exponent bits over the chunk, then histograms of the next 8, 8 and 7 bits
over the few candidates left in the bin the k-th largest falls in. Ties go to the lowest index, so the
encoding of a tensor does not depend on the machine either.
"""

from __future__ import annotations

import numpy as np

from diloco.protocol._kernels import BF16_MAX_BITS, F32_ABS_MASK, _bits_to_f32, _jit

# (shift, width) of the radix levels after the exponent: bits 22..15, 14..7, 6..0 of the magnitude
_LEVELS = ((15, 8), (7, 8), (0, 7))


@_jit
def _f32_to_bf16_bits(v: np.float32, scratch: np.ndarray) -> int:
    """Round a finite, non-negative float32 to the nearest-even bfloat16 (bits), at most the largest finite."""
    scratch.view(np.float32)[0] = v
    b = scratch[0]
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return min(r, BF16_MAX_BITS)


@_jit
def _select(a: np.ndarray, kk: int, hist: np.ndarray, cand: np.ndarray, sel: np.ndarray, guess: int) -> int:
    """Indices of the `kk` largest magnitudes of `a` (float32 bits, int32) into `sel`, in increasing index
    order (ties: lowest index first). Returns the exponent bin the kk-th largest fell in, the `guess` of the
    next chunk (whose candidates are then gathered in the first pass, saving one when the bin stays the same),
    or -1, selecting nothing, if `a` holds inf or NaN (exponent bits 255)."""
    n = a.size
    for i in range(256):
        hist[i] = 0
    nc = 0
    for i in range(n):
        e = (a[i] & F32_ABS_MASK) >> 23
        hist[e] += 1
        if e >= guess:
            cand[nc] = i
            nc += 1
    if hist[255]:
        return -1
    above = 0
    prefix = 255
    while True:  # the exponent bin the kk-th largest falls in (n >= kk, so it exists)
        prefix -= 1
        if above + hist[prefix] >= kk:
            break
        above += hist[prefix]
    found = prefix
    if prefix < guess:  # candidates: that bin and above, in index order
        nc = 0
        for i in range(n):
            if (a[i] & F32_ABS_MASK) >> 23 >= prefix:
                cand[nc] = i
                nc += 1
    need = kk - above  # how many of the bin's elements are taken
    count = hist[prefix]  # elements in the bin
    shift = 23
    for level in range(3):
        if count == need:  # the whole bin is taken: every magnitude >= prefix << shift, no ties to break
            break
        shift, width = _LEVELS[level]
        top = shift + width
        for i in range(1 << width):
            hist[i] = 0
        for t in range(nc):
            b = a[cand[t]] & F32_ABS_MASK
            if (b >> top) == prefix:
                hist[(b >> shift) & ((1 << width) - 1)] += 1
        below = 1 << width
        cum = 0
        while True:
            below -= 1
            if cum + hist[below] >= need:
                break
            cum += hist[below]
        need -= cum
        count = hist[below]
        prefix = (prefix << width) | below
    # the kk-th largest magnitude is in [T, T + 2^shift); all of it is taken unless shift is 0, where `need`
    # of the elements equal to T are (the first ones)
    low = prefix << shift
    ties = count != need
    s = 0
    for t in range(nc):
        i = cand[t]
        b = a[i] & F32_ABS_MASK
        if b > low or (b == low and (need > 0 or not ties)):
            if b == low and ties:
                need -= 1
            sel[s] = i
            s += 1
    return found


@_jit
def topk_encode(x: np.ndarray, chunk_log2: int, k: int, bits: int, books: np.ndarray, stream: np.ndarray) -> int:
    """Sparse form of `x` (float32): per chunk of 2^chunk_log2 elements, its min(k, n) largest magnitudes, each as
    an entry: the gap since the entry before it, Rice-coded (`rice_param`), then its code of `bits` bits
    (code = level | sign << (bits - 1)); and 2^(bits-1) codebook magnitudes (bfloat16 bits): the means of the
    chosen magnitudes in equal-width groups between the smallest and the largest; each value takes the nearest
    one (the lower on a tie). Returns the stream bytes written, or -1 if `x` holds inf or NaN."""
    n_all = x.size
    chunk = 1 << chunk_log2
    levels = 1 << (bits - 1)
    xi = x.view(np.int32)
    hist = np.empty(256, np.int32)
    cand = np.empty(chunk, np.int32)
    sel = np.empty(min(k, chunk), np.int32)
    mags = np.empty(min(k, chunk), np.float32)
    groups = np.empty(min(k, chunk), np.int64)
    table = np.empty(levels, np.float32)
    sums = np.empty(levels, np.float64)
    counts = np.empty(levels, np.int64)
    scratch = np.empty(1, np.int32)
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    nchunks = (n_all + chunk - 1) >> chunk_log2
    guess = 255
    for j in range(nchunks):
        lo = j << chunk_log2
        a = xi[lo : min(lo + chunk, n_all)]
        kk = min(k, a.size)
        guess = _select(a, kk, hist, cand, sel, guess)
        if guess < 0:
            return -1
        lo_mag, hi_mag = np.float32(np.inf), np.float32(0.0)
        for t in range(kk):
            mags[t] = abs(x[lo + sel[t]])
            lo_mag, hi_mag = min(lo_mag, mags[t]), max(hi_mag, mags[t])
        step = (hi_mag - lo_mag) / np.float32(levels)
        for g in range(levels):
            sums[g], counts[g] = 0.0, 0
        for t in range(kk):  # the group of equal width over [lo_mag, hi_mag] each magnitude falls in
            g = min(int((mags[t] - lo_mag) / step), levels - 1) if step > 0 else 0
            groups[t] = g
            sums[g] += np.float64(mags[t])
            counts[g] += 1
        for g in range(levels):  # its mean (an empty group: its middle)
            mean = np.float32(sums[g] / counts[g]) if counts[g] else lo_mag + step * (np.float32(g) + np.float32(0.5))
            books[j * levels + g] = _f32_to_bf16_bits(mean, scratch)
            table[g] = _bits_to_f32(np.int32(books[j * levels + g]) << 16, scratch)
        r = rice_param(a.size, kk)
        prev = -1
        for t in range(kk):
            i = sel[t]
            v = x[lo + i]
            mag = abs(v)
            # the nearest magnitude is that of its group or of a group next to it (the means are in order)
            best = max(groups[t] - 1, 0)
            for g in range(best + 1, min(groups[t] + 2, levels)):
                if abs(mag - table[g]) < abs(mag - table[best]):
                    best = g
            code = best | ((1 << (bits - 1)) if v < 0 else 0)
            gap = i - prev - 1
            prev = i
            q = gap >> r
            while q > 0:  # the quotient in unary: q one bits (then the zero below)
                w = min(q, 32)
                acc, nacc, pos = _put(acc, nacc, pos, stream, (1 << w) - 1, w)
                q -= w
            rest = ((gap & ((1 << r) - 1)) | (code << r)) << 1  # the zero, the r low bits of the gap, the code
            acc, nacc, pos = _put(acc, nacc, pos, stream, rest, 1 + r + bits)
    if nacc > 0:
        stream[pos] = np.uint8(acc & np.uint64(0xFF))
        pos += 1
    return pos


@_jit
def rice_param(n: int, entries: int) -> int:
    """The Rice parameter r of a chunk of `n` elements holding `entries` entries: floor(log2(n / entries)), so
    that the mean gap's quotient is about one."""
    r = 0
    while (entries << (r + 1)) <= n:
        r += 1
    return r


@_jit
def _put(acc: np.uint64, nacc: int, pos: int, stream: np.ndarray, value: int, width: int):
    """Append the `width` (<= 32) low bits of `value` to the LSB-first stream; whole bytes go out."""
    acc |= np.uint64(value) << np.uint64(nacc)
    nacc += width
    while nacc >= 8:
        stream[pos] = np.uint8(acc & np.uint64(0xFF))
        acc >>= np.uint64(8)
        nacc -= 8
        pos += 1
    return acc, nacc, pos


@_jit
def topk_decode(books: np.ndarray, stream: np.ndarray, n_all: int, chunk_log2: int, k: int, bits: int,
                out: np.ndarray, write: bool) -> int:
    """Read the entries of a sparse form (checked: `books` below 0x7F80, `stream` at most its largest size); with
    `write`, `out` (float32, n_all) := 0 except entry values ±codebook[level]. Returns 0, or 1 for an entry
    whose gap takes it past the end of its chunk, 2 for a non-zero padding bit or a byte after the last entry's,
    3 for a stream that ends inside an entry. Never reads past `stream`."""
    chunk = 1 << chunk_log2
    levels = 1 << (bits - 1)
    sign_bit = 1 << (bits - 1)
    size = stream.size
    table = np.empty(levels, np.float32)
    scratch = np.empty(1, np.int32)
    if write:
        for i in range(n_all):
            out[i] = 0.0
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    nchunks = (n_all + chunk - 1) >> chunk_log2
    for j in range(nchunks):
        lo = j << chunk_log2
        n = min(chunk, n_all - lo)
        kk = min(k, n)
        r = rice_param(n, kk)
        need = r + bits
        low_mask = np.uint64((1 << r) - 1)
        for g in range(levels):
            table[g] = _bits_to_f32(np.int32(books[j * levels + g]) << 16, scratch)
        prev = -1
        for _ in range(kk):
            q = 0
            while True:  # the quotient: one bits up to a zero
                if nacc == 0:
                    if pos >= size:
                        return 3
                    acc = np.uint64(stream[pos])
                    nacc = 8
                    pos += 1
                bit = acc & np.uint64(1)
                acc >>= np.uint64(1)
                nacc -= 1
                if bit == 0:
                    break
                q += 1
                if prev + 1 + (q << r) >= n:
                    return 1
            while nacc < need:
                if pos >= size:
                    return 3
                acc |= np.uint64(stream[pos]) << np.uint64(nacc)
                nacc += 8
                pos += 1
            i = prev + 1 + (q << r) + np.int64(acc & low_mask)
            code = np.int64((acc >> np.uint64(r)) & np.uint64((1 << bits) - 1))
            acc >>= np.uint64(need)
            nacc -= need
            if i >= n:
                return 1
            prev = i
            v = table[code & (levels - 1)]
            if write:
                out[lo + i] = -v if code & sign_bit else v
    return 2 if acc != 0 or pos != size else 0
