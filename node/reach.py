"""The reachability probe: can the other peers open a connection to the address a joiner announces?

A joiner asks a bootstrap peer with a signed `reach` request naming its own URL (`POST /v1/reach`, docs/protocol.md
§7.10). The peer answers `reachable` only if a `GET URL/v1/status` answers, within 3 s, with the requester's own
PeerId: so it never fetches anything for an unsigned caller or for a key outside the run, and what it says of
any other address is only "not that member". One probe per key every `PER_KEY_S`, and at most `AT_ONCE` at a
time: the probe is not a free port scanner.
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from diloco.coordinator.runspec import RunSpec
from diloco.coordinator.wire import REACH, ROUTE_REACH, ROUTE_STATUS, reach_url
from diloco.protocol.envelope import Envelope, EnvelopeVerifier, seal
from diloco.protocol.errors import BackPressure
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerClient, PeerServer, TransportError

PER_KEY_S = 10.0
AT_ONCE = 2
PROBE_DEADLINE_S = 3.0


async def ask(client: PeerClient, identity: Identity, spec: RunSpec, peer: str, url: str) -> bool:
    """Ask `peer` whether it can reach `url` (ours); raises `TransportError` when `peer` gives no answer."""
    env = seal(identity, REACH, spec.run_id, {"url": url}, b"")
    body = await client.send_envelope(peer, ROUTE_REACH, env, deadline_s=10.0)
    return bytes(body).strip() == b"reachable"


class ReachProbe:
    """The serving side: `POST /v1/reach` on `server`."""

    def __init__(self, spec: RunSpec, client: PeerClient, server: PeerServer) -> None:
        self.client = client
        self.verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={REACH})
        self._last: dict[bytes, float] = {}  # sender key -> when it was last probed
        self._running = 0
        server.add_envelope_route(ROUTE_REACH, self.verifier, self._serve, kinds={REACH}, max_payload=0)

    async def _serve(self, env: Envelope, request: web.Request) -> bytes:
        url = reach_url(env.fields)
        now = time.monotonic()
        self._last = {k: t for k, t in self._last.items() if now - t < PER_KEY_S}
        if env.sender in self._last or self._running >= AT_ONCE:
            raise BackPressure(f"one reachability probe per peer every {PER_KEY_S:.0f} s, {AT_ONCE} at a time")
        self._last[env.sender] = now
        self._running += 1
        try:
            body = await self.client.request("GET", url, ROUTE_STATUS, deadline_s=PROBE_DEADLINE_S,
                                             max_response=1 << 20, retries=0)
            answered = json.loads(bytes(body)).get("peer_id")
        except (TransportError, ValueError, AttributeError):
            answered = None
        finally:
            self._running -= 1
        return b"reachable\n" if answered == env.sender_id else b"unreachable\n"
