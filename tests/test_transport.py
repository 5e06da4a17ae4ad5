import asyncio
import hashlib
import logging
import socket
import sys

import pytest
from aiohttp import http_exceptions, web

from diloco.protocol import intake
from diloco.protocol.deadlines import DeadlinePolicy, LinkEstimator
from diloco.protocol.envelope import EnvelopeVerifier, register_kind, seal
from diloco.protocol.errors import BackPressure, Unavailable
from diloco.protocol.identity import Identity
from diloco.protocol.transport import (
    DeadlineExceeded,
    PeerClient,
    PeerServer,
    PeerUnreachable,
    RemoteError,
    ResponseTooLarge,
)

RUN = hashlib.sha256(b"transport-test").digest()
register_kind("test.blob", 8 * 1024 * 1024)
ME = Identity.generate()


@pytest.fixture
async def server():
    srv = PeerServer()
    seen = []

    async def echo(env, request):
        seen.append(env)
        return hashlib.sha256(env.payload).digest()

    async def busy(env, request):
        raise BackPressure("too many deltas in flight; retry later")

    async def big(request):
        return web.Response(body=b"x" * 4096)

    async def not_yet(env, request):  # (refuses a message until it has refused it once: an owner-to-be)
        if not srv.refused:
            srv.refused.append(env)
            raise Unavailable("not the owner of fragment 1 yet")
        seen.append(env)
        return b"ok"

    srv.refused = []
    srv.add_envelope_route("/v1/echo", EnvelopeVerifier(RUN), echo, kinds={"test.blob"})
    srv.add_envelope_route("/v1/busy", EnvelopeVerifier(RUN), busy)
    srv.add_envelope_route("/v1/not-yet", EnvelopeVerifier(RUN), not_yet)
    srv.add_route("GET", "/v1/big", big)
    await srv.start()
    srv.seen = seen
    yield srv
    await srv.stop()


async def test_large_envelope_streams_and_is_verified(server):
    payload = bytes(range(256)) * 20_000  # 5 MB, several chunks
    async with PeerClient() as client:
        env = seal(ME, "test.blob", RUN, {"p": 1}, payload)
        out = await client.send_envelope(server.url, "/v1/echo", env)
    assert out == hashlib.sha256(payload).digest()
    assert bytes(server.seen[0].payload) == payload
    served = server.counters.served["/v1/echo"]
    assert served.requests == 1 and served.bytes_in == env.frame_size()
    assert client.counters.sent["/v1/echo"].bytes_out == env.frame_size()


async def test_protocol_errors_become_status_and_one_line_reason(server):
    async with PeerClient() as client:
        with pytest.raises(RemoteError) as e:
            await client.request("POST", server.url, "/v1/echo", body=b"\0\0\0\x05hello")
        assert e.value.status == 400 and "\n" not in e.value.reason
        other = seal(ME, "test.blob", hashlib.sha256(b"x").digest(), {}, b"")
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/echo", other)
        assert e.value.status == 409 and "run" in e.value.reason
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/busy", seal(ME, "test.blob", RUN, {}, b""))
        assert e.value.status == 429 and "retry later" in e.value.reason
    assert server.seen == []


async def test_a_message_refused_as_unavailable_may_be_sent_again_but_one_taken_is_not(server):
    # a drain relays a signed delta to the fragment's next owner until that owner knows it owns it (503):
    # the same bytes must get in then; once taken, they are a replay like any other
    env = seal(ME, "test.blob", RUN, {"p": 1}, b"delta")
    async with PeerClient() as client:
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/not-yet", env)
        assert e.value.status == 503
        assert await client.send_envelope(server.url, "/v1/not-yet", env) == b"ok"
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/not-yet", env)
        assert e.value.status == 409 and "already received" in e.value.reason
        with pytest.raises(RemoteError) as e:  # (any other refusal still spends the nonce)
            await client.send_envelope(server.url, "/v1/busy", env)
        assert e.value.status == 429
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/busy", env)
        assert e.value.status == 409
    assert len(server.seen) == 1


async def test_wrong_kind_on_route_is_400(server):
    register_kind("test.other", 10)
    async with PeerClient() as client:
        with pytest.raises(RemoteError) as e:
            await client.send_envelope(server.url, "/v1/echo", seal(ME, "test.other", RUN, {}, b""))
    assert e.value.status == 400


async def test_oversized_content_length_refused_before_body(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b" 413 " in status


async def test_response_over_limit_is_refused(server):
    async with PeerClient() as client:
        with pytest.raises(ResponseTooLarge):
            await client.request("GET", server.url, "/v1/big", max_response=1000)
        assert len(await client.request("GET", server.url, "/v1/big")) == 4096


async def test_peer_that_accepts_but_never_answers_hits_the_deadline():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # accepts connections (kernel backlog) but never reads or answers
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        async with PeerClient(policy=DeadlinePolicy(floor_s=0.3, initial_rtt_s=0.01)) as client:
            t = asyncio.get_running_loop().time()
            with pytest.raises(DeadlineExceeded, match="within"):
                await client.request("GET", url, "/v1/x")
            assert asyncio.get_running_loop().time() - t < 2.0
    finally:
        sock.close()


async def test_only_idempotent_requests_are_retried():
    hits = []

    async def flaky(request):
        hits.append(1)
        return web.Response(status=429, text="slow down")

    srv = PeerServer()
    srv.add_route("POST", "/v1/flaky", flaky)
    await srv.start()
    try:
        async with PeerClient(retries=2) as client:
            with pytest.raises(RemoteError):
                await client.request("POST", srv.url, "/v1/flaky")
            assert len(hits) == 1
            with pytest.raises(RemoteError):
                await client.request("POST", srv.url, "/v1/flaky", idempotent=True)
            assert len(hits) == 4
            with pytest.raises(RemoteError):  # a caller with other peers to ask turns retries off
                await client.request("POST", srv.url, "/v1/flaky", idempotent=True, retries=0)
            assert len(hits) == 5
    finally:
        await srv.stop()


async def test_refused_connection_is_peer_unreachable():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    async with PeerClient(retries=0) as client:
        with pytest.raises(PeerUnreachable):
            await client.request("GET", f"http://127.0.0.1:{port}", "/v1/x")


async def test_graceful_shutdown_finishes_in_flight_requests():
    started = asyncio.Event()

    async def slow(request):
        started.set()
        await asyncio.sleep(0.3)
        return web.Response(text="done")

    srv = PeerServer(shutdown_timeout_s=3)
    srv.add_route("GET", "/v1/slow", slow)
    await srv.start()
    async with PeerClient() as client:
        task = asyncio.create_task(client.request("GET", srv.url, "/v1/slow"))
        await started.wait()
        await srv.stop()
        assert await task == b"done"
        with pytest.raises(PeerUnreachable):
            await client.request("GET", srv.url, "/v1/slow")


def test_deadline_adapts_to_observed_latency_and_rate():
    est = LinkEstimator(DeadlinePolicy(floor_s=0.01, ceiling_s=1000, slack=2))
    est.observe(0.05, 100)
    assert est.deadline(0) == pytest.approx(0.1)
    est.observe(1.0, 10_000_000)  # 10 MB in 1 s, latency included
    assert est.rate_bps == pytest.approx(10e6, rel=0.01)
    assert est.deadline(100_000_000) == pytest.approx(2 * (0.05 + 10), rel=0.01)
    slow = LinkEstimator(DeadlinePolicy(floor_s=0.5, ceiling_s=30))
    assert slow.deadline(0) >= 0.5 and slow.deadline(10**12) == 30


async def test_a_body_that_trickles_in_is_cut_at_the_minimum_pace(server, monkeypatch):
    """slow-loris: a byte every 0.1 s never completes; with a 1 s grace at 1 KiB/s the peer answers 408 within
    about a second instead of holding the connection for as long as the sender likes."""
    monkeypatch.setattr(intake, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(intake, "BODY_MIN_RATE", 1024.0)
    frame = seal(ME, "test.blob", RUN, {}, b"x" * 100_000).to_bytes()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(frame))
    started = asyncio.get_running_loop().time()

    async def trickle():
        for byte in frame:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    try:
        status = await asyncio.wait_for(reader.readline(), 10)
    finally:
        sender.cancel()
        writer.close()
    assert b" 408 " in status and asyncio.get_running_loop().time() - started < 5
    assert server.seen == []


async def test_a_body_on_a_get_route_above_the_plain_body_limit_is_413(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /v1/big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (2 * 1024 * 1024))
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    assert b" 413 " in status


def test_malformed_http_is_logged_as_one_rate_limited_line_without_a_traceback():
    clock = [0.0]
    log_filter = intake.RefusedRequestLog(every_s=10.0, clock=lambda: clock[0])
    try:
        raise http_exceptions.BadHttpMessage("Invalid character in Content-Length")
    except http_exceptions.BadHttpMessage:
        exc_info = sys.exc_info()

    def record() -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (),
                                 exc_info)

    first = record()
    assert log_filter.filter(first) and first.exc_info is None and first.levelno == logging.INFO
    assert "Invalid character" in first.getMessage()
    assert not any(log_filter.filter(record()) for _ in range(50))  # the next 50 within 10 s: left out
    clock[0] = 11.0
    later = record()
    assert log_filter.filter(later) and "50 more" in later.getMessage()
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "a real bug", (), None)
    assert log_filter.filter(other) and other.levelno == logging.ERROR
