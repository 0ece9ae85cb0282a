"""A Docker Engine API client on aiohttp: the few calls the Docker backend makes.

aiohttp speaks HTTP/1.1 over the engine's unix socket (``UnixConnector``) or TCP, plain or
with TLS (Docker's ``--tlsverify`` model: the client shows its certificate, the engine's is
verified against the CA and the engine's host name), on the gateway's own event loop; nothing
blocks and nothing shells out to the ``docker`` CLI. Every library error is translated here,
once: ``EngineUnreachable`` when no answer came (connection refused, socket missing, timeout,
a TLS handshake refused either way), ``EngineError`` (with the HTTP status) when the engine
answered with an error. Each call names the engine in its message.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from ...unreachable import unreachable_reason

API_VERSION = "v1.41"
"""Docker 20.10's API; later engines serve it too (their minimum is 1.24)."""
CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class EngineTls:
    """The files of a ``tcp://`` engine's TLS: the CA that signed the engine's certificate,
    and the client's certificate and key."""

    ca_file: str
    cert_file: str
    key_file: str

    def context(self) -> ssl.SSLContext:
        """A client context; raises OSError or ssl.SSLError when a file cannot be used."""
        context = ssl.create_default_context(cafile=self.ca_file)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


class EngineError(Exception):
    """The engine answered with an error (``status``), or a stream reported one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class EngineUnreachable(EngineError, ConnectionError):
    """No answer from the engine: it is not running, or cannot be reached."""


def image_reference(image: str) -> tuple[str, str]:
    """``(name, tag)`` as ``POST /images/create`` takes them; ``latest`` when none is given."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon + 1 :]
    return image, "latest"


class EngineClient:
    """One engine: ``unix:///var/run/docker.sock``, or ``tcp://host:port``: with TLS when
    ``tls`` is given, else plain HTTP (a trusted network only)."""

    def __init__(self, engine: str, tls: EngineTls | None = None) -> None:
        parts = urlsplit(engine)
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "unix" and parts.path and tls is None:
            self._socket: str | None = parts.path
            self._base = f"http://docker/{API_VERSION}"
        elif parts.scheme == "tcp" and parts.hostname and parts.port:
            self._socket = None
            scheme = "http" if tls is None else "https"
            self._base = f"{scheme}://{parts.netloc}/{API_VERSION}"
            if tls is not None:
                self._ssl = tls.context()
        else:
            raise ValueError(
                f"not an engine address: {engine!r} (unix:///PATH, or tcp://HOST:PORT with TLS "
                "or without)"
            )
        self.engine = engine
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector
            if self._socket is not None:
                connector = aiohttp.UnixConnector(path=self._socket, limit=0)
            else:
                connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl or False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT, sock_connect=CONNECT_TIMEOUT),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        seconds: float | None = REQUEST_TIMEOUT,
        ok: tuple[int, ...] = (),
    ) -> tuple[int, bytes]:
        """One request; returns ``(status, body)`` for a 2xx or a status in ``ok``."""
        try:
            async with self._http().request(
                method,
                self._base + path,
                params=params,
                json=body,
                timeout=aiohttp.ClientTimeout(total=seconds, sock_connect=CONNECT_TIMEOUT),
            ) as response:
                data = await response.read()
                status = response.status
        except (aiohttp.ClientConnectionError, OSError, TimeoutError) as exc:
            # TLS refused either way (a certificate not trusted) is a ClientConnectionError too:
            # the engine is out of reach until the files or the engine change.
            raise EngineUnreachable(f"engine {self.engine}: {unreachable_reason(exc)}") from exc
        if status < 300 or status in ok:
            return status, data
        raise EngineError(f"engine {self.engine}: {_message(data) or status}", status)

    async def ping(self, seconds: float = REQUEST_TIMEOUT) -> None:
        await self._call("GET", "/_ping", seconds=seconds)

    async def image_exists(self, image: str) -> bool:
        status, _ = await self._call("GET", f"/images/{quote(image, safe='')}/json", ok=(404,))
        return status != 404

    async def pull(
        self, image: str, progress: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """Pull ``image``, each message of the engine's progress stream given to ``progress``
        as it comes; raises EngineError with the engine's reason when it fails (the reason may
        come inside the progress stream of a 200 answer)."""
        name, tag = image_reference(image)
        try:
            async with self._http().post(
                self._base + "/images/create",
                params={"fromImage": name, "tag": tag},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
            ) as response:
                if response.status >= 300:
                    data = await response.read()
                    raise EngineError(
                        f"engine {self.engine}: {_message(data) or response.status}",
                        response.status,
                    )
                async for line in response.content:
                    try:
                        message = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(message, dict):
                        continue
                    if message.get("error"):
                        raise EngineError(f"engine {self.engine}: {message['error']}")
                    if progress is not None:
                        progress(message)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise EngineUnreachable(f"engine {self.engine}: {unreachable_reason(exc)}") from exc

    async def create(self, name: str, config: dict[str, Any]) -> str:
        _, data = await self._call("POST", "/containers/create", params={"name": name}, body=config)
        container_id: str = json.loads(data)["Id"]
        return container_id

    async def start(self, container: str) -> None:
        await self._call("POST", f"/containers/{container}/start", ok=(304,))

    async def stop(self, container: str, grace: int) -> None:
        """SIGTERM, SIGKILL after ``grace`` seconds; returns once the container stopped."""
        await self._call(
            "POST",
            f"/containers/{container}/stop",
            params={"t": str(grace)},
            seconds=grace + REQUEST_TIMEOUT,
            ok=(304, 404),
        )

    async def kill(self, container: str, signal: str = "SIGKILL") -> None:
        await self._call("POST", f"/containers/{container}/kill", params={"signal": signal})

    async def remove(self, container: str) -> None:
        await self._call("DELETE", f"/containers/{container}", params={"force": "1"}, ok=(404,))

    async def inspect(self, container: str) -> dict[str, Any] | None:
        status, data = await self._call("GET", f"/containers/{container}/json", ok=(404,))
        if status == 404:
            return None
        info: dict[str, Any] = json.loads(data)
        return info

    async def containers(self, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying all of ``labels``."""
        filters = json.dumps({"label": [f"{k}={v}" for k, v in labels.items()]})
        _, data = await self._call(
            "GET", "/containers/json", params={"all": "1", "filters": filters}
        )
        found: list[dict[str, Any]] = json.loads(data)
        return found

    async def logs(self, container: str, tail: int) -> list[str]:
        """The last ``tail`` lines of the container's stdout and stderr, interleaved."""
        _, data = await self._call(
            "GET",
            f"/containers/{container}/logs",
            params={"stdout": "1", "stderr": "1", "tail": str(tail)},
        )
        return demultiplex(data).decode("utf-8", "replace").splitlines()[-tail:]

    async def events(self, labels: Mapping[str, str], since: str | None) -> EventStream:
        """The engine's container events with ``labels``, from ``since`` (an engine time,
        ``seconds.nanoseconds``) or from now; ends when the stream does. The request is sent
        and answered before this returns, so no event after that is missed. The caller
        closes the stream."""
        filters = {"type": ["container"], "label": [f"{k}={v}" for k, v in labels.items()]}
        params = {"filters": json.dumps(filters)}
        if since is not None:
            params["since"] = since
        try:
            # An engine that accepts the connection but does not answer (a stopped process)
            # must not hold the caller: the head of the answer comes within REQUEST_TIMEOUT.
            response = await asyncio.wait_for(
                self._http().get(
                    self._base + "/events",
                    params=params,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
                ),
                REQUEST_TIMEOUT,
            )
        except (aiohttp.ClientConnectionError, OSError, TimeoutError) as exc:
            raise EngineUnreachable(f"engine {self.engine}: {unreachable_reason(exc)}") from exc
        if response.status >= 300:
            data = await response.read()
            response.release()
            raise EngineError(f"engine {self.engine}: {_message(data)}", response.status)
        return EventStream(self.engine, response)

    def __repr__(self) -> str:
        return f"<EngineClient {self.engine}>"


class EventStream:
    """An open ``/events`` answer: iterate it for events, ``close`` it when done."""

    def __init__(self, engine: str, response: aiohttp.ClientResponse) -> None:
        self._engine = engine
        self._response = response

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._events()

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in self._response.content:
                if line.strip():
                    event = json.loads(line)
                    if isinstance(event, dict):
                        yield event
        except (aiohttp.ClientError, OSError) as exc:
            why = unreachable_reason(exc)
            raise EngineUnreachable(f"engine {self._engine}: event stream lost: {why}") from exc

    def close(self) -> None:
        self._response.close()  # an endless answer: its connection cannot be reused


def demultiplex(data: bytes) -> bytes:
    """A log answer without a TTY is frames of ``[stream, 0, 0, 0, size (4 bytes BE)]`` and
    ``size`` bytes; the payloads joined. Data that is not framed is returned as it is."""
    out = bytearray()
    at = 0
    while at + 8 <= len(data):
        kind, size = data[at], struct.unpack(">I", data[at + 4 : at + 8])[0]
        if kind not in (0, 1, 2) or data[at + 1 : at + 4] != b"\0\0\0":
            return data  # a TTY container: raw bytes
        out += data[at + 8 : at + 8 + size]
        at += 8 + size
    return bytes(out)


def _message(data: bytes) -> str:
    try:
        doc = json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace").strip()[:300]
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return str(doc["message"])
    return str(doc)[:300]
