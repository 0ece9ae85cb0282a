"""The admin listener on aiohttp.web (``controller.admin.app``): what our app adds to aiohttp's
HTTP (the JSON refusals, ``100 Continue`` only for a body it would read, the body's limits),
the settings it runs with, ``AdminServer``'s start and stop, and the cluster's forwarding."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from controller.admin import app as app_module
from controller.admin.app import AdminServer, build_admin_app
from controller.admin.cluster import NodeInfo, cluster_logs, cluster_middleware, cluster_operations
from controller.admin.handlers import LOGS_ELSEWHERE
from controller.admin.openapi import Operation
from controller.spec import ServiceSpec
from tests.support.admin_client import AdminClient, AdminClientFactory
from tests.support.ports import free_port
from tests.support.raw_servers import closed_by_peer

from .conftest import Harness, spec

TOKEN = "admin-server-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Gate:
    """A route that waits until it is released, and says whether it was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def slow(self, request: web.Request) -> web.Response:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.json_response({"slow": True})

    def operation(self) -> Operation:
        return Operation("GET", "/api/slow", self.slow, "Answers once released", {200: None})


@pytest.fixture
async def client(h: Harness, admin_client: AdminClientFactory) -> AdminClient:
    app = build_admin_app(h.controller, lambda: True, TOKEN, client_max_size=1000)
    return await admin_client(app)


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``; everything the server sends until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    await closed(writer)
    return data


async def closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def answer(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw``; the first answer (after a ``100 Continue``, if any), then close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert not head.startswith(b"HTTP/1.1 100 "), head
    [(status, fields, _)] = answers(head)
    body = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), 5)
    await closed(writer)
    return status, fields, body


def answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Each answer of a byte stream of Content-Length answers: status, fields, body."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        size = int(fields.get("content-length", "0"))
        out.append((int(lines[0].split()[1]), fields, data[:size]))
        data = data[size:]
    return out


async def test_no_route_is_404_and_another_method_405_with_allow(client: AdminClient) -> None:
    response = await client.get("/nothing", headers=AUTH)
    assert response.status == 404
    assert await response.json() == {"error": "not_found", "message": "no route GET /nothing"}
    response = await client.delete("/api/services", headers=AUTH)
    assert response.status == 405
    assert response.headers["Allow"] == "GET"
    assert await response.json() == {
        "error": "method_not_allowed",
        "message": "DELETE is not allowed on /api/services (allowed: GET)",
    }
    response = await client.request("HEAD", "/healthz")  # no route takes HEAD
    assert (response.status, response.headers["Allow"]) == (405, "GET")


async def test_a_body_over_the_limit_is_413_and_never_continued(client: AdminClient) -> None:
    status, fields, body = await answer(
        client.port,
        b"PUT /api/services/web HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode()
        + b"\r\nExpect: 100-continue\r\nContent-Length: 1001\r\n\r\n",
    )  # fmt: skip
    assert (status, fields["connection"]) == (413, "close")
    assert json.loads(body) == {
        "error": "payload_too_large",
        "message": "the body is larger than the 1000 bytes accepted",
    }
    without_expect = await client.put("/api/services/web", data=b"x" * 1001, headers=AUTH)
    assert without_expect.status == 413
    assert (await without_expect.json())["error"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield b"a" * 500

    chunked = await client.put("/api/services/web", data=chunks(), headers=AUTH)
    assert chunked.status == 413
    assert (await chunked.json())["error"] == "payload_too_large"


async def test_continue_is_sent_only_to_a_request_whose_body_is_read(
    client: AdminClient,
) -> None:
    # A wrong token: refused before 100, and the connection ends (the body never came).
    status, fields, body = await answer(
        client.port,
        b"POST /api/services/web/scale HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
        b"Content-Length: 15\r\n\r\n",
    )
    assert (status, fields["www-authenticate"], fields["connection"]) == (401, "Bearer", "close")
    assert json.loads(body)["error"] == "unauthorized"
    status, _, body = await answer(
        client.port,
        b"POST /api/services/web/scale HTTP/1.1\r\nHost: t\r\nExpect: 200-ok\r\n"
        b"Content-Length: 15\r\n\r\n",
    )
    assert (status, json.loads(body)["error"]) == (417, "expectation_failed")
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(
        b"POST /api/services/web/scale HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
        + TOKEN.encode() + b"\r\nExpect: 100-continue\r\nContent-Length: 15\r\n\r\n"
    )  # fmt: skip
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b'{"replicas": 1}')
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 404 ")  # read, parsed, and no such service
    await closed(writer)


async def test_a_slow_body_is_408(client: AdminClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_module, "BODY_TIMEOUT", 0.05)
    status, fields, body = await answer(
        client.port,
        b"PUT /api/services/web HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + TOKEN.encode()
        + b"\r\nContent-Length: 10\r\n\r\nabc",
    )  # fmt: skip
    assert (status, fields["connection"]) == (408, "close")
    assert json.loads(body)["error"] == "request_timeout"


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: t\r\n" + b"X: a\r\n" * 101 + b"\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"G\x00T / HTTP/1.1\r\n\r\n",
    ],
)
async def test_a_hostile_head_is_refused_and_the_connection_closed(
    client: AdminClient, raw: bytes
) -> None:
    """Over the settings' limits (HTTP_SETTINGS) or malformed: aiohttp's 400, then the
    listener serves on."""
    [(status, _, _)] = answers(await exchange(client.port, raw))  # then closed
    assert status == 400
    assert (await client.get("/healthz")).status == 200


async def test_a_client_that_goes_away_cancels_its_handler(
    h: Harness, admin_client: AdminClientFactory
) -> None:
    gate = Gate()
    app = build_admin_app(h.controller, lambda: True, TOKEN, extra_routes=[gate.operation()])
    client = await admin_client(app)
    _, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(b"GET /api/slow HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %b\r\n\r\n"
                 % TOKEN.encode())  # fmt: skip
    await asyncio.wait_for(gate.started.wait(), 5)
    await closed(writer)
    await asyncio.wait_for(gate.cancelled.wait(), 5)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_stop_ends_streams_and_lets_answers_finish(
    h: Harness, session: aiohttp.ClientSession
) -> None:
    gate = Gate()
    app = build_admin_app(h.controller, lambda: True, TOKEN, extra_routes=[gate.operation()])
    server = AdminServer(app, "127.0.0.1:0")
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    stream = await session.get(f"{base}/api/events", headers=AUTH)
    assert await stream.content.readline() == b": watching\n"
    slow = asyncio.ensure_future(session.get(f"{base}/api/slow", headers=AUTH))
    await asyncio.wait_for(gate.started.wait(), 5)
    stopping = asyncio.ensure_future(server.stop())
    # The stream ends whole (its last chunk), while the slow answer still runs.
    assert await asyncio.wait_for(stream.content.read(), 5) == b"\n"
    assert not h.controller.journal._watchers
    assert not stopping.done()
    gate.release.set()
    response = await asyncio.wait_for(slow, 5)
    assert (response.status, await response.json()) == (200, {"slow": True})
    await asyncio.wait_for(stopping, 5)
    assert not gate.cancelled.is_set()
    with pytest.raises(aiohttp.ClientConnectionError):
        await session.get(f"{base}/healthz")


async def test_stop_cancels_what_outlives_its_grace(
    h: Harness, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        app_module, "HTTP_SETTINGS", {**app_module.HTTP_SETTINGS, "shutdown_timeout": 0.1}
    )
    gate = Gate()
    app = build_admin_app(h.controller, lambda: True, TOKEN, extra_routes=[gate.operation()])
    server = AdminServer(app, "127.0.0.1:0")
    await server.start()
    slow = asyncio.ensure_future(
        session.get(f"http://127.0.0.1:{server.port}/api/slow", headers=AUTH)
    )
    await asyncio.wait_for(gate.started.wait(), 5)
    await asyncio.wait_for(server.stop(), 5)
    assert gate.cancelled.is_set()
    with pytest.raises(aiohttp.ClientError):
        await slow


async def test_the_server_serves_on_a_socket_bound_before_it(
    h: Harness, session: aiohttp.ClientSession
) -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    server = AdminServer(build_admin_app(h.controller, lambda: True, TOKEN), "127.0.0.1:0", sock)
    await server.start()
    try:
        assert server.port == port
        async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
            assert await response.json() == {"status": "ok"}
    finally:
        await server.stop()


@pytest.mark.parametrize("turns", range(5))
async def test_a_connection_accepted_as_the_listener_stops_is_closed(
    h: Harness, turns: int
) -> None:
    """asyncio's loop makes an accepted connection's transport a turn after the accept: a
    server closed in between left that socket open for good (CPython gh-109564; a browser
    connecting as the gateway stopped, and a ResourceWarning in a later test). ``turns``:
    the loop's turns between the connect and the stop (2 left it open on Python 3.11)."""
    server = AdminServer(build_admin_app(h.controller, lambda: True, TOKEN), "127.0.0.1:0")
    await server.start()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(turns):
            await asyncio.sleep(0)
        await server.stop()
        assert await closed_by_peer(sock)


# -- a cluster's forwarding -------------------------------------------------------------------


class Membership:
    """A node's view of the cluster, as the test sets it."""

    def __init__(self, node: str, leading: bool, leader: NodeInfo | None) -> None:
        self.node = node
        self._leading = leading
        self._leader = leader
        self.reachable = True
        self.others: dict[str, str] = {}
        """Live nodes but the leader, by name: their admin API."""
        self.runs: dict[str, str] = {}
        """The node of each replica, as the state says."""
        self.logs: dict[str, list[str]] = {}
        """This node's own replica logs."""

    def leading(self) -> bool:
        return self._leading

    def leader(self) -> NodeInfo | None:
        return self._leader

    def nodes(self) -> Sequence[NodeInfo]:
        others = [NodeInfo(n, address, False, 0.0) for n, address in self.others.items()]
        return others if self._leader is None else [self._leader, *others]

    def node_address(self, name: str) -> str | None:
        return next((n.address for n in self.nodes() if n.name == name), None)

    def replica_node(self, service: str, replica_id: str) -> str | None:
        return self.runs.get(replica_id)

    def local_logs(self, replica_id: str, tail: int) -> list[str] | None:
        lines = self.logs.get(replica_id)
        return None if lines is None else lines[-tail:]

    def store_reachable(self) -> bool:
        return self.reachable

    def store_reason(self) -> str:
        return "" if self.reachable else "etcd: connection refused"

    async def committed(self) -> None:
        return None


async def test_a_follower_forwards_api_requests_to_the_leader(
    h: Harness, admin_client: AdminClientFactory, session: aiohttp.ClientSession
) -> None:
    def app(membership: Membership) -> web.Application:
        middleware = cluster_middleware(membership, lambda: session)
        return build_admin_app(h.controller, lambda: True, TOKEN, middlewares=[middleware])

    leading = Membership("a", True, None)
    leader = await admin_client(app(leading))
    info = NodeInfo("a", f"http://127.0.0.1:{leader.port}", True, 0.0)
    follower = await admin_client(app(Membership("b", False, info)))

    response = await follower.put("/api/services/web", json=spec("web", 1), headers=AUTH)
    assert response.status == 200, await response.text()
    assert response.headers["X-Gateway-Leader"] == "a"
    assert (await response.json())["service"] == "web"
    assert "web" in h.controller.service_names()
    missing = await follower.get("/api/services/nothing", headers=AUTH)
    assert (missing.status, missing.headers["X-Gateway-Leader"]) == (404, "a")
    assert (await missing.json())["error"] == "not_found"
    # Its token goes with it; a wrong one is refused by the follower already.
    assert (await follower.get("/api/services")).status == 401
    # The events stream through the follower.
    stream = await follower.get("/api/events", headers=AUTH)
    assert stream.headers["Content-Type"].startswith("text/event-stream")
    assert await stream.content.readline() == b": watching\n"
    stream.close()
    # What the follower answers itself.
    assert "X-Gateway-Leader" not in (await follower.get("/healthz")).headers

    leading.reachable = False
    write = await leader.post("/api/services/web/scale", json={"replicas": 2}, headers=AUTH)
    assert (write.status, (await write.json())["error"]) == (503, "store_unavailable")

    lost = await admin_client(app(Membership("c", False, None)))
    response = await lost.get("/api/services", headers=AUTH)
    assert (response.status, response.headers["Retry-After"]) == (503, "2")
    assert (await response.json())["error"] == "no_leader"


async def test_a_leader_that_does_not_answer_is_said_in_words(
    h: Harness, admin_client: AdminClientFactory, session: aiohttp.ClientSession
) -> None:
    address = f"http://127.0.0.1:{free_port()}"
    membership = Membership("b", False, NodeInfo("a", address, True, 0.0))
    middleware = cluster_middleware(membership, lambda: session)
    follower = await admin_client(
        build_admin_app(h.controller, lambda: True, TOKEN, middlewares=[middleware])
    )
    response = await follower.get("/api/services", headers=AUTH)
    assert (response.status, response.headers["Retry-After"]) == (503, "2")
    body = await response.json()
    assert body["error"] == "leader_unreachable"
    # Before: "... did not answer: Cannot connect to host 127.0.0.1:N ssl:default [...]".
    assert body["message"] == f"the leader a ({address}) did not answer: connection refused"


async def test_a_replicas_logs_are_read_on_the_node_that_runs_it(
    h: Harness, admin_client: AdminClientFactory, session: aiohttp.ClientSession
) -> None:
    """Issue 54.5: through a follower, from the node that runs the replica (not the leader);
    one the state has no node for, through the leader, from the node that holds its log."""

    def app(membership: Membership) -> web.Application:
        made = build_admin_app(
            h.controller,
            lambda: True,
            TOKEN,
            extra_routes=cluster_operations(membership),
            middlewares=[cluster_middleware(membership, lambda: session)],
        )
        if membership.leading():
            made[LOGS_ELSEWHERE] = cluster_logs(membership, lambda: session)
        return made

    await h.controller.apply(ServiceSpec.model_validate(spec("web", 1)))
    await h.settle()
    (replica,) = h.replicas("web")
    a = Membership("a", True, None)
    leader = await admin_client(app(a))
    info = NodeInfo("a", f"http://127.0.0.1:{leader.port}", True, 0.0)
    c = Membership("c", False, info)
    c.logs[replica.id] = [f"line {i}" for i in range(5)]
    runner = await admin_client(app(c))
    b = Membership("b", False, info)
    follower = await admin_client(app(b))
    for m in (a, b, c):
        m.others = {
            "b": f"http://127.0.0.1:{follower.port}",
            "c": f"http://127.0.0.1:{runner.port}",
        }
    path = f"/api/services/web/replicas/{replica.id}/logs?tail=2"

    # The state says c runs it: the follower asks c, the leader is not asked.
    b.runs[replica.id] = "c"
    answer = await follower.get(path, headers=AUTH)
    assert answer.status == 200, await answer.text()
    assert "X-Gateway-Leader" not in answer.headers
    assert await answer.json() == {
        "service": "web",
        "replica": replica.id,
        "lines": ["line 3", "line 4"],
        "node": "c",
    }
    # c's own route says what it holds, and never forwards.
    own = await runner.get(f"/api/cluster/replicas/{replica.id}/logs?tail=1", headers=AUTH)
    assert await own.json() == {
        "node": "c",
        "replica": replica.id,
        "found": True,
        "lines": ["line 4"],
    }
    nothing = await follower.get("/api/cluster/replicas/web-9-x/logs", headers=AUTH)
    assert (await nothing.json())["found"] is False
    assert (await follower.get(f"/api/cluster/replicas/{replica.id}/logs")).status == 401

    # No node in the state (it ended): through the leader, which asks every live node.
    del b.runs[replica.id]
    answer = await follower.get(path, headers=AUTH)
    assert (answer.status, answer.headers["X-Gateway-Leader"]) == (200, "a")
    body = await answer.json()
    assert (body["lines"], body["node"]) == (["line 3", "line 4"], "c")
    # The leader checks the replica is the service's.
    missing = await follower.get("/api/services/web/replicas/web-9-x/logs", headers=AUTH)
    assert missing.status == 404

    # The node that runs it does not answer: said, with that node's name.
    dead = f"http://127.0.0.1:{free_port()}"
    b.runs[replica.id] = "d"
    b.others["d"] = dead
    answer = await follower.get(path, headers=AUTH)
    assert answer.status == 503
    body = await answer.json()
    assert body["error"] == "node_unreachable"
    assert body["message"] == (
        f"node d ({dead}) did not answer for the log of {replica.id}: connection refused"
    )
    # No node holds one: no lines, and no node named.
    c.logs.clear()
    del b.runs[replica.id]
    body = await (await follower.get(path, headers=AUTH)).json()
    assert (body["lines"], body["node"]) == ([], None)


def test_the_settings_are_the_admin_listeners() -> None:
    settings: dict[str, Any] = dict(app_module.HTTP_SETTINGS)
    assert settings["keepalive_timeout"] == 75.0
    assert settings["access_log"] is None
    web.AppRunner(web.Application(), handler_cancellation=True, **settings)  # all taken


async def test_a_head_sent_slowly_is_closed_with_the_idle_timeout(
    h: Harness, aiohttp_server: Any
) -> None:
    """aiohttp's ``keepalive_timeout`` counts from the connection's start (or its last answer)
    while no whole head has come: a slowloris head is closed, unanswered."""
    app = build_admin_app(h.controller, lambda: True, TOKEN)
    server = await aiohttp_server(app, **{**app_module.HTTP_SETTINGS, "keepalive_timeout": 0.2})
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    for part in (b"GET /healthz HTTP/1.1\r\n", b"Host: t\r\n", b"X: 1\r\n"):
        writer.write(part)
        await asyncio.sleep(0.1)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    await closed(writer)
