"""Large GET answers read by the socket straight into the caller's memory (docs/architecture.md §3, §5.4).

A joiner downloads every fragment whole: hundreds of MB, with the peers it downloads from training on the
same machines. Through aiohttp every socket read lands in a fresh bytes object, runs through its stream
bookkeeping and is then copied into the tensor: measured on 100 MB from four loopback peers on 2 cores, that
took 2–3× the client CPU of reading with `recv_into`, and the download as a whole took twice as long. Here an
`asyncio.BufferedProtocol` lets the kernel write each read into the memory a `BodySink` hands out.

The serving side is an ordinary aiohttp route. This side speaks just enough HTTP/1.1 for one GET and one
answer that states its Content-Length: `Connection: close`, no keep-alive, no chunked or compressed bodies
(such an answer is refused). aiohttp stays the client for everything else. The caller (`PeerClient.request`
with a `sink`) sets the deadline.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Protocol, cast
from urllib.parse import urlsplit

from .errors import Malformed, PeerUnreachable, RemoteError, ResponseTooLarge
from .tls import WrongPeer, check_peer

MAX_HEAD = 64 * 1024  # status line and headers
ERROR_BODY = 4096  # how much of an error answer's body is read (its first line is the reason)


class BodySink(Protocol):
    """Where a large answer's body goes, e.g. straight into a tensor. `begin` starts (again, on a retry) with
    the announced length; `buffer` gives the memory the next bytes are written into (never empty before the
    body is complete); `advance(n)` says that n bytes were written there; `end` checks the whole. Each may
    raise a `ProtocolError` to refuse the answer."""

    def begin(self, content_length: int) -> None: ...

    def buffer(self) -> memoryview: ...

    def advance(self, n: int) -> None: ...

    def end(self) -> None: ...


class Hasher(Protocol):
    """What `RunningDigest` feeds: `hashlib`'s objects and `blake3.blake3` alike (both release the GIL)."""

    def update(self, data: memoryview, /) -> object: ...

    def digest(self) -> bytes: ...


class RunningDigest:
    """A digest of a body while it arrives: the bytes the socket has written are hashed on the loop's worker
    threads while the rest is still coming, so a download is checked a few milliseconds after its last byte
    instead of a whole hash later. A joiner's fragments arrive together and were hashed together at the end:
    ~55 ms of one core for 100 MB with SHA-256. Call `filled(n)` from the event loop as bytes [0, n) of `data`
    become final, then `await digest()` once the body is whole. `hasher`: a fresh one (`update`, `digest`)."""

    STEP = 2 << 20  # bytes per hand-over to a worker: its cost (~50 us) is small against hashing them (~1 ms)

    def __init__(self, data: memoryview, hasher: Hasher) -> None:
        self._data = data if data.format == "B" else data.cast("B")
        self._hash = hasher
        self._hashed = self._filled = 0
        self._job: asyncio.Future[None] | None = None

    def filled(self, n: int) -> None:
        """Bytes [0, n) of the data are final (n never goes back)."""
        self._filled = n
        if n - self._hashed >= self.STEP and (self._job is None or self._job.done()):
            self._job = asyncio.get_running_loop().run_in_executor(None, self._catch_up)

    def _catch_up(self) -> None:
        # On a worker thread, one job at a time. What is filled while it ends waits for the next `filled`
        # or for `digest`, which hashes the rest.
        while (end := self._filled) - self._hashed >= self.STEP:
            self._hash.update(self._data[self._hashed : end])
            self._hashed = end

    async def digest(self) -> bytes:
        """The digest of the bytes filled, once the job in flight and the rest are hashed."""
        if self._job is not None:
            await self._job
        if self._hashed < self._filled:
            rest = self._data[self._hashed : self._filled]
            await asyncio.get_running_loop().run_in_executor(None, self._hash.update, rest)
            self._hashed = self._filled
        return self._hash.digest()


def _decimal(text: str, max_digits: int = 19) -> bool:
    """1 to `max_digits` ASCII digits: `str.isdigit` also takes '²' and other digits `int` refuses, and `int`
    refuses more than 4300 digits (ValueError) where a head may hold 64 KiB of them."""
    return 0 < len(text) <= max_digits and text.isascii() and text.isdigit()


def parse_head(head: bytes) -> tuple[int, int]:
    """(status, content length) of an HTTP/1.1 answer's status line and headers (without the blank line)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or len(parts[1]) != 3 or not _decimal(parts[1]) \
            or parts[1][0] == "0":  # (a status is 3 digits, 100-999: status 0 would read as "no head yet")
        raise Malformed(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise Malformed(f"bad header line: {line[:80]!r}")
        name = name.strip().lower()
        if name in headers and headers[name] != value.strip():
            raise Malformed(f"header {name!r} given twice with different values")
        headers[name] = value.strip()
    if "transfer-encoding" in headers or headers.get("content-encoding", "identity") != "identity":
        raise Malformed("a bulk answer must be sent whole and uncompressed, with a Content-Length")
    length = headers.get("content-length", "")
    if not _decimal(length):
        raise Malformed("a bulk answer must state its Content-Length")
    return int(parts[1]), int(length)


class _OneGet(asyncio.BufferedProtocol):
    """One GET on its own connection: the head into a small buffer, then the body into the sink."""

    def __init__(self, url: str, path: str, sink: BodySink, limit: int, tally: Callable[[int], None] | None,
                 headers: dict[str, str] | None = None, expected: str | None = None, tls: bool = False) -> None:
        self.url, self.path, self.sink, self.limit, self.tally = url, path, sink, limit, tally
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.request = (f"GET {path} HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nAccept-Encoding: identity\r\n"
                        f"{extra}Connection: close\r\n\r\n").encode("latin-1")
        self.tls, self.expected = tls, expected
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.head = bytearray(MAX_HEAD)
        self.head_len = 0
        self.status = 0  # 0 until the head is read
        self.length = 0
        self.received = 0  # body bytes
        self.error_body = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if self.tls:  # (after the handshake: nothing is sent to a server that is not the expected peer)
            try:
                check_peer(self.transport.get_extra_info("ssl_object"), self.expected, self.url)
            except WrongPeer as e:
                self._finish(e)
                self.transport.abort()
                return
        self.transport.write(self.request)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.done.done():  # finished or refused: whatever still arrives is dropped
            return memoryview(self.head)
        if not self.status:
            return memoryview(self.head)[self.head_len :]
        if self.status != 200:
            return memoryview(self.error_body)[self.received :]
        try:
            return self._sink_view()
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            self._finish(e)
            return memoryview(self.head)

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done():
            return
        try:
            if not self.status:
                self._head_read(nbytes)
            elif self.status == 200:
                self.sink.advance(nbytes)
                self._count(nbytes)
            else:
                self.received += nbytes
            self._maybe_complete()
        except Exception as e:  # noqa: BLE001 - handed to the waiting caller
            self._finish(e)

    def _head_read(self, nbytes: int) -> None:
        self.head_len += nbytes
        end = self.head.find(b"\r\n\r\n", 0, self.head_len)
        if end < 0:
            if self.head_len == MAX_HEAD:
                raise Malformed(f"an answer head longer than {MAX_HEAD} bytes")
            return
        status, length = parse_head(bytes(self.head[:end]))
        if status == 200 and length > self.limit:
            raise ResponseTooLarge(f"{self.url}{self.path} answered {length} bytes (limit {self.limit})")
        self.status, self.length = status, length
        extra = memoryview(self.head)[end + 4 : self.head_len]
        if status != 200:
            self.length = min(length, ERROR_BODY)
            self.error_body = bytearray(self.length)
            n = min(len(extra), self.length)
            self.error_body[:n] = extra[:n]
            self.received = n
            return
        self.sink.begin(length)
        while len(extra) and self.received < self.length:  # body bytes that came with the head
            view = self._sink_view()
            n = min(len(view), len(extra))
            view[:n] = extra[:n]
            self.sink.advance(n)
            self._count(n)
            extra = extra[n:]

    def _sink_view(self) -> memoryview:
        """Where the sink takes the next body bytes, never past the Content-Length."""
        view = self.sink.buffer()[: self.length - self.received]
        if not len(view):
            raise Malformed(f"the sink has no room for the {self.length - self.received} bytes still due")
        return view

    def _count(self, n: int) -> None:
        self.received += n
        if self.tally is not None:
            self.tally(n)

    def _maybe_complete(self) -> None:
        if not self.status or self.received < self.length:
            return
        if self.status != 200:
            reason = bytes(self.error_body[:500]).decode("utf-8", "replace").strip()
            self._finish(RemoteError(self.status, reason, self.url))
            return
        self.sink.end()
        self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(self.received)
            else:
                self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close; connection_lost tells whether the answer was whole

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            what = f"after {self.received} of {self.length} bytes" if self.status else "before answering"
            self.done.set_exception(PeerUnreachable(f"{self.url}{self.path} closed the connection {what}"
                                                    + (f" ({exc})" if exc else "")))


async def get_into(url: str, path: str, sink: BodySink, limit: int, tally: Callable[[int], None] | None = None,
                   connected: Callable[[], None] | None = None, *, tls: tuple[ssl.SSLContext, str | None] | None = None,
                   headers: dict[str, str] | None = None) -> int:
    """GET `path` from the peer at `url` (http://host:port, or https:// with `tls`: the client context and
    the PeerId expected there, None for any) into `sink`; returns the body's length. `headers`: extra request
    headers (a signed read).
    `tally(n)` is told of every n body bytes read, also of an answer that then fails; `connected()` once the
    TCP connection is made (each bulk answer has its own: `Connection: close`).

    Raises `PeerUnreachable`, `ResponseTooLarge`, `RemoteError` (another status than 200: the sink sees
    nothing), a `ProtocolError` (a malformed head, or the sink's refusal) or `OSError` (no connection).
    Cancelling it (the caller's deadline) drops the connection."""
    try:  # (a URL from a peer's own record: urlsplit and .port raise ValueError for "[::1" or port 99999)
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise PeerUnreachable(f"{url!r} is not a host:port URL: {e}") from None
    if parts.scheme != ("https" if tls else "http") or not parts.hostname:
        raise PeerUnreachable(f"{url!r} is not an {'https' if tls else 'http'}://host:port URL")
    loop = asyncio.get_running_loop()
    expected = tls[1] if tls else None
    transport, proto = await loop.create_connection(
        lambda: _OneGet(url, path, sink, limit, tally, headers, expected, tls is not None), parts.hostname,
        port or (443 if tls else 80), ssl=tls[0] if tls else None, server_hostname="" if tls else None)
    if connected is not None:
        connected()
    whole = False
    try:
        received = await proto.done
        whole = True
        return received
    finally:
        if not whole:  # refused, broken or past the deadline: drop the connection at once
            transport.abort()
