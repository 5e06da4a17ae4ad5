"""Canonical msgpack: one byte string for one value, so that signatures and hashes are well defined.

Rules (docs/protocol.md, "Canonical msgpack"): maps have string keys sorted by their UTF-8 bytes; integers and
lengths use msgpack's shortest form; floats are float64; strings are UTF-8 `str`, bytes are `bin`; no ext
types (msgpack timestamps included). Decoding is strict: anything that does not re-encode to the very same
bytes is `Malformed`, which closes the door on two encodings of one signed message.
"""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import Malformed

Plain = None | bool | int | float | str | bytes | list["Plain"] | dict[str, "Plain"]

_MAX_DEPTH = 32


def _canon(obj: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise Malformed("value nested too deeply")
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
            raise Malformed("integer out of the 64-bit range")
        return obj
    if isinstance(obj, bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, list | tuple):
        return [_canon(x, depth + 1) for x in obj]
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, str):
                raise Malformed(f"map keys must be strings, got {type(k).__name__}")
        return {k: _canon(obj[k], depth + 1) for k in sorted(obj, key=lambda s: s.encode())}
    raise Malformed(f"type {type(obj).__name__} is not allowed in a canonical message")


def packb(obj: Any) -> bytes:
    """Encode `obj` canonically. Raises `Malformed` for values outside the allowed types."""
    return msgpack.packb(_canon(obj), use_bin_type=True, use_single_float=False)


def _no_ext(code: int, data: bytes) -> Any:
    raise Malformed(f"msgpack ext type {code} is not allowed")


def unpackb(data: bytes | bytearray | memoryview, *, max_len: int = 1 << 20) -> Any:
    """Decode canonical msgpack, refusing trailing bytes, ext types and non-canonical encodings."""
    if len(data) > max_len:
        raise Malformed(f"msgpack value of {len(data)} bytes exceeds {max_len}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
            timestamp=0,
        )
    except Malformed:
        raise
    except Exception as e:  # msgpack raises a zoo: ExtraData, FormatError, StackError, ValueError, ...
        raise Malformed(f"not valid msgpack: {type(e).__name__}: {e}") from None
    if packb(obj) != bytes(data):
        raise Malformed("msgpack value is not in canonical form")
    return obj
