"""The browser dashboard: three static files served at `GET /` by every peer that has a server.

The page (`index.html`, `app.js`, `style.css`, plain JavaScript with no build step and nothing fetched from
elsewhere, so it works offline) polls this peer's `GET /v1/status` (docs/status.md) and draws the swarm as
this peer sees it. The files ship inside the package (pyproject `package-data`) and are read with
`importlib.resources`, so a wheel install serves them as an editable checkout does. Only these names are
served: `/dashboard/{name}` never maps a request onto the file system.

A private run (membership allowlist) guards every GET with a member's signature (protocol/reads.py), which a
browser cannot make: there the page is refused like any other unsigned read.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Protocol

from aiohttp import web

ROUTE_INDEX = "/"
ROUTE_ASSET = "/dashboard/{name}"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
# The page may talk to its own origin only: no CDN, no font server, no third-party script.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Routable(Protocol):
    """What the dashboard is registered on: a `PeerServer` (protocol/transport.py) or any object with the same
    `add_route`, e.g. an `aiohttp.web.Application`'s router."""

    def add_route(self, method: str, path: str, handler: Handler) -> object: ...


@functools.cache
def _read(name: str) -> bytes:
    return resources.files(__name__).joinpath(name).read_bytes()


async def _index(request: web.Request) -> web.Response:
    return web.Response(body=_read("index.html"), content_type="text/html", charset="utf-8", headers=HEADERS)


async def _asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound(reason=f"no dashboard file {name!r}")
    return web.Response(body=_read(name), content_type=ASSETS[name], charset="utf-8", headers=HEADERS)


def register(server: Routable) -> None:
    """Serve the dashboard on `server`: `GET /` (the page) and `GET /dashboard/{name}` (its two assets)."""
    server.add_route("GET", ROUTE_INDEX, _index)
    server.add_route("GET", ROUTE_ASSET, _asset)
