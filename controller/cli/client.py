"""The admin API client: where the API is (``resolve_target``) and the calls to it.

The URL and token come from ``--admin`` / ``--token``, else ``GATEWAY_ADMIN_URL`` /
``GATEWAY_ADMIN_TOKEN``, else the gateway config named by ``-c``, else ``DEFAULT_URL``. An
unreachable gateway or a refused token is ``EXIT_UNUSABLE``; any other refusal ``EXIT_FAILED``
with the API's message.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from gateway import parse_address

from ..config import ConfigError, load_config
from .exits import EXIT_FAILED, EXIT_UNUSABLE, CliError

DEFAULT_URL = "http://127.0.0.1:8081"
URL_ENV = "GATEWAY_ADMIN_URL"
TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
REQUEST_TIMEOUT = 30.0


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None


def admin_url(listen: str) -> str:
    """The URL at which a client reaches an admin listener bound to ``listen``."""
    host, port = parse_address(listen, listen=True)
    if port == 0:
        raise CliError(f"admin.listen {listen!r} has no fixed port: pass --admin", EXIT_UNUSABLE)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolve_target(args: argparse.Namespace, env: dict[str, str] | None = None) -> Target:
    """Flags first, then the environment, then the gateway config, then the default."""
    environ = os.environ if env is None else env
    url = args.admin or environ.get(URL_ENV) or None
    token = args.token or environ.get(TOKEN_ENV) or None
    if args.config and (url is None or token is None):
        try:
            config = load_config(args.config).config
            token = token or config.admin_token()
        except ConfigError as e:
            raise CliError(str(e).replace("\n", " "), EXIT_UNUSABLE) from None
        url = url or admin_url(config.admin.listen)
    url = (url or DEFAULT_URL).rstrip("/")
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise CliError(f"not an admin API URL: {url!r} (e.g. {DEFAULT_URL})", EXIT_UNUSABLE)
    return Target(url, token)


class Client:
    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self.session = session
        self.target = target
        self.headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}

    def _unreachable(self, error: BaseException) -> CliError:
        reason = str(error) or type(error).__name__
        return CliError(f"cannot reach the gateway at {self.target.url}: {reason}", EXIT_UNUSABLE)

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
