"""What a peer's server does before a request may cost it anything (docs/protocol.md §4.3): bodies that must keep
a minimum pace, and malformed HTTP that is logged as one rate-limited line instead of a traceback each.

A body that trickles in (slow-loris: a byte a second) would otherwise hold its connection and its buffer for as
long as the sender likes; a stranger sending junk HTTP would fill the log with aiohttp's tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import http_exceptions

from .errors import ProtocolError

BODY_GRACE_S = 10.0  # a body may take this long before its pace counts
BODY_MIN_RATE = 16 * 1024  # bytes/s on average after that: a 128 kbit/s link, far below any WAN a learner uses
REFUSED_LOG_EVERY_S = 10.0


class TooSlow(ProtocolError):
    """A request body that arrives slower than the minimum pace."""

    status = 408


async def paced(chunks: AsyncIterator[bytes], *, grace_s: float | None = None, min_rate: float | None = None,
                clock=time.monotonic) -> AsyncIterator[bytes]:
    """`chunks`, cut with `TooSlow` as soon as fewer than (elapsed − grace_s) × min_rate bytes have arrived
    (defaults: BODY_GRACE_S, BODY_MIN_RATE)."""
    grace_s = BODY_GRACE_S if grace_s is None else grace_s
    min_rate = BODY_MIN_RATE if min_rate is None else min_rate
    start, got = clock(), 0
    it = chunks.__aiter__()
    while True:
        due = start + grace_s + got / min_rate  # when the next byte is late
        try:
            async with asyncio.timeout(max(due - clock(), 0.0)):  # (no task per chunk, unlike `wait_for`)
                chunk = await it.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise TooSlow(f"request body arrived at under {min_rate / 1024:.0f} KiB/s ({got} bytes in "
                          f"{clock() - start:.0f} s)") from None
        got += len(chunk)
        yield chunk


class RefusedRequestLog(logging.Filter):
    """On aiohttp's server logger: a malformed HTTP request becomes one line without its traceback, at most one
    every `every_s` (with how many were left out since), instead of an ERROR with a traceback each."""

    def __init__(self, every_s: float = REFUSED_LOG_EVERY_S, clock=time.monotonic) -> None:
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self._last: float | None = None
        self.left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, http_exceptions.HttpProcessingError):
            return True
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self.left_out += 1
            return False
        self._last = now
        reason = (getattr(error, "message", "") or str(error) or "?").splitlines()[0][:200]
        record.msg = "refused a malformed HTTP request (%s; %d more since the last such line)"
        record.args = (reason, self.left_out)
        record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        self.left_out = 0
        return True


def quiet_malformed_requests() -> None:
    """Install `RefusedRequestLog` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RefusedRequestLog) for f in logger.filters):
        logger.addFilter(RefusedRequestLog())
