"""In-process fuzz targets: every decoder of network bytes, each fed mutations of valid inputs.

A target is `one(rng, tally)`: it makes one input from `rng` and checks it with `check_one` (typed errors
only, a time bound, no state change on refusal). Inputs that must pass a signature before reaching a deeper
check are re-signed after mutation with a real key, so the mutation reaches the check it aims at.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import torch
from _fuzz_core import PROTOCOL_ERRORS, Tally, check_one, junk_value, mutate_bytes, mutate_value

from diloco.coordinator import wire
from diloco.coordinator.runspec import GENESIS_DOMAIN, Genesis, RunSpec
from diloco.coordinator.version import Version
from diloco.protocol import bulk, canonical, codecs
from diloco.protocol.dht.node import DHTNode, _decode_reply
from diloco.protocol.dht.records import NODE_INFO_DOMAIN, NodeInfo, ValueRecord
from diloco.protocol.envelope import DOMAIN, Envelope, EnvelopeVerifier, ReplayCache, parse_header, seal
from diloco.protocol.errors import Malformed, ProtocolError, TooLarge, TransportError
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerClient

BOUND_S = 2.0  # per input: far above any honest decode of these sizes, far below a hang
NOW_MS = 1_800_000_000_000
RUN_ID = hashlib.sha256(b"fuzz-run").digest()
CODECS = ["fp32", "fp16", "bf16", "int8", "int4"]
MAX_ELEMENTS = 1 << 16

Target = Callable[[random.Random, Tally], None]


def raw_pack(obj: Any, rng: random.Random | None = None) -> bytes | None:
    """msgpack of `obj`: canonical when it can be (and `rng` says so, 80%), else without the canonical rules
    (so non-canonical inputs reach the decoder); None when msgpack cannot hold it."""
    if rng is not None and rng.random() < 0.8:
        try:
            return canonical.packb(obj)
        except ProtocolError:
            pass
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


def resign(ident: Identity, header: bytes, payload: bytes = b"") -> bytes:
    """A frame of exactly `header` (any bytes), signed by `ident`, with `payload`."""
    return struct.pack(">I", len(header)) + header + ident.sign(DOMAIN + header) + payload


class Fixtures:
    """The valid inputs every mutation starts from, made once."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.ident = Identity.generate()
        self.other = Identity.generate()
        self.tensors = [torch.randn(s) for s in ((0,), (1,), (3,), (129,), (7, 5), (2, 3, 4), (600,), (1000,))]
        self.encoded = {c: [codecs.get_codec(c).encode(t) for t in self.tensors] for c in CODECS}
        meta, payload = self.encoded["int8"][4]
        self.fields = {
            wire.DELTA: wire.DeltaFields(1, Version(0, 3), 10, 640, meta).to_fields(),
            wire.UPDATE: wire.UpdateFields(
                1, Version(0, 3), Version(0, 4), bytes(32), meta, learners=(self.ident.peer_id,),
                merged=(wire.Merged(self.ident.peer_id, bytes(32), 10, 640, 0),), clip=1.5).to_fields(),
            wire.REPLICATE: wire.ReplicateFields(1, 5, Version(5, 4), False, 100, meta, deltas=(7, 9)).to_fields(),
        }
        self.envelopes = [seal(self.ident, kind, RUN_ID, f, bytes(payload), now_ms=NOW_MS)
                          for kind, f in self.fields.items()]
        self.envelopes.append(seal(self.ident, "dht", RUN_ID, {"op": "ping"}, b"\x80", now_ms=NOW_MS))
        self.envelopes.append(seal(self.ident, "reach", RUN_ID, {"url": "http://127.0.0.1:9"}, now_ms=NOW_MS))
        self.frames = [e.to_bytes() for e in self.envelopes]
        self.infos = [NodeInfo.create(i, u, r, c, now_ms=NOW_MS) for i, u, r, c in (
            (self.ident, "http://127.0.0.1:8000", "eu", False), (self.other, "", "", True),
            (self.other, "https://[::1]:443/p", "us-east", False))]
        exp = NOW_MS / 1000 + 600
        self.records = [ValueRecord.create(self.ident, "run:abc:members", b"\x81\xa1a\x01", exp,
                                           self.ident.peer_id),
                        ValueRecord.create(self.other, "plain-key", b"v" * 40, exp)]
        spec = RunSpec(name="fuzz", allowlist=(self.ident.public_key,), membership="allowlist",
                       plan_digest=bytes(32), model={"n_layer": 2, "preset": "tiny"})
        self.genesis = Genesis.create(self.ident, spec)
        self.plains: list[Any] = [e.fields for e in self.envelopes] + [canonical.unpackb(e.header)
                                                                       for e in self.envelopes]
        self.plains += [i.to_wire() for i in self.infos] + [r.to_wire() for r in self.records]
        self.plains += [self.genesis.spec.to_wire(), [1.5, None, True, -3, "s", b"b", {"": []}]]
        self.byte_pool = [canonical.packb(p) for p in self.plains] + self.frames


# -- canonical msgpack and the envelope ----------------------------------------------------------------------


def canonical_target(fx: Fixtures) -> Target:
    def one(rng: random.Random, tally: Tally) -> None:
        if rng.random() < 0.3:
            data = raw_pack(mutate_value(rng, rng.choice(fx.plains))) or b""
        else:
            data = mutate_bytes(rng, rng.choice(fx.byte_pool), fx.byte_pool)

        def call() -> None:
            value = canonical.unpackb(data)
            if canonical.packb(value) != data:  # accepted means canonical: one value, one encoding
                raise AssertionError("unpackb accepted a non-canonical encoding")
            canonical.unpackb(data, strict=False)

        check_one(tally, "canonical.unpackb", call, (Malformed,), BOUND_S, lambda: data.hex())
    return one


def _header_input(rng: random.Random, fx: Fixtures) -> bytes:
    header = rng.choice(fx.envelopes).header
    if rng.random() < 0.5:
        return mutate_bytes(rng, header, fx.byte_pool)
    return raw_pack(mutate_value(rng, canonical.unpackb(header)), rng) or header


def envelope_targets(fx: Fixtures) -> dict[str, Target]:
    replay = ReplayCache()
    loop = asyncio.new_event_loop()

    def verifier(rng: random.Random) -> EnvelopeVerifier:
        member = rng.choice((None, lambda k: k == fx.ident.public_key))
        kinds = rng.choice((None, {"delta"}, {"update", "delta", "replicate", "dht", "reach"}))
        return EnvelopeVerifier(RUN_ID, is_member=member, clock=lambda: NOW_MS / 1000, replay=replay, kinds=kinds)

    def frame_input(rng: random.Random) -> bytes:
        r = rng.random()
        if r < 0.05:
            return rng.choice(fx.frames)
        if r < 0.35:  # a header changed and signed again: past the signature, into the field checks
            env = rng.choice(fx.envelopes)
            return resign(fx.ident, _header_input(rng, fx), bytes(env.payload))
        if r < 0.5:  # the payload changed under a valid signature: the digest and length checks
            env = rng.choice(fx.envelopes)
            return env.prefix() + mutate_bytes(rng, bytes(env.payload))
        return mutate_bytes(rng, rng.choice(fx.frames), fx.frames)

    def state() -> int:
        return len(replay)

    def header(rng: random.Random, tally: Tally) -> None:
        data = _header_input(rng, fx)
        check_one(tally, "envelope.parse_header", lambda: parse_header(data), PROTOCOL_ERRORS, BOUND_S,
                  lambda: data.hex())

    def open_(rng: random.Random, tally: Tally) -> None:
        data, v, fresh = frame_input(rng), verifier(rng), rng.random() < 0.7

        def call() -> None:
            env = v.open(data, fresh=fresh)
            v.release({"sender": env.sender, "nonce": env.nonce, "fresh": fresh})  # (an accepted one is kept)
        check_one(tally, "envelope.open", call, PROTOCOL_ERRORS, BOUND_S, lambda: data.hex(), state)

    def cert(rng: random.Random, tally: Tally) -> None:
        env = rng.choice(fx.envelopes)
        data = mutate_bytes(rng, env.prefix()) if rng.random() < 0.6 else resign(fx.ident, _header_input(rng, fx))
        v = verifier(rng)
        check_one(tally, "envelope.certificate", lambda: v.certificate(data), PROTOCOL_ERRORS, BOUND_S,
                  lambda: data.hex(), state)

    def read(rng: random.Random, tally: Tally) -> None:
        data, v, fresh = frame_input(rng), verifier(rng), rng.random() < 0.7
        cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(4)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        length = rng.choice((len(data), None, len(data) + rng.choice((-1, 1, 1000)), 2**40))
        kinds = rng.choice((None, frozenset({"delta"}), frozenset({"update"})))
        max_payload = rng.choice((None, 0, 100, 10_000))

        async def chunks() -> AsyncIterator[bytes]:
            for p in pieces:
                yield p

        async def go() -> Envelope:
            return await v.read(chunks(), content_length=length, fresh=fresh, kinds=kinds, max_payload=max_payload)

        def call() -> None:
            env = loop.run_until_complete(go())
            v.release({"sender": env.sender, "nonce": env.nonce, "fresh": fresh})
        check_one(tally, "envelope.read", call, PROTOCOL_ERRORS, BOUND_S, lambda: f"{data.hex()} {length}", state)

    return {"envelope.parse_header": header, "envelope.open": open_, "envelope.certificate": cert,
            "envelope.read": read}


# -- tensor codecs ----------------------------------------------------------------------------------------------


def codec_targets(fx: Fixtures) -> dict[str, Target]:
    def make(name: str) -> Target:
        codec = codecs.get_codec(name)

        def one(rng: random.Random, tally: Tally) -> None:
            src = rng.choice(CODECS) if rng.random() < 0.1 else name
            meta, payload = rng.choice(fx.encoded[src])
            payload = bytes(payload)
            r = rng.random()
            if r < 0.4:
                meta = mutate_value(rng, meta)
            elif r < 0.8:
                payload = mutate_bytes(rng, payload)
            else:
                meta, payload = mutate_value(rng, meta), mutate_bytes(rng, payload)
            use_out = rng.random() < 0.2
            max_el = rng.choice((MAX_ELEMENTS, 1000, 1))

            def call() -> None:
                n = codec.check(meta, payload, max_elements=max_el)
                out = torch.empty(n) if use_out else None
                try:
                    t = codec.decode(meta, payload, max_elements=max_el, out=out)
                except ProtocolError as e:  # an owner keeps what `check` passed and decodes it at its round
                    if codec.finite_when_checked:
                        raise AssertionError(f"check passed what decode refuses: {e}") from None
                    raise
                if not bool(torch.isfinite(t).all()) or t.numel() != n:
                    raise AssertionError("decode returned a non-finite value or a wrong size")
            check_one(tally, f"codec.{name}", call, (Malformed, TooLarge), BOUND_S,
                      lambda: f"{meta!r} {payload.hex()[:400]}")
        return one

    def lookup(rng: random.Random, tally: Tally) -> None:
        name = junk_value(rng) if rng.random() < 0.5 else rng.choice(CODECS) + rng.choice(("", "x", "\x00"))
        check_one(tally, "codec.get_codec", lambda: codecs.get_codec(name), (Malformed,), BOUND_S, lambda: repr(name))

    return {**{f"codec.{n}": make(n) for n in CODECS}, "codec.get_codec": lookup}


# -- the DHT -----------------------------------------------------------------------------------------------------


def dht_targets(fx: Fixtures) -> dict[str, Target]:
    loop = asyncio.new_event_loop()
    node = DHTNode(fx.other, PeerClient(), server=None)
    node.storage._clock = lambda: NOW_MS / 1000  # the records' clock
    for info in fx.infos:
        node._saw(info)  # (a routing table with entries, so lookups answer something)
    sender = fx.infos[0]
    bodies = [{"node": sender.to_wire()}, {"node": sender.to_wire(), "target": bytes(20)},
              {"node": sender.to_wire(), "key": "run:abc:members"},
              {"node": sender.to_wire(), "records": [r.to_wire() for r in fx.records]}]
    ops = ["ping", "find_node", "find_value", "store"]

    def dht_state() -> tuple[int, int, int]:
        return len(node.storage), node.storage.total_bytes, len(node.routing)

    def handle(rng: random.Random, tally: Tally) -> None:
        i = rng.randrange(4)
        body: Any = bodies[i]
        op: Any = ops[i] if rng.random() < 0.9 else junk_value(rng)
        r = rng.random()
        if r < 0.6:
            body = mutate_value(rng, body)
        payload = raw_pack(body, rng) or b""
        if r >= 0.6:
            payload = mutate_bytes(rng, payload)
        try:
            env = seal(fx.ident, "dht", RUN_ID, {"op": op}, payload, now_ms=NOW_MS)
        except ProtocolError:  # (an op canonical msgpack cannot hold: no such request can arrive)
            env = seal(fx.ident, "dht", RUN_ID, {"op": "ping"}, payload, now_ms=NOW_MS)
        refused: list[bool] = []

        def call() -> None:
            reply = loop.run_until_complete(node._handle(env, None))
            hlen = struct.unpack(">I", reply[:4])[0]
            out = canonical.unpackb(reply[4 + hlen + 64 :], max_len=1 << 23, strict=False)
            stored = out.get("stored")
            if stored is not None and all(s is not None for s in stored):
                refused.append(True)  # every record refused: storage must be as it was

        before = dht_state()
        check_one(tally, "dht.handle", call, PROTOCOL_ERRORS, BOUND_S, lambda: f"{op!r} {payload.hex()}", dht_state)
        if refused and (len(node.storage), node.storage.total_bytes) != before[:2]:
            tally.state_changes += 1
            tally.fail("dht.handle", "storage changed by refused records", payload.hex())
        if len(node.storage) > 50:
            node.storage.purge()

    def records(rng: random.Random, tally: Tally) -> None:
        if rng.random() < 0.5:
            obj = mutate_value(rng, rng.choice(fx.infos).to_wire())
            if rng.random() < 0.5 and isinstance(obj, dict):  # re-signed: past the signature
                try:
                    signed = {k: obj.get(k) for k in ("public_key", "url", "region", "client_mode", "timestamp_ms")}
                    signed["public_key"] = fx.ident.public_key
                    msg = NODE_INFO_DOMAIN + canonical.packb(signed)
                    obj = {**obj, "public_key": fx.ident.public_key, "signature": fx.ident.sign(msg)}
                except ProtocolError:
                    pass
            check_one(tally, "dht.NodeInfo.from_wire", lambda: NodeInfo.from_wire(obj), PROTOCOL_ERRORS, BOUND_S,
                      lambda: repr(obj))
        else:
            obj = mutate_value(rng, rng.choice(fx.records).to_wire())
            if rng.random() < 0.5 and isinstance(obj, dict):  # re-signed: past the signature
                try:
                    fake = ValueRecord(obj.get("key"), obj.get("subkey"), obj.get("value"),
                                       obj.get("expiration"), fx.ident.public_key, b"")
                    obj = {**obj, "signer": fx.ident.public_key,
                           "signature": fx.ident.sign(fake.signed_message())}
                except (ProtocolError, TypeError, ValueError, AttributeError):
                    pass
            check_one(tally, "dht.ValueRecord.from_wire", lambda: ValueRecord.from_wire(obj), PROTOCOL_ERRORS,
                      BOUND_S, lambda: repr(obj))

    def reply(rng: random.Random, tally: Tally) -> None:
        op = rng.choice(ops)
        body = {"node": fx.infos[0].to_wire(), "nodes": [i.to_wire() for i in fx.infos],
                "records": [r.to_wire() for r in fx.records], "stored": [None, "Expired: x"]}
        payload = raw_pack(mutate_value(rng, body), rng) or b""
        if rng.random() < 0.3:
            payload = mutate_bytes(rng, payload)
        env = seal(fx.ident, "dht.reply", RUN_ID, {"reply_to": bytes(16)}, payload, now_ms=NOW_MS)
        check_one(tally, "dht.decode_reply", lambda: _decode_reply(env, op), PROTOCOL_ERRORS, BOUND_S,
                  lambda: f"{op} {payload.hex()}")

    return {"dht.handle": handle, "dht.records": records, "dht.decode_reply": reply}


# -- the swarm's messages, the run spec, bulk heads -----------------------------------------------------------


def wire_targets(fx: Fixtures) -> dict[str, Target]:
    parsers = {wire.DELTA: wire.DeltaFields.parse, wire.UPDATE: wire.UpdateFields.parse,
               wire.REPLICATE: wire.ReplicateFields.parse}
    member = wire.MemberRecord("http://127.0.0.1:1", "eu", False, 3, 0.5, 100.0, True).encode()
    frag = wire.FragRecord(Version(2, 3)).encode()
    momentum = bytes(wire.pack_momentum(*fx.encoded["int8"][3]))
    versions = wire.pack_versions([Version(0, 1), Version(2, 3), Version(0, 0), Version(9, 9)])

    def fields(rng: random.Random, tally: Tally) -> None:
        kind = rng.choice(list(parsers))
        f = mutate_value(rng, fx.fields[kind], keep_root=True)  # (the envelope checked that fields is a map)
        P = rng.choice((1, 4, 2**40))
        trailer = memoryview(bytes(rng.choice((0, 1, 100, 115, 116, 117, 4096))))

        def call() -> None:
            parsed = parsers[kind](f, P)
            if kind == wire.REPLICATE:  # (a replicate's trailer, split by the lengths its fields declare)
                wire.split_replicate(parsed, trailer)

        check_one(tally, f"wire.{kind}", call, PROTOCOL_ERRORS, BOUND_S, lambda: repr(f))

    def bodies(rng: random.Random, tally: Tally) -> None:
        which = rng.randrange(5)
        data = mutate_bytes(rng, (member, frag, momentum, versions, b"")[which], fx.byte_pool)
        call = (lambda: wire.MemberRecord.decode(data), lambda: wire.FragRecord.decode(data),
                lambda: wire.parse_momentum(data), lambda: wire.parse_versions(data, 4),
                lambda: wire.reach_url(mutate_value(rng, {"url": "http://127.0.0.1:9"}, keep_root=True)))[which]
        check_one(tally, "wire.records", call, PROTOCOL_ERRORS, BOUND_S, lambda: data.hex())

    def text(rng: random.Random, tally: Tally) -> None:
        raw = rng.choice(("0", "3", "12", "1.2", "0.0", "9223372036854775807.1", "18446744073709551616.0"))
        raw = raw if rng.random() < 0.2 else mutate_bytes(rng, raw.encode()).decode("latin-1")
        which = rng.randrange(3)
        call = (lambda: wire.path_fragment(raw, 4), lambda: Version.parse(raw),
                lambda: Version.from_wire(mutate_value(rng, [1, 2])))[which]
        check_one(tally, "wire.path_and_query", call, PROTOCOL_ERRORS, BOUND_S, lambda: repr(raw))

    def fragment_body(rng: random.Random, tally: Tally) -> None:
        numel = rng.choice((0, 1, 5))
        cert = fx.envelopes[1].prefix()
        body = b"".join(wire.pack_fragment(cert, bytes(4 * numel)))
        body = mutate_bytes(rng, body) if rng.random() < 0.8 else body
        length = rng.choice((len(body), len(body) + 1, len(body) - 1, 0, 2**31))

        def call() -> None:
            r = wire.FragmentReader(numel)
            r.begin(length)
            pos = 0
            while pos < len(body):
                buf = r.buffer()
                if not len(buf):
                    raise Malformed("sink full")  # (the transport stops here too: more bytes than announced)
                n = min(len(buf), len(body) - pos, rng.choice((1, 3, 1000)))
                buf[:n] = body[pos : pos + n]
                r.advance(n)
                pos += n
            r.end()
        check_one(tally, "wire.FragmentReader", call, PROTOCOL_ERRORS, BOUND_S, lambda: f"{body.hex()} {length}")

    return {"wire.fields": fields, "wire.records": bodies, "wire.path_and_query": text,
            "wire.FragmentReader": fragment_body}


def runspec_targets(fx: Fixtures) -> dict[str, Target]:
    good = fx.genesis.to_bytes()

    def spec(rng: random.Random, tally: Tally) -> None:
        obj = mutate_value(rng, fx.genesis.spec.to_wire())

        def call() -> None:
            s = RunSpec.from_wire(obj)
            if not isinstance(s.model, dict) or not all(isinstance(k, bytes) for k in s.allowlist):
                raise AssertionError("accepted a spec whose model is no map or whose allowlist holds no keys")
            if RunSpec.from_wire(s.to_wire()) != s:
                raise AssertionError("an accepted spec does not read back as itself")
        check_one(tally, "runspec.RunSpec.from_wire", call, PROTOCOL_ERRORS, BOUND_S, lambda: repr(obj))

    def genesis(rng: random.Random, tally: Tally) -> None:
        if rng.random() < 0.5:
            data = mutate_bytes(rng, good, fx.byte_pool)
        else:  # a changed spec signed again by its creator: past the signature, into the spec's checks
            spec_wire = mutate_value(rng, fx.genesis.spec.to_wire())
            packed = raw_pack(spec_wire, rng)
            sig = fx.ident.sign(GENESIS_DOMAIN + packed) if packed else bytes(64)
            data = raw_pack({"spec": spec_wire, "signature": sig}, rng) or good
        check_one(tally, "runspec.Genesis.from_bytes", lambda: Genesis.from_bytes(data), PROTOCOL_ERRORS, BOUND_S,
                  lambda: data.hex())

    return {"runspec.RunSpec.from_wire": spec, "runspec.Genesis.from_bytes": genesis}


def bulk_target(fx: Fixtures) -> Target:
    heads = [b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nContent-Type: application/octet-stream",
             b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nContent-Length: 3",
             b"HTTP/1.0 413 X\r\nContent-Length: 0\r\nServer: a:b:c"]

    def one(rng: random.Random, tally: Tally) -> None:
        data = rng.choice(heads)
        if rng.random() < 0.2:  # a status or a length of any number of digits
            digits = b"".join(rng.choice((b"0", b"2", b"9")) for _ in range(rng.choice((1, 3, 4, 19, 20, 4301))))
            data = data.replace(rng.choice((b"200", b"404", b"1234", b"0\r")), digits, 1)
        if rng.random() < 0.8:
            data = mutate_bytes(rng, data, heads)
        check_one(tally, "bulk.parse_head", lambda: bulk.parse_head(data), (Malformed,), BOUND_S, lambda: data.hex())
    return one


def bulk_url_target(fx: Fixtures) -> Target:
    """The URL a fragment download goes to comes from a peer's own member record: any text at all."""
    loop = asyncio.new_event_loop()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused at once
    port = closed.getsockname()[1]

    def one(rng: random.Random, tally: Tally) -> None:
        url = mutate_bytes(rng, f"http://127.0.0.1:{port}".encode()).decode("latin-1")
        try:
            host = urlsplit(url).hostname
        except ValueError:
            host = None
        if host not in (None, "127.0.0.1"):  # (no lookups of other names, no connections elsewhere)
            url = f"http://[{url}"

        async def go() -> None:
            await asyncio.wait_for(bulk.get_into(url, "/v1/fragment/0", wire.FragmentReader(4), 1 << 20), 1.0)

        check_one(tally, "bulk.get_into(url)", lambda: loop.run_until_complete(go()),
                  (ProtocolError, TransportError, TimeoutError, OSError), BOUND_S, lambda: repr(url))  # (as documented)
    return one


def all_targets() -> dict[str, Target]:
    """Every in-process target by name (routes of a live peer are in `_fuzz_routes`)."""
    codecs.load_kernels()
    fx = Fixtures()
    return {"canonical.unpackb": canonical_target(fx), **envelope_targets(fx), **codec_targets(fx),
            **dht_targets(fx), **wire_targets(fx), **runspec_targets(fx), "bulk.parse_head": bulk_target(fx),
            "bulk.get_into(url)": bulk_url_target(fx)}
