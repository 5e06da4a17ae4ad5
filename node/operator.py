"""A peer's read-only views (the dashboard, `/v1/status`, `/metrics`) and the operator's port that serves
them where the peer's own port cannot (docs/operations.md "The operator's port").

A private run's port speaks TLS bound to PeerIds and answers only reads a member signed (protocol/reads.py),
which neither a browser nor a Prometheus scraper can make; a client-mode peer has no port at all. `join
--operator-listen HOST:PORT` (`SwarmConfig.operator_listen`) opens a second, plain-HTTP server with these
three views and nothing else: no route on it changes any state, and none needs a key. Whoever reaches it reads
the peer's status (member URLs, versions, losses), never a tensor. It defaults to loopback; binding it
elsewhere is a choice for a trusted network or a firewall.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco.coordinator.wire import ROUTE_METRICS, ROUTE_STATUS
from diloco.protocol.transport import PeerServer

from . import dashboard, metrics

if TYPE_CHECKING:
    from .swarm import Swarm


def register_views(server: PeerServer, swarm: Swarm) -> None:
    """GET /v1/status, GET /metrics and the dashboard (GET /, /dashboard/{name}) of `swarm` on `server`."""
    server.add_route("GET", ROUTE_STATUS, swarm.serve_status)
    server.add_route("GET", ROUTE_METRICS, metrics.handler(swarm))  # (node/metrics.py)
    dashboard.register(server)  # (node/dashboard/)


async def start_operator_port(swarm: Swarm, host: str, port: int) -> PeerServer:
    """The operator's port of `swarm`, started: its views over plain HTTP, with the peer's usual limits."""
    server = PeerServer(host, port)
    register_views(server, swarm)
    await server.start()
    return server
