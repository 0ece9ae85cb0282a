"""A client of an admin app served on a loopback port of its own, for the tests.

``admin_client(app)`` starts the app's listener (``controller.admin.server``) on 127.0.0.1
and answers a client whose paths are relative to it; both are closed when the test ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from controller.admin.server import AdminListener
from controller.admin.web import App


class AdminClient:
    """An aiohttp session bound to one admin listener."""

    def __init__(self, app: App, listener: AdminListener, session: aiohttp.ClientSession):
        self.app = app
        self.listener = listener
        self.session = session

    @property
    def port(self) -> int:
        return self.listener.port

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.session.request(method, self.url(path), **kwargs)

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> Any:
        return self.request("PUT", path, **kwargs)

    def patch(self, path: str, **kwargs: Any) -> Any:
        return self.request("PATCH", path, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> Any:
        return self.request("DELETE", path, **kwargs)


AdminClientFactory = Callable[[App], Awaitable[AdminClient]]


@pytest.fixture
async def admin_client() -> AsyncIterator[AdminClientFactory]:
    made: list[AdminClient] = []

    async def make(app: App) -> AdminClient:
        listener = AdminListener(app, "127.0.0.1", 0)
        await listener.start()
        client = AdminClient(app, listener, aiohttp.ClientSession())
        made.append(client)
        return client

    yield make
    for client in made:
        await client.session.close()
        await client.listener.stop(grace=2)
