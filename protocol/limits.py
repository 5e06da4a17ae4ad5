"""Limits before work: what a peer refuses before a request costs it a parse, a decode or a signature check.

Anyone who can reach a peer's port can open connections and send requests; every refusal further in
(`intake.py`, `envelope.py`) is cheap, but not free. So, keyed on the source address (an IPv4 address, or
the /64 of an IPv6 one: a host gets a /64), before anything else runs:

- **connections**: at most `conns_per_addr` open per address, `conns_total` in all. Over the cap a connection
  is aborted in `connection_made`, before aiohttp builds its request handler or reads a byte. At the total
  cap an address holding less than its fair share (total / addresses) still gets in, and the oldest
  connection of the address holding the most is closed instead: a stranger's idle connections cannot keep
  an honest member out (unless the stranger has more addresses than the cap has connections). At its first
  byte a connection takes a token of its address's connection bucket (`conn_rate_per_s`, `conn_burst`); while
  that bucket is empty, or the address holds its cap, its new connections are closed in `accept()` (listen.py),
  before asyncio builds a transport for them (a flood's reconnects then cost an `accept` and a `close`);
- **requests**: a token bucket per address (`rate_per_s`, `burst`) and at most `inflight_per_addr` requests
  handled at once per address (`inflight_total` in all, fair-shared as above), else 429 from the first
  middleware, before the body is read; the connection is then closed, so a refused body is never read
  (aiohttp would otherwise drain it for up to 10 s);
- **TLS** (a private run): done by the gate, after admission, from the connection's first byte on: an idle
  connection holds no TLS state and costs no handshake; at most `handshakes_per_addr` handshakes at once
  (`handshakes_total` in all), each within `handshake_timeout_s`;
- **memory**: aiohttp's header limits and an idle timeout (`handler_args`): a connection holds at most
  `max_headers` × `max_field_size` of header, aiohttp's read buffer and a 64 KiB TLS buffer, and one that
  sends nothing is closed after `idle_timeout_s` (aiohttp's own default keeps it an hour);
- **the log**: one line per refusal, at most one every `log_every_s`, with how many were left out since.

An address never shares a bucket with another, so a flood from one host does not throttle a member sending
from another. The defaults are far above what a learner sends: in a 3-learner tiny-GPT swarm on one host (every
peer from 127.0.0.1, `--fast-membership`), a learner served about 10 requests/s from the two others together
and opened no new connection in 30 s (its client pools them) (benchmarks/flood.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from .gate import Gate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Per source address unless `_total`. Sized from a learner's traffic with a wide margin (module doc)."""

    rate_per_s: float = 200.0  # requests per second, sustained
    burst: float = 400.0  # requests at once after a quiet spell
    conn_rate_per_s: float = 10.0  # new connections per second (a client pools its connections); with TLS each
    conn_burst: float = 40.0  # costs a handshake, the dearest thing a stranger can make a peer do
    inflight_per_addr: int = 32  # requests being handled at once (a slow body holds one for up to ~10 s)
    inflight_total: int = 512
    conns_per_addr: int = 128  # a PeerClient keeps up to 8 per peer: a host of 16 learners fits
    conns_total: int = 1024  # (each is a file descriptor: keep it well below the process's limit)
    idle_timeout_s: float = 30.0  # longer than aiohttp's client keep-alive (15 s): the client closes first
    handshake_timeout_s: float = 10.0  # TLS: from a connection's first byte (asyncio's default is 60 s)
    handshakes_per_addr: int = 8  # TLS handshakes under way at once (each costs the peer's CPU, and a buffer)
    handshakes_total: int = 64
    backlog: int = 1024  # connections the kernel queues before accept (aiohttp's 128 overflows in a flood,
    # and then the kernel drops every host's SYNs alike, an honest member's too)
    max_headers: int = 32
    max_field_size: int = 8190
    log_every_s: float = 10.0

    def handler_args(self) -> dict[str, Any]:
        """aiohttp `RequestHandler` options that bound one connection's memory and idle life."""
        return {"keepalive_timeout": self.idle_timeout_s, "max_headers": self.max_headers,
                "max_field_size": self.max_field_size, "max_line_size": self.max_field_size}


@lru_cache(maxsize=4096)
def address_key(host: str) -> str:
    """The limits' key of a source address: IPv4 as is (a mapped one too), IPv6 by its /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def peer_key(transport: asyncio.BaseTransport | None) -> str:
    peer = transport.get_extra_info("peername") if transport is not None else None
    return address_key(str(peer[0])) if isinstance(peer, tuple) and peer else "?"


class RefusalLog:
    """One line per refusal, at most one every `every_s`, naming the last one and counting the rest."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last: float | None = None
        self.left_out: Counter[str] = Counter()

    def refused(self, what: str, key: str) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self.left_out[what] += 1
            return
        self._last = now
        rest = ", ".join(f"{n} {w}" for w, n in sorted(self.left_out.items())) or "none"
        log.warning("refused %s from %s (since the last such line: %s)", what, key, rest)
        self.left_out.clear()


class SharedCap:
    """Things under way per address (requests, TLS handshakes): at most `per_addr` each, and `total` in all,
    past which an address already holding its fair share (total / addresses) is refused."""

    def __init__(self, per_addr: int, total: int) -> None:
        self.per_addr, self.total = per_addr, total
        self.held: dict[str, int] = {}
        self.count = 0

    def full(self, key: str) -> str | None:
        """Why `key` may not take one more now ("per address" or "all addresses"), or None."""
        n = self.held.get(key, 0)
        if n >= self.per_addr:
            return "per address"
        if self.count >= self.total and n >= fair_share(self.total, len(self.held)):
            return "all addresses"
        return None

    def take(self, key: str) -> None:
        self.held[key] = self.held.get(key, 0) + 1
        self.count += 1

    def give(self, key: str) -> None:
        self.count -= 1
        n = self.held.pop(key) - 1
        if n:
            self.held[key] = n


def fair_share(total: int, addresses: int) -> int:
    return max(1, total // max(1, addresses))


class Limiter:
    """The state behind `Limits`: buckets, in-flight and connection counts per address, and refusal counts."""

    PURGE_EVERY_S = 10.0  # buckets that refilled and addresses with nothing open are forgotten this often

    def __init__(self, limits: Limits | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or Limits()
        self.clock = clock
        self._buckets: dict[tuple[str, bool], tuple[float, float]] = {}  # (key, connection?) -> (tokens, at)
        self._handshakes = SharedCap(self.limits.handshakes_per_addr, self.limits.handshakes_total)
        self._inflight = SharedCap(self.limits.inflight_per_addr, self.limits.inflight_total)
        self._conns: dict[str, dict[Gate, None]] = {}  # key -> its open connections, oldest first
        self._nconns = 0
        self._next_purge = 0.0
        self.stats: Counter[str] = Counter()
        self.log = RefusalLog(self.limits.log_every_s, clock)

    # -- token buckets --------------------------------------------------------------------------------------

    def take(self, key: str, connection: bool = False) -> bool:
        """Take one token of `key`'s request (or `connection`) bucket; False (nothing taken) if it is empty."""
        now = self.clock()
        tokens = self._tokens(key, connection, now)
        if now >= self._next_purge:
            self._purge(now)
        self._buckets[(key, connection)] = (tokens - 1.0, now) if tokens >= 1.0 else (tokens, now)
        return tokens >= 1.0

    def _tokens(self, key: str, connection: bool, now: float) -> float:
        lim = self.limits
        rate, burst = (lim.conn_rate_per_s, lim.conn_burst) if connection else (lim.rate_per_s, lim.burst)
        tokens, at = self._buckets.get((key, connection), (burst, now))
        return min(burst, tokens + (now - at) * rate)

    def _purge(self, now: float) -> None:
        self._next_purge = now + self.PURGE_EVERY_S
        lim = self.limits
        full_after = max(lim.burst / lim.rate_per_s, lim.conn_burst / lim.conn_rate_per_s)
        self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}

    # -- requests -------------------------------------------------------------------------------------------

    def admit_request(self, key: str) -> str | None:
        """None if a request from `key` may be handled now (count it; call `done`), else why not."""
        why = self._inflight.full(key)
        if why is not None:
            return "requests in flight" if why == "per address" else "requests in flight (all addresses)"
        if not self.take(key):
            return "request rate"
        self._inflight.take(key)
        return None

    def done(self, key: str) -> None:
        self._inflight.give(key)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """First middleware: 429 before the route, the body, or any other middleware runs."""
        key = peer_key(request.transport)
        why = self.admit_request(key)
        if why is None:
            try:
                return await handler(request)
            finally:
                self.done(key)
        self.stats["refused_requests"] += 1
        self.log.refused(f"a request ({why})", key)
        resp = web.Response(status=429, text=f"too many requests from {key} ({why}); retry later\n",
                            headers={"Retry-After": "1"})
        resp.force_close()
        await resp.prepare(request)
        await resp.write_eof()
        request.protocol.force_close()  # (the body is never read: no lingering drain of a flood)
        return resp

    # -- connections ----------------------------------------------------------------------------------------

    def refuse_at_accept(self, host: str) -> bool:
        """Close a new connection from `host` in `accept()` (listen.py), before anything is built for it: its
        address holds `conns_per_addr` already, or its connection bucket is empty (the connection would be
        refused at its first byte). Counted and logged as a refused connection."""
        key = address_key(host)
        mine = self._conns.get(key)
        if mine is not None and len(mine) >= self.limits.conns_per_addr:
            why = "connections"
        elif self._tokens(key, True, self.clock()) < 1.0:
            why = "connection rate"
        else:
            return False
        self.stats["refused_connections"] += 1
        self.stats["refused_at_accept"] += 1
        self.log.refused(f"a connection ({why})", key)
        return True

    def admit_connection(self, gate: Gate, key: str) -> str | None:
        """None if `gate`'s connection may stay open (it is counted until `closed`), else why not."""
        lim = self.limits
        mine = self._conns.get(key)
        n = len(mine) if mine else 0
        if n >= lim.conns_per_addr:
            return "connections"
        if self._nconns >= lim.conns_total:
            heaviest = max(self._conns, key=lambda k: len(self._conns[k]))
            if n >= fair_share(lim.conns_total, len(self._conns)) or len(self._conns[heaviest]) <= n + 1:
                return "connections (all addresses)"
            victim = next(iter(self._conns[heaviest]))
            self.closed(victim, heaviest)  # (counted out now: its `connection_lost` comes later)
            self.stats["evicted_connections"] += 1
            victim.abort()
        self._conns.setdefault(key, {})[gate] = None
        self._nconns += 1
        return None

    def closed(self, gate: Gate, key: str) -> None:
        mine = self._conns.get(key)
        if mine is None or gate not in mine:
            return  # (refused, or already counted out when it was evicted)
        del mine[gate]
        self._nconns -= 1
        if not mine:
            del self._conns[key]

    def admit_handshake(self, key: str) -> str | None:
        """None if a TLS handshake from `key` may start now (call `handshake_done` after), else why not."""
        why = self._handshakes.full(key)
        if why is not None:
            return "TLS handshakes" if why == "per address" else "TLS handshakes (all addresses)"
        self._handshakes.take(key)
        return None

    def handshake_done(self, key: str) -> None:
        self._handshakes.give(key)

    def connections(self, key: str | None = None) -> int:
        return self._nconns if key is None else len(self._conns.get(key, ()))

    def snapshot(self) -> dict[str, int]:
        """Counters for a status page or a benchmark: refusals, evictions, open connections."""
        return {**self.stats, "open_connections": self._nconns, "requests_in_flight": self._inflight.count}
