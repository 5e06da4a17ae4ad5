"""The `topk` codec: chunked top-k pseudo-gradients with low-bit values, for links of a few Mbit/s
(docs/protocol.md §6 `topk`; the design after SparseLoCo, arXiv 2508.15706, and DeMo, arXiv 2411.19870).

A sparse form drops most of a tensor, so it is only right where the sender carries what it dropped into its
next message: a learner's delta (the dropped part stays in θ[p], or in its error-feedback residual) and an
owner's update (its residual, always on). `encode_delta` is that form. Everything else a codec encodes
(an outer momentum to a replica, a checkpoint) has nobody to carry a loss: `encode` gives the dense form,
exactly int8's layout under this codec's name. `decode` reads both; a meta holds `block` (dense) or
`chunk`, `k` and `bits` (sparse), never both. Both forms are checked whole by `check` before anything is
allocated or decoded, and decode to finite values only.
"""

from __future__ import annotations

import functools
import re
from typing import Any, ClassVar

import numpy as np
import torch

from diloco.protocol import _topk_kernels as TK
from diloco.protocol.codecs import (
    DEFAULT_MAX_ELEMENTS,
    Codec,
    Int8Codec,
    Payload,
    _array,
    check_meta,
    flat_float32,
    output_tensor,
    owned_bytes,
    payload_view_within,
    register_codec,
    register_family,
)
from diloco.protocol.errors import Malformed

MAX_CHUNK_LOG2 = 16  # entries hold an index of chunk_log2 bits
MAX_BITS = 8  # value bits: a sign and up to 7 bits of level (128 codebook magnitudes per chunk)
_SPARSE_KEYS = ("chunk", "k", "bits")


class _DenseForm(Int8Codec):
    """The dense form of a `topk` codec: int8's layout and checks, under that codec's name (not registered)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def rice_param(n: int, entries: int) -> int:
    """floor(log2(n / entries)): the Rice parameter of a chunk of `n` elements holding `entries` entries (the
    kernels compute the same)."""
    return (n // entries).bit_length() - 1


def _entry_bits_max(n: int, entries: int, bits: int) -> int:
    """The most bits one chunk's entries can take: per entry a zero, r gap bits and the code, plus the
    quotients' one bits, whose sum is at most (n - entries) >> r (the gaps add up to at most n - entries)."""
    r = rice_param(n, entries)
    return entries * (1 + r + bits) + ((n - entries) >> r)


def sparse_size(numel: int, chunk: int, k: int, bits: int) -> int:
    """The largest payload of the sparse form: 2^(bits-1) bfloat16 magnitudes per chunk, then each chunk's
    min(k, n) entries (a Rice-coded index gap and a code each), bit-packed, padded to a byte. An encoding is
    usually ~15% shorter: its length is what its entries take."""
    nchunks = -(-numel // chunk)
    if not nchunks:
        return 0
    last = numel - (nchunks - 1) * chunk
    entry_bits = (nchunks - 1) * _entry_bits_max(chunk, min(k, chunk), bits) + _entry_bits_max(last, min(k, last), bits)
    return books_size(numel, chunk, bits) + -(-entry_bits // 8)


def books_size(numel: int, chunk: int, bits: int) -> int:
    """Bytes of the sparse form's codebooks, before its entries."""
    return 2 * (1 << (bits - 1)) * -(-numel // chunk)


@register_codec
class TopkCodec(Codec):
    """Chunked top-k: per chunk of `chunk` elements (a power of two) the `k` largest magnitudes, each sent as
    its index (the gap since the one before it, Rice-coded) and a `bits`-bit code (sign, level) into the
    chunk's codebook of 2^(bits-1) magnitudes (the means of equal-count groups of the chosen magnitudes,
    bfloat16); everything else decodes to 0.

    Default chunk 4096, k 128 (3.1%), 2 bits: at most 147.5 bytes per 4096 elements, ~141 on Gaussian data
    (~116x below fp32, ~29x below int8; the README gives the sweep of k and H that chose them). Decode copies
    codebook values into place: every receiver gets the same bits."""

    name = "topk"
    finite_when_checked: ClassVar[bool] = True

    sparse = True

    def __init__(self, chunk: int = 4096, k: int = 128, bits: int = 2, update_bits: int = 6) -> None:
        if chunk < 2 or chunk & (chunk - 1) or chunk > 1 << MAX_CHUNK_LOG2:
            raise ValueError(f"topk chunk must be a power of two in [2, {1 << MAX_CHUNK_LOG2}]")
        if not 1 <= k <= chunk or not 1 <= bits <= MAX_BITS or not 1 <= update_bits <= MAX_BITS:
            raise ValueError(f"topk k must be in [1, chunk] and bits in [1, {MAX_BITS}]")
        self.chunk, self.k, self.bits, self.update_bits = chunk, k, bits, update_bits
        self.dense = _DenseForm(self.name)

    # -- encoding -------------------------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        """The dense form (int8's layout): for what nobody carries a loss of."""
        return self.dense.encode(tensor)

    def encode_delta(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        """The sparse form, for a sender that carries what it drops into its next message."""
        return self.encode_sparse(tensor, self.k, self.bits)

    def encode_update(self, tensor: torch.Tensor, merged: int) -> tuple[dict[str, Any], Payload]:
        """An owner's update, the merge of `merged` sparse deltas: room for all of their coordinates (k per
        chunk each: the merge adds them up), so only the values are rounded, to `update_bits`; the dense form
        where that would be no smaller (many deltas)."""
        k = min(self.chunk, self.k * max(merged, 1))
        if sparse_size(tensor.numel(), self.chunk, k, self.update_bits) >= self.dense.encoded_size(tensor.numel()):
            return self.dense.encode(tensor)
        return self.encode_sparse(tensor, k, self.update_bits)

    def encode_sparse(self, tensor: torch.Tensor, k: int, bits: int) -> tuple[dict[str, Any], Payload]:
        """The sparse form with `k` entries of `bits` value bits per chunk."""
        x = flat_float32(tensor)
        numel = x.numel()
        c = self.chunk.bit_length() - 1
        levels = 1 << (bits - 1)
        nchunks = -(-numel // self.chunk)
        buf = np.zeros(sparse_size(numel, self.chunk, k, bits), np.uint8)
        books, stream = buf[: 2 * levels * nchunks].view(np.uint16), buf[2 * levels * nchunks :]
        used = TK.topk_encode(x.numpy(), c, k, bits, books, stream)
        if used < 0:
            raise Malformed("tensor contains non-finite values")
        meta = {"codec": self.name, "shape": list(tensor.shape), "chunk": self.chunk, "k": k, "bits": bits}
        return meta, owned_bytes(buf[: 2 * levels * nchunks + used])

    def encoded_size(self, numel: int) -> int:
        """The largest payload this codec sends: the dense form (no larger update is ever sent in the sparse
        one), or, for a handful of elements, a delta."""
        return max(self.dense.encoded_size(numel), sparse_size(numel, self.chunk, self.k, self.bits))

    def delta_size(self, numel: int) -> int:
        """The most payload bytes `encode_delta` gives for `numel` elements."""
        return sparse_size(numel, self.chunk, self.k, self.bits)

    # -- decoding -------------------------------------------------------------------------------------------

    def decode(
        self,
        meta: dict[str, Any],
        data: Payload,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._dense(meta):
            return self.dense.decode(meta, data, max_elements=max_elements, out=out)
        shape, numel, params, books, stream = self._checked(meta, data, max_elements)
        if out is not None and out.device.type != "cpu":  # (a GPU learner's buffer: decoded here, copied over)
            if out.dtype != torch.float32 or not out.is_contiguous() or out.requires_grad or out.numel() != numel:
                raise ValueError(f"out must be a contiguous float32 tensor of {numel} elements, no grad")
            return out.view(shape).copy_(self.decode(meta, data, max_elements=max_elements))
        result, flat = output_tensor(shape, numel, out)
        self._entries(books, stream, numel, params, flat)
        return result

    def check(self, meta: dict[str, Any], data: Payload, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> int:
        """Every check `decode` makes, without decoding (either form); returns numel."""
        if self._dense(meta):
            return self.dense.check(meta, data, max_elements=max_elements)
        _, numel, params, books, stream = self._checked(meta, data, max_elements)
        self._entries(books, stream, numel, params, None)
        return numel

    def _dense(self, meta: Any) -> bool:
        if not isinstance(meta, dict):
            raise Malformed(f"codec meta must be a map, got {type(meta).__name__}")
        sparse = [key in meta for key in _SPARSE_KEYS]
        if "block" in meta:
            if any(sparse):
                raise Malformed("topk meta holds 'block' (the dense form) and sparse keys; one form only")
            return True
        if not all(sparse):
            raise Malformed("topk meta needs 'block' (the dense form) or 'chunk', 'k' and 'bits' (the sparse form)")
        return False

    def _checked(self, meta: dict[str, Any], data: Payload, max_elements: int):
        shape, numel = check_meta(meta, self.name, max_elements)
        chunk, k, bits = (meta[key] for key in _SPARSE_KEYS)
        if type(chunk) is not int or not 2 <= chunk <= 1 << MAX_CHUNK_LOG2 or chunk & (chunk - 1):
            raise Malformed(f"topk meta 'chunk' must be a power of two in [2, {1 << MAX_CHUNK_LOG2}]")
        if type(k) is not int or not 1 <= k <= chunk:
            raise Malformed("topk meta 'k' must be an int in [1, chunk]")
        if type(bits) is not int or not 1 <= bits <= MAX_BITS:
            raise Malformed(f"topk meta 'bits' must be an int in [1, {MAX_BITS}]")
        view = payload_view_within(data, self.name, books_size(numel, chunk, bits), sparse_size(numel, chunk, k, bits))
        nbooks = (1 << (bits - 1)) * -(-numel // chunk)
        books = _array(view, np.uint16, 0, nbooks)
        if books.size and int(books.max()) >= 0x7F80:
            raise Malformed("topk codebook magnitudes must be finite, non-negative bfloat16 values")
        stream = np.frombuffer(view, np.uint8, offset=2 * nbooks)
        return shape, numel, (chunk, k, bits), books, stream

    def _entries(self, books: np.ndarray, stream: np.ndarray, numel: int, params: tuple[int, int, int],
                 flat: np.ndarray | None) -> None:
        chunk, k, bits = params
        out = flat if flat is not None else np.empty(0, np.float32)
        status = TK.topk_decode(books, stream, numel, chunk.bit_length() - 1, k, bits, out, flat is not None)
        if status == 1:
            raise Malformed("topk entries: an index gap takes an entry past the end of its chunk")
        if status == 2:
            raise Malformed("topk payload: the padding bits after the last entry must be zero, and nothing follow it")
        if status:
            raise Malformed("topk payload ends inside an entry")


_VARIANT = re.compile(r"topk:([0-9]{1,6}):([0-9]{1,6}):([0-9])")


@functools.lru_cache(maxsize=32)
def variant(name: str) -> TopkCodec:
    """The codec a RunSpec names `topk:CHUNK:K:BITS` (its deltas' chunk, k and bits; ASCII digits only): `topk`
    at other settings, for sweeps. Its meta names `topk`, so every peer decodes it with `topk` itself."""
    match = _VARIANT.fullmatch(name)
    if match is None:
        raise Malformed(f"codec {name[:40]!r}: a topk variant is named topk:CHUNK:K:BITS (e.g. topk:4096:64:2)")
    try:
        return TopkCodec(*(int(g) for g in match.groups()))
    except ValueError as e:
        raise Malformed(f"codec {name[:40]!r}: {e}") from None


register_family("topk", variant)
