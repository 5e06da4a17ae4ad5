"""A bandwidth-limited TCP relay on loopback: the chaos harness's throttled link into one learner.

The learner listens on its own port and announces the relay's, so every connection another peer opens to it
(deltas it owns, fragment downloads from it, updates pushed to it, and the answers) crosses the relay. Bytes
are forwarded in both directions through one token bucket per direction, shared by all connections, so the
link as a whole runs at `rate_bytes_s`. This works on any kernel and needs no root (`tc` on loopback would
throttle every learner at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

CHUNK = 16 * 1024


class TokenBucket:
    """`rate` bytes/s with a burst of `burst` bytes; `take` waits until the bytes may pass."""

    def __init__(self, rate: float, burst: int = 64 * 1024) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class ThrottleRelay:
    """Relay 127.0.0.1:`port` → 127.0.0.1:`target_port` at `rate_bytes_s` each way, in a thread of its own."""

    def __init__(self, port: int, target_port: int, rate_bytes_s: float) -> None:
        self.port, self.target_port, self.rate = port, target_port, rate_bytes_s
        self.forwarded = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{port}", daemon=True)

    def start(self) -> ThrottleRelay:
        self._thread.start()
        if not self._ready.wait(10) or self._server is None:
            raise OSError(f"throttle relay could not listen on 127.0.0.1:{self.port}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        up, down = TokenBucket(self.rate), TokenBucket(self.rate)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: TokenBucket) -> None:
            try:
                while data := await reader.read(CHUNK):
                    await bucket.take(len(data))
                    writer.write(data)
                    await writer.drain()
                    self.forwarded += len(data)
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            try:
                target_r, target_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            except OSError:  # the learner is down: refuse, as its port would
                client_w.close()
                return
            await asyncio.gather(pump(client_r, target_w, up), pump(target_r, client_w, down))

        async def serve() -> None:
            with contextlib.suppress(OSError):
                self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)
            self._ready.set()

        self._loop.run_until_complete(serve())
        if self._server is not None:
            self._loop.run_forever()
        self._loop.close()
