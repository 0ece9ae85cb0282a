"""A test client of an admin app, served by pytest-aiohttp with the admin listener's settings.

``admin_client(app)`` serves the app on a loopback port (pytest-aiohttp's ``aiohttp_server``,
with ``HTTP_SETTINGS``: the keep-alive, header and shutdown limits ``AdminServer`` runs it
with) and answers its ``aiohttp_client``, whose paths are relative to it; both are closed
when the test ends. (``aiohttp_client(app, server_kwargs=...)`` would drop the settings:
``TestServer`` takes them only in ``start_server``.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from controller.admin.app import HTTP_SETTINGS

AdminClient = TestClient[web.Request, web.Application]
AdminClientFactory = Callable[[web.Application], Awaitable[AdminClient]]


@pytest.fixture
def admin_client(aiohttp_server: Any, aiohttp_client: Any) -> AdminClientFactory:
    async def make(app: web.Application) -> AdminClient:
        server = await aiohttp_server(app, **HTTP_SETTINGS)
        client: AdminClient = await aiohttp_client(server)
        return client

    return make
