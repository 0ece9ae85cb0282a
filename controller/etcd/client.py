"""An asyncio etcd v3 client over etcd's JSON gateway (``/v3/...``), on the caller's loop.

Calls are plain HTTP POSTs through one aiohttp session; nothing blocks. The records and their
wire form are in ``wire``, the errors in ``errors``.

Failover: a call starts at the endpoint that answered last and goes round the others until one
answers or ``timeout`` (for the whole call) passes. Each attempt gets half of what is left (the
last one all of it), so a member that hangs (paused, partitioned) costs half the call, and a
refused connection nothing. An answer that says the member cannot serve now (no leader, request
timed out, 5xx) counts as no answer. A write retried elsewhere after a timeout may have been
applied twice (etcd gives no idempotency key): a ``txn`` caller that compares first sees its
own earlier write.

Watches are one streaming POST each (one JSON object per line); a broken stream ends the
iterator with ``EtcdUnavailable``: the caller watches again from the revision after the last
it saw, or reloads if that revision was compacted (``Compacted``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence

import aiohttp

from controller.etcd.errors import (
    Compacted,
    EtcdError,
    EtcdUnavailable,
    LeaseNotFound,
)
from controller.etcd.wire import (
    Compare,
    Delete,
    Get,
    Json,
    KeyValue,
    Op,
    Put,
    TxnResult,
    WatchEvent,
    b64,
    header_revision,
    key_values,
    range_fields,
    txn_json,
    txn_result,
    watch_events,
)

__all__ = [
    "Compacted",
    "Compare",
    "Delete",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "Get",
    "KeyValue",
    "LeaseNotFound",
    "Op",
    "Put",
    "TxnResult",
    "WatchEvent",
]

# gRPC codes that mean "this member cannot serve now, another may": deadline exceeded,
# resource exhausted, internal, unavailable (no leader, request timed out, leader changed).
_RETRY_ELSEWHERE = frozenset({4, 8, 13, 14})
_UNAUTHENTICATED = 16
_AUTH_STALE = ("invalid auth token", "revision of auth store is old", "user name is empty")
# Ask the member to end a watch when it loses its leader (a member cut off from the others
# would otherwise keep a silent stream open): gRPC metadata ``hasleader``, through the gateway.
_REQUIRE_LEADER = {"Grpc-Metadata-Hasleader": "true"}
_PAUSE_BETWEEN_ROUNDS = 0.05


class _Unreachable(Exception):
    """This endpoint did not answer usefully; try another."""


class _StaleToken(Exception):
    """etcd refused the auth token: authenticate again."""


class EtcdClient:
    """etcd v3 over its JSON gateway. Create and use it on one running loop; ``close`` it."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 2.0,
        username: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        page_size: int = 1000,
        watch_check: float = 5.0,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout = timeout
        self.page_size = page_size
        self.watch_check = watch_check
        """Seconds a watch may stay silent before its member is asked whether it still
        answers (a paused member keeps its connections open and says nothing)."""
        self.requests = 0
        """HTTP requests sent, every attempt and authentication counted."""
        self._username = username
        self._password = password
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self._current = 0
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<EtcdClient current={self.endpoints[self._current]} "
            f"endpoints={len(self.endpoints)} requests={self.requests}>"
        )

    @property
    def current(self) -> str:
        """The endpoint that answered last (tried first by the next call)."""
        return self.endpoints[self._current]

    # --- keys -------------------------------------------------------------------------------

    async def get(
        self, key: bytes, *, prefix: bool = False, revision: int = 0
    ) -> tuple[list[KeyValue], int]:
        """The kvs of ``key`` (or under it), sorted by key, and the header revision.

        A big prefix is read in pages of ``page_size``, every page at the first one's
        revision, so the result is one consistent snapshot."""
        body = range_fields(key, prefix)
        if revision:
            body["revision"] = str(revision)
        if prefix:
            body["limit"] = str(self.page_size)
        answer = await self._range(body, revision)
        kvs = key_values(answer)
        header = header_revision(answer)
        at = revision or header
        while answer.get("more") and kvs:
            body = {**body, "key": b64(kvs[-1].key + b"\x00"), "revision": str(at)}
            answer = await self._range(body, at)
            kvs.extend(key_values(answer))
        return kvs, header

    async def _range(self, body: Json, revision: int) -> Json:
        try:
            return await self._call("/v3/kv/range", body)
        except EtcdError as e:
            if e.code == 11 and "compacted" in str(e):
                raise Compacted(str(e), revision) from None
            raise

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write ``key``; the revision of the write."""
        body: Json = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return header_revision(await self._call("/v3/kv/put", body))

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under it); the revision after the delete."""
        return header_revision(await self._call("/v3/kv/deleterange", range_fields(key, prefix)))

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        within: float | None = None,
    ) -> TxnResult:
        """If every compare holds, do ``success``, else ``failure``: one atomic step.
        ``within``: seconds this call may take, when fewer than the client's ``timeout``."""
        body = txn_json(compare, success, failure)
        return txn_result(await self._call("/v3/kv/txn", body, within))

    async def compact(self, revision: int) -> None:
        """Drop the history before ``revision``: watches and gets from before it fail."""
        await self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})

    # --- leases -----------------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl)})
        if answer.get("error"):
            raise EtcdError(str(answer["error"]))
        return int(answer["ID"])

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL in seconds, 0 when etcd no longer has it."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        # A stream on the gRPC side: the gateway answers with its first message, {"result":...}.
        result = answer.get("result", answer)
        return int(result.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        """End ``lease`` and delete the keys bound to it; a lease already gone is fine."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except LeaseNotFound:
            pass

    # --- watches ----------------------------------------------------------------------------

    def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[list[WatchEvent]]:
        """The changes of ``key`` (or under it), one batch per watch response, in revision
        order, from ``start_revision`` (0: from now on).

        Opening fails over like a call (``EtcdUnavailable`` after ``timeout``); once open, a
        broken stream raises ``EtcdUnavailable``, a compacted ``start_revision`` ``Compacted``.
        """
        create: Json = range_fields(key, prefix)
        if start_revision:
            create["start_revision"] = str(start_revision)
        return self._watch({"create_request": create})

    async def _watch(self, body: Json) -> AsyncIterator[list[WatchEvent]]:
        response, first, lines = await self._open_watch(body)
        endpoint = str(response.url.origin())
        try:
            events = watch_events(first)
            if events:
                yield events
            while True:
                try:
                    async with asyncio.timeout(self.watch_check):
                        line = await lines.readline()
                except TimeoutError:
                    await self._check_alive(endpoint)
                    continue
                if line is None:
                    break
                message = _watch_message(line, endpoint)
                if message.get("canceled"):
                    _watch_canceled(message, endpoint)
                events = watch_events(message)
                if events:
                    yield events
            raise EtcdUnavailable(f"etcd {endpoint}: the watch stream ended")
        except (aiohttp.ClientError, OSError) as e:
            raise EtcdUnavailable(f"etcd {endpoint}: the watch stream broke: {_why(e)}") from e
        except (_Unreachable, _StaleToken) as e:
            # An error in the stream: the member lost its leader (hasleader), or its token.
            raise EtcdUnavailable(
                f"etcd {endpoint}: the watch ended: {e}", {endpoint: str(e)}
            ) from e
        finally:
            response.close()

    async def _open_watch(self, body: Json) -> tuple[aiohttp.ClientResponse, Json, _Lines]:
        """POST the watch to the first endpoint that confirms it was created."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        reasons: dict[str, str] = {}
        authenticated = False
        while True:
            for index, endpoint, budget in self._attempts(deadline):
                response: aiohttp.ClientResponse | None = None
                try:
                    async with asyncio.timeout(budget):
                        response = await self._send(endpoint, "/v3/watch", body, _REQUIRE_LEADER)
                        if response.status != 200:
                            _raise_answer(response.status, await response.read(), endpoint)
                        lines = _Lines(response.content)
                        line = await lines.readline()
                        if line is None:
                            raise _Unreachable("the watch stream ended at once")
                        first = _watch_message(line, endpoint)
                    if first.get("canceled"):
                        response.close()
                        try:
                            _watch_canceled(first, endpoint)
                        except EtcdUnavailable as e:  # this member cannot watch now
                            reasons[endpoint] = str(e)
                            continue
                    self._current = index
                    return response, first, lines
                except _StaleToken:
                    if response is not None:
                        response.close()
                    if authenticated:
                        raise _refused_token(endpoint) from None
                    authenticated = True
                    self._token = None
                    await self._authenticate(deadline)
                except (_Unreachable, TimeoutError, aiohttp.ClientError, OSError) as e:
                    if response is not None:
                        response.close()
                    reasons[endpoint] = _why(e)
                except BaseException:
                    if response is not None:
                        response.close()
                    raise
            if await self._out_of_time(deadline):
                raise _unavailable("watch", reasons)

    async def _check_alive(self, endpoint: str) -> None:
        """A watch heard nothing for ``watch_check`` seconds: quiet keys, or a member that
        stopped (paused, cut off) and keeps the connection open. Ask it a linearizable read
        (it needs a leader to answer); no answer in ``timeout`` ends the watch."""
        body = {"key": b64(b"\x00"), "limit": "1", "keys_only": True}
        try:
            await self._post(endpoint, "/v3/kv/range", body, self.timeout)
        except _StaleToken:
            pass  # it answered
        except (_Unreachable, EtcdError) as e:
            raise EtcdUnavailable(
                f"etcd {endpoint}: the watch's member stopped answering: {e}", {endpoint: str(e)}
            ) from None

    # --- the calls --------------------------------------------------------------------------

    async def _call(self, path: str, body: Json, within: float | None = None) -> Json:
        """POST ``body`` to ``path`` of the first endpoint that answers, within the timeout
        (or ``within`` seconds, when fewer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.timeout if within is None else min(within, self.timeout))
        reasons: dict[str, str] = {}
        authenticated = False
        while True:
            for index, endpoint, budget in self._attempts(deadline):
                try:
                    if self._username is not None and self._token is None:
                        await self._authenticate(deadline)
                    answer = await self._post(endpoint, path, body, budget)
                except _StaleToken:
                    if authenticated:
                        raise _refused_token(endpoint) from None
                    authenticated = True
                    self._token = None
                    continue
                except _Unreachable as e:
                    reasons[endpoint] = str(e)
                    continue
                except EtcdError:
                    self._current = index
                    raise
                self._current = index
                return answer
            if await self._out_of_time(deadline):
                raise _unavailable(path, reasons)

    def _attempts(self, deadline: float) -> Iterator[tuple[int, str, float]]:
        """One round over the endpoints from the current one: index, endpoint and the
        attempt's share of the time left (read as the round goes)."""
        loop = asyncio.get_running_loop()
        count = len(self.endpoints)
        start = self._current
        for step in range(count):
            left = deadline - loop.time()
            if left <= 0:
                return
            index = (start + step) % count
            # Half of what is left while another endpoint remains: a slow but healthy member
            # gets time to answer (a write retried elsewhere may be applied twice), a hung
            # one costs half the call.
            yield index, self.endpoints[index], left / min(2, count - step)

    async def _out_of_time(self, deadline: float) -> bool:
        """After a round every endpoint failed: pause a little, unless the time is up."""
        left = deadline - asyncio.get_running_loop().time()
        if left <= _PAUSE_BETWEEN_ROUNDS:
            return True
        await asyncio.sleep(_PAUSE_BETWEEN_ROUNDS)
        return False

    async def _post(self, endpoint: str, path: str, body: Json, budget: float) -> Json:
        try:
            async with asyncio.timeout(budget):
                response = await self._send(endpoint, path, body)
                async with response:
                    data = await response.read()
        except TimeoutError:
            raise _Unreachable(f"no answer in {budget:.2f} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise _Unreachable(_why(e)) from e
        if response.status != 200:
            _raise_answer(response.status, data, endpoint)
        return _json(data, endpoint)

    async def _send(
        self, endpoint: str, path: str, body: Json, headers: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        if self._closed:
            raise RuntimeError("the etcd client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        sent = dict(headers or {})
        if self._token is not None and path != "/v3/auth/authenticate":
            sent["Authorization"] = self._token
        self.requests += 1
        try:
            return await self._session.post(endpoint + path, json=body, headers=sent)
        except (aiohttp.ClientError, OSError) as e:
            raise _Unreachable(_why(e)) from e

    async def _authenticate(self, deadline: float) -> None:
        """Get a token for ``username``; etcd replicates it to every member."""
        if self._username is None:
            raise EtcdError("etcd asks for authentication: give the client a username", 16)
        body = {"name": self._username, "password": self._password or ""}
        reasons: dict[str, str] = {}
        while True:
            for index, endpoint, budget in self._attempts(deadline):
                try:
                    answer = await self._post(endpoint, "/v3/auth/authenticate", body, budget)
                except _Unreachable as e:
                    reasons[endpoint] = str(e)
                    continue
                except _StaleToken as e:
                    raise EtcdError(f"etcd {endpoint}: authentication refused: {e}", 16) from None
                self._current = index
                self._token = str(answer["token"])
                return
            if await self._out_of_time(deadline):
                raise _unavailable("authenticate", reasons)

    async def close(self) -> None:
        """Close the connections; open watches end with ``EtcdUnavailable``."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


def _why(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if isinstance(e, _Unreachable) else f"{type(e).__name__}: {text}"


def _refused_token(endpoint: str) -> EtcdError:
    return EtcdError(f"etcd {endpoint} refused a fresh auth token (or asks for one)", 16)


def _unavailable(what: str, reasons: dict[str, str]) -> EtcdUnavailable:
    tried = "; ".join(f"{endpoint}: {why}" for endpoint, why in reasons.items())
    return EtcdUnavailable(f"etcd unavailable ({what}): {tried or 'no time left'}", reasons)


def _json(data: bytes, endpoint: str) -> Json:
    try:
        answer = json.loads(data)
    except ValueError:
        raise _Unreachable(f"not JSON: {data[:200]!r}") from None
    if not isinstance(answer, dict):
        raise _Unreachable(f"not a JSON object: {data[:200]!r}")
    return answer


def _raise_answer(status: int, data: bytes, endpoint: str) -> None:
    """Turn a non-200 answer into the error it means."""
    try:
        answer = json.loads(data)
        code = int(answer.get("code", 0))
        message = str(answer.get("message") or answer.get("error") or "")
    except (ValueError, AttributeError, TypeError):
        code, message = 0, data[:200].decode(errors="replace")
    _raise_code(code, message, status, endpoint)


def _raise_code(code: int, message: str, status: int, endpoint: str) -> None:
    if code in _RETRY_ELSEWHERE or (code == 0 and status >= 500):
        raise _Unreachable(f"{status} {message}".strip())
    if code == _UNAUTHENTICATED or any(stale in message for stale in _AUTH_STALE):
        raise _StaleToken(message)
    if code == 5 and "lease not found" in message:
        raise LeaseNotFound(f"etcd {endpoint}: {message}")
    raise EtcdError(f"etcd {endpoint}: {message or status}", code)


def _watch_message(line: bytes, endpoint: str) -> Json:
    message = _json(line, endpoint)
    if "error" in message:
        error = message["error"]
        if isinstance(error, dict):
            code = int(error.get("grpc_code") or error.get("code") or 0)
            status = int(error.get("http_code", 500))
            text = str(error.get("message", ""))
        else:
            code, status, text = int(message.get("code", 0)), 500, str(error)
        _raise_code(code, text, status, endpoint)
    result = message.get("result", {})
    return result if isinstance(result, dict) else {}


def _watch_canceled(message: Json, endpoint: str) -> None:
    compact = int(message.get("compact_revision", 0))
    if compact:
        raise Compacted(f"etcd {endpoint}: the watch start was compacted (at {compact})", compact)
    reason = message.get("cancel_reason", "") or "canceled by etcd"
    raise EtcdUnavailable(f"etcd {endpoint}: the watch ended: {reason}")


class _Lines:
    """The lines of a stream, whatever their length (aiohttp's readline caps one line).

    ``readline`` may be cancelled (a timeout) and called again: nothing is lost."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self._buffer = b""
        self._ready: list[bytes] = []

    async def readline(self) -> bytes | None:
        """The next non-empty line; None at the end of the stream."""
        while not self._ready:
            chunk = await self._content.readany()
            if not chunk:
                last, self._buffer = self._buffer, b""
                return last if last.strip() else None
            *complete, self._buffer = (self._buffer + chunk).split(b"\n")
            self._ready.extend(line for line in complete if line.strip())
        return self._ready.pop(0)
