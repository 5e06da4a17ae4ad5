"""Every input is bounded before it costs anything: a route refuses a payload above its plan-sized limit or a
kind it does not take as soon as the envelope's header has arrived, without waiting for the payload."""

from __future__ import annotations

import asyncio
import socket
import struct
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
from aiohttp import web

from diloco.coordinator.wire import (
    DELTA,
    REPLICATE,
    ROUTE_DELTA,
    ROUTE_REPLICATE,
    ROUTE_STATUS,
    ROUTE_UPDATE,
    UPDATE,
    replicate_payload_max,
    tensor_payload_max,
)
from diloco.node import reach
from diloco.protocol import canonical
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import SIGNATURE_BYTES, seal
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError

from .swarm_utils import LocalLearner, tiny_run


@pytest.fixture(scope="module")
def learner():
    node = LocalLearner(tiny_run(quorum=1), 0).start()
    try:
        yield node
    finally:
        node.learner.close()


def header_only(node: LocalLearner, route: str, kind: str, payload_len: int) -> tuple[int, bytes]:
    """POST the prefix of an envelope declaring `payload_len` payload bytes, chunked, and no payload: the
    status the peer answers within 5 s (it must not wait for bytes that never come)."""
    swarm = node.learner.swarm
    env = seal(swarm.identity, kind, swarm.spec.run_id, {}, b"x")
    h = canonical.unpackb(env.header)  # the declared length is changed: the signature fails if it is checked
    h["payload_len"] = payload_len
    header = canonical.packb(h)
    prefix = struct.pack(">I", len(header)) + header + bytes(SIGNATURE_BYTES)
    url = urlparse(node.url)
    with socket.create_connection((url.hostname, url.port), timeout=5) as s:
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        s.sendall(f"{len(prefix):x}\r\n".encode() + prefix + b"\r\n")
        answer = s.recv(4096)
    status = int(answer.split(b" ", 2)[1])
    return status, answer


def test_a_route_refuses_a_payload_above_its_plan_sized_limit_before_reading_it(learner):
    swarm = learner.learner.swarm
    codec, numel = get_codec(swarm.spec.codec), swarm.store.max_numel()
    for route, kind, limit in [(ROUTE_UPDATE, UPDATE, tensor_payload_max(codec, numel)),
                               (ROUTE_DELTA, DELTA, tensor_payload_max(codec, numel)),
                               (ROUTE_REPLICATE, REPLICATE, replicate_payload_max(codec, numel))]:
        assert limit < 1 << 24  # the tiny run's fragments: far below the 2 GiB limit of the kind
        status, answer = header_only(learner, route, kind, limit + 1)
        assert status == 413 and b"exceeds the limit" in answer, (route, answer[:200])


def test_a_route_refuses_another_kind_before_reading_its_payload(learner):
    status, answer = header_only(learner, ROUTE_UPDATE, DELTA, 1000)
    assert status == 400 and b"not accepted" in answer, answer[:200]


def test_the_reachability_probe_answers_a_member_about_its_own_address_only(learner):
    """A signed request from a member naming its own URL is `reachable`; one naming another peer's address is
    not, a second one within 10 s is refused (429), and an unsigned GET is no probe at all."""
    genesis_spec = learner.learner.swarm.spec
    second = Identity.generate()  # a joiner: its own key and a server that answers /v1/status as it

    async def probes() -> list:
        server = PeerServer()
        async def status(request: web.Request) -> web.Response:
            return web.json_response({"peer_id": second.peer_id})

        server.add_route("GET", ROUTE_STATUS, status)
        await server.start()
        client = PeerClient()
        try:
            mine = await reach.ask(client, second, genesis_spec, learner.url, server.url)
            with pytest.raises(RemoteError) as again:
                await reach.ask(client, second, genesis_spec, learner.url, server.url)
            someone_else = await reach.ask(client, Identity.generate(), genesis_spec, learner.url, server.url)
            return [mine, again.value.status, someone_else]
        finally:
            await client.close()
            await server.stop()

    assert asyncio.run(probes()) == [True, 429, False]
    with pytest.raises(urllib.error.HTTPError) as unsigned:
        urllib.request.urlopen(f"{learner.url}/v1/reach?url=http://127.0.0.1:1", timeout=5)
    assert unsigned.value.code in (404, 405)


def test_a_learner_refuses_a_token_count_its_run_would_refuse_before_counting_it(learner):
    lr = learner.learner
    t, tokens = lr.t, lr.tokens
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        lr.step(tokens=lr.spec.max_tokens_per_step + 1)
    assert (lr.t, lr.tokens) == (t, tokens)
