"""A private (`allowlist`) run end to end: its learners train over TLS with signed reads, a stranger gets 403 on
every route and changes nothing, and a capture of the bytes between two learners holds no tensor data, while
the same capture of an open run does (docs/security.md)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from diloco.coordinator.authority import TERM_SLOTS, term_slot
from diloco.coordinator.certs import AuthRecord, auth_key
from diloco.coordinator.membership import ROUTE_AUTH
from diloco.coordinator.version import Version
from diloco.coordinator.wire import (
    DELTA,
    REPLICATE,
    ROUTE_DELTA,
    ROUTE_REACH,
    ROUTE_REPLICATE,
    ROUTE_UPDATE,
    UPDATE,
)
from diloco.protocol import canonical
from diloco.protocol.dht.node import DEFAULT_NETWORK_ID, DHT_ROUTE
from diloco.protocol.dht.records import ValueRecord
from diloco.protocol.envelope import seal
from diloco.protocol.identity import Identity
from diloco.protocol.reads import HEADER, ReadSigner

from .swarm_utils import LocalLearner, tiny_run, wait_until
from .test_tls import Relay

KEYS = [Identity.generate() for _ in range(2)]
STRANGER = Identity.generate()
GETS = ["/v1/fragment/0", "/v1/updates/0?after=0.0", "/v1/versions", "/v1/momentum/0?label=0.0", "/v1/status",
        "/v1/no-such-route"]


class RelayThread:
    """`Relay` (a byte-capturing TCP relay) on an event loop of its own, in front of a port chosen now."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.target = s.getsockname()[1]
        self.relay = Relay(self.target)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self.relay.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def unverified() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


def answer(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=unverified() if url.startswith("https") else None) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def labels(node: LocalLearner) -> list:
    return [h.label for h in node.learner.swarm.store.held]


def update_payloads(node: LocalLearner) -> list[bytes]:
    """The tensor payloads of the update frames this learner keeps (the encoded changes of the anchors)."""
    out = []
    for p in range(len(node.learner.swarm.store.held)):
        for frame in node.learner.swarm.store.updates_after(p, Version(0, 0)) or []:
            header_len = int.from_bytes(frame[:4], "big")
            out.append(bytes(frame[4 + header_len + 64 :]))
    return out


def train_until_published(nodes: list[LocalLearner], rounds: int = 2, timeout: float = 60) -> None:
    start = labels(nodes[0])
    deadline = time.monotonic() + timeout
    while sum(a != b for a, b in zip(labels(nodes[0]), start, strict=True)) < rounds:
        assert time.monotonic() < deadline, f"no {rounds} published versions in {timeout:.0f}s: {labels(nodes[0])}"
        for n in nodes:
            n.train(5)


def two_learners(private: bool, *relays: RelayThread):
    """Two learners of a private run; the i-th relay, if given, fronts learner i (its announced address)."""
    genesis = tiny_run(quorum=2, membership="allowlist", allowlist=[k.public_key for k in KEYS])
    scheme = "https" if private else "http"
    nodes: list[LocalLearner] = []
    for i, key in enumerate(KEYS):
        fronted = {"port": relays[i].target, "announce": f"{scheme}://127.0.0.1:{relays[i].port}"} \
            if i < len(relays) else {}
        nodes.append(LocalLearner(genesis, i, [nodes[0].url] if nodes else None, learner_kw={"identity": key},
                                  private=private, **fronted).start())
    return genesis, nodes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("private", [True, False], ids=["private", "open-control"])
def test_the_bytes_between_two_learners_of_a_private_run_hold_no_tensor_data(private):
    # a relay in front of each learner: every byte either sends the other passes one (with one, the control
    # captured no update when the unfronted learner owned no fragment: the other pushed it its updates directly)
    relays = [RelayThread(), RelayThread()]
    nodes = []
    try:
        genesis, nodes = two_learners(private, *relays)
        assert nodes[0].learner.swarm.url.startswith("https" if private else "http")
        wait_until(lambda: all(len(n.learner.swarm.members.live()) == 2 for n in nodes), 30, "2 live members")
        train_until_published(nodes)
        captured = b"".join(bytes(r.relay.captured) for r in relays)
        windows = [w for n in nodes for blob in update_payloads(n) for i in range(0, len(blob) - 32, 97)
                   if (w := blob[i : i + 32]).count(0) < 16]
        assert len(windows) > 100, len(windows)
        found = sum(w in captured for w in windows)
        if private:
            assert found == 0, f"{found} of {len(windows)} windows of tensor bytes in the capture"
        else:
            assert found > len(windows) // 20, f"only {found} of {len(windows)}: the control cannot fail"
    finally:
        for n in nodes:
            n.learner.close()
        for r in relays:
            r.close()


@pytest.mark.timeout(120)
def test_a_stranger_gets_403_on_every_route_of_a_private_run_and_changes_nothing():
    relay = RelayThread()
    nodes = []
    try:
        genesis, nodes = two_learners(True, relay)
        wait_until(lambda: all(len(n.learner.swarm.members.live()) == 2 for n in nodes), 30, "2 live members")
        train_until_published(nodes, rounds=1)
        url = f"https://127.0.0.1:{relay.target}"
        run = genesis.spec.run_id
        refused = {}
        for path in GETS:
            refused[f"GET {path}"] = answer(url, "GET", path)
            signed = ReadSigner(STRANGER, run)("GET", path)
            refused[f"GET {path} (signed)"] = answer(url, "GET", path, headers={HEADER: signed})
        payload = torch.zeros(8).numpy().tobytes()
        for route, kind in [(ROUTE_DELTA, DELTA), (ROUTE_UPDATE, UPDATE), (ROUTE_REPLICATE, REPLICATE),
                            (ROUTE_REACH, "reach")]:
            frame = seal(STRANGER, kind, run, {"p": 0}, payload if kind != "reach" else b"").to_bytes()
            refused[f"POST {route}"] = answer(url, "POST", route, frame)
        dht = seal(STRANGER, "dht", DEFAULT_NETWORK_ID, {"op": "ping"}).to_bytes()
        refused[f"POST {DHT_ROUTE}"] = answer(url, "POST", DHT_ROUTE, dht)
        auth = ValueRecord.create(STRANGER, auth_key(run), AuthRecord(None, None).encode(), time.time() + 30,
                                  subkey=STRANGER.peer_id)
        refused[f"POST {ROUTE_AUTH}"] = answer(url, "POST", ROUTE_AUTH, canonical.packb(auth.to_wire()))
        assert refused == dict.fromkeys(refused, 403), refused
        member = ReadSigner(KEYS[1], run)("GET", "/v1/versions")
        assert answer(url, "GET", "/v1/versions", headers={HEADER: member}) == 200  # (the route itself works)
        slots = {0, *(term_slot(k.peer_id) for k in KEYS)}
        assert all(v.term % TERM_SLOTS in slots for n in nodes for v in labels(n)), [labels(n) for n in nodes]
        assert all(STRANGER.peer_id != m.peer_id for m in nodes[0].learner.swarm.members.live())
    finally:
        for n in nodes:
            n.learner.close()
        relay.close()


@pytest.mark.timeout(120)
def test_the_operators_port_serves_a_private_runs_views_without_a_key_and_nothing_else():
    """join --operator-listen (node/operator.py): the peer's own port refuses an unsigned read; the operator's
    port answers the dashboard, the status and the metrics over plain HTTP, and has no other route."""
    from prometheus_client.parser import text_string_to_metric_families

    genesis = tiny_run(quorum=2, membership="allowlist", allowlist=[k.public_key for k in KEYS])
    a = LocalLearner(genesis, 0, learner_kw={"identity": KEYS[0]}, private=True,
                     operator_listen=("127.0.0.1", 0)).start()
    b = LocalLearner(genesis, 1, [a.url], learner_kw={"identity": KEYS[1]}, private=True, client_mode=True,
                     operator_listen=("127.0.0.1", 0)).start()  # (no port of its own: the operator's only)
    try:
        swarm = a.learner.swarm
        assert swarm.operator is not None and b.learner.swarm.server is None
        with urllib.request.urlopen(b.learner.swarm.operator.url + "/v1/status", timeout=10) as r:
            assert json.loads(r.read())["peer_id"] == KEYS[1].peer_id
        view = swarm.operator.url
        assert view.startswith("http://127.0.0.1:") and a.url.startswith("https://")
        assert answer(a.url, "GET", "/v1/status") == 403  # (unsigned: refused on the peer's own port)
        with urllib.request.urlopen(view + "/v1/status", timeout=10) as r:
            status = json.loads(r.read())
        assert status["peer_id"] == KEYS[0].peer_id
        with urllib.request.urlopen(view + "/metrics", timeout=10) as r:
            names = {f.name for f in text_string_to_metric_families(r.read().decode())}
        assert "diloco_inner_steps" in names
        with urllib.request.urlopen(view + "/", timeout=10) as r:
            assert b"<html" in r.read().lower()
        for method, path in [("GET", "/v1/versions"), ("GET", "/v1/fragment/0"), ("POST", "/v1/delta"),
                             ("POST", "/v1/update"), ("POST", DHT_ROUTE)]:
            assert answer(view, method, path, b"" if method == "POST" else None) in (404, 405), path
    finally:
        for n in (b, a):
            n.learner.close()
