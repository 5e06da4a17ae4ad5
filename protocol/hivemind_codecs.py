"""Adapter: hivemind 1.1.12's tensor codecs behind diloco's `Codec` interface.

Registers `hivemind_fp16` (Float16Compression), `hivemind_uniform8` (Uniform8BitQuantization) and
`hivemind_blockwise8` (BlockwiseQuantization, needs bitsandbytes) on import, for side-by-side benchmarks
and for talking to peers that speak hivemind's formats. The payload is hivemind's `runtime_pb2.Tensor`
protobuf exactly as `SerializeToString` writes it; meta is `{"codec", "shape"}`.

It must never unpickle, and never hand hivemind's own decoder bytes it has not checked: the protobuf's
compression type, dtype, size and buffer length are validated against `meta` first, so that a peer
cannot make hivemind index out of range, allocate from a forged length, or resolve an arbitrary dtype name.
Importing it without hivemind installed raises an ImportError that says what to install.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

try:
    from hivemind.compression import (
        BlockwiseQuantization,
        CompressionBase,
        CompressionInfo,
        Float16Compression,
        Uniform8BitQuantization,
    )
    from hivemind.proto import runtime_pb2
except ImportError as err:  # pragma: no cover - exercised only where hivemind is absent
    raise ImportError(
        "diloco.protocol.hivemind_codecs needs hivemind 1.1.12 (with numpy<2.4, and bitsandbytes for "
        f"hivemind_blockwise8): pip install 'diloco-node[bench]' ({err})"
    ) from err

from diloco.protocol.codecs import (
    DEFAULT_MAX_ELEMENTS,
    Codec,
    Payload,
    abs_max_bits,
    check_meta,
    flat_float32,
    output_tensor,
    register_codec,
)
from diloco.protocol.errors import Malformed

_CODEBOOK = 256  # hivemind's 8-bit codecs always send a 256-entry float32 codebook
_BLOCK = 4096  # hivemind.compression.quantization._BLOCKWISE_QUANTIZATION_BLOCKSIZE
_DTYPES = ("float32", "float16", "float64")  # dtype names we let hivemind resolve


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


class _HivemindCodec(Codec):
    compression: ClassVar[CompressionBase]
    compression_type: ClassVar[int]

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        x = flat_float32(tensor)
        abs_max_bits(x)
        x = x.view(tensor.shape)
        proto = self._compress(x)
        return {"codec": self.name, "shape": list(tensor.shape)}, proto.SerializeToString()

    def _compress(self, x: torch.Tensor) -> runtime_pb2.Tensor:
        return self.compression.compress(x, CompressionInfo.from_tensor(x))

    def decode(
        self,
        meta: dict[str, Any],
        data: Payload,
        *,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape, numel = check_meta(meta, self.name, max_elements)
        try:
            view = memoryview(data).cast("B")
        except (TypeError, ValueError):
            raise Malformed(f"{self.name} payload must be contiguous bytes") from None
        if len(view) > self._max_size(shape, numel):
            raise Malformed(f"{self.name} payload is {len(view)} bytes, too long for shape {shape}")
        proto = runtime_pb2.Tensor()
        try:
            proto.ParseFromString(bytes(view))
        except Exception:  # DecodeError, or another type depending on the protobuf backend
            raise Malformed(f"{self.name} payload is not a hivemind Tensor protobuf") from None
        if proto.compression != self.compression_type:
            raise Malformed(f"{self.name} payload has compression type {proto.compression}")
        if list(proto.size) != shape:
            raise Malformed(f"{self.name} payload shape {list(proto.size)[:8]} != meta shape {shape}")
        if proto.dtype not in _DTYPES:
            raise Malformed(f"{self.name} payload dtype must be one of {', '.join(_DTYPES)}")
        self._check_buffer(bytes(proto.buffer[:16]), len(proto.buffer), numel)
        try:
            decoded = self.compression.extract(proto).detach().to(torch.float32)
        except Exception as err:  # validated above; anything left is hivemind's own failure
            raise Malformed(f"{self.name} payload rejected by hivemind: {type(err).__name__}") from None
        result, flat = output_tensor(shape, numel, out)
        flat[:] = decoded.reshape(-1).numpy()
        if numel and not np.isfinite(flat).all():
            raise Malformed(f"{self.name} payload contains non-finite values")
        return result

    def _check_buffer(self, head: bytes, length: int, numel: int) -> None:
        """Raise Malformed unless hivemind's buffer (first 16 bytes `head`) fits `numel` elements exactly."""
        expected = self._buffer_len(numel)
        if length != expected:
            raise Malformed(f"{self.name} buffer is {length} bytes; shape needs exactly {expected}")

    def _buffer_len(self, numel: int) -> int:
        raise NotImplementedError

    def _proto_size(self, shape: list[int], numel: int, requires_grad: bool) -> int:
        header = runtime_pb2.Tensor(
            size=shape, dtype="float32", compression=self.compression_type, requires_grad=requires_grad
        )
        length = self._buffer_len(numel)
        return header.ByteSize() + (1 + _varint_len(length) + length if length else 0)

    def _max_size(self, shape: list[int], numel: int) -> int:
        """The longest protobuf hivemind writes for `shape` (every allowed dtype name is 7 bytes)."""
        return self._proto_size(shape, numel, requires_grad=True)

    def encoded_size(self, numel: int) -> int:
        """Protobuf bytes for a 1-D tensor of `numel` elements (other shapes differ by a few bytes)."""
        return self._proto_size([numel], numel, requires_grad=False)


@register_codec
class HivemindFp16(_HivemindCodec):
    """hivemind's FLOAT16: the buffer is `numel` IEEE float16 values (saturating at ±65504)."""

    name = "hivemind_fp16"
    compression = Float16Compression()
    compression_type = runtime_pb2.FLOAT16

    def _buffer_len(self, numel: int) -> int:
        return 2 * numel


@register_codec
class HivemindUniform8(_HivemindCodec):
    """hivemind's UNIFORM_8BIT: int64 codebook size (256), 256 float32 bucket means, `numel` uint8 codes."""

    name = "hivemind_uniform8"
    compression = Uniform8BitQuantization()
    compression_type = runtime_pb2.UNIFORM_8BIT

    def _compress(self, x: torch.Tensor) -> runtime_pb2.Tensor:
        if x.numel() == 0:  # hivemind fails on empty tensors (std of nothing); this is what it would send
            buffer = np.int64(_CODEBOOK).tobytes() + bytes(4 * _CODEBOOK)
            return runtime_pb2.Tensor(
                compression=self.compression_type, buffer=buffer, size=x.shape, dtype="float32"
            )
        return super()._compress(x)

    def _buffer_len(self, numel: int) -> int:
        return 8 + 4 * _CODEBOOK + numel

    def _check_buffer(self, head: bytes, length: int, numel: int) -> None:
        super()._check_buffer(head, length, numel)
        if int.from_bytes(head[:8], "little", signed=True) != _CODEBOOK:
            raise Malformed(f"{self.name} codebook size must be {_CODEBOOK}")


@register_codec
class HivemindBlockwise8(_HivemindCodec):
    """hivemind's BLOCKWISE_8BIT (bitsandbytes dynamic 8-bit, block 4096): int64 number of blocks, int64
    codebook size (256), float32 absmax per block, 256 float32 codebook entries, `numel` uint8 codes."""

    name = "hivemind_blockwise8"
    compression = BlockwiseQuantization()
    compression_type = runtime_pb2.BLOCKWISE_8BIT

    def _buffer_len(self, numel: int) -> int:
        return 16 + 4 * -(-numel // _BLOCK) + 4 * _CODEBOOK + numel

    def _check_buffer(self, head: bytes, length: int, numel: int) -> None:
        super()._check_buffer(head, length, numel)
        blocks = int.from_bytes(head[:8], "little", signed=True)
        codebook = int.from_bytes(head[8:16], "little", signed=True)
        if blocks != -(-numel // _BLOCK) or codebook != _CODEBOOK:
            raise Malformed(
                f"{self.name} needs {-(-numel // _BLOCK)} blocks and a {_CODEBOOK}-entry codebook"
            )
