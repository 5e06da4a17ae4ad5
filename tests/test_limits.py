"""Limits before work (protocol/limits.py): refusals that cost a peer nothing but a counter.

Distinct hosts are emulated with other loopback addresses: 127.0.0.2, 127.0.0.3, ... are all loopback on Linux,
and the limits key on the source address.
"""

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from diloco.protocol.envelope import EnvelopeVerifier, register_kind, seal
from diloco.protocol.identity import Identity
from diloco.protocol.limits import Limiter, Limits, RefusalLog, address_key
from diloco.protocol.transport import PeerServer

RUN = hashlib.sha256(b"limits-test").digest()
register_kind("test.limits", 1024)
ME = Identity.generate()
STRANGER = "127.0.0.2"


class CountingVerifier(EnvelopeVerifier):
    """Counts header checks: each would cost a signature verification."""

    def __init__(self) -> None:
        super().__init__(RUN)
        self.calls = 0

    def check_header(self, *a, **kw):
        self.calls += 1
        return super().check_header(*a, **kw)


async def start_server(limits: Limits) -> PeerServer:
    srv = PeerServer(limits=limits)
    srv.verifier = CountingVerifier()

    async def echo(env, request):
        return b"ok"

    async def ping(request):
        return web.Response(text="pong")

    srv.add_envelope_route("/v1/echo", srv.verifier, echo, kinds={"test.limits"})
    srv.add_route("GET", "/v1/ping", ping)
    await srv.start()
    return srv


def session(source: str = "127.0.0.1", *, keep_alive: bool = False) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(source, 0), force_close=not keep_alive))


async def post(s: aiohttp.ClientSession, srv: PeerServer) -> int:
    """The answer's status; 0 for a connection closed before any answer (refused at accept)."""
    body = seal(ME, "test.limits", RUN, {}, b"x" * 100).to_bytes()
    try:
        async with s.post(srv.url + "/v1/echo", data=body) as r:
            await r.read()
            return r.status
    except aiohttp.ClientConnectionError:
        return 0


async def get(s: aiohttp.ClientSession, srv: PeerServer) -> int:
    try:
        async with s.get(srv.url + "/v1/ping") as r:
            await r.read()
            return r.status
    except aiohttp.ClientConnectionError:
        return 0


async def test_over_the_rate_is_429_before_any_signature_is_checked():
    srv = await start_server(Limits(rate_per_s=0.001, burst=5))
    try:
        async with session(keep_alive=True) as s:
            statuses = [await post(s, srv) for _ in range(10)]
        # the sixth is 429 and its connection closed; each later one comes on a new connection, and is 429 too
        assert statuses == [200] * 5 + [429] * 5
        assert srv.verifier.calls == 5  # the refused never reached the verifier
        assert srv.limiter.stats["refused_requests"] == 5
    finally:
        await srv.stop()


async def test_a_flood_from_one_address_does_not_refuse_another():
    srv = await start_server(Limits(rate_per_s=0.001, burst=20))
    try:
        async with session(STRANGER) as s:
            flood = await asyncio.gather(*(get(s, srv) for _ in range(40)), return_exceptions=True)
        refused = [x for x in flood if x != 200]
        assert len(refused) >= 20  # (429, or the connection closed at accept)
        async with session("127.0.0.1") as s:
            assert [await get(s, srv) for _ in range(5)] == [200] * 5
    finally:
        await srv.stop()


async def open_raw(srv: PeerServer, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", srv.port, local_addr=(source, 0))


@contextlib.asynccontextmanager
async def raw_connections(srv: PeerServer) -> AsyncIterator[list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
    """The raw connections a test opens to `srv` (append them): all closed, and `srv` stopped, at the end."""
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        yield conns
    finally:
        for _, w in conns:
            w.close()
        await srv.stop()


async def is_closed(reader: asyncio.StreamReader, within_s: float = 0.5) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_connections_over_the_cap_are_closed_before_aiohttp_sees_them():
    srv = await start_server(Limits(conns_per_addr=3))
    async with raw_connections(srv) as conns:
        conns += [await open_raw(srv, STRANGER) for _ in range(5)]
        closed = [await is_closed(r, 0.3) for r, _ in conns]
        assert closed == [False, False, False, True, True]
        assert len(srv._runner.server.connections) == 0  # aiohttp made no handler: none has sent a byte yet
        assert srv.limiter.connections(STRANGER) == 3
        r, w = conns[0]
        w.write(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await r.readline()).startswith(b"HTTP/1.1 200")
        assert len(srv._runner.server.connections) == 1


async def test_new_connections_over_the_rate_are_closed_at_their_first_byte():
    srv = await start_server(Limits(conn_rate_per_s=0.001, conn_burst=3))
    async with raw_connections(srv) as conns:
        conns += [await open_raw(srv, STRANGER) for _ in range(5)]
        assert not any([await is_closed(r, 0.1) for r, _ in conns])  # (held idle: they cost nothing)
        for _, w in conns:
            w.write(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = [await asyncio.wait_for(r.readline(), 2) for r, _ in conns]
        assert [a[:12] for a in answers] == [b"HTTP/1.1 200"] * 3 + [b""] * 2
        assert len(srv._runner.server.connections) == 3
        async with session("127.0.0.1") as s:
            assert await get(s, srv) == 200  # (another address: its own bucket)


async def test_once_its_connection_bucket_is_empty_an_address_is_closed_at_accept():
    """Closed in `accept()` (protocol/listen.py): no transport, no gate, no handler is built for it."""
    srv = await start_server(Limits(conn_rate_per_s=0.001, conn_burst=2))
    async with raw_connections(srv) as conns:
        for _ in range(2):  # two connections that sent their first bytes: the address's bucket is empty
            r, w = await open_raw(srv, STRANGER)
            conns.append((r, w))
            w.write(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(r.readline(), 2)).startswith(b"HTTP/1.1 200")
        assert srv.limiter.stats["refused_at_accept"] == 0
        r, w = await open_raw(srv, STRANGER)
        conns.append((r, w))
        assert await is_closed(r, 1.0)
        assert srv.limiter.stats["refused_at_accept"] == 1
        assert srv.limiter.connections(STRANGER) == 2  # (the gate never saw the third)
        async with session("127.0.0.1") as s:
            assert await get(s, srv) == 200  # (another address: its own bucket)


async def test_at_the_total_cap_a_new_address_evicts_the_heaviest_one():
    srv = await start_server(Limits(conns_per_addr=10, conns_total=4))
    async with raw_connections(srv) as conns:
        conns += [await open_raw(srv, STRANGER) for _ in range(4)]
        assert not any([await is_closed(r, 0.2) for r, _ in conns])
        async with session("127.0.0.1") as s:
            assert await get(s, srv) == 200  # an honest newcomer gets in while a stranger holds the whole cap
        assert await is_closed(conns[0][0])  # the stranger's oldest connection made room
        assert srv.limiter.stats["evicted_connections"] == 1


async def test_bodies_in_flight_are_capped_per_address():
    srv = await start_server(Limits(inflight_per_addr=2))
    async with raw_connections(srv) as conns:
        body = seal(ME, "test.limits", RUN, {}, b"x" * 100).to_bytes()
        head = f"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        for _ in range(2):  # two slow-loris bodies: a few bytes, then nothing
            conns.append(await open_raw(srv, STRANGER))
            conns[-1][1].write(head + body[:3])
        await asyncio.sleep(0.2)
        r, w = await open_raw(srv, STRANGER)
        conns.append((r, w))
        w.write(head + body)
        assert (await asyncio.wait_for(r.readline(), 2)).startswith(b"HTTP/1.1 429")
        async with session("127.0.0.1") as s:
            assert await post(s, srv) == 200
        assert srv.verifier.calls == 1  # only the honest one: the slow two are still in their prefix


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout():
    srv = await start_server(Limits(idle_timeout_s=0.5))
    try:
        r, w = await open_raw(srv, STRANGER)
        assert await is_closed(r, 3.0)  # (aiohttp's own default keeps it open for an hour)
        w.close()
    finally:
        await srv.stop()


async def test_with_tls_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout_too():
    from diloco.protocol.tls import server_context

    srv = PeerServer(limits=Limits(idle_timeout_s=0.5), ssl_context=server_context(ME))
    await srv.start()
    try:
        r, w = await open_raw(srv, STRANGER)
        assert await is_closed(r, 3.0)
        w.close()
        assert srv.limiter.connections() == 0
    finally:
        await srv.stop()


async def test_refusals_are_one_rate_limited_line_without_a_traceback(caplog):
    srv = await start_server(Limits(rate_per_s=0.001, burst=1, log_every_s=60))
    try:
        with caplog.at_level(logging.INFO, logger="diloco.protocol.limits"):
            async with session(STRANGER) as s:
                statuses = [await get(s, srv) for _ in range(20)]
        assert statuses == [200] + [429] * 19
        lines = [r for r in caplog.records if r.name == "diloco.protocol.limits"]
        assert len(lines) == 1 and lines[0].exc_info is None and "\n" not in lines[0].getMessage()
        assert STRANGER in lines[0].getMessage()
    finally:
        await srv.stop()


def test_the_refusal_log_counts_what_it_left_out(caplog):
    now = [0.0]
    rl = RefusalLog(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="diloco.protocol.limits"):
        for _ in range(5):
            rl.refused("a request (request rate)", STRANGER)
        now[0] = 11.0
        rl.refused("a connection (connections)", STRANGER)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "4 a request (request rate)" in msgs[1]


def test_buckets_refill_at_the_rate_and_are_per_address():
    now = [0.0]
    lim = Limiter(Limits(rate_per_s=2.0, burst=2.0), clock=lambda: now[0])
    assert [lim.take("a") for _ in range(3)] == [True, True, False]
    assert lim.take("b")
    now[0] = 0.5
    assert lim.take("a") and not lim.take("a")


@pytest.mark.parametrize("host,key", [
    ("10.1.2.3", "10.1.2.3"), ("::ffff:10.1.2.3", "10.1.2.3"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
])
def test_an_ipv6_host_is_keyed_by_its_64(host, key):
    assert address_key(host) == key


async def test_with_tls_the_gate_admits_first_and_an_idle_connection_holds_no_tls_state():
    import gc
    import ssl
    from asyncio import sslproto

    from diloco.protocol.tls import client_context, server_context

    srv = PeerServer(limits=Limits(conns_per_addr=2), ssl_context=server_context(ME))

    async def ping(request):
        return web.Response(text="pong")

    srv.add_route("GET", "/v1/ping", ping)
    await srv.start()
    async with raw_connections(srv) as idle:
        idle += [await open_raw(srv, STRANGER) for _ in range(2)]  # admitted; they send nothing
        await asyncio.sleep(0.2)
        assert not [o for o in gc.get_objects() if type(o) is sslproto.SSLProtocol]  # (asyncio's: 256 KiB each)
        with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
            _, w = await asyncio.open_connection("127.0.0.1", srv.port, ssl=client_context(), local_addr=(STRANGER, 0))
            w.close()  # (not reached: over the cap, closed before any handshake)
        async with aiohttp.ClientSession() as s, s.get(f"https://127.0.0.1:{srv.port}/v1/ping",
                                                       ssl=client_context()) as r:
            assert r.status == 200 and await r.text() == "pong"


async def test_tls_handshakes_under_way_are_capped_per_address():
    from diloco.protocol.tls import server_context

    srv = PeerServer(limits=Limits(handshakes_per_addr=1), ssl_context=server_context(ME))
    await srv.start()
    async with raw_connections(srv) as conns:
        conns += [await open_raw(srv, STRANGER) for _ in range(2)]
        for _, w in conns:
            w.write(b"\x16\x03\x01")  # the first bytes of a ClientHello, and no more: a handshake left hanging
            await asyncio.sleep(0.1)
        assert [await is_closed(r, 0.5) for r, _ in conns] == [False, True]
        assert srv.limiter.stats["refused_connections"] == 1
