"""Tensor codecs: how a float tensor becomes `(meta, payload)` on the wire, and back.

A codec turns a tensor into a small msgpack-able `meta` dict and a payload of raw bytes that is complete on
its own; docs/protocol.md §6 gives the exact byte layout of each. Decoding reads bytes from the network,
so it validates every field of `meta` and the exact payload length before it allocates anything, and it
raises only `Malformed` or `TooLarge` (never `IndexError`, `ValueError`, a crash or a huge allocation).
This module must never unpickle, never trust a length it did not compute itself, and never put a non-finite
value on the wire or hand one back from the wire.

Codecs: `fp32` (identity), `fp16`, `bf16`, `int8` (blockwise absmax, linear), `int4` (blockwise NF4) and
`topk` (chunked top-k, `protocol/sparse.py`). `ErrorFeedback` carries what a lossy codec dropped into the next
encode of the same key.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import torch

from diloco.protocol import _kernels as K
from diloco.protocol import device_int8
from diloco.protocol.errors import Malformed, TooLarge

if sys.byteorder != "little":  # payloads are little-endian and the kernels write native order
    raise ImportError("diloco.protocol.codecs needs a little-endian host")

DEFAULT_MAX_ELEMENTS = 1 << 28  # 1 GiB of float32; callers pass the limit their plan allows
MAX_NDIM = 32
MAX_BLOCK = 1 << 20
FP16_MAX = 65504.0
_FP16_MAX_BITS = 0x477FE000  # float32 bits of 65504.0
_BF16_MAX_BITS_F32 = 0x7F7F7FFF  # float32 values above this round to inf in bfloat16
_BF16_MAX = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])
_INT8_MAX_SCALE_BITS = int(np.array([K.INT8_MAX_SCALE], np.float32).view(np.uint32)[0])

Payload = bytes | bytearray | memoryview


class Codec(ABC):
    """Turns a float tensor into `(meta, payload)` and back. Instances are stateless and thread-safe."""

    name: ClassVar[str]
    # True when `encode_delta` keeps only a few coordinates: an owner then merges by the weighted mean
    # (coordinator/merge.py `mean_prefix`)
    sparse: ClassVar[bool] = False

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        """Encode any float tensor (any shape, contiguous or not, any device; read as float32).

        Returns `meta` (str keys; int/str/list values; always "codec" and "shape") and the payload.
        Raises `Malformed("tensor contains non-finite values")` for inf/NaN: such deltas are refused.
        """

    def encode_delta(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        """Encode a delta or an update: a tensor whose sender carries what the encoding dropped into its next
        one (θ[p] or an error-feedback residual). `encode` for every codec but those, like `topk`'s sparse
        form, that drop too much for anything else."""
        return self.encode(tensor)

    def encode_update(self, tensor: torch.Tensor, merged: int) -> tuple[dict[str, Any], Payload]:
        """Encode an owner's update, the merge of `merged` deltas: `encode_delta` for every codec but a sparse
        one, whose update has room for the coordinates of all of them."""
        return self.encode_delta(tensor)

    @abstractmethod
    def decode(
        self,
        meta: dict[str, Any],
        data: Payload,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode a payload from the network into a float32 CPU tensor of `meta["shape"]`.

        Validates `meta` and the exact payload length before allocating; raises only `Malformed` or
        `TooLarge`. `out`, if given, is a contiguous CPU float32 tensor with as many elements; the result is
        then a view of it (its contents are undefined if decode raises).
        """

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Payload bytes for a tensor of `numel` elements (meta not included)."""

    def ratio(self, numel: int) -> float:
        """Compression ratio against float32: `4 * numel / encoded_size(numel)`; meta is not counted."""
        size = self.encoded_size(numel)
        return 4 * numel / size if size else 1.0


# --- registry ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Codec] = {}


def register_codec(codec_cls: type[Codec]) -> type[Codec]:
    """Register a codec class under its `name` (one shared instance). Usable as a class decorator."""
    _REGISTRY[codec_cls.name] = codec_cls()
    return codec_cls


def available_codecs() -> list[str]:
    """Names of the registered codecs (the hivemind adapters appear once they have been imported)."""
    return sorted(_REGISTRY)


def get_codec(name: str) -> Codec:
    """The codec registered under `name`; `hivemind_*` names import the hivemind adapter on first use."""
    if not isinstance(name, str):
        raise Malformed(f"codec name must be a string, got {type(name).__name__}")
    if name not in _REGISTRY and name.startswith("hivemind_"):
        try:
            import diloco.protocol.hivemind_codecs  # noqa: F401  (registers on import)
        except ImportError as err:
            raise Malformed(
                f"codec {name[:40]!r} needs hivemind, which is not installed here ({err})"
            ) from None
    codec = _REGISTRY.get(name)
    family = _FAMILIES.get(name.partition(":")[0]) if codec is None and ":" in name else None
    if family is not None:
        return family(name)
    if codec is None:
        raise Malformed(f"unknown codec {name[:40]!r}; known: {', '.join(available_codecs())}")
    return codec


# codec families: "NAME:ARGS" names a registered codec's variant (`topk:CHUNK:K:BITS`), built by its factory;
# the variant's meta names the family, so any peer decodes it with the family's own codec
_FAMILIES: dict[str, Callable[[str], Codec]] = {}


def register_family(name: str, factory: Callable[[str], Codec]) -> None:
    """`get_codec("NAME:...")` returns `factory("NAME:...")`, which raises `Malformed` for a bad name."""
    _FAMILIES[name] = factory


# --- helpers shared by every codec (and the hivemind adapter) -----------------------------------------------


def owned_bytes(array: np.ndarray) -> memoryview:
    """A read-only byte view of `array`, a buffer the encoder allocated (so never aliasing the caller's tensor).
    Payloads are handed on as such views: `ndarray.tobytes()` would copy megabytes while holding the GIL,
    stalling every other thread of the process (the training thread among them) for that long."""
    return memoryview(array.reshape(-1).view(np.uint8)).toreadonly()


def copied_bytes(x: torch.Tensor) -> memoryview:
    """The bytes of `x` in a new buffer, copied by torch (which releases the GIL while it copies)."""
    out = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8)
    out.copy_(x.reshape(-1).view(torch.uint8))
    return owned_bytes(out.numpy())


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a contiguous 1-D float32 CPU tensor (a copy only where needed)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"codecs encode float tensors, got {getattr(tensor, 'dtype', type(tensor))}")
    x = tensor.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    return x.to(torch.float32).resolve_neg().contiguous().reshape(-1)


def abs_max_bits(x: torch.Tensor) -> int:
    """Float32 bits of max |x| for a flat float32 CPU tensor; raises `Malformed` if any value is non-finite."""
    bits = int(K.abs_max_bits(x.numpy().view(np.int32))) if x.numel() else 0
    if bits >= K.F32_INF_BITS:
        raise Malformed("tensor contains non-finite values")
    return bits


def l2_norm(x: torch.Tensor) -> float:
    """‖x‖₂ of a flat float32 CPU tensor, summed in float64 (inf or NaN if x holds any). About ten times
    faster than `torch.linalg.vector_norm(x, dtype=torch.float64)`, which first copies x to float64."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.linalg.vector_norm(x, dtype=torch.float64).item()
    return math.sqrt(K.sum_squares(x.detach().contiguous().numpy())) if x.numel() else 0.0


def load_kernels() -> None:
    """Load every kernel now. numba starts its runtime on the first call of any kernel (~0.4 s, holding the
    GIL), so a long-lived peer calls this at start-up rather than stall its network loop at the first
    decode. Idempotent, and a few milliseconds once loaded."""
    with K.without_scipy_blas():
        for name in ("fp32", "fp16", "bf16", "int8", "int4", "topk"):
            codec = _REGISTRY[name]
            codec.decode(*codec.encode(torch.zeros(2)))
            codec.decode(*codec.encode_delta(torch.zeros(2)))
        l2_norm(torch.zeros(1))
        zeros = np.zeros(2, np.float32)
        K.momentum_update(zeros, zeros.copy(), zeros.copy(), np.float32(0.5), np.float32(-1.0), True)


def check_meta(meta: Any, name: str, max_elements: int) -> tuple[list[int], int]:
    """Validate the fields every codec shares; returns `(shape, numel)`."""
    if not isinstance(meta, dict):
        raise Malformed(f"codec meta must be a map, got {type(meta).__name__}")
    codec = meta.get("codec")
    if codec != name:
        raise Malformed(f"meta names codec {str(codec)[:40]!r}, this is {name!r}")
    shape = meta.get("shape")
    if not isinstance(shape, list | tuple):
        raise Malformed("meta 'shape' must be a list of non-negative ints")
    if len(shape) > MAX_NDIM:
        raise Malformed(f"meta 'shape' has {len(shape)} dimensions; at most {MAX_NDIM} allowed")
    numel = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise Malformed("meta 'shape' must be a list of non-negative ints")
        if dim > max_elements:
            raise TooLarge(f"shape dimension {dim} exceeds the limit of {max_elements} elements")
        numel *= dim
    if numel > max_elements:
        raise TooLarge(f"shape {shape} has {numel} elements; the limit is {max_elements}")
    return list(shape), numel


def check_block(meta: dict[str, Any], name: str, *, even: bool) -> int:
    block = meta.get("block")
    if type(block) is not int or not 1 <= block <= MAX_BLOCK or (even and block % 2):
        kind = "an even int" if even else "an int"
        raise Malformed(f"{name} meta 'block' must be {kind} in [{2 if even else 1}, {MAX_BLOCK}]")
    return block


def payload_view(data: Any, name: str, expected: int) -> memoryview:
    """`data` as a flat byte view of exactly `expected` bytes."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError):
        raise Malformed(f"{name} payload must be contiguous bytes") from None
    if len(view) != expected:
        raise Malformed(f"{name} payload is {len(view)} bytes; its meta needs exactly {expected}")
    return view


def payload_view_within(data: Any, name: str, least: int, most: int) -> memoryview:
    """`data` as a flat byte view of `least` to `most` bytes (a variable-length payload, bounded before any work)."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError):
        raise Malformed(f"{name} payload must be contiguous bytes") from None
    if not least <= len(view) <= most:
        raise Malformed(f"{name} payload is {len(view)} bytes; its meta allows {least} to {most}")
    return view


def plain_fp32(t: torch.Tensor) -> bool:
    """A contiguous float32 CPU tensor without grad: one whose numpy view a kernel may read and write."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


def output_tensor(shape: list[int], numel: int, out: torch.Tensor | None) -> tuple[torch.Tensor, np.ndarray]:
    """The tensor to decode into (shaped as `shape`) and its flat float32 numpy view."""
    if out is None:
        result = torch.empty(shape, dtype=torch.float32)
    else:
        if not plain_fp32(out) or out.numel() != numel:
            raise ValueError(f"out must be a contiguous CPU float32 tensor of {numel} elements, no grad")
        result = out.view(shape)
    return result, result.view(-1).numpy()


def _array(view: memoryview, dtype: type, offset: int, count: int) -> np.ndarray:
    """A read-only numpy view of `count` items at `offset`, copied only if it is misaligned."""
    arr = np.frombuffer(view, dtype=dtype, count=count, offset=offset)
    return arr if arr.flags.aligned else arr.copy()


class _FlatCodec(Codec):
    """Shared decode path: validate meta, then the exact length, then the payload, then allocate."""

    block: int = 0  # 0: not blockwise; otherwise elements per block, sent as meta "block"
    even_block: ClassVar[bool] = False

    def decode(
        self,
        meta: dict[str, Any],
        data: Payload,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape, numel, block, view = self._checked(meta, data, max_elements)
        result, flat = output_tensor(shape, numel, out)
        self._decode_into(view, numel, block, flat)
        return result

    # True when `check` alone proves the payload decodes to finite values (blockwise codecs: checked scales
    # times bounded codes); raw float codecs must decode to find a NaN.
    finite_when_checked: ClassVar[bool] = False

    def check(self, meta: dict[str, Any], data: Payload, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> int:
        """Every check `decode` makes before decoding the values (meta, exact length, scales, int8 codes);
        returns numel.
        Cheap: for a receiver that keeps the bytes and decodes them later."""
        _, numel, block, view = self._checked(meta, data, max_elements)
        self._check_codes(view, numel, block)
        return numel

    def _checked(self, meta: dict[str, Any], data: Payload, max_elements: int):
        shape, numel = check_meta(meta, self.name, max_elements)
        block = check_block(meta, self.name, even=self.even_block) if self.block else 0
        view = payload_view(data, self.name, self._payload_len(numel, block))
        self._check_payload(view, numel, block)
        return shape, numel, block, view

    def encoded_size(self, numel: int) -> int:
        return self._payload_len(numel, self.block)

    def _meta(self, tensor: torch.Tensor) -> dict[str, Any]:
        meta: dict[str, Any] = {"codec": self.name, "shape": list(tensor.shape)}
        if self.block:
            meta["block"] = self.block
        return meta

    @abstractmethod
    def _payload_len(self, numel: int, block: int) -> int: ...

    def _check_codes(self, view: memoryview, numel: int, block: int) -> None:
        """Raise `Malformed` for codes a CPU decode refuses as it decodes (so `decode` skips this pass)."""

    def _check_payload(self, view: memoryview, numel: int, block: int) -> None:
        """Raise `Malformed` for payload fields that are checkable before decoding (scales, padding)."""

    @abstractmethod
    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        """Decode into `flat` (float32, `numel` long); raise `Malformed` if the values are not acceptable."""


# --- raw floating-point codecs --------------------------------------------------------------------------


@register_codec
class Fp32Codec(_FlatCodec):
    """Identity: little-endian IEEE float32, 4 bytes per element."""

    name = "fp32"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        x = flat_float32(tensor)
        abs_max_bits(x)
        return self._meta(tensor), copied_bytes(x)

    def _payload_len(self, numel: int, block: int) -> int:
        return 4 * numel

    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        if K.f32_copy(_array(view, np.uint32, 0, numel), flat.view(np.uint32)) >= K.F32_INF_BITS:
            raise Malformed("fp32 payload contains non-finite values")


@register_codec
class Fp16Codec(_FlatCodec):
    """IEEE half precision, little-endian, 2 bytes per element. Values beyond ±65504 saturate to ±65504
    (as hivemind's Float16Compression does); magnitudes below 2**-25 (3e-8) round to zero."""

    name = "fp16"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        x = flat_float32(tensor)
        if abs_max_bits(x) > _FP16_MAX_BITS:
            x = x.clamp(-FP16_MAX, FP16_MAX)
        return self._meta(tensor), owned_bytes(x.to(torch.float16).numpy())

    def _payload_len(self, numel: int, block: int) -> int:
        return 2 * numel

    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        if K.f16_decode(_array(view, np.uint16, 0, numel), flat.view(np.uint32), flat) >= 0x7C00:
            raise Malformed("fp16 payload contains non-finite values")


@register_codec
class Bf16Codec(_FlatCodec):
    """bfloat16 (the upper 16 bits of a float32, round-to-nearest-even), little-endian, 2 bytes per element.
    Same range as float32; values beyond the largest bfloat16 (3.39e38) saturate to it."""

    name = "bf16"

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        x = flat_float32(tensor)
        if abs_max_bits(x) > _BF16_MAX_BITS_F32:
            x = x.clamp(-_BF16_MAX, _BF16_MAX)
        return self._meta(tensor), owned_bytes(x.to(torch.bfloat16).view(torch.int16).numpy())

    def _payload_len(self, numel: int, block: int) -> int:
        return 2 * numel

    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        if K.bf16_decode(_array(view, np.uint16, 0, numel), flat.view(np.uint32)) >= 0x7F80:
            raise Malformed("bf16 payload contains non-finite values")


# --- blockwise quantizers -------------------------------------------------------------------------------


@register_codec
class Int8Codec(_FlatCodec):
    """Blockwise absmax int8, linear and symmetric.

    The flat tensor is cut into blocks of `block` elements (the last may be shorter). Per block,
    `scale = absmax / 127` (float32) and `code = rint(x / scale)` in [-127, 127]; decode is `code * scale`.
    Payload: `nblocks` float32 scales, then `numel` int8 codes. Default block 512: ratio 3.97, rel_l2 ~0.0075
    on Gaussian data (hivemind's BlockwiseQuantization: 0.013). Decode refuses code -128 and any scale that
    is negative, non-finite or above float32_max/127, so its output is always finite.
    """

    finite_when_checked = True

    name = "int8"

    def __init__(self, block: int = 512) -> None:
        self.block = block

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" and tensor.is_floating_point():
            # on its device (protocol/device_int8.py): only the payload crosses to the host
            x = tensor.detach().to(torch.float32).reshape(-1).contiguous()
            payload = device_int8.encode(x, self.block)
            # into pinned host memory (torch caches it): the copy is one DMA at the link's rate, not staged
            host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=payload.device.type == "cuda")
            host.copy_(payload)
            return self._meta(tensor), owned_bytes(host.numpy())
        x = flat_float32(tensor)
        nblocks = -(-x.numel() // self.block)
        buf = np.empty(self.encoded_size(x.numel()), np.uint8)
        scales, codes = buf[: 4 * nblocks].view(np.float32), buf[4 * nblocks :].view(np.int8)
        if not K.int8_encode(x.numpy(), self.block, scales, codes):
            raise Malformed("tensor contains non-finite values")
        return self._meta(tensor), owned_bytes(buf)

    def decode(self, meta: dict[str, Any], data: Payload, *, max_elements: int = DEFAULT_MAX_ELEMENTS,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """As every codec's; into an `out` on a device (a GPU learner's buffer), decoded there: only the
        payload crosses from the host."""
        if out is None or out.device.type == "cpu":
            return super().decode(meta, data, max_elements=max_elements, out=out)
        shape, numel, block, view = self._checked(meta, data, max_elements)
        self._check_codes(view, numel, block)  # (the device kernel does not refuse them)
        if out.dtype != torch.float32 or not out.is_contiguous() or out.requires_grad or out.numel() != numel:
            raise ValueError(f"out must be a contiguous float32 tensor of {numel} elements, no grad")
        host = torch.empty(len(view), dtype=torch.uint8, pin_memory=out.device.type == "cuda")
        host.numpy()[:] = np.frombuffer(view, np.uint8)
        device_int8.decode(host.to(out.device, non_blocking=True), numel, block, out.view(-1))
        return out.view(shape)

    def _payload_len(self, numel: int, block: int) -> int:
        return 4 * -(-numel // block) + numel

    def _check_payload(self, view: memoryview, numel: int, block: int) -> None:
        nblocks = -(-numel // block)
        scales = _array(view, np.uint32, 0, nblocks)
        if scales.size and int(scales.max()) > _INT8_MAX_SCALE_BITS:
            raise Malformed("int8 scales must be finite, non-negative and at most float32_max/127")

    def _check_codes(self, view: memoryview, numel: int, block: int) -> None:
        # (in `check` too, not only in decode: an owner keeps a checked delta and decodes it at the outer step,
        # where one refused code would fail the whole round)
        nblocks = -(-numel // block)
        if numel and int(np.frombuffer(view, np.int8, count=numel, offset=4 * nblocks).min()) < -127:
            raise Malformed("int8 code -128 is not allowed (codes are in [-127, 127])")

    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        nblocks = -(-numel // block)
        scales = _array(view, np.float32, 0, nblocks)
        codes = np.frombuffer(view, np.int8, count=numel, offset=4 * nblocks)
        if K.int8_decode(scales, codes, block, flat) < -127:
            raise Malformed("int8 code -128 is not allowed (codes are in [-127, 127])")


@register_codec
class Int4Codec(_FlatCodec):
    """Blockwise 4-bit NF4 (QLoRA's normal-float levels), two codes per byte.

    Why NF4: its 16 levels are quantiles of N(0, 1), which fits pseudo-gradients (roughly Gaussian per
    block) better than a uniform or E3M0 grid, and it has an exact zero. Per block of `block` elements
    (default 128), `scale` = absmax rounded *up* to bfloat16, so |x| / scale <= 1; each element gets the
    nearest level, `code` in 0..15 indexing `levels`; decode is `levels[code] * scale`.
    Why a bfloat16 scale: float16 cannot hold 1e30 or 1e-30 and float32 costs 2 more bytes per block; with
    block 128, bf16 gives ratio 7.76 where fp32 would give 7.53, at the same error (rel_l2 ~0.096 on Gaussian).
    Payload: `nblocks` scales as uint16 (bfloat16 bits), then ceil(numel/2) bytes: element 2i in the low
    nibble of byte i, element 2i+1 in the high nibble; for odd numel the last high nibble is zero.
    """

    finite_when_checked = True

    name = "int4"
    levels: ClassVar[np.ndarray] = K.NF4_LEVELS
    even_block = True

    def __init__(self, block: int = 128) -> None:
        if block % 2:
            raise ValueError("int4 block must be even")
        self.block = block

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        x = flat_float32(tensor)
        nblocks = -(-x.numel() // self.block)
        buf = np.empty(self.encoded_size(x.numel()), np.uint8)
        scales, packed = buf[: 2 * nblocks].view(np.uint16), buf[2 * nblocks :]
        if not K.int4_encode(x.numpy(), self.block, scales, packed):
            raise Malformed("tensor contains non-finite values")
        return self._meta(tensor), owned_bytes(buf)

    def _payload_len(self, numel: int, block: int) -> int:
        return 2 * -(-numel // block) + (numel + 1) // 2

    def _check_payload(self, view: memoryview, numel: int, block: int) -> None:
        scales = _array(view, np.uint16, 0, -(-numel // block))
        if scales.size and int(scales.max()) >= 0x7F80:
            raise Malformed("int4 scales must be finite, non-negative bfloat16 values")
        if numel % 2 and view[-1] >> 4:
            raise Malformed("int4 payload: the unused high nibble of the last byte must be zero")

    def _decode_into(self, view: memoryview, numel: int, block: int, flat: np.ndarray) -> None:
        nblocks = -(-numel // block)
        packed = np.frombuffer(view, np.uint8, count=(numel + 1) // 2, offset=2 * nblocks)
        K.int4_decode(_array(view, np.uint16, 0, nblocks), packed, block, flat)


# --- error feedback -------------------------------------------------------------------------------------


class ErrorFeedback:
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD): what a lossy codec dropped from
    one encode of `key` is added to the next, so the sum of decoded tensors tracks the sum of inputs.

    encode: `x = tensor + residual[key]`; send `codec.encode_delta(x)`; `residual[key] = x - decode(encoded)`.
    Residuals live on the CPU as float32. Not thread-safe per key.
    """

    def __init__(self, codec: Codec | str) -> None:
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        self._residuals: dict[str, torch.Tensor] = {}

    def encode(self, key: str, tensor: torch.Tensor) -> tuple[dict[str, Any], Payload]:
        x = flat_float32(tensor).view(tensor.shape)
        carried = self._residuals.get(key)
        if carried is None:
            x = x.clone()  # the residual is computed in place below; never write into the caller's tensor
        elif carried.shape != x.shape:
            raise ValueError(f"error feedback {key!r}: shape {list(x.shape)} != {list(carried.shape)}")
        else:
            x = x + carried
        meta, data = self.codec.encode_delta(x)
        self._residuals[key] = x.sub_(self.codec.decode(meta, data, max_elements=max(x.numel(), 1)))
        return meta, data

    def residual(self, key: str) -> torch.Tensor | None:
        """What the last encode of `key` left out (None before the first encode or after reset)."""
        return self._residuals.get(key)

    def restore(self, key: str, residual: torch.Tensor | None) -> None:
        """Put back the residual `residual(key)` returned before an encode whose result was never delivered:
        what it carried has still not reached the receiver (`encode` never writes into the old residual)."""
        if residual is None:
            self._residuals.pop(key, None)
        else:
            self._residuals[key] = residual

    def reset(self, key: str | None = None) -> None:
        """Forget the residual of `key`, or of every key when `key` is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)


from diloco.protocol import sparse as _sparse  # noqa: E402, F401  (registers `topk`; it builds on the above)
