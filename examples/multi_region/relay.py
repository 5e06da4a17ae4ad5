"""A userspace latency relay: an asyncio TCP proxy that delays every chunk by a one-way latency.

This kernel has no `netem`, so `examples/multi_region/run.py` emulates wide-area latency here instead: every
connection between two regions goes through this relay, which runs in the hub namespace. For each route it
listens on LISTEN and forwards to TARGET; the delay of a connection depends on the region of the client
(known from its source address) and the region of the route (the server's region):

    client → server chunks wait latency[client region][server region]
    server → client chunks wait latency[server region][client region]

Each chunk read at time t is written at t + delay, never earlier, and in the order it was read (a delayed
FIFO per direction). A new connection first waits one round trip (the TCP handshake a real WAN would cost)
before the relay connects to the target. Back-pressure: at most `max_buffer` bytes wait in a direction; beyond
that the relay stops reading, so the sender's TCP window fills as it would on a real link. Half-closes are
forwarded after the delay too.

Usage (what run.py does):  relay.py --config relay.json
    {"routes": [{"listen": ["10.213.0.1", 7000], "target": ["10.213.0.2", 7000], "region": 0}, ...],
     "sources": {"10.213.0.2": 0, ...},          client address → region
     "latency_ms": [[0, 40, 80], [40, 0, 120], [80, 120, 0]]}
It prints one JSON line {"event": "ready", ...} once every listener is up, and {"event": "stats", ...} when
stopped (SIGINT or SIGTERM).

As a library (the tests): `Relay(target=("127.0.0.1", 9000), latency=0.05)` then `await relay.start(host, port)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import deque
from collections.abc import Callable

CHUNK = 64 * 1024
MAX_BUFFER = 4 << 20  # bytes waiting in one direction before the relay stops reading


class DelayedPipe:
    """One direction of a connection: read chunks, write each `delay` seconds after it was read, in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                 max_buffer: int = MAX_BUFFER, on_bytes: Callable[[int], None] | None = None) -> None:
        self.reader, self.writer, self.delay, self.max_buffer = reader, writer, max(0.0, delay), max_buffer
        self.on_bytes = on_bytes
        self.queue: deque[tuple[float, bytes | None]] = deque()  # (due time, chunk); None: end of stream
        self.buffered = 0  # bytes read and not yet handed to the writer's socket
        self.bytes = 0  # bytes forwarded
        self.queued = asyncio.Event()  # set when the queue gets an item
        self.space = asyncio.Event()  # set when buffered bytes drop

    async def read_side(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self.buffered >= self.max_buffer:  # back-pressure: let the sender's window fill
                    self.space.clear()
                    await self.space.wait()
                data = await self.reader.read(CHUNK)
                if not data:
                    break
                self.queue.append((loop.time() + self.delay, data))
                self.buffered += len(data)
                self.queued.set()
        except (ConnectionError, OSError):
            pass
        self.queue.append((loop.time() + self.delay, None))
        self.queued.set()

    async def write_side(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.queued.clear()
                await self.queued.wait()
            due, data = self.queue[0]
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            if data is None:
                with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()
            self.buffered -= len(data)
            self.bytes += len(data)
            if self.on_bytes is not None:
                self.on_bytes(len(data))
            self.space.set()

    async def run(self) -> None:
        """Forward until the end of the stream has been forwarded; raises if the writing side breaks."""
        reader = asyncio.create_task(self.read_side())
        try:
            await self.write_side()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


LatencyFn = Callable[[str], tuple[float, float]]  # client host → (client→server, server→client) seconds


class Relay:
    """Listen on one address, forward every connection to `target` with a one-way delay per direction.

    `latency`: seconds for both directions, or a function of the client's address returning
    (client→server, server→client) seconds.
    """

    def __init__(self, target: tuple[str, int], latency: float | LatencyFn, max_buffer: int = MAX_BUFFER) -> None:
        self.target = target
        self.latency: LatencyFn = latency if callable(latency) else (lambda _host, d=float(latency): (d, d))
        self.max_buffer = max_buffer
        self.server: asyncio.Server | None = None
        self.connections = 0
        self.failed = 0
        self.bytes_up = 0  # client → server
        self.bytes_down = 0
        self._conns: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        return self.server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            await self._forward(c_reader, c_writer)
        except asyncio.CancelledError:
            pass  # the relay is closing: this connection ends here (its sockets are closed below _forward)
        finally:
            self._conns.discard(task)

    def _count_up(self, n: int) -> None:
        self.bytes_up += n

    def _count_down(self, n: int) -> None:
        self.bytes_down += n

    async def _forward(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        s_writer = None
        try:
            peer = c_writer.get_extra_info("peername") or ("?", 0)
            up, down = self.latency(peer[0])
            self.connections += 1
            await asyncio.sleep(up + down)  # the handshake's round trip
            try:
                s_reader, s_writer = await asyncio.open_connection(*self.target)
            except OSError:
                self.failed += 1
                return
            pipes = (DelayedPipe(c_reader, s_writer, up, self.max_buffer, self._count_up),
                     DelayedPipe(s_reader, c_writer, down, self.max_buffer, self._count_down))
            tasks = [asyncio.create_task(p.run()) for p in pipes]
            try:
                # both directions end after forwarding their EOF; a broken socket ends the connection at once
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for w in (c_writer, s_writer):
                if w is not None:
                    w.close()
            for w in (c_writer, s_writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1)


def matrix_latency(sources: dict[str, int], latency_ms: list[list[float]], server_region: int) -> LatencyFn:
    """The (up, down) delays of a route to `server_region` for a client at a known address (unknown: 0)."""

    def fn(host: str) -> tuple[float, float]:
        c = sources.get(host)
        if c is None:
            return 0.0, 0.0
        return latency_ms[c][server_region] / 1000.0, latency_ms[server_region][c] / 1000.0

    return fn


async def serve(config: dict) -> None:
    relays = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for route in config["routes"]:
            relay = Relay(tuple(route["target"]),
                          matrix_latency(config["sources"], config["latency_ms"], int(route["region"])))
            await relay.start(*route["listen"])
            relays.append((route, relay))
        print(json.dumps({"event": "ready", "t": time.time(), "routes": len(relays)}), flush=True)
        await stop.wait()
    finally:
        for _, relay in relays:
            await relay.close()
        print(json.dumps({"event": "stats", "t": time.time(), "routes": [
            {"region": route["region"], "connections": r.connections, "failed": r.failed,
             "bytes_up": r.bytes_up, "bytes_down": r.bytes_down} for route, r in relays]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="TCP relay that adds a one-way latency per direction.")
    ap.add_argument("--config", required=True, help="JSON file: routes, sources, latency_ms (see the module doc)")
    args = ap.parse_args(argv)
    try:
        with open(args.config) as f:
            config = json.load(f)
        asyncio.run(serve(config))
    except OSError as e:
        print(f"relay: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
