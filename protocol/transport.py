"""HTTP transport: one aiohttp server per peer, and one pooled client (docs/architecture.md §3).

Every layer registers its routes on the same `PeerServer`, under `/v1/`. Envelope routes verify the signed
frame while it streams in, before the handler sees it, and map every `ProtocolError` to its HTTP status with
a one-line reason. The `PeerClient` gives each request a deadline learned from the link (`deadlines.py`),
retries only idempotent requests, and refuses oversized answers before reading them.

Nothing here knows what a DHT or a delta is; nothing here ever deserializes with pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from aiohttp import web

from .bulk import BodySink, get_into
from .deadlines import DeadlinePolicy, LinkEstimator
from .envelope import Envelope, EnvelopeVerifier, max_frame_size
from .errors import (
    DeadlineExceeded,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    ResponseTooLarge,
    TransportError,
    Unavailable,
)
from .gate import LimitedRunner
from .intake import paced, quiet_malformed_requests
from .limits import Limiter, Limits
from .listen import listen
from .reads import HEADER as READ_HEADER
from .reads import ReadSigner, check_read
from .tls import PeerCheck, WrongPeer, client_context

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
DEFAULT_MAX_RESPONSE = 64 * 1024 * 1024
MAX_PLAIN_BODY = 1024 * 1024  # the body of a route that does not take an envelope


@dataclass
class RouteCounter:
    requests: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class Counters:
    """Bytes and requests per route, for what this peer served and what it sent."""

    served: dict[str, RouteCounter] = field(default_factory=dict)
    sent: dict[str, RouteCounter] = field(default_factory=dict)
    connections_opened: int = 0  # by the client: climbing in a steady swarm means connections are torn down

    def record(self, side: str, route: str, bytes_in: int, bytes_out: int, ok: bool) -> None:
        table = self.served if side == "served" else self.sent
        c = table.setdefault(route, RouteCounter())
        c.requests += 1
        c.errors += 0 if ok else 1
        c.bytes_in += bytes_in
        c.bytes_out += bytes_out

    def totals(self) -> dict[str, int]:
        rows = [*self.served.values(), *self.sent.values()]
        return {"bytes_in": sum(c.bytes_in for c in rows), "bytes_out": sum(c.bytes_out for c in rows)}


BYTES_IN = web.RequestKey("bytes_in", int)
EnvelopeHandler = Callable[[Envelope, web.Request], Awaitable[bytes | web.StreamResponse]]


def error_response(status: int, reason: str) -> web.Response:
    return web.Response(status=status, text=reason.replace("\n", " ")[:500] + "\n")


class PeerServer:
    """The one HTTP server of a peer. Call `add_*_route` before `start()`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout_s: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None, limits: Limits | None = None) -> None:
        self.host = host
        self.port = port
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ssl_context = ssl_context  # (tls.server_context: a private run's TLS)
        self.reads: EnvelopeVerifier | None = None  # set: every GET needs a member's signature (`guard_reads`)
        self.counters = Counters()
        self.closing = False
        self.limiter = Limiter(limits)  # (limits.py: caps and 429s before any other work; first middleware)
        self.app = web.Application(middlewares=[self.limiter.middleware, self._middleware],
                                   client_max_size=MAX_PLAIN_BODY)
        quiet_malformed_requests()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.ssl_context else 'http'}://{host}:{self.port}"

    def guard_reads(self, verifier: EnvelopeVerifier) -> None:
        """Answer a GET (any path) only to a member who signed it (reads.check_read): a private run."""
        self.reads = verifier

    def add_route(self, method: str, path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.app.router.add_route(method, path, handler)

    def add_envelope_route(
        self,
        path: str,
        verifier: EnvelopeVerifier,
        handler: EnvelopeHandler,
        *,
        kinds: Iterable[str] | None = None,
        fresh: bool = True,
        max_payload: int | None = None,
        trailer: Callable[[dict[str, Any]], int] | None = None,
        max_trailer: int = 0,
    ) -> None:
        """POST route whose body is one envelope, verified (signature, run, replay, digest) before `handler`.

        `fresh=False` accepts relayed envelopes of any age (no replay window): only for idempotent messages.
        `kinds` and `max_payload` (the route's own limit, from the run's plan) are checked on the header,
        before any payload byte is read. `trailer` and `max_trailer`: the body goes on after the frame by that
        many bytes, the envelope's `trailer` (`EnvelopeVerifier.read`), which the handler checks.
        """
        accepted = frozenset(kinds) if kinds is not None else None

        async def route(request: web.Request) -> web.StreamResponse:
            env = await verifier.read(
                paced(request.content.iter_chunked(CHUNK)), content_length=request.content_length, fresh=fresh,
                kinds=accepted, max_payload=max_payload, trailer=trailer, max_trailer=max_trailer,
            )
            request[BYTES_IN] = env.frame_size() + len(env.trailer)
            try:
                out = await handler(env, request)
            except Unavailable:  # (refused before any work: the same message may come again, e.g. relayed)
                if fresh:
                    verifier.forget(env)
                raise
            return web.Response(body=out, content_type="application/octet-stream") if isinstance(out, bytes) else out

        self.app.router.add_post(path, route)

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        if self.closing:
            return error_response(503, "peer is shutting down")
        limit = MAX_PLAIN_BODY if request.method in ("GET", "HEAD") else max_frame_size()
        if request.content_length is not None and request.content_length > limit:
            resp: web.StreamResponse = error_response(413, f"body of {request.content_length} bytes is too large")
        else:
            try:
                if self.reads is not None and request.method != "POST":
                    check_read(self.reads, request.method, request.raw_path, request.headers.get(READ_HEADER))
                resp = await handler(request)
            except ProtocolError as e:
                resp = error_response(e.status, e.reason)
            except web.HTTPException as e:  # (aiohttp's own: 404, 405, ...) answered in our one-line form
                resp = error_response(e.status, e.reason)
            except (ConnectionError, asyncio.IncompleteReadError, aiohttp.ClientPayloadError):
                resp = error_response(400, "request body ended early")
            except Exception:
                log.exception("handler for %s failed", route)
                resp = error_response(500, "internal error in the handler; see the peer's log")
        body_len = len(resp.body) if isinstance(resp, web.Response) and isinstance(resp.body, bytes) else 0
        self.counters.record(
            "served", route, request.get(BYTES_IN, request.content_length or 0), body_len, resp.status < 400
        )
        return resp

    async def start(self) -> None:
        self._runner = LimitedRunner(  # (connections through the limiter's gate, which does the TLS after it)
            self.app, self.limiter, ssl_context=self.ssl_context, access_log=None, handle_signals=False,
            shutdown_timeout=self.shutdown_timeout_s,
        )
        await self._runner.setup()
        # (our own listening sockets: a connection the limiter refuses is closed at accept, listen.py)
        sockets = listen(self.host, self.port, self.limiter.limits.backlog, self.limiter.refuse_at_accept)
        try:
            for sock in sockets:  # (no ssl_context: TLS is the gate's, limits.py)
                await web.SockSite(self._runner, sock).start()
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        self.port = sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Refuse new requests, let in-flight ones finish within `shutdown_timeout_s`, then cancel them."""
        self.closing = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class PeerClient:
    """Pooled HTTP client with adaptive per-link deadlines, size limits and safe retries."""

    def __init__(
        self,
        *,
        policy: DeadlinePolicy | None = None,
        retries: int = 2,
        limit: int = 256,
        limit_per_host: int = 8,
        max_response: int = DEFAULT_MAX_RESPONSE,
        tls: bool = False,
        read_signer: ReadSigner | None = None,
    ) -> None:
        """`tls`: every connection is TLS (whatever a URL's scheme says), its server checked by PeerId where
        `expect` named one; `read_signer`: every GET carries this peer's signature (a private run)."""
        self.policy = policy or DeadlinePolicy()
        self.retries = retries
        self.max_response = max_response
        self.counters = Counters()
        self.links: dict[str, LinkEstimator] = {}
        self._limit = (limit, limit_per_host)
        self._session: aiohttp.ClientSession | None = None
        self.tls = client_context() if tls else None
        self.read_signer = read_signer
        self._expected: dict[str, str] = {}  # host:port -> the PeerId that must answer there
        self._checks: dict[str | None, PeerCheck] = {}  # (one per PeerId: aiohttp pools connections by it)

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit[0], limit_per_host=self._limit[1])
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(self._opened)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False,
                trace_configs=[trace],
            )
        return self._session

    async def _opened(self, *_: object) -> None:  # (aiohttp's trace hook: pooled connections)
        self._count_connection()

    def _count_connection(self) -> None:
        self.counters.connections_opened += 1

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def expect(self, url: str, peer_id: str) -> None:
        """Only the peer `peer_id` may answer at `url` (from its signed member record): TLS checks it."""
        with contextlib.suppress(ValueError):  # (a URL that does not parse is never connected to either)
            self._expected[urlsplit(url).netloc] = peer_id

    def tls_for(self, url: str) -> tuple[str, PeerCheck | None]:
        """The URL to connect to and the check of its server: https and a PeerCheck when this client is TLS."""
        if self.tls is None:
            return url, None
        try:
            parts = urlsplit(url)
        except ValueError:
            raise PeerUnreachable(f"{url!r} is not an http(s)://host:port URL") from None
        expected = self._expected.get(parts.netloc)
        check = self._checks.get(expected)
        if check is None:
            check = self._checks[expected] = PeerCheck(expected)
        return urlunsplit(("https", parts.netloc, parts.path, parts.query, parts.fragment)), check

    def read_headers(self, method: str, path: str) -> dict[str, str]:
        return {READ_HEADER: self.read_signer(method, path)} if self.read_signer is not None and method != "POST" else {}

    def link(self, url: str) -> LinkEstimator:
        est = self.links.get(url)
        if est is None:
            est = self.links[url] = LinkEstimator(self.policy)
        return est

    async def send_envelope(self, url: str, path: str, env: Envelope,
                            trailer: Sequence[bytes | bytearray | memoryview] = (), **kw) -> bytes | bytearray:
        """POST one envelope, then the `trailer` buffers where the route takes one; large bodies stream without
        being copied into one buffer."""
        if len(env.payload) <= CHUNK and not trailer:
            return await self.request("POST", url, path, body=env.to_bytes(), **kw)
        return await self.request("POST", url, path, body=[env.prefix(), env.payload, *trailer], **kw)

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        body: bytes | list[bytes | bytearray | memoryview] = b"",
        idempotent: bool = False,
        deadline_s: float | None = None,
        max_response: int | None = None,
        min_deadline_s: float = 0.0,
        sink: BodySink | None = None,
        retries: int | None = None,
    ) -> bytes | bytearray:
        """One request with a deadline (`deadline_s`, or the link's estimate but at least `min_deadline_s`);
        retried with jittered backoff only if `idempotent`, at most `retries` times (default: the client's;
        0 where the caller has other peers to ask instead). With a `sink`, a successful answer's body goes
        there as it arrives, and the return value is empty."""
        nbytes = len(body) if isinstance(body, bytes) else sum(len(p) for p in body)
        attempts = 1 + ((self.retries if retries is None else retries) if idempotent else 0)
        for attempt in range(attempts):
            try:
                return await self._once(method, url, path, body, nbytes, deadline_s, max_response or self.max_response,
                                        min_deadline_s, sink)
            except TransportError as e:
                if attempt + 1 >= attempts or not e.retryable:
                    raise
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")

    async def _once(
        self, method: str, url: str, path: str, body, nbytes: int, deadline_s: float | None, max_response: int,
        min_deadline_s: float = 0.0, sink: BodySink | None = None,
    ) -> bytes | bytearray:
        if sink is not None and (method != "GET" or nbytes):
            raise ValueError("a sink takes the answer of a GET without a body")
        link = self.link(url)
        path_label = route_label(path)
        expected = nbytes + (max_response if sink is not None else 0)  # a bulk answer's size is known ahead
        deadline = deadline_s if deadline_s is not None else max(link.deadline(expected), min_deadline_s)
        start = time.monotonic()
        received = 0

        def tally(n: int) -> None:
            nonlocal received
            received += n

        try:
            async with asyncio.timeout(deadline):
                if sink is not None:
                    target, check = self.tls_for(url)
                    await get_into(target, path, sink, max_response, tally, connected=self._count_connection,
                                   tls=(self.tls, check.expected) if check is not None else None,
                                   headers=self.read_headers(method, path))
                    out = bytearray()
                else:
                    status, out = await self._aiohttp(method, url, path, body, nbytes, max_response)
                    received = len(out)
                    if status >= 400:
                        raise RemoteError(status, bytes(out[:500]).decode("utf-8", "replace").strip(), url)
        except TimeoutError:
            self.counters.record("sent", path_label, received, nbytes, False)
            raise DeadlineExceeded(f"{url}{path} gave no complete answer within {deadline:.2f}s") from None
        except aiohttp.ServerFingerprintMismatch as e:  # (tls.PeerCheck: the wrong peer answered)
            self.counters.record("sent", path_label, received, nbytes, False)
            raise WrongPeer(f"{url}{path}: {e.__cause__ or e}") from None
        except aiohttp.ClientError as e:
            self.counters.record("sent", path_label, received, nbytes, False)
            raise PeerUnreachable(f"{url}{path}: {type(e).__name__}: {e}") from None
        except OSError as e:
            self.counters.record("sent", path_label, received, nbytes, False)
            raise PeerUnreachable(f"{url}{path}: {e.strerror or e}") from None
        except RuntimeError as e:  # aiohttp: the connection (or our session, while closing) went away mid-read
            if "closed" not in str(e).lower():
                raise
            self.counters.record("sent", path_label, received, nbytes, False)
            raise PeerUnreachable(f"{url}{path}: {e}") from None
        except (TransportError, ProtocolError):  # (a sink refusing the answer raises a ProtocolError)
            self.counters.record("sent", path_label, received, nbytes, False)
            raise
        link.observe(time.monotonic() - start, nbytes + received)
        self.counters.record("sent", path_label, received, nbytes, True)
        return out

    async def _aiohttp(
        self, method: str, url: str, path: str, body, nbytes: int, max_response: int
    ) -> tuple[int, bytearray]:
        data = body if isinstance(body, bytes) else _stream(body)
        headers = {"Content-Length": str(nbytes), "Content-Type": "application/octet-stream",
                   **self.read_headers(method, path)}
        target, check = self.tls_for(url)
        async with self.session.request(method, target + path, data=data, headers=headers,
                                        ssl=check if check is not None else True) as resp:
            if resp.content_length is not None and resp.content_length > max_response:
                raise ResponseTooLarge(f"{url}{path} answered {resp.content_length} bytes (limit {max_response})")
            return resp.status, await _read_body(resp, max_response, f"{url}{path}")


def route_label(path: str) -> str:
    """The counter key of a request path: query dropped, numeric segments as {n} (one key per route)."""
    parts = path.split("?", 1)[0].split("/")
    return "/".join("{n}" if part.isdigit() else part for part in parts)


async def _read_body(resp: aiohttp.ClientResponse, limit: int, where: str) -> bytearray:
    """Read a response body into one buffer, preallocated when its length is known (no copy per chunk)."""
    if resp.content_length is not None:
        out = bytearray(resp.content_length)
        view, pos = memoryview(out), 0
        async for part in resp.content.iter_chunked(CHUNK):
            if pos + len(part) > len(out):
                raise ResponseTooLarge(f"{where} sent more than its Content-Length")
            view[pos : pos + len(part)] = part
            pos += len(part)
        if pos != len(out):
            raise PeerUnreachable(f"{where} closed the connection after {pos} of {len(out)} bytes")
        return out
    out = bytearray()
    async for part in resp.content.iter_chunked(CHUNK):
        out += part
        if len(out) > limit:
            raise ResponseTooLarge(f"{where} answered more than {limit} bytes")
    return out


async def _stream(parts: list[bytes | bytearray | memoryview]) -> AsyncIterator[bytes]:
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), CHUNK):
            yield view[i : i + CHUNK]

