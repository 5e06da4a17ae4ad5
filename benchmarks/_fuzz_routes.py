"""Route fuzzing: raw HTTP requests at every route of a live peer (a one-learner swarm on a loopback port).

Why raw sockets: `http.client` and aiohttp's client refuse odd paths before they leave; here every byte of the
request line reaches the peer. Envelopes are signed with a real key of the run (fresh timestamp, right run
id), their fields and payload mutated, so they pass the verifier and reach the route's own parsers. Any 500
(an exception in a handler), a connection that never answers, or a refused request that changed what the
peer holds (its fragments' versions, its DHT records) is counted.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
import struct
import time
from typing import Any
from urllib.parse import quote, urlparse

import torch
from _fuzz_core import Tally, mutate_bytes, mutate_value

from diloco.coordinator import wire
from diloco.node.learner import Learner
from diloco.node.swarm import SwarmConfig
from diloco.node.train import new_run, task_of
from diloco.protocol import canonical
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import DOMAIN, payload_digest_of, seal
from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import Identity

ANSWER_BOUND_S = 10.0  # per request: a peer that has not answered by then counts as hung


class LivePeer:
    """A started one-learner swarm (quorum 1, open run) and the valid messages mutations start from."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        genesis = new_run(Identity.generate(), "fuzz-run", task="markov", inner_steps=10, fragments=4, quorum=1,
                          codec="int8")
        task = task_of(genesis.spec)
        model = task.build_model()
        cfg = SwarmConfig(peers=[], member_ttl_s=4.0, member_refresh_s=1.0, member_poll_s=0.5, watch_s=1.0,
                          join_timeout_s=60)
        self.learner = Learner(model, task.optimizer(model), genesis, config=cfg).start()
        self.swarm = self.learner.swarm
        limiter = self.swarm.server.limiter  # (per-address request and connection rates: this one client sends
        # hundreds a second, on a new connection each)
        rates = {f.name: 1e9 for f in dataclasses.fields(limiter.limits) if "rate" in f.name or "burst" in f.name}
        limiter.limits = dataclasses.replace(limiter.limits, **rates)
        self.spec = self.swarm.spec
        url = urlparse(self.swarm.url)
        self.addr = (url.hostname, url.port)
        self.P = len(self.swarm.store)
        self.stranger = Identity.generate()
        self.last_accept = [-1e9]  # monotonic time of the last accepted envelope (its effects may still run)
        self.codec = get_codec(self.spec.codec)
        numel = self.swarm.store.numel(0)
        meta, payload = self.codec.encode(torch.randn(numel) * 1e-3)
        self.tensor = (meta, bytes(payload))
        labels = self.swarm.store.labels()
        me = self.swarm.identity.peer_id
        self.fields = {
            wire.DELTA: wire.DeltaFields(0, labels[0], 10, 640, meta).to_fields(),
            wire.UPDATE: wire.UpdateFields(0, labels[0], labels[0].next(), bytes(32), meta, learners=(me,),
                                           merged=(wire.Merged(me, bytes(32), 10, 640, 0),), clip=1.0).to_fields(),
            wire.REPLICATE: None,  # (set below: its update_len is the trailer's update frame's length)
            wire.REACH: {"url": self.swarm.url},
            wire.ACCUSE: wire.AccuseFields(0, labels[0].next(), 120, 64).to_fields(),
        }
        # a replicate's trailer (protocol §4.1): an update frame as the owner signed it, then its delta frames
        self.update_frame = seal(self.swarm.identity, wire.UPDATE, self.spec.run_id, self.fields[wire.UPDATE],
                                 self.tensor[1]).to_bytes()
        self.fields[wire.REPLICATE] = wire.ReplicateFields(0, 1, labels[0].next(), False, len(self.update_frame),
                                                           meta).to_fields()

    def close(self) -> None:
        self.learner.close()

    def state(self) -> tuple[Any, ...]:
        """What a refused request must leave as it was."""
        return tuple(self.swarm.store.labels()), len(self.swarm.dht.storage)


def http(addr: tuple[str, int], request: bytes) -> int | None:
    """Send one raw request on a new connection; the answer's status (0: closed without an answer; None: no
    answer within ANSWER_BOUND_S)."""
    with socket.create_connection(addr, timeout=ANSWER_BOUND_S) as s:
        s.settimeout(ANSWER_BOUND_S)
        try:
            s.sendall(request)
            head = b""
            deadline = time.monotonic() + ANSWER_BOUND_S
            while b"\r\n" not in head and time.monotonic() < deadline:
                part = s.recv(4096)
                if not part:
                    break
                head += part
        except TimeoutError:
            return None
        except (ConnectionResetError, BrokenPipeError):
            return 0
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() and len(parts[1]) == 3 else 0


def seal_any(ident: Identity, kind: str, run_id: bytes, fields: Any, payload: bytes) -> bytes:
    """A signed frame like `seal`'s, without its limits (a sender may declare any payload length)."""
    env = seal(ident, kind, run_id, fields, b"")
    h = canonical.unpackb(env.header)
    h["payload_len"], h["payload_digest"] = len(payload), payload_digest_of(payload, h["v"])
    header = canonical.packb(h)
    return struct.pack(">I", len(header)) + header + ident.sign(DOMAIN + header) + payload


def _get_request(rng: random.Random, peer: LivePeer) -> bytes:
    p = rng.choice(["0", "1", str(peer.P - 1), str(peer.P), "-1", "01", "9" * 30, "٣", "²", "0x1", "", "%30"])
    if rng.random() < 0.3:
        p = mutate_bytes(rng, p.encode()).decode("latin-1")
    label = str(rng.choice(peer.swarm.store.labels()))
    label = rng.choice([label, "0.0", "1.2", "", ".", "1.", ".1", "9" * 20 + ".0", "0." + "9" * 5000, "a.b"])
    if rng.random() < 0.3:
        label = mutate_bytes(rng, label.encode()).decode("latin-1")
    path = rng.choice([f"/v1/fragment/{p}", f"/v1/fragment/{p}?held={label}", f"/v1/updates/{p}?after={label}",
                       f"/v1/momentum/{p}?label={label}",
                       "/v1/versions", "/v1/status", f"/v1/updates/{p}?after={label}&after=0.0",
                       f"/v1/updates/{p}", f"/v1/momentum/{p}?label=", "/v1/", "/v1/fragment/", "/"])
    if rng.random() < 0.5:
        path = quote(path, safe="/?=&.%")
    elif rng.random() < 0.2:
        path = mutate_bytes(rng, path.encode()).decode("latin-1")
    method = rng.choice(["GET"] * 8 + ["HEAD", "POST", "PUT"])
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode("utf-8", "surrogateescape")


def _envelope_request(rng: random.Random, peer: LivePeer, *, broken: bool) -> tuple[str, bytes]:
    route, kind = rng.choice([(wire.ROUTE_DELTA, wire.DELTA), (wire.ROUTE_UPDATE, wire.UPDATE),
                              (wire.ROUTE_REPLICATE, wire.REPLICATE), (wire.ROUTE_REACH, wire.REACH),
                              (wire.ROUTE_ACCUSE, wire.ACCUSE), ("/v1/dht", "dht"), ("/v1/auth", "dht")])
    if rng.random() < 0.1:
        kind = rng.choice([wire.DELTA, wire.UPDATE, "dht", "x"])
    fields: Any = peer.fields.get(kind, {"op": "ping"})
    payload = peer.tensor[1] if kind in (wire.DELTA, wire.UPDATE, wire.REPLICATE) else b""
    if kind == wire.ACCUSE:  # (the shape of one: a replicate prefix, a momentum, a replicate frame)
        payload = bytes(120) + peer.tensor[1][:64] + bytes(rng.randrange(0, 400))
    if kind == "dht":
        payload = canonical.packb({"node": peer.swarm.dht.info.to_wire()})
    r = rng.random()
    if r < 0.5:
        fields = mutate_value(rng, fields, keep_root=True)
    elif r < 0.8:
        payload = mutate_bytes(rng, payload)
    else:
        fields, payload = mutate_value(rng, fields, keep_root=True), mutate_bytes(rng, payload)
    ident = peer.swarm.identity if rng.random() < 0.7 else peer.stranger
    try:
        frame = seal_any(ident, kind, peer.spec.run_id, fields, payload)
    except ProtocolError:  # fields canonical msgpack cannot hold: no peer could send them
        frame = seal_any(ident, kind, peer.spec.run_id, {}, payload)
    if kind == wire.REPLICATE and rng.random() < 0.7:  # (the trailer, intact or mutated: not signed by the frame)
        trailer = peer.update_frame if rng.random() < 0.3 else mutate_bytes(rng, peer.update_frame)
        frame += trailer + bytes(rng.choice((0, 0, 1, 64)))
    if broken:  # (a frame changed after signing: until the mutation, every byte is as a member sent it)
        while True:
            changed = mutate_bytes(rng, frame)
            if changed != frame:
                frame = changed
                break
    # (a body shorter than its Content-Length only waits for aiohttp's read timeout: not sent)
    length = len(frame) if rng.random() < 0.9 else rng.choice((0, max(len(frame) - 1, 0)))
    head = f"POST {route} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {length}\r\n\r\n"
    return route, head.encode() + frame[:length]


QUIET_S = 40.0  # a refused request's state check waits this long after the last accepted one (its round ran)


class BackgroundErrors(logging.Handler):
    """Counts exceptions the peer logs (a failed round, a crashed task): errors no answer shows."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(self.format(record))


def route_target(peer: LivePeer, *, signed: bool):
    """One request at a route; counts a 500, a hang, or a refused request that changed the peer's state.

    `signed=False`: GETs and envelope frames broken after signing (none can be accepted, so every refusal's
    state is checked); `signed=True`: valid signatures over mutated fields and payloads, which reach the
    routes' own parsers (state checked only while no accepted request's round may still be running)."""
    last_accept = peer.last_accept

    def one(rng: random.Random, tally: Tally) -> None:
        envelope = rng.random() < 0.6
        route, request = _envelope_request(rng, peer, broken=not signed) if envelope else ("", _get_request(rng, peer))
        name = "routes.post" if envelope else "routes.get"
        tally.per_decoder[name] = tally.per_decoder.get(name, 0) + 1
        quiet = time.monotonic() - last_accept[0] > QUIET_S
        before = peer.state()
        status = http(peer.addr, request)
        key = f"{name} {status}"
        tally.statuses[key] = tally.statuses.get(key, 0) + 1
        if status is None:
            tally.hangs += 1
            tally.fail(name, "no answer", request[:300].hex())
        elif status == 500:
            tally.untyped_errors += 1
            tally.fail(name, "answered 500", request[:2000].hex())
        elif envelope and (status == 200 or (status == 409 and route == wire.ROUTE_UPDATE)):
            last_accept[0] = time.monotonic()  # (a 409 on /v1/update starts a catch-up)
            tally.accepted[name] = tally.accepted.get(name, 0) + (status == 200)
        elif status >= 400 or status == 0:
            if quiet:
                tally.statuses["state checked"] = tally.statuses.get("state checked", 0) + 1
                if peer.state() != before:
                    tally.state_changes += 1
                    tally.fail(name, f"state changed by a refused request ({status})", request[:300].hex())
        else:
            tally.accepted[name] = tally.accepted.get(name, 0) + 1
    return one
