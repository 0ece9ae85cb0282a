"""The admin API client: the calls to it, at the URL ``target.resolve_target`` found. An
unreachable gateway or a refused token is ``EXIT_UNUSABLE``; any other refusal ``EXIT_FAILED``
with the API's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp

from ..unreachable import unreachable_reason
from .exits import EXIT_FAILED, EXIT_UNUSABLE, CliError
from .target import REQUEST_TIMEOUT, TOKEN_ENV, Target

USER_AGENT = "gateway-cli"
"""How the CLI names itself to the admin API (an apply's span says who applied)."""


class Client:
    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self.session = session
        self.target = target
        self.headers = {"User-Agent": USER_AGENT}
        if target.token:
            self.headers["Authorization"] = f"Bearer {target.token}"

    def _unreachable(self, error: BaseException) -> CliError:
        reason = unreachable_reason(error)
        if isinstance(error, aiohttp.ClientConnectorError):
            message = f"cannot connect to the gateway at {self.target.url}: {reason}"
        else:
            message = f"cannot reach the gateway at {self.target.url}: {reason}"
        return CliError(message, EXIT_UNUSABLE)

    def _refused(self, status: int, data: Any) -> CliError:
        if status == 401:
            hint = "" if self.target.token else f" (no token given: --token or ${TOKEN_ENV})"
            return CliError(
                f"the gateway at {self.target.url} refused the token{hint}", EXIT_UNUSABLE
            )
        if isinstance(data, dict) and "message" in data:
            message = str(data["message"])
        else:
            message = f"HTTP {status}"
        return CliError(message, EXIT_FAILED)

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        allow: Sequence[int] = (),
    ) -> Any:
        """The JSON of a successful answer (or of one whose status is in ``allow``)."""
        try:
            async with self.session.request(
                method, self.target.url + path, json=body, headers=self.headers
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise self._unreachable(e) from None
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if status >= 400 and status not in allow:
            raise self._refused(status, data)
        return data

    async def service(self, name: str) -> dict[str, Any] | None:
        data = await self.call("GET", f"/api/services/{quote(name)}", allow=(404,))
        return data if isinstance(data, dict) and "name" in data else None

    @contextlib.asynccontextmanager
    async def watch(self, name: str) -> AsyncIterator[asyncio.Event]:
        """An event set on each server-sent event of the service (the stream is best-effort:
        if it cannot be opened or breaks, the follower falls back to reading every POLL)."""
        changed = asyncio.Event()
        task = asyncio.create_task(self._listen(name, changed), name=f"watch:{name}")
        try:
            yield changed
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self, name: str, changed: asyncio.Event) -> None:
        url = f"{self.target.url}/api/events?service={quote(name)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.get(url, headers=self.headers, timeout=timeout) as response:
                if response.status != 200:
                    return
                async for line in response.content:
                    if line.startswith(b"data:"):
                        changed.set()
