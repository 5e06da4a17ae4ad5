"""Bulk GETs read straight into a sink (`protocol/bulk.py`), against aiohttp servers and scripted raw peers."""

import asyncio
import hashlib
import os

import blake3
import pytest
import torch
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.wire import FragmentReader, anchor_digest, pack_fragment
from diloco.protocol.bulk import MAX_HEAD, RunningDigest, get_into, parse_head
from diloco.protocol.deadlines import DeadlinePolicy
from diloco.protocol.errors import Malformed
from diloco.protocol.transport import (
    DeadlineExceeded,
    PeerClient,
    PeerServer,
    PeerUnreachable,
    RemoteError,
    ResponseTooLarge,
)

BIG = os.urandom(3 * 1024 * 1024 + 17)


class Collect:
    """A BodySink into one bytearray, handing out at most `room` bytes per read; may refuse at its end."""

    def __init__(self, refuse: bool = False, room: int = 1 << 30) -> None:
        self.refuse, self.room, self.begun, self.reads = refuse, room, [], 0

    def begin(self, content_length):
        self.begun.append(content_length)
        self.data, self.pos = bytearray(content_length), 0

    def buffer(self):
        return memoryview(self.data)[self.pos : self.pos + self.room]

    def advance(self, n):
        self.pos += n
        self.reads += 1

    def end(self):
        if self.refuse:
            raise Malformed("not what was expected")


@pytest.fixture
async def server():
    srv = PeerServer()

    async def big(request):
        return web.Response(body=BIG)

    async def streamed(request):  # as the fragment route answers: a StreamResponse with a Content-Length
        resp = web.StreamResponse()
        resp.content_length = len(BIG)
        await resp.prepare(request)
        for i in range(0, len(BIG), 1 << 20):
            await resp.write(BIG[i : i + (1 << 20)])
        await resp.write_eof()
        return resp

    srv.add_route("GET", "/v1/big", big)
    srv.add_route("GET", "/v1/streamed", streamed)
    await srv.start()
    yield srv
    await srv.stop()


async def test_the_body_lands_in_the_sink_in_reads_of_any_size(server):
    async with PeerClient() as client:
        for path, room in [("/v1/big", 1 << 30), ("/v1/streamed", 1 << 30), ("/v1/streamed", 4093)]:
            sink = Collect(room=room)
            assert await client.request("GET", server.url, path, sink=sink) == b""
            assert sink.begun == [len(BIG)] and sink.data == BIG
            assert room > len(BIG) or sink.reads >= len(BIG) // room
        assert client.counters.sent["/v1/streamed"].bytes_in == 2 * len(BIG)


async def test_a_sink_may_refuse_and_an_error_or_oversized_answer_never_reaches_it(server):
    async with PeerClient() as client:
        with pytest.raises(Malformed):
            await client.request("GET", server.url, "/v1/big", sink=Collect(refuse=True))
        with pytest.raises(ResponseTooLarge):
            await client.request("GET", server.url, "/v1/big", max_response=1000, sink=(small := Collect()))
        with pytest.raises(RemoteError) as e:
            await client.request("GET", server.url, "/v1/nothing-here", sink=(unused := Collect()))
        assert e.value.status == 404 and small.begun == unused.begun == []
        with pytest.raises(ValueError):
            await client.request("POST", server.url, "/v1/big", body=b"x", sink=Collect())
        assert (await client.request("GET", server.url, "/v1/big")) == BIG  # the aiohttp path still reads it


async def scripted_peer(answer: bytes, then_close: bool = True):
    """A raw TCP peer that reads one request head and writes `answer` (then closes, or keeps silent)."""

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if then_close:
            writer.close()
        else:
            await asyncio.sleep(30)

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize(
    "answer, error, match",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 60, PeerUnreachable, "after 60 of 100"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", PeerUnreachable, "before answering"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", Malformed, "status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", Malformed, "whole"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc", Malformed, "whole"),
        (b"HTTP/1.1 200 OK\r\n\r\nabc", Malformed, "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nabc", Malformed, "Content-Length"),  # '²' in latin-1
        (b"HTTP/1.1 2\xb2 OK\r\nContent-Length: 3\r\n\r\nabc", Malformed, "status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc", Malformed, "twice"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * MAX_HEAD, Malformed, "longer than"),
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 9\r\n\r\ntoo busy\n", RemoteError, "too busy"),
    ],
)
async def test_a_peer_that_breaks_the_answer_gets_a_typed_error(answer, error, match):
    srv, url = await scripted_peer(answer)
    try:
        async with PeerClient(retries=0) as client:
            with pytest.raises(error, match=match):
                await client.request("GET", url, "/v1/x", sink=Collect(), idempotent=True)
            assert client.counters.sent["/v1/x"].errors == 1
    finally:
        srv.close()


async def test_head_and_body_in_one_write_and_reads_past_the_end_are_not_taken():
    body = bytes(range(256)) * 40
    srv, url = await scripted_peer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body + b"junk")
    try:
        async with PeerClient() as client:
            sink = Collect()
            await client.request("GET", url, "/v1/x", sink=sink)
        assert sink.data == body
    finally:
        srv.close()


async def test_a_peer_that_stops_mid_body_hits_the_deadline_and_the_connection_is_dropped():
    srv, url = await scripted_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nxx", then_close=False)
    try:
        async with PeerClient(policy=DeadlinePolicy(floor_s=0.3, initial_rtt_s=0.01)) as client:
            t = asyncio.get_running_loop().time()
            with pytest.raises(DeadlineExceeded, match="within"):
                await client.request("GET", url, "/v1/x", sink=Collect(), deadline_s=0.3)
            assert asyncio.get_running_loop().time() - t < 2.0
            assert client.counters.sent["/v1/x"].bytes_in == 2
    finally:
        srv.close()


async def test_a_bulk_answers_deadline_counts_its_size():
    """The rtt-only deadline (0.3 s) is far shorter than this slow 2 MB answer; the size-aware one is not."""

    async def slow(request):
        resp = web.StreamResponse()
        resp.content_length = 2_000_000
        await resp.prepare(request)
        for _ in range(10):
            await asyncio.sleep(0.08)
            await resp.write(b"z" * 200_000)
        await resp.write_eof()
        return resp

    srv = PeerServer()
    srv.add_route("GET", "/v1/slow", slow)
    await srv.start()
    try:
        policy = DeadlinePolicy(floor_s=0.3, initial_rtt_s=0.01, initial_rate_bps=2e6)
        async with PeerClient(policy=policy) as client:
            sink = Collect()
            await client.request("GET", srv.url, "/v1/slow", sink=sink, max_response=2_000_000)
            assert sink.data == b"z" * 2_000_000
    finally:
        await srv.stop()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.builds(lambda s, rest: b"HTTP/1.1 " + s.encode("latin-1") + rest,
                                          st.sampled_from(["200 OK", "404 x", "2", "", "2\xb2 OK"]),
                                          st.binary(max_size=80)))
def test_any_head_either_parses_or_is_malformed(head):
    try:
        status, length = parse_head(head)
    except Malformed:
        return
    assert 0 <= status and 0 <= length


async def test_every_bulk_answer_counts_one_connection_and_a_refused_one_none(server):
    import socket

    with socket.socket() as s:  # a port that refuses connections
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with PeerClient(retries=0) as client:
        for _ in range(3):
            await client.request("GET", server.url, "/v1/big", sink=Collect())
        assert client.counters.connections_opened == 3  # `Connection: close`: one each
        with pytest.raises(PeerUnreachable):
            await client.request("GET", refused, "/v1/big", sink=Collect())
        assert client.counters.connections_opened == 3
        assert await client.request("GET", server.url, "/v1/big") == BIG  # pooled: aiohttp's own connection
        assert client.counters.connections_opened == 4


@given(cuts=st.lists(st.integers(0, len(BIG)), max_size=12), step=st.sampled_from([1, 4096, 1 << 20, 1 << 30]))
@settings(max_examples=40, deadline=None)
def test_a_running_digest_is_that_of_the_bytes_filled_however_they_arrive(cuts, step):
    async def run() -> bytes:
        data = bytearray(len(BIG))
        digest = RunningDigest(memoryview(data), hashlib.sha256())
        digest.STEP = step  # (from one job per read to none before the end)
        for n in [*sorted(cuts), len(BIG)]:
            data[:n] = BIG[:n]  # (the socket writes front to back: bytes below n are final)
            digest.filled(n)
            await asyncio.sleep(0)
        return await digest.digest()

    assert asyncio.run(run()) == hashlib.sha256(BIG).digest()


async def test_an_empty_running_digest_is_the_digest_of_nothing():
    assert await RunningDigest(memoryview(b""), blake3.blake3()).digest() == blake3.blake3(b"").digest()


async def test_a_fragment_read_while_hashed_has_the_digest_of_its_anchor():
    numel, cert = (3 << 20) + 5, b"a certificate"
    anchor = torch.randn(numel)
    head, data = pack_fragment(cert, anchor.numpy().data.cast("B"))
    body = bytes(head) + bytes(data)
    srv = PeerServer()

    async def fragment(request):
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        for i in range(0, len(body), 1 << 19):
            await resp.write(body[i : i + (1 << 19)])
        return resp

    srv.add_route("GET", "/v1/f", fragment)
    await srv.start()
    try:
        for hashing in (True, False):
            reader = FragmentReader(numel, hash_while_reading=hashing)
            await get_into(srv.url, "/v1/f", reader, len(body))
            assert reader.cert == cert and torch.equal(reader.anchor, anchor)
            assert await reader.digest() == anchor_digest(anchor)
    finally:
        await srv.stop()
