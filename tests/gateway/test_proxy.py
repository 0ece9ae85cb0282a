"""The forwarding path, against real aiohttp upstreams on loopback."""

from __future__ import annotations

import asyncio
import gzip

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import unused_port
from multidict import CIMultiDict
from yarl import URL

from gateway.config import LimitsConfig, RetriesConfig, TimeoutsConfig
from gateway.pool.upstream import Health
from tests.support.eventually import eventually

from .conftest import add, raw_request, routing, url


async def get_json(client, gw, path="/", **kwargs):
    async with client.get(url(gw, path), **kwargs) as resp:
        return resp.status, await resp.json(), resp.headers


# -- routing -------------------------------------------------------------------------------


async def test_routes_by_host_and_prefix(pool, upstream, gateway, client):
    pool.set_service(routing("web", hosts=["a.example"]))
    pool.set_service(routing("api", hosts=["a.example"], prefix="/api"))
    pool.set_service(routing("other", prefix="/"))
    for name in ("web", "api", "other"):
        await upstream(name, name)
    gw = await gateway()

    cases = [
        ("a.example", "/x", "web"),
        ("A.Example:8080", "/api/v1", "api"),
        ("a.example", "/apix", "web"),
        ("b.example", "/api", "other"),
    ]
    for host, path, expected in cases:
        status, body, _ = await get_json(client, gw, path, headers={"Host": host})
        assert (status, body["upstream"]) == (200, expected), (host, path)


async def test_no_route_is_404_json(pool, upstream, gateway, client):
    pool.set_service(routing("web", hosts=["a.example"]))
    await upstream("web", "w1")
    gw = await gateway()

    status, body, headers = await get_json(client, gw, "/x", headers={"Host": "nope.example"})

    assert status == 404
    assert body["error"] == "no_route"
    assert body["request_id"] == headers["X-Request-Id"]
    assert headers["Content-Type"].startswith("application/json")


async def test_strip_prefix_keeps_raw_query(pool, upstream, gateway, client):
    pool.set_service(routing("api", prefix="/api", strip=True))
    await upstream("api", "a1")
    gw = await gateway()

    target = URL(url(gw, "/api/users/caf%C3%A9?x=%20&y=1+2&z"), encoded=True)
    async with client.get(target) as resp:
        body = await resp.json()

    assert body["path"] == "/users/caf%C3%A9?x=%20&y=1+2&z"


@pytest.mark.parametrize("path", ["/api/../admin", "/api/%2e%2e/admin", "/api/x/../../admin"])
async def test_dot_segments_cannot_escape_a_prefix(pool, upstream, gateway, client, path):
    pool.set_service(routing("api", prefix="/api", strip=True))
    pool.set_service(routing("admin", prefix="/admin"))
    await upstream("api", "api1")
    await upstream("admin", "admin1")
    gw = await gateway()

    async with client.get(URL(url(gw, path), encoded=True)) as resp:
        body = await resp.json()

    # Routed and forwarded on the same normalised path: /admin, to the admin service.
    assert (body["upstream"], body["path"]) == ("admin1", "/admin")


# -- health gating -------------------------------------------------------------------------


async def test_only_routable_upstreams_get_traffic(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    await upstream("web", "good")
    await upstream("web", "unknown", health=Health.UNKNOWN)
    await upstream("web", "sick", health=Health.UNHEALTHY)
    await upstream("web", "draining")
    await pool.drain("web", "draining", timeout=1)
    gw = await gateway()

    seen = set()
    for _ in range(12):
        _, body, _ = await get_json(client, gw)
        seen.add(body["upstream"])

    assert seen == {"good"}


async def test_503_when_nothing_is_routable(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1", health=Health.UNKNOWN)
    await upstream("web", "u2", health=Health.UNHEALTHY)
    gw = await gateway()

    status, body, headers = await get_json(client, gw, "/x")

    assert status == 503
    assert headers["Retry-After"] == "1"
    assert body["error"] == "no_routable_upstream"
    assert body["upstreams"] == 2
    assert body["states"] == {"unknown": 1, "unhealthy": 1}
    assert body["service"] == "web"
    assert body["request_id"] == headers["X-Request-Id"]


async def test_queue_timeout_waits_for_an_upstream_to_become_routable(
    pool, upstream, gateway, client
):
    sp = pool.set_service(routing("web", prefix="/", queue_timeout=10))
    await upstream("web", "u1", health=Health.UNKNOWN)
    gw = await gateway()

    request = asyncio.create_task(get_json(client, gw))
    await eventually(
        lambda: sp._routable_waiters, timeout=2, every=0.005, what="the request in wait_routable"
    )
    assert not request.done()
    pool.set_health("web", "u1", Health.HEALTHY)
    status, body, _ = await request

    assert (status, body["upstream"]) == (200, "u1")


async def test_queue_timeout_expires_with_503(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/", queue_timeout=0.2))
    await upstream("web", "u1", health=Health.UNKNOWN)
    gw = await gateway()
    loop = asyncio.get_running_loop()

    started = loop.time()
    status, body, _ = await get_json(client, gw)

    assert status == 503
    assert body["error"] == "no_routable_upstream"
    assert loop.time() - started >= 0.2


# -- upstream failures ---------------------------------------------------------------------


async def test_502_when_the_upstream_refuses(pool, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "dead", unused_port())
    gw = await gateway()

    status, body, headers = await get_json(client, gw)

    assert status == 502
    assert body["error"] == "upstream_connect_error"
    assert body["upstream"] == "dead"
    assert body["request_id"] == headers["X-Request-Id"]


async def test_502_when_the_upstream_answers_garbage(pool, raw_upstream, gateway, client):
    async def junk(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"this is not HTTP at all\r\n\r\n")
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "junk", await raw_upstream(junk))
    gw = await gateway()

    status, body, _ = await get_json(client, gw)

    assert status == 502
    assert body["error"] == "upstream_protocol_error"


async def test_504_when_the_upstream_is_too_slow(pool, upstream, gateway, client):
    never = asyncio.Event()

    async def slow(request):
        await never.wait()
        return web.Response()

    app = web.Application()
    app.router.add_get("/", slow)
    pool.set_service(routing("web", prefix="/", timeouts=TimeoutsConfig(read=0.2)))
    await upstream("web", "slow", app)
    gw = await gateway()

    status, body, _ = await get_json(client, gw)

    assert status == 504
    assert body["error"] == "upstream_timeout"


async def test_retry_on_another_upstream_after_a_connect_failure(
    pool, upstream, gateway, client, recorder
):
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    add(pool, "web", "dead", unused_port())
    await upstream("web", "live")
    gw = await gateway()

    for _ in range(6):
        status, body, _ = await get_json(client, gw)
        assert (status, body["upstream"]) == (200, "live")

    # A body not yet taken from the client is no obstacle: the retry sends it in full.
    for _ in range(2):
        async with client.post(url(gw), data=b"payload") as resp:
            assert (resp.status, (await resp.json())["body"]) == (200, 7)

    retried = [r for r in recorder.records if r.retries]
    assert retried
    assert all(r.retry_reasons == ("connect",) and r.upstream_id == "live" for r in retried)
    # Passive detection saw the failures and ejected the dead upstream.
    assert pool.upstream("web", "dead").ejected


async def test_retry_on_status_for_idempotent_requests(pool, upstream, gateway, client):
    async def unavailable(request):
        return web.json_response({"upstream": "busy"}, status=503)

    app = web.Application()
    app.router.add_route("*", "/", unavailable)
    retries = RetriesConfig(on_status=True)
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin", retries=retries))
    await upstream("web", "busy", app)
    await upstream("web", "ok")
    gw = await gateway()

    for _ in range(4):
        status, body, _ = await get_json(client, gw)
        assert (status, body["upstream"]) == (200, "ok")
    # A POST with a body is not replayed: the upstream's own 503 comes through.
    statuses = set()
    for _ in range(4):
        async with client.post(url(gw), data=b"x") as resp:
            statuses.add(resp.status)
    assert statuses == {200, 503}


async def test_no_failed_request_when_an_upstream_stops(pool, upstream, gateway, client, recorder):
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    await upstream("web", "a")
    b = await upstream("web", "b")
    gw = await gateway()
    failures = []

    async def one():
        try:
            async with client.get(url(gw)) as resp:
                await resp.read()
                if resp.status != 200:
                    failures.append(resp.status)
        except aiohttp.ClientError as e:
            failures.append(e)

    stopping = []
    for i in range(60):
        if i == 20:
            stopping.append(asyncio.create_task(b.close()))
        await one()
        await asyncio.gather(*(one() for _ in range(5)))
    await asyncio.gather(*stopping)

    assert failures == []
    served_by = {r.upstream_id for r in recorder.records}
    assert served_by == {"a", "b"}
    assert any(r.retries for r in recorder.records)  # requests that met b stopped went to a


# -- streaming -----------------------------------------------------------------------------

SIZE = 64 * 1024 * 1024
CHUNK = 256 * 1024


async def test_large_upload_is_streamed(pool, upstream, gateway, client):
    first_chunk = asyncio.Event()

    async def sink(request):
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            first_chunk.set()
        return web.json_response({"total": total})

    app = web.Application()
    app.router.add_post("/", sink)
    pool.set_service(routing("web", prefix="/", limits=LimitsConfig(max_body_size=0)))
    await upstream("web", "sink", app)
    gw = await gateway()

    async def body():
        block = b"u" * CHUNK
        yield block
        # The upstream sees the body before the client has finished sending it.
        async with asyncio.timeout(5):
            await first_chunk.wait()
        for _ in range(SIZE // CHUNK - 1):
            yield block

    async with client.post(url(gw), data=body()) as resp:
        assert resp.status == 200
        assert (await resp.json())["total"] == SIZE


async def test_large_download_is_streamed(pool, upstream, gateway, client):
    client_has_bytes = asyncio.Event()

    async def source(request):
        response = web.StreamResponse()
        response.content_length = SIZE
        await response.prepare(request)
        block = b"d" * CHUNK
        await response.write(block)
        # The client sees the body before the upstream has finished sending it.
        async with asyncio.timeout(5):
            await client_has_bytes.wait()
        for _ in range(SIZE // CHUNK - 1):
            await response.write(block)
        return response

    app = web.Application()
    app.router.add_get("/", source)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "source", app)
    gw = await gateway()

    total = 0
    async with client.get(url(gw)) as resp:
        assert resp.headers["Content-Length"] == str(SIZE)
        async for chunk in resp.content.iter_any():
            total += len(chunk)
            client_has_bytes.set()

    assert total == SIZE


async def test_server_sent_events_are_flushed_per_event(pool, upstream, gateway, client):
    next_event = asyncio.Event()

    async def events(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await next_event.wait()
        await response.write(b"data: two\n\n")
        return response

    app = web.Application()
    app.router.add_get("/events", events)
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "sse", app)
    gw = await gateway()

    async with client.get(url(gw, "/events")) as resp, asyncio.timeout(5):
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert await resp.content.readuntil(b"\n\n") == b"data: one\n\n"
        next_event.set()
        assert await resp.content.read() == b"data: two\n\n"


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_upstream_body_broken_midway_aborts_the_response(
    pool, raw_upstream, gateway, client, recorder, head
):
    async def breaks(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + b"x" * 100)
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "broken", await raw_upstream(breaks))
    gw = await gateway()

    async with client.get(url(gw)) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    record = await recorder.next() if not recorder.records else recorder.records[-1]
    assert record.error == "upstream_protocol_error"


async def test_head_keeps_content_length(pool, raw_upstream, gateway, client):
    async def head(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "h", await raw_upstream(head))
    gw = await gateway()

    async with client.head(url(gw)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == "1234"


async def test_expect_100_continue_is_answered_by_the_gateway(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()

    async with client.put(url(gw), data=b"x" * 5000, expect100=True) as resp:
        body = await resp.json()

    assert (resp.status, body["body"]) == (200, 5000)
    assert "Expect" not in CIMultiDict(body["headers"])


async def test_compressed_bodies_cross_untouched(pool, raw_upstream, gateway):
    packed = gzip.compress(b"hello " * 1000)
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def gzip_echo(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(_parse_head(head)["Content-Length"])
        received.set_result(await reader.readexactly(length))
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s"
            % (len(packed), packed)
        )
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "gz", await raw_upstream(gzip_echo))
    gw = await gateway()

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        headers = {"Content-Encoding": "gzip"}
        async with session.post(url(gw), data=packed, headers=headers) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert await resp.read() == packed
    assert await received == packed


# -- limits --------------------------------------------------------------------------------


async def test_413_on_a_content_length_over_the_limit(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/", limits=LimitsConfig(max_body_size=1024)))
    await upstream("web", "u1")
    gw = await gateway()

    async with client.post(url(gw), data=b"x" * 1025) as resp:
        body = await resp.json()
        assert resp.status == 413
    assert body["error"] == "request_too_large"
    async with client.post(url(gw), data=b"x" * 1024) as resp:
        assert (await resp.json())["body"] == 1024


async def test_413_on_a_chunked_body_over_the_limit(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/", limits=LimitsConfig(max_body_size=1024)))
    await upstream("web", "u1")
    gw = await gateway()

    async def body():
        for _ in range(8):
            yield b"x" * 512

    async with client.post(url(gw), data=body()) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"] == "request_too_large"


# -- headers -------------------------------------------------------------------------------


def _parse_head(head: bytes) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for line in head.decode().split("\r\n")[1:]:
        if line:
            name, _, value = line.partition(":")
            out.add(name.strip(), value.strip())
    return out


HOP_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: X-Hop, keep-alive\r\n"
    b"X-Hop: secret\r\nKeep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\n"
    b"Trailer: X-T\r\nUpgrade: foo\r\nX-End: 1\r\nX-Request-Id: upstream-made\r\n\r\nok"
)


async def _recording_upstream(raw_upstream, heads):
    async def record(reader, writer):
        heads.put_nowait(await reader.readuntil(b"\r\n\r\n"))
        writer.write(HOP_RESPONSE)
        await writer.drain()
        writer.close()

    return await raw_upstream(record)


async def test_hop_by_hop_headers_stripped_and_forwarded_headers_set(pool, raw_upstream, gateway):
    heads: asyncio.Queue[bytes] = asyncio.Queue()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "rec", await _recording_upstream(raw_upstream, heads))
    gw = await gateway()

    answer = await raw_request(
        gw.port,
        b"GET /p?q=1 HTTP/1.1\r\nHost: shop.example:8443\r\nConnection: close, X-Secret\r\n"
        b"X-Secret: 1\r\nKeep-Alive: 300\r\nTE: trailers\r\nProxy-Authorization: Basic x\r\n"
        b"Proxy-Connection: keep-alive\r\nX-Forwarded-For: 6.6.6.6\r\n"
        b"X-Forwarded-Host: evil.example\r\nX-Custom: yes\r\nX-Request-Id: client-id.1\r\n\r\n",
    )
    sent = await heads.get()
    upstream_headers = _parse_head(sent)

    assert sent.startswith(b"GET /p?q=1 HTTP/1.1\r\n")
    for name in ("Connection", "X-Secret", "Keep-Alive", "TE", "Proxy-Authorization"):
        assert name not in upstream_headers, name
    assert "Proxy-Connection" not in upstream_headers
    # The client sent no User-Agent/Accept-Encoding, and the gateway adds none.
    assert "User-Agent" not in upstream_headers
    assert "Accept-Encoding" not in upstream_headers
    assert upstream_headers["Host"] == "shop.example:8443"
    assert upstream_headers["X-Custom"] == "yes"
    assert upstream_headers.getall("X-Forwarded-For") == ["127.0.0.1"]
    assert upstream_headers["X-Forwarded-Proto"] == "http"
    assert upstream_headers["X-Forwarded-Host"] == "shop.example:8443"
    assert upstream_headers["X-Request-Id"] == "client-id.1"

    head, _, body = answer.partition(b"\r\n\r\n")
    response_headers = _parse_head(head)
    assert head.startswith(b"HTTP/1.1 200")
    assert body == b"ok"
    for name in ("X-Hop", "Keep-Alive", "Proxy-Authenticate", "Trailer", "Upgrade"):
        assert name not in response_headers, name
    assert response_headers["X-End"] == "1"
    assert response_headers["X-Request-Id"] == "client-id.1"


async def test_trusted_forwarded_headers_are_appended(pool, raw_upstream, gateway):
    heads: asyncio.Queue[bytes] = asyncio.Queue()
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "rec", await _recording_upstream(raw_upstream, heads))
    gw = await gateway(trust_forwarded=True)

    await raw_request(
        gw.port,
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\nX-Forwarded-For: 10.0.0.1\r\n"
        b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: outer.example\r\n\r\n",
    )
    upstream_headers = _parse_head(await heads.get())

    assert upstream_headers["X-Forwarded-For"] == "10.0.0.1, 127.0.0.1"
    assert upstream_headers["X-Forwarded-Proto"] == "https"
    assert upstream_headers["X-Forwarded-Host"] == "outer.example"


@pytest.mark.parametrize("given", [None, "bad id with spaces", "x" * 129])
async def test_request_id_is_generated_when_missing_or_malformed(
    pool, upstream, gateway, client, given
):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()

    headers = {"X-Request-Id": given} if given else {}
    _, body, response_headers = await get_json(client, gw, headers=headers)

    request_id = response_headers["X-Request-Id"]
    assert request_id != given
    # Traced (the default): the trace id and the gateway's span id, as in its traceparent.
    trace_id, span_id = request_id.split("-")
    assert (len(trace_id), len(span_id)) == (32, 16)
    received = CIMultiDict(body["headers"])
    assert received["X-Request-Id"] == request_id
    assert received["traceparent"] in (f"00-{request_id}-00", f"00-{request_id}-01")


# -- WebSocket -----------------------------------------------------------------------------


def ws_app(closed: asyncio.Future[int | None]) -> web.Application:
    async def echo(request):
        ws = web.WebSocketResponse(protocols=("chat", "superchat"))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is WSMsgType.TEXT and msg.data == "close-me":
                await ws.close(code=4002, message=b"bye")
            elif msg.type is WSMsgType.TEXT and msg.data == "ping-me":
                await ws.ping(b"from-upstream")
            elif msg.type is WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        if not closed.done():
            closed.set_result(ws.close_code)
        return ws

    app = web.Application()
    app.router.add_get("/ws", echo)
    return app


@pytest.fixture
async def ws_gateway(pool, upstream, gateway):
    closed = asyncio.get_running_loop().create_future()
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "ws", ws_app(closed))
    return await gateway(), closed


async def test_websocket_relays_text_binary_ping_and_pong(ws_gateway, client):
    gw, _ = ws_gateway
    async with (
        client.ws_connect(url(gw, "/ws"), protocols=("superchat",), autoping=False) as ws,
        asyncio.timeout(5),
    ):
        assert ws.protocol == "superchat"
        await ws.send_str("hello")
        assert (await ws.receive()).data == "hello"
        await ws.send_bytes(b"\x00\x01")
        assert (await ws.receive()).data == b"\x00\x01"
        await ws.ping(b"from-client")
        pong = await ws.receive()
        assert (pong.type, pong.data) == (WSMsgType.PONG, b"from-client")
        await ws.send_str("ping-me")
        ping = await ws.receive()
        assert (ping.type, ping.data) == (WSMsgType.PING, b"from-upstream")


async def test_websocket_client_close_code_reaches_upstream(ws_gateway, client):
    gw, closed = ws_gateway
    async with client.ws_connect(url(gw, "/ws")) as ws:
        await ws.send_str("hi")
        await ws.receive()
        await ws.close(code=4001, message=b"done")
    async with asyncio.timeout(5):
        assert await closed == 4001


async def test_websocket_upstream_close_code_reaches_client(ws_gateway, client):
    gw, closed = ws_gateway
    async with client.ws_connect(url(gw, "/ws")) as ws, asyncio.timeout(5):
        await ws.send_str("close-me")
        msg = await ws.receive()
        assert (msg.type, msg.data, msg.extra) == (WSMsgType.CLOSE, 4002, "bye")
    # The relay is transparent: the upstream hears the client's own answer to its close
    # (aiohttp's client answers 1000), not one the gateway made up.
    assert await closed == 1000


async def test_websocket_client_vanishing_closes_the_upstream_with_1001(ws_gateway, recorder):
    gw, closed = ws_gateway
    finished = recorder.next()
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(url(gw, "/ws"))
    await ws.send_str("hi")
    assert (await ws.receive()).data == "hi"

    await session.connector.close()  # the connection drops without a close frame

    async with asyncio.timeout(5):
        assert await closed == 1001
        await finished
    await session.close()


async def test_websocket_refused_by_the_upstream_is_502(pool, upstream, gateway, client):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "plain")  # answers 200 to the upgrade
    gw = await gateway()

    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect(url(gw, "/ws"))

    assert refused.value.status == 502


# -- cancellation and drain ----------------------------------------------------------------


async def test_client_disconnect_cancels_the_upstream_request(
    pool, raw_upstream, gateway, client, recorder
):
    got_request = asyncio.Event()
    upstream_closed = asyncio.Event()

    async def hang(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        got_request.set()
        await reader.read()  # b"" once the gateway closes the connection
        upstream_closed.set()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "hang", await raw_upstream(hang))
    gw = await gateway()
    finished = recorder.next()

    request = asyncio.create_task(client.get(url(gw)))
    async with asyncio.timeout(5):
        await got_request.wait()
        request.cancel()
        await upstream_closed.wait()
        record = await finished

    assert record.error == "cancelled"
    assert pool.service("web").inflight == {}


async def test_drain_waits_for_the_in_flight_request(pool, upstream, gateway, client):
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(request):
        if request.path == "/slow":
            started.set()
            await release.wait()
        return web.json_response({"upstream": "a"})

    app = web.Application()
    app.router.add_get("/{tail:.*}", slow)
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    await upstream("web", "a", app)
    gw = await gateway()

    in_flight = asyncio.create_task(get_json(client, gw, "/slow"))
    await started.wait()
    await upstream("web", "b")
    drained = pool.drain("web", "a", timeout=10)

    for _ in range(4):
        _, body, _ = await get_json(client, gw)
        assert body["upstream"] == "b"
    assert not drained.done()
    release.set()
    status, body, _ = await in_flight
    assert (status, body["upstream"]) == (200, "a")
    assert await drained is True


async def test_drain_timeout_closes_a_websocket_with_1001(ws_gateway, client, pool, recorder):
    gw, closed = ws_gateway
    finished = recorder.next()
    async with client.ws_connect(url(gw, "/ws")) as ws, asyncio.timeout(5):
        await ws.send_str("hi")
        assert (await ws.receive()).data == "hi"
        drained = pool.drain("web", "ws", timeout=0.2)
        msg = await ws.receive()
        assert (msg.type, msg.data) == (WSMsgType.CLOSE, 1001)
        assert await drained is False
        assert await closed == 1001
        record = await finished
    assert (record.status, record.error, record.bytes_in, record.bytes_out) == (101, None, 2, 2)
    assert pool.service("web").inflight == {}


# -- records -------------------------------------------------------------------------------


async def test_one_record_per_request_and_a_broken_observer_is_harmless(
    pool, upstream, gateway, client, recorder
):
    class Broken:
        def on_request(self, record):
            raise RuntimeError("observer bug")

    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()
    gw.proxy.forwarding.observers = (Broken(), *gw.proxy.forwarding.observers)

    async with client.post(url(gw, "/a/./b"), data=b"12345") as resp:
        assert resp.status == 200
        await resp.read()

    (record,) = recorder.records
    assert (record.service, record.upstream_id, record.method) == ("web", "u1", "POST")
    assert (record.path, record.status, record.bytes_in) == ("/a/b", 200, 5)
    assert record.bytes_out > 0
    assert (record.error, record.retries) == (None, 0)
    assert record.ttfb is not None
    assert 0 <= record.ttfb <= record.duration


async def test_a_target_routed_before_follows_a_new_route_table(pool, upstream, gateway, client):
    # The proxy keeps where recent (Host, target) pairs went: a route change must not be
    # hidden by it, nor a removed service.
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "w1")
    gw = await gateway()
    for _ in range(2):
        assert (await get_json(client, gw, "/api/x"))[1]["upstream"] == "w1"

    pool.set_service(routing("api", prefix="/api"))
    await upstream("api", "a1")
    assert (await get_json(client, gw, "/api/x"))[1]["upstream"] == "a1"

    pool.remove_service("api")
    assert (await get_json(client, gw, "/api/x"))[1]["upstream"] == "w1"
    pool.remove_service("web")
    status, body, _ = await get_json(client, gw, "/api/x")
    assert (status, body["error"]) == (404, "no_route")
