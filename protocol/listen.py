"""The listening sockets of a peer's server: a connection the limiter would refuse at once is closed in
`accept()`, before asyncio builds a transport and a protocol for it (limits.py).

A flood's reconnects arrive by the hundred a second; for each one asyncio makes a transport (a few syscalls and
objects), calls the gate, which aborts it, and tears it down again: about a fifth of a flooded peer's event
loop (benchmarks/flood.py). Closed here, a refused connection costs an `accept` and a `close`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

Refuse = Callable[[str], bool]  # (the source address) -> close the connection now


class GatedSocket(socket.socket):
    """A listening socket whose `accept` skips (closes) the connections `refuse` names. asyncio's server calls
    `accept` until it raises `BlockingIOError`; so does this, past the refused ones."""

    __slots__ = ("refuse",)

    def accept(self) -> tuple[socket.socket, object]:
        while True:
            fd, address = self._accept()  # type: ignore[attr-defined]  # (raises BlockingIOError when none is queued)
            if self.refuse(str(address[0])):
                os.close(fd)
                continue
            conn = socket.socket(self.family, self.type, self.proto, fileno=fd)
            if socket.getdefaulttimeout() is None and self.gettimeout():
                conn.setblocking(True)  # (as `socket.accept` does)
            return conn, address


def listen(host: str, port: int, backlog: int, refuse: Refuse) -> list[GatedSocket]:
    """Bound, listening, non-blocking sockets for `host:port`, one per address it resolves to, as
    `loop.create_server` would make them (SO_REUSEADDR; an IPv6 one takes IPv6 only)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[GatedSocket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = GatedSocket(family, kind, proto)
            sockets.append(sock)
            sock.refuse = refuse
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
