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
    t = type(obj)
    if t is str or t is bytes or t is float or t is bool or obj is None:
        return obj
    if t is int:
        if not -(2**63) <= obj < 2**64:
            raise Malformed("integer out of the 64-bit range")
        return obj
    if depth > _MAX_DEPTH:
        raise Malformed("value nested too deeply")
    if t is dict:
        for k in obj:
            if type(k) is not str:
                raise Malformed(f"map keys must be strings, got {type(k).__name__}")
        # Python orders str by code point, which is the order of their UTF-8 bytes.
        return {k: _canon(obj[k], depth + 1) for k in sorted(obj)}
    if t is list or t is tuple:
        return [_canon(x, depth + 1) for x in obj]
    if t is bytearray or t is memoryview:
        return bytes(obj)
    raise Malformed(f"type {t.__name__} is not allowed in a canonical message")


def packb(obj: Any) -> bytes:
    """Encode `obj` canonically. Raises `Malformed` for values outside the allowed types."""
    return msgpack.packb(_canon(obj), use_bin_type=True, use_single_float=False)


def _no_ext(code: int, data: bytes) -> Any:
    raise Malformed(f"msgpack ext type {code} is not allowed")


def unpackb(data: bytes | bytearray | memoryview, *, max_len: int = 1 << 20, strict: bool = True) -> Any:
    """Decode canonical msgpack, refusing trailing bytes, ext types and non-canonical encodings.

    `strict=False` skips the re-encoding check, for bytes already covered by a verified digest (an envelope
    payload): their encoding cannot be changed without breaking the signature, so canonical form adds nothing.
    """
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
    if not strict:
        _canon(obj)  # still refuse types outside the plain set (ext timestamps)
        return obj
    if packb(obj) != bytes(data):
        raise Malformed("msgpack value is not in canonical form")
    return obj


MAX_DECIMAL_DIGITS = 19  # every count, index and term on our routes fits an int64


def parse_decimal(text: str, what: str) -> int:
    """A non-negative integer written in a URL path or query: 1 to 19 ASCII digits, nothing else (`str.isdigit`
    also takes '²' and '٣', which `int` reads or refuses; 5,000 digits would cost `int` real time). Raises
    `Malformed` naming `what`."""
    if not (0 < len(text) <= MAX_DECIMAL_DIGITS and text.isascii() and text.isdigit()):
        raise Malformed(f"{what} must be 1 to {MAX_DECIMAL_DIGITS} ASCII digits, got {text[:24]!r}")
    return int(text)
