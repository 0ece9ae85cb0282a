"""The admin API of the HTTPS listeners: what certificates serve, and a reload.

``GET /api/tls``: every certificate loaded (names, expiry, file, obtained by ACME or
configured), the pairs refused at their last load and why, and the handshakes so far.
``POST /api/tls/reload``: load what changed on disk now, in the main process and every worker
(what SIGHUP does), and answer what was loaded and refused. Without ``listen_tls`` both
answer ``enabled: false``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from .bodies import TlsCertificateView, TlsRefusalView, TlsView
from .openapi import Operation

if TYPE_CHECKING:  # annotations: a gateway without TLS loads none of it
    from gateway import ReloadReport, Termination


def tls_view(tls: Termination | None, report: ReloadReport | None = None) -> TlsView:
    if tls is None:
        return TlsView(enabled=False, certificates=[], refused=[], reload_failures=0, handshakes={})
    store = tls.store
    certificates = [
        TlsCertificateView(
            name=c.name,
            names=list(c.names),
            not_after=c.not_after,
            cert_file=c.cert_file,
            key_file=c.key_file,
            acme=c.managed,
        )
        for c in (report.loaded if report is not None else store.loaded.values())
    ]
    refusals = report.refused if report is not None else tuple(store.refused.values())
    refused = [
        TlsRefusalView(cert_file=r.cert_file, key_file=r.key_file, file=r.file, reason=r.reason)
        for r in refusals
    ]
    tally = tls.tally
    return TlsView(
        enabled=True,
        certificates=certificates,
        refused=refused,
        reload_failures=store.reload_failures,
        handshakes={
            "ok": dict(tally.ok),
            "resumed": dict(tally.resumed),
            "failed": {k: v for k, v in tally.failed.items() if v},
        },
    )


def tls_operations(
    tls: Termination | None, reload: Callable[[], ReloadReport | None]
) -> list[Operation]:
    """``GET /api/tls`` and ``POST /api/tls/reload``, for ``build_admin_app``'s extra routes."""

    async def show(request: web.Request) -> web.Response:
        return web.json_response(text=tls_view(tls).model_dump_json())

    async def reload_now(request: web.Request) -> web.Response:
        return web.json_response(text=tls_view(tls, reload()).model_dump_json())

    return [
        Operation(
            "GET",
            "/api/tls",
            show,
            "HTTPS: the certificates serving, those refused and why, handshakes so far",
            {200: TlsView},
        ),
        Operation(
            "POST",
            "/api/tls/reload",
            reload_now,
            "Load the certificate files that changed now (what SIGHUP does), everywhere",
            {200: TlsView},
        ),
    ]
