"""The admin API's side of HTTP: requests, responses, streams and the app's typed state.

What a handler sees of the admin listener (``server.py`` speaks the wire). A ``Request``
carries its head, decoded once; its body is read only when the handler asks for it
(``read``), so a route that refuses first (auth, a missing service) never buffers a body and
never sends ``100 Continue``. A ``Response`` is a whole answer; a ``StreamResponse`` is sent
as it is written (server-sent events, a forwarded answer), chunked on HTTP/1.1.

Invariants:
- Header names and values the server writes carry no CR, LF or NUL: a value that does is
  refused with ``ValueError`` before anything is sent.
- A body larger than the app's ``max_body`` is never read whole: ``read`` raises
  ``HTTPError(413)`` as soon as the declared or received length passes it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Mapping
from http import HTTPStatus
from typing import Any, Generic, Protocol, TypeVar, cast, overload
from urllib.parse import unquote

from gateway import http_date

T = TypeVar("T")

Handler = Callable[["Request"], Awaitable["Response"]]
Middleware = Callable[["Request", Handler], Awaitable["Response"]]

_REASONS = {s.value: s.phrase for s in HTTPStatus}
_UNSAFE = frozenset("\r\n\0")


def reason(status: int) -> str:
    return _REASONS.get(status, "Unknown")


class Routes(Protocol):
    """The route table an app answers from (``routes.Router``)."""

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler of ``method`` on ``path`` and its parameters; ``HTTPError`` 404/405."""
        ...


class HTTPError(Exception):
    """A refusal by the HTTP layer itself: no route (404), a method the route does not take
    (405, with ``Allow``), a body too large (413), a request too slow (408). The app's error
    middleware renders it like every other refusal."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


class AppKey(Generic[T]):
    """A typed key of the app's state (``app[CONTROLLER]`` is a ``Controller``)."""

    __slots__ = ("name",)

    def __init__(self, name: str, t: type[T] | None = None) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<AppKey {self.name}>"


class App:
    """The admin app: its state by typed keys, its routes (``routes.Router``) and the
    middlewares every request goes through, outermost first."""

    def __init__(self, router: Routes, middlewares: list[Middleware]) -> None:
        self._state: dict[AppKey[Any], Any] = {}
        self.router = router
        self.middlewares = middlewares
        self.on_shutdown: list[Callable[[App], Awaitable[None]]] = []
        self.max_body = 1024 * 1024
        self.refusal: Callable[[HTTPError], Response] = _refusal
        """How a refusal the server makes before any handler (a malformed or slow request)
        is answered."""
        self._handler = self._chain()

    def __getitem__(self, key: AppKey[T]) -> T:
        return cast(T, self._state[key])

    def __setitem__(self, key: AppKey[T], value: T) -> None:
        self._state[key] = value

    def __contains__(self, key: AppKey[Any]) -> bool:
        return key in self._state

    async def handle(self, request: Request) -> Response:
        """The answer to ``request``: through every middleware, then its route's handler."""
        return await self._handler(request)

    def _chain(self) -> Handler:
        async def endpoint(request: Request) -> Response:
            handler, request.match_info = self.router.resolve(request.method, request.raw_path)
            return await handler(request)

        handler: Handler = endpoint
        for middleware in reversed(self.middlewares):
            handler = _bind(middleware, handler)
        return handler


def _refusal(error: HTTPError) -> Response:
    return json_response({"error": f"http_{error.status}", "message": error.message},
                         status=error.status, headers=error.headers)  # fmt: skip


def _bind(middleware: Middleware, inner: Handler) -> Handler:
    async def call(request: Request) -> Response:
        return await middleware(request, inner)

    return call


class Headers:
    """A request's header fields as received: looked up by name without regard to case (the
    first field of a name), iterated in order with their names as sent."""

    __slots__ = ("_first", "_items")

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self._items = items
        self._first: dict[str, str] = {}
        for name, value in items:
            self._first.setdefault(name.lower(), value)

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._first.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._first[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._first

    def items(self) -> Iterator[tuple[str, str]]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class Body(Protocol):
    """Where a request's body comes from: the connection that reads it (``server.py``)."""

    async def read_body(self) -> bytes:
        """The whole body; ``HTTPError`` 413 past the app's limit, 408 if it is too slow."""
        ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None:
        """Return once the written data is below the transport's high-water mark."""
        ...


class Request:
    """One request's head, and its body on demand."""

    __slots__ = ("_body", "_conn", "app", "headers", "match_info", "method", "path", "path_qs",
                 "query", "raw_path", "version")  # fmt: skip

    def __init__(
        self,
        app: App,
        conn: Body,
        method: str,
        target: str,
        version: str,
        headers: Headers,
        has_body: bool,
    ) -> None:
        self.app = app
        self._conn = conn
        self.method = method
        self.version = version
        self.headers = headers
        self.path_qs = target
        self.raw_path, _, query = target.partition("?")
        self.path = unquote(self.raw_path)
        self.query = _query(query)
        self.match_info: dict[str, str] = {}
        self._body: bytes | None = None if has_body else b""

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower case, without its parameters."""
        value = self.headers.get("Content-Type")
        if not value:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    @property
    def can_read_body(self) -> bool:
        return self._body != b""

    async def read(self) -> bytes:
        if self._body is None:
            self._body = await self._conn.read_body()
        return self._body

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path_qs}>"


def _query(query: str) -> dict[str, str]:
    """The first value of each parameter, ``+`` a space and percent-decoded."""
    out: dict[str, str] = {}
    for pair in query.split("&"):
        if not pair:
            continue
        name, _, value = pair.partition("=")
        out.setdefault(unquote(name.replace("+", " ")), unquote(value.replace("+", " ")))
    return out


class Response:
    """A whole answer: status, header fields and a body of known length."""

    def __init__(
        self,
        *,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.reason = reason
        self.headers: dict[str, str] = dict(headers or {})

    def head(self, *, length: int | None, close: bool, chunked: bool) -> bytes:
        """The status line and header fields, as sent."""
        lines = [f"HTTP/1.1 {self.status} {self.reason or reason(self.status)}"]
        fields = dict(self.headers)
        fields.setdefault("Date", http_date().decode())
        if length is not None:
            fields["Content-Length"] = str(length)
        if chunked:
            fields["Transfer-Encoding"] = "chunked"
        if close:
            fields["Connection"] = "close"
        for name, value in fields.items():
            if _UNSAFE.intersection(name) or _UNSAFE.intersection(value) or ":" in name:
                raise ValueError(f"header field {name!r} is not safe to send")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.status}>"


class StreamResponse(Response):
    """An answer sent as it is written: ``prepare`` sends the head, each ``write`` a piece
    (one chunk on HTTP/1.1), ``write_eof`` the end. The server ends one the handler left
    open."""

    def __init__(
        self,
        *,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(status=status, headers=headers, reason=reason)
        self._conn: Body | None = None
        self._chunked = True
        self.finished = False

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request) -> None:
        if self._conn is not None:
            return
        self._conn = request._conn
        self._chunked = request.version == "1.1"
        head = self.head(length=None, close=not self._chunked, chunked=self._chunked)
        self._conn.write(head)
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        if self._conn is None or self.finished:
            raise RuntimeError("the stream is not prepared, or already ended")
        if data:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
            await self._conn.drain()

    async def write_eof(self) -> None:
        if self._conn is not None and not self.finished:
            self.finished = True
            if self._chunked:
                self._conn.write(b"0\r\n\r\n")
            await self._conn.drain()


def json_response(
    data: Any = None,
    *,
    text: str | None = None,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A JSON answer: ``text`` as it is, else ``data`` serialised."""
    body = (text if text is not None else json.dumps(data)).encode()
    fields = {"Content-Type": "application/json; charset=utf-8", **(headers or {})}
    return Response(status=status, body=body, headers=fields)
