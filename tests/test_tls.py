"""A private run's transport: TLS whose certificate is the peer's Ed25519 key, checked by PeerId before a byte
of the request leaves, and GETs answered only to a member who signed them (protocol/tls.py, protocol/reads.py)."""

import asyncio
import hashlib

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from diloco.protocol.envelope import EnvelopeVerifier, register_kind, seal
from diloco.protocol.errors import Malformed, NotMember, Replayed
from diloco.protocol.identity import Identity
from diloco.protocol.reads import HEADER, READ, ReadSigner, check_read
from diloco.protocol.tls import WrongPeer, certificate, peer_key, server_context
from diloco.protocol.transport import PeerClient, PeerServer, PeerUnreachable, RemoteError

from .test_bulk import Collect

RUN = hashlib.sha256(b"tls-test").digest()
register_kind("test.tls", 1 << 20)
SERVER, MEMBER, STRANGER, OTHER = (Identity.generate() for _ in range(4))
BODY = bytes(range(256)) * 4096  # 1 MiB


class Relay:
    """A TCP relay that keeps every byte passing through it: a stranger on the path, capturing the traffic."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.captured = bytearray()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pipe_both, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _pipe_both(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # (the peer behind is not up yet, or gone)
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.captured += data
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


async def start_server(*, private: bool, guard: bool = False) -> PeerServer:
    srv = PeerServer(ssl_context=server_context(SERVER) if private else None)
    srv.seen = []

    async def blob(request):
        srv.seen.append(request.raw_path)
        return web.Response(body=BODY)

    async def echo(env, request):
        srv.seen.append(bytes(env.payload))
        return hashlib.sha256(env.payload).digest()

    srv.add_route("GET", "/v1/blob/{n}", blob)
    srv.add_envelope_route("/v1/echo", EnvelopeVerifier(RUN), echo, kinds={"test.tls"})
    if guard:
        srv.guard_reads(EnvelopeVerifier(RUN, is_member=lambda key: key in (MEMBER.public_key,), kinds={READ}))
    await srv.start()
    return srv


def test_the_certificate_holds_the_peers_own_key_signed_by_itself():
    cert = x509.load_pem_x509_certificate(certificate(SERVER))
    assert peer_key(cert.public_bytes(serialization.Encoding.DER)) == SERVER.public_key
    assert SERVER.peer_id in cert.subject.rfc4514_string()
    with pytest.raises(WrongPeer):
        peer_key(b"not a certificate")


async def test_a_private_connection_reaches_the_expected_peer_and_nothing_else():
    srv = await start_server(private=True)
    try:
        assert srv.url.startswith("https://")
        async with PeerClient(tls=True) as client:
            client.expect(srv.url, SERVER.peer_id)
            assert bytes(await client.request("GET", srv.url, "/v1/blob/1")) == BODY
            sink = Collect(room=1 << 30)
            await client.request("GET", srv.url, "/v1/blob/2", sink=sink)  # (the bulk path: its own TLS)
            assert sink.data == BODY
            env = seal(MEMBER, "test.tls", RUN, {}, b"delta")
            assert bytes(await client.send_envelope(srv.url, "/v1/echo", env)) == hashlib.sha256(b"delta").digest()
        assert srv.seen == ["/v1/blob/1", "/v1/blob/2", b"delta"]
        async with PeerClient(tls=True, retries=0) as client:  # the URL now names another peer: refused before
            client.expect(srv.url, OTHER.peer_id)  # any request byte was sent
            with pytest.raises(WrongPeer):
                await client.request("GET", srv.url, "/v1/blob/3")
            with pytest.raises(WrongPeer):
                await client.request("GET", srv.url, "/v1/blob/4", sink=Collect(room=1 << 30))
            with pytest.raises(WrongPeer):
                await client.send_envelope(srv.url, "/v1/echo", seal(MEMBER, "test.tls", RUN, {}, b"secret"))
        assert srv.seen == ["/v1/blob/1", "/v1/blob/2", b"delta"]
    finally:
        await srv.stop()


@pytest.mark.parametrize("private", [False, True])
async def test_a_stranger_capturing_the_bytes_finds_the_tensor_data_only_without_tls(private):
    srv = await start_server(private=private)
    relay = Relay(srv.port)
    port = await relay.start()
    url = f"{'https' if private else 'http'}://127.0.0.1:{port}"
    payload = (bytes(range(251)) * 1000)[:200_000]
    try:
        async with PeerClient(tls=private) as client:
            client.expect(url, SERVER.peer_id)
            assert bytes(await client.request("GET", url, "/v1/blob/1")) == BODY
            sink = Collect(room=1 << 30)
            await client.request("GET", url, "/v1/blob/2", sink=sink)
            await client.send_envelope(url, "/v1/echo", seal(MEMBER, "test.tls", RUN, {}, payload))
        windows = [BODY[i : i + 32] for i in range(0, len(BODY), 4099)] + [payload[i : i + 32] for i in (0, 99_000)]
        found = sum(w in relay.captured for w in windows)
        assert len(relay.captured) > len(BODY) * 2
        assert found == (len(windows) if not private else 0), found
    finally:
        await relay.stop()
        await srv.stop()


async def test_a_guarded_get_is_answered_only_to_a_member_who_signed_that_very_request():
    srv = await start_server(private=True, guard=True)
    try:
        async with PeerClient(tls=True, read_signer=ReadSigner(MEMBER, RUN)) as member:
            assert bytes(await member.request("GET", srv.url, "/v1/blob/1?after=2.3")) == BODY
            sink = Collect(room=1 << 30)
            await member.request("GET", srv.url, "/v1/blob/2", sink=sink)
            assert sink.data == BODY
        for signer in (None, ReadSigner(STRANGER, RUN)):
            async with PeerClient(tls=True, retries=0, read_signer=signer) as stranger:
                for path in ("/v1/blob/3", "/v1/no-such-route"):
                    with pytest.raises(RemoteError) as e:
                        await stranger.request("GET", srv.url, path)
                    assert e.value.status == 403
        assert srv.seen == ["/v1/blob/1?after=2.3", "/v1/blob/2"]
    finally:
        await srv.stop()


def test_a_signed_read_is_bound_to_its_method_and_path_and_cannot_be_replayed():
    verifier = EnvelopeVerifier(RUN, is_member=lambda key: key == MEMBER.public_key, kinds={READ})
    sign = ReadSigner(MEMBER, RUN)
    value = sign("GET", "/v1/fragment/1")
    assert check_read(verifier, "GET", "/v1/fragment/1", value) == MEMBER.public_key
    with pytest.raises(Replayed):
        check_read(verifier, "GET", "/v1/fragment/1", value)
    with pytest.raises(Malformed):
        check_read(verifier, "GET", "/v1/fragment/2", sign("GET", "/v1/fragment/1"))
    with pytest.raises(NotMember):
        check_read(verifier, "GET", "/v1/fragment/1", None)
    with pytest.raises(NotMember):
        check_read(verifier, "GET", "/v1/fragment/1", ReadSigner(STRANGER, RUN)("GET", "/v1/fragment/1"))
    with pytest.raises(Malformed):
        check_read(verifier, "GET", "/v1/fragment/1", "!!not base64!!")
    assert HEADER.lower().startswith("x-diloco")


async def test_a_url_that_does_not_parse_is_a_typed_error_and_is_never_expected():
    async with PeerClient(tls=True, retries=0) as client:
        client.expect("http://[::1", SERVER.peer_id)  # (a member record's URL: ignored, not an exception)
        with pytest.raises(PeerUnreachable):
            await client.request("GET", "http://[::1", "/v1/status")
