"""Requests a browser makes to the admin API on another site's behalf: refused.

Any page a browser shows can make it send a request to the admin listener: a form's POST, a
``fetch`` in ``no-cors`` mode. The page cannot read the answer, but a write needs no answer;
with no token configured (allowed on a loopback listener only) nothing else would stop it. A
name that an attacker resolves to 127.0.0.1 (DNS rebinding) even makes such a page the
listener's own origin to the browser. So every ``/api/`` request

- that a browser marks as sent for another site (``Sec-Fetch-Site`` other than
  ``same-origin`` or ``none``), or whose ``Origin`` is not the listener's own (its host and
  port, as the request's ``Host`` names them), is 403 ``cross_site_request``;
- whose ``Host`` is a name other than ``localhost``, while no token is configured, is 403
  ``untrusted_host``: a name is what rebinding needs, an address is what a local client uses.

Clients that are not browsers (the CLI, curl, Prometheus, a cluster node forwarding to its
leader) send neither header, and the console sends its own origin. The open paths (the probes,
``/metrics``, the console's page) take no action and are not checked.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .handlers import ApiError

BROWSER_HEADERS = ("origin", "sec-fetch-site")
"""What a browser says of the site a request is sent for: a cluster node that forwards a
request to its leader has checked them, and does not pass them on."""
_SAME_SITE = frozenset({"same-origin", "none"})


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def refusal(request: web.Request, token_configured: bool) -> ApiError | None:
    """Why ``request`` is refused as sent for another site, or None."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site.lower() not in _SAME_SITE:
        return ApiError(
            403,
            "cross_site_request",
            f"a browser sent this request for another site (Sec-Fetch-Site: {fetch_site})",
        )
    host = request.host
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
        return ApiError(
            403,
            "cross_site_request",
            f"a request from the page of another origin ({origin}) is not taken",
        )
    if not token_configured:
        name = urlsplit(f"//{host}").hostname or ""
        if name != "localhost" and not _is_address(name):
            return ApiError(
                403,
                "untrusted_host",
                f"Host {host!r} is a name: with no admin token configured, the admin API "
                "answers requests to an address or localhost only",
            )
    return None


def origin_middleware(token_configured: bool) -> Middleware:
    @web.middleware
    async def same_site(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/api/"):
            error = refusal(request, token_configured)
            if error is not None:
                raise error
        return await handler(request)

    return same_site
