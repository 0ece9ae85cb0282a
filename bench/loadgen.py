"""The load generator of the zero-downtime harness: fixed concurrency, a mix, every outcome.

``LoadGen(url, LoadMix(...))`` runs ``concurrency`` HTTP clients and ``websockets`` WebSocket
clients against the gateway until ``stop()`` (or ``limit`` seconds). Half the HTTP clients send
short ``GET /`` requests back to back; the other half send long ones: slow requests
(``/slow``, 1-3 s), server-sent event streams (``/sse``) and uploads (``POST /upload``,
256 KiB-2 MiB, half with Content-Length and half chunked). Clients alternate, in pairs,
between one kept-alive connection and a fresh connection per request. Each WebSocket client
opens ``/ws``, sends a message every ``ws_interval`` seconds for a session of
``ws_session`` seconds, checks that each echo comes back in order, closes with 1000 and opens
the next one.

Each request (a WebSocket session counts as one) becomes an ``Outcome`` with the revision and
replica that answered (from ``X-Revision``/``X-Replica``, the SSE data or the WebSocket
greeting). An outcome fails on a connection error, a timeout, a non-2xx answer that the
replica did not produce itself (no ``X-Replica`` header: the gateway made it), a body that
is short or wrong, an SSE stream that ends before its last event, an upload whose length or
digest the replica did not see, a missing or wrong echo, or a WebSocket closed by the other
side. A close with 1001 (going away) is recorded as ``going_away``: whether that is expected
is the scenario's call (a drain timeout or a gateway shutdown sends it on purpose).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True)
class LoadMix:
    concurrency: int = 16
    """HTTP clients busy at once (half short requests, half long ones)."""
    websockets: int = 3
    slow: tuple[float, float] = (1.0, 3.0)
    """Seconds a slow request is held open, uniformly between the two."""
    sse_events: tuple[int, int] = (5, 20)
    sse_interval: float = 0.1
    upload: tuple[int, int] = (256 * KiB, 2 * MiB)
    ws_session: tuple[float, float] = (2.0, 4.0)
    ws_interval: float = 0.1
    long_weights: tuple[float, float, float] = (0.35, 0.35, 0.3)
    """Of the long requests: slow, SSE, upload."""
    think: float = 0.002
    """Pause of a short-request client between two requests."""
    timeout: float = 30.0
    """A request (a WebSocket echo) not done within this long fails as a timeout."""


@dataclass(slots=True)
class Outcome:
    kind: str
    """``short``, ``slow``, ``sse``, ``upload`` or ``ws``; ``grpc-unary`` or ``grpc-stream``
    (``zero_downtime.GrpcLoad``)."""
    client: int
    keepalive: bool
    start: float
    end: float = 0.0
    status: int | None = None
    revision: int | None = None
    replica: str | None = None
    error: str = ""
    """Why it failed; empty when it did not."""
    replica_error: bool = False
    """A non-2xx answer the replica produced itself (not a failure of the gateway)."""
    going_away: bool = False
    """A WebSocket closed by the other side with 1001, or whose close it answered with 1001."""
    messages: int = 0
    """WebSocket: echoes received."""

    @property
    def failed(self) -> bool:
        """Anything but a full, correct answer (a 1001 close included: see ``going_away``)."""
        return bool(self.error)

    @property
    def took(self) -> float:
        return self.end - self.start


Role = Callable[[aiohttp.ClientSession, "Outcome"], Awaitable[None]]


def _revision(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


class LoadGen:
    def __init__(
        self,
        url: str,
        mix: LoadMix,
        *,
        seed: int = 1,
        limit: float = 600.0,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.mix = mix
        self.limit = limit
        self.outcomes: list[Outcome] = []
        self.on_outcome = on_outcome
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._payload = random.Random(seed).randbytes(mix.upload[1] * 2)
        self._pending: dict[int, Outcome] = {}

    # -- running --------------------------------------------------------------------------

    async def start(self) -> None:
        mix = self.mix
        for i in range(mix.concurrency):
            keepalive = (i // 2) % 2 == 0
            role: Role = self._short if i % 2 == 0 else self._long
            self._tasks.append(asyncio.create_task(self._http_client(i, keepalive, role)))
        for j in range(mix.websockets):
            self._tasks.append(asyncio.create_task(self._ws_client(mix.concurrency + j)))

    async def __aenter__(self) -> LoadGen:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def stop_new(self) -> None:
        """Start no new request; those in flight run on."""
        self._stop.set()

    async def stop(self, timeout: float = 60.0) -> None:
        """Start no new request and wait for those in flight (cancelled after ``timeout``)."""
        self._stop.set()
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for outcome in list(self._pending.values()):
            outcome.error = outcome.error or "not finished when the load stopped"
            self._finish(outcome)
        self._tasks = []

    async def wait_for(self, count: int, timeout: float = 30.0) -> None:
        """Until ``count`` more outcomes were recorded."""
        target = len(self.outcomes) + count
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} more outcomes not seen within {timeout:g} s")
            await asyncio.sleep(0.02)

    def _running(self, deadline: float) -> bool:
        return not self._stop.is_set() and time.monotonic() < deadline

    def _begin(self, kind: str, client: int, keepalive: bool) -> Outcome:
        outcome = Outcome(kind, client, keepalive, time.monotonic())
        self._pending[id(outcome)] = outcome
        return outcome

    def _finish(self, outcome: Outcome) -> None:
        if self._pending.pop(id(outcome), None) is None:
            return
        outcome.end = time.monotonic()
        self.outcomes.append(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def pending(self) -> list[Outcome]:
        return list(self._pending.values())

    # -- HTTP -----------------------------------------------------------------------------

    async def _http_client(self, i: int, keepalive: bool, role: Role) -> None:
        connector = aiohttp.TCPConnector(force_close=not keepalive, limit=1)
        timeout = aiohttp.ClientTimeout(total=self.mix.timeout)
        deadline = time.monotonic() + self.limit
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as session:
            while self._running(deadline):
                outcome = await self._one(session, i, keepalive, role)
                if outcome.kind == "short" and self.mix.think:
                    await asyncio.sleep(self.mix.think)

    async def _one(
        self, session: aiohttp.ClientSession, i: int, keepalive: bool, role: Role
    ) -> Outcome:
        outcome = self._begin("?", i, keepalive)
        try:
            await role(session, outcome)
        except (aiohttp.ClientError, OSError) as e:
            outcome.error = outcome.error or f"{type(e).__name__}: {e}"
        except TimeoutError:
            outcome.error = outcome.error or f"timeout after {self.mix.timeout:g} s"
        except asyncio.CancelledError:
            outcome.error = outcome.error or "cancelled"
            self._finish(outcome)
            raise
        self._finish(outcome)
        return outcome

    def _check_status(self, response: aiohttp.ClientResponse, outcome: Outcome, text: str) -> bool:
        outcome.status = response.status
        outcome.revision = _revision(response.headers.get("X-Revision"))
        outcome.replica = response.headers.get("X-Replica")
        if 200 <= response.status < 300:
            return True
        if outcome.replica is not None:
            outcome.replica_error = True
        else:
            outcome.error = f"status {response.status} from the gateway: {text[:160]!r}"
        return False

    async def _short(self, session: aiohttp.ClientSession, outcome: Outcome) -> None:
        outcome.kind = "short"
        async with session.get(self.url + "/") as response:
            body = await response.read()
            text = body.decode(errors="replace")
            if self._check_status(response, outcome, text):
                self._check_length(response, body, outcome)
                if not outcome.error and text != f"rev {outcome.revision} {outcome.replica}\n":
                    outcome.error = f"unexpected body {text[:80]!r}"

    def _check_length(
        self, response: aiohttp.ClientResponse, body: bytes, outcome: Outcome
    ) -> None:
        length = response.content_length
        if length is not None and len(body) != length:
            outcome.error = f"truncated: {len(body)} of {length} bytes"

    async def _long(self, session: aiohttp.ClientSession, outcome: Outcome) -> None:
        kind = self._rng.choices(("slow", "sse", "upload"), self.mix.long_weights)[0]
        outcome.kind = kind
        if kind == "slow":
            await self._slow(session, outcome, self._rng.uniform(*self.mix.slow))
        elif kind == "sse":
            await self._sse(session, outcome, self._rng.randint(*self.mix.sse_events))
        else:
            await self._upload(session, outcome, self._rng.randint(*self.mix.upload))

    async def _slow(self, session: aiohttp.ClientSession, outcome: Outcome, seconds: float) -> None:
        seconds = round(seconds, 2)
        async with session.get(f"{self.url}/slow", params={"s": f"{seconds:g}"}) as response:
            body = await response.read()
            text = body.decode(errors="replace")
            if self._check_status(response, outcome, text):
                self._check_length(response, body, outcome)
                expected = f"slept {seconds:g} rev {outcome.revision} {outcome.replica}\n"
                if not outcome.error and text != expected:
                    outcome.error = f"unexpected body {text[:80]!r}"

    async def slow(self, seconds: float, client: int = -1) -> Outcome:
        """One slow request on a fresh connection, outside the mix (scenarios 7 and 8)."""

        async def role(session: aiohttp.ClientSession, outcome: Outcome) -> None:
            outcome.kind = "slow"
            await self._slow(session, outcome, seconds)

        return await self._single(client, role)

    async def sse(self, events: int, interval: float, client: int = -1) -> Outcome:
        """One SSE stream on a fresh connection, outside the mix."""

        async def role(session: aiohttp.ClientSession, outcome: Outcome) -> None:
            outcome.kind = "sse"
            await self._sse(session, outcome, events, interval)

        return await self._single(client, role)

    async def upload(self, size: int, client: int = -1) -> Outcome:
        """One upload on a fresh connection, outside the mix."""

        async def role(session: aiohttp.ClientSession, outcome: Outcome) -> None:
            outcome.kind = "upload"
            await self._upload(session, outcome, size)

        return await self._single(client, role)

    async def _single(self, client: int, role: Role) -> Outcome:
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=max(self.mix.timeout, 120.0))
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            return await self._one(session, client, False, role)

    async def _sse(
        self,
        session: aiohttp.ClientSession,
        outcome: Outcome,
        events: int,
        interval: float | None = None,
    ) -> None:
        interval = self.mix.sse_interval if interval is None else interval
        params = {"n": str(events), "interval": f"{interval:g}"}
        async with session.get(f"{self.url}/sse", params=params) as response:
            if not self._check_status(response, outcome, ""):
                if not outcome.replica_error:
                    text = (await response.read()).decode(errors="replace")
                    outcome.error = f"status {response.status} from the gateway: {text[:160]!r}"
                return
            seen = 0
            ended = False
            pending_id: int | None = None
            try:
                async for raw in response.content:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("id: "):
                        pending_id = int(line[4:])
                    elif line.startswith("data: ") and pending_id is not None:
                        if pending_id != seen or line != f"data: {outcome.revision} {seen}":
                            outcome.error = f"sse event {seen} out of order: {line!r}"
                            return
                        seen += 1
                        pending_id = None
                    elif line == "event: end":
                        ended = True
            except (aiohttp.ClientError, OSError) as e:
                outcome.error = f"sse broken after {seen} of {events} events: {type(e).__name__}"
                return
            if not ended or seen != events:
                outcome.error = f"sse truncated: {seen} of {events} events, end={ended}"

    async def _upload(self, session: aiohttp.ClientSession, outcome: Outcome, size: int) -> None:
        offset = self._rng.randrange(len(self._payload) - size)
        body = self._payload[offset : offset + size]
        digest = hashlib.sha256(body).hexdigest()
        chunked = self._rng.random() < 0.5

        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, size, 64 * KiB):
                yield body[at : at + 64 * KiB]

        data: object = chunks() if chunked else body
        async with session.post(f"{self.url}/upload", data=data) as response:
            raw = await response.read()
            text = raw.decode(errors="replace")
            if not self._check_status(response, outcome, text):
                return
            try:
                answer = json.loads(text)
            except ValueError:
                outcome.error = f"upload answer not JSON: {text[:80]!r}"
                return
            if answer.get("length") != size or answer.get("sha256") != digest:
                outcome.error = (
                    f"upload mangled: sent {size} bytes, replica saw {answer.get('length')}"
                )

    # -- WebSocket ------------------------------------------------------------------------

    async def _ws_client(self, i: int) -> None:
        deadline = time.monotonic() + self.limit
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.mix.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self._running(deadline):
                length = self._rng.uniform(*self.mix.ws_session)
                outcome = await self._ws_session(session, i, length)
                if outcome.error:
                    await asyncio.sleep(0.1)  # no hot loop against a refusing server

    async def websocket(self, seconds: float, client: int = -1) -> Outcome:
        """One WebSocket session of ``seconds`` outside the mix (scenarios 7 and 8)."""
        async with aiohttp.ClientSession() as session:
            return await self._ws_session(session, client, seconds, stoppable=False)

    async def _ws_session(
        self, session: aiohttp.ClientSession, i: int, length: float, stoppable: bool = True
    ) -> Outcome:
        outcome = self._begin("ws", i, False)
        try:
            await self._ws_talk(session, outcome, length, stoppable)
        except (aiohttp.ClientError, OSError) as e:
            outcome.error = outcome.error or f"{type(e).__name__}: {e}"
        except TimeoutError:
            outcome.error = outcome.error or f"websocket timeout after {self.mix.timeout:g} s"
        except asyncio.CancelledError:
            outcome.error = outcome.error or "cancelled"
            self._finish(outcome)
            raise
        self._finish(outcome)
        return outcome

    async def _ws_talk(
        self, session: aiohttp.ClientSession, outcome: Outcome, length: float, stoppable: bool
    ) -> None:
        mix = self.mix
        async with session.ws_connect(
            f"{self.url}/ws", autoclose=False, autoping=True, heartbeat=None
        ) as ws:
            outcome.status = 101
            greeting = await asyncio.wait_for(ws.receive(), mix.timeout)
            if greeting.type is not aiohttp.WSMsgType.TEXT:
                self._ws_closed(ws, outcome, "before its greeting")
                return
            hello = json.loads(greeting.data)
            outcome.revision, outcome.replica = hello["revision"], hello["replica"]
            ends = time.monotonic() + length
            seq = 0
            while time.monotonic() < ends and not (stoppable and self._stop.is_set()):
                text = f"{seq} {outcome.client}"
                try:
                    await ws.send_str(text)
                except (ConnectionError, RuntimeError) as e:
                    # aiohttp raises these when the other side has already closed.
                    msg = await asyncio.wait_for(ws.receive(), mix.timeout)
                    if msg.type is aiohttp.WSMsgType.CLOSE:
                        self._ws_closed(ws, outcome, f"after {seq} echoes", msg.data)
                    else:
                        outcome.error = f"websocket send failed after {seq} echoes: {e!r}"
                    return
                msg = await asyncio.wait_for(ws.receive(), mix.timeout)
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    code = msg.data if msg.type is aiohttp.WSMsgType.CLOSE else None
                    self._ws_closed(ws, outcome, f"after {seq} echoes", code)
                    return
                if msg.data != text:
                    outcome.error = f"wrong echo {msg.data[:40]!r} for {text!r}"
                    return
                seq += 1
                outcome.messages = seq
                await asyncio.sleep(mix.ws_interval)
            await ws.close(code=aiohttp.WSCloseCode.OK)
            if ws.close_code != aiohttp.WSCloseCode.OK:
                # 1001: the other side's going-away close crossed ours (a drain timeout, a
                # shutdown): as much going away as a close it began (``_ws_closed``).
                outcome.going_away = ws.close_code == aiohttp.WSCloseCode.GOING_AWAY
                outcome.error = f"websocket close answered with {ws.close_code}"

    def _ws_closed(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        outcome: Outcome,
        when: str,
        code: int | None = None,
    ) -> None:
        code = code if code is not None else ws.close_code
        if code == aiohttp.WSCloseCode.GOING_AWAY:
            outcome.going_away = True
        outcome.error = f"websocket closed by the other side with {code} {when}"
        outcome.status = code


@dataclass(slots=True)
class Summary:
    requests: int = 0
    failed: int = 0
    going_away: int = 0
    replica_errors: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    p50: float | None = None
    p99: float | None = None
    revisions: list[int] = field(default_factory=list)
    ws_messages: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summarize(
    outcomes: list[Outcome], expected: Callable[[Outcome], bool] | None = None
) -> Summary:
    """Counts and latencies (of short requests and unary gRPC calls, the back-to-back kinds);
    ``expected(o)``: that failed outcome is one the scenario meant."""
    s = Summary(requests=len(outcomes))
    shorts = [o.took for o in outcomes if o.kind in ("short", "grpc-unary") and not o.error]
    s.p50, s.p99 = percentile(shorts, 50), percentile(shorts, 99)
    revisions = set()
    for o in outcomes:
        s.by_kind[o.kind] = s.by_kind.get(o.kind, 0) + 1
        s.ws_messages += o.messages
        if o.error and not (expected is not None and expected(o)):
            s.failed += 1
            s.failed_by_kind[o.kind] = s.failed_by_kind.get(o.kind, 0) + 1
        if o.going_away:
            s.going_away += 1
        if o.replica_error:
            s.replica_errors += 1
        if o.revision is not None:
            revisions.add(o.revision)
    s.revisions = sorted(revisions)
    return s
