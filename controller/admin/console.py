"""The web console: one page and its assets, served by the admin app at ``/`` and ``/ui/``.

The page is static files (``ui/``: HTML, CSS and JavaScript modules; no build step, nothing
fetched from anywhere but this listener) that read the admin API with the token the user
enters into it. It holds no data, so it is served without a token; the API it calls is not.

Invariants: the routes serve exactly ``FILES``, each from memory (no path from a request
reaches the file system); every answer carries ``HEADERS``: a Content-Security-Policy that
runs only this origin's scripts and styles (no inline code, no ``eval``), allows no framing,
and connects only back to this origin; and an ``ETag`` (a digest of the body), so a browser
revalidates with ``If-None-Match`` and an unchanged file costs a 304.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from aiohttp import web
from aiohttp.typedefs import Handler

from .openapi import Operation

__all__ = ["FILES", "HEADERS", "PATHS", "console_operations"]

UI = Path(__file__).with_name("ui")
"""The page's files (package data: ``[tool.setuptools.package-data]`` in pyproject.toml)."""

FILES = (
    "index.html",
    "console.css",
    "console.js",
    "api.js",
    "dom.js",
    "metrics.js",
    "charts.js",
    "views.js",
)
"""Every file served: ``index.html`` at ``/``, the others at ``/ui/<name>``."""

PATHS = frozenset("/" if name == "index.html" else f"/ui/{name}" for name in FILES)
"""The console's paths: open (no token), as the page holds no data."""

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'; "
    "object-src 'none'"
)

HEADERS: Mapping[str, str] = MappingProxyType(
    {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",  # frame-ancestors, for browsers that predate it
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cross-Origin-Resource-Policy": "same-origin",
        # Revalidated on each load (a 304 while unchanged): an upgraded gateway's page and
        # modules are never mixed with a cached older one's.
        "Cache-Control": "no-cache",
    }
)
"""Headers of every console answer."""


@dataclass(frozen=True, slots=True)
class Asset:
    path: str
    body: bytes
    content_type: str
    etag: str


@functools.cache
def _asset(name: str) -> Asset:
    body = (UI / name).read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    path = "/" if name == "index.html" else f"/ui/{name}"
    return Asset(path, body, CONTENT_TYPES[Path(name).suffix], etag)


def _serve(asset: Asset) -> Handler:
    async def serve(request: web.Request) -> web.StreamResponse:
        headers = {**HEADERS, "ETag": asset.etag}
        if asset.etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers=headers)
        return web.Response(
            body=asset.body, headers={**headers, "Content-Type": asset.content_type}
        )

    # The document's operationId.
    serve.__name__ = (
        "console" if asset.path == "/" else "console_" + asset.path[4:].replace(".", "_")
    )
    return serve


def console_operations() -> list[Operation]:
    """The console's routes; each file is read on the first call (once a process)."""
    operations = []
    for name in FILES:
        asset = _asset(name)
        summary = (
            "The web console (HTML; it reads the API with the token entered into it)"
            if asset.path == "/"
            else f"The web console's {name}"
        )
        operations.append(
            Operation("GET", asset.path, _serve(asset), summary, {200: None, 304: None}, auth=False)
        )
    return operations
