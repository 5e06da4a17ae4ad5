"""The connection gate in front of aiohttp: each accepted connection is admitted or aborted by the `Limiter`
(limits.py) before aiohttp builds anything for it, and a private run's TLS starts only after admission, at
the connection's first byte (an idle connection holds no TLS state and costs no handshake).

asyncio's own TLS (`loop.create_server(ssl=...)`) would shake hands with every connection first and give each
a 256 KiB buffer; doing the handshake here is what keeps 1,000 junk connections cheap (benchmarks/flood.py).
It builds asyncio's `SSLProtocol` itself (stable since Python 3.11, though not a documented API).
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .limits import Limiter, peer_key


class Gate(asyncio.Protocol):
    """A connection's protocol until it is admitted; then a pass-through to aiohttp's handler. A refused one is
    aborted here: no handler, parser or buffer of aiohttp's is ever made for it. The caps are checked at
    accept; the connection rate at the first byte (a connection that sends nothing costs nothing while it is
    held, and refusing it would only make its sender reconnect); aiohttp's handler, and with TLS the
    handshake, start only then: an idle connection holds no TLS state (asyncio's is a 256 KiB buffer) and a
    refused one costs no handshake."""

    __slots__ = ("_limiter", "_factory", "_tls", "_inner", "_key", "_transport", "_handshake", "_idle")

    def __init__(self, limiter: Limiter, factory: Callable[[], asyncio.Protocol], tls: ssl.SSLContext | None) -> None:
        self._limiter, self._factory, self._tls = limiter, factory, tls
        self._inner: asyncio.Protocol | None = None
        self._key = "?"
        self._transport: asyncio.BaseTransport | None = None
        self._handshake: asyncio.Future | None = None
        self._idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._transport is not None:  # (the second call: the TLS layer's, its handshake done)
            self._start(transport)
            return
        self._transport = transport
        self._key = peer_key(transport)
        why = self._limiter.admit_connection(self, self._key)
        if why is not None:
            self._limiter.stats["refused_connections"] += 1
            self._limiter.log.refused(f"a connection ({why})", self._key)
            transport.abort()  # type: ignore[attr-defined]
            return
        # (until its first byte: aiohttp's idle timeout starts only with aiohttp's handler)
        self._idle = asyncio.get_running_loop().call_later(self._limiter.limits.idle_timeout_s, self.abort)

    def _first(self, data: bytes) -> None:
        """The connection's first bytes: the connection rate, then aiohttp's handler (or the TLS handshake)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not self._limiter.take(self._key, connection=True):
            self._refuse("connection rate")
        elif self._tls is not None:
            self._start_tls(data)
        else:
            self._start(self._transport)  # type: ignore[arg-type]
            self._inner.data_received(data)  # type: ignore[union-attr]

    def _refuse(self, why: str) -> None:
        self._limiter.stats["refused_connections"] += 1
        self._limiter.log.refused(f"a connection ({why})", self._key)
        self.abort()

    def _start(self, transport: asyncio.BaseTransport) -> None:
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def _start_tls(self, first: bytes) -> None:
        why = self._limiter.admit_handshake(self._key)
        if why is not None:
            self._refuse(why)
            return
        loop = asyncio.get_running_loop()
        self._handshake = loop.create_future()
        self._handshake.add_done_callback(self._handshaken)
        tls = _TLS(loop, self, self._tls, self._handshake, server_side=True,
                   ssl_handshake_timeout=self._limiter.limits.handshake_timeout_s)
        raw = self._transport
        raw.set_protocol(tls)  # type: ignore[union-attr]
        tls.connection_made(raw)
        view = memoryview(first)
        while view and self._handshake is not None and not self._handshake.done():
            buf = tls.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            tls.buffer_updated(n)
            view = view[n:]

    def _handshaken(self, fut: asyncio.Future) -> None:
        self._limiter.handshake_done(self._key)
        if not fut.cancelled():
            fut.exception()  # (retrieved: a failed handshake is a refusal, not an error to log)
        if self._inner is None:  # the handshake failed: the TLS layer tells us nothing more
            self._limiter.closed(self, self._key)
            self._transport = None

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
        elif self._handshake is None and self._transport is not None:
            self._first(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._limiter.closed(self, self._key)
        if self._inner is not None:
            self._inner.connection_lost(exc)
            self._inner = None
        self._transport = None


class _TLS(sslproto.SSLProtocol):
    """asyncio's TLS layer with a 64 KiB read buffer instead of 256 KiB: it is allocated (and zeroed) for every
    connection, and 1,024 connections must not hold a quarter of a gigabyte."""

    max_size = 64 * 1024


class GateFactory:
    """The runner's `web.Server` as a site sees it: its protocol factory puts the gate first; everything else
    (`connections`, `requests_count`, ...) is the server's own."""

    def __init__(self, limiter: Limiter, server: web.Server, tls: ssl.SSLContext | None) -> None:
        self._limiter, self._server, self._tls = limiter, server, tls

    def __call__(self) -> Gate:
        return Gate(self._limiter, self._server, self._tls)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class LimitedRunner(web.AppRunner):
    """`web.AppRunner` whose sites accept connections through the limiter's gate, and whose request handlers
    take `Limits.handler_args` (explicit keyword arguments win). `ssl_context`: TLS done by the gate, after the
    limits (give the site none)."""

    def __init__(self, app: web.Application, limiter: Limiter, *, ssl_context: ssl.SSLContext | None = None,
                 **kwargs: Any) -> None:
        super().__init__(app, **{**limiter.limits.handler_args(), **kwargs})
        self._limiter, self._tls = limiter, ssl_context

    @property
    def server(self) -> Any:  # (what a site passes to `loop.create_server` as the protocol factory)
        inner = super().server
        return None if inner is None else GateFactory(self._limiter, inner, self._tls)
