"""The client's leg on the wire: pipelining, HTTP/1.0, framing, upgrades, keep-alive."""

from __future__ import annotations

import asyncio

from gateway.config import LimitsConfig
from tests.support.eventually import eventually

from .conftest import add, raw_request, routing
from .test_server import read_response


async def _raw_upstream_answering(raw_upstream, answer: bytes, heads=None, connections=None) -> int:
    """An upstream that answers every request on a connection with ``answer``; ``heads`` and
    ``connections`` (lists), if given, get each request head and a 1 for each connection."""

    async def serve(reader, writer):
        if connections is not None:
            connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if heads is not None:
                    heads.append(head)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return await raw_upstream(serve)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_pipelined_requests_are_answered_in_order(pool, upstream, gateway):
    pool.set_service(routing("web", prefix="/"))
    await upstream("web", "u1")
    gw = await gateway()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"GET /one HTTP/1.1\r\nHost: h\r\n\r\n"
            b"POST /two HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /three HTTP/1.1\r\nHost: h\r\n\r\n"
        )
        async with asyncio.timeout(5):
            paths = []
            for _ in range(3):
                head, body = await read_response(reader)
                assert head.startswith(b"HTTP/1.1 200")
                paths.append(body.split(b'"path": "')[1].split(b'"')[0])
    finally:
        writer.close()

    assert paths == [b"/one", b"/two", b"/three"]


async def test_upstream_connections_are_kept_alive_and_reused(pool, raw_upstream, gateway):
    heads: list[bytes] = []
    connections: list[int] = []
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, OK, heads, connections))
    gw = await gateway()

    for _ in range(5):
        answer = await raw_request(
            gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
        assert answer.endswith(b"\r\n\r\nok")

    assert len(heads) == 5
    assert len(connections) == 1
    assert gw.proxy.connector.idle_count() == 1


async def test_an_upstream_connection_that_sent_more_than_its_answer_is_not_reused(
    pool, raw_upstream, gateway
):
    # Not a plain head (a byte past ASCII in a value): llhttp reads it, and what follows the
    # body. Before, the connection was kept, and the next request on it failed with a 502.
    answer = b"HTTP/1.1 200 OK\r\nX: caf\xc3\xa9\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
    connections: list[int] = []
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, answer, None, connections))
    gw = await gateway()

    for _ in range(3):
        got = await raw_request(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 OK")
        assert got.endswith(b"\r\n\r\nok")

    assert len(connections) == 3


async def test_http10_client_gets_a_close_delimited_answer_to_a_chunked_one(
    pool, raw_upstream, gateway
):
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, chunked))
    gw = await gateway()

    answer = await raw_request(gw.port, b"GET / HTTP/1.0\r\nHost: h\r\n\r\n")

    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"Connection: close" in head
    assert body == b"hello"


async def _open_after_eof(gw, request: bytes) -> tuple[bytes, asyncio.StreamWriter]:
    """Send ``request``, read the answer to its end (EOF), and keep our socket open."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(request)
    async with asyncio.timeout(5):
        return await reader.read(), writer


async def test_a_last_request_closes_its_connection_at_once(pool, raw_upstream, gateway):
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, OK))
    gw = await gateway()

    answer, writer = await _open_after_eof(
        gw, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    try:
        assert answer.endswith(b"\r\n\r\nok")
        # Not lingering for our FIN (up to LINGER_TIMEOUT, 2 s): we said we send no more.
        await eventually(lambda: gw.connections == 0, timeout=0.5, what="the connection closed")
    finally:
        writer.close()


async def test_a_close_the_client_did_not_ask_for_lingers(pool, raw_upstream, gateway):
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, chunked))
    gw = await gateway()

    # An HTTP/1.0 client that keeps alive gets a chunked answer delimited by the close: it may
    # still send, so the gateway shuts its side and reads on until the client closes.
    answer, writer = await _open_after_eof(
        gw, b"GET / HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n"
    )
    try:
        assert answer.endswith(b"\r\n\r\nhello")
        await asyncio.sleep(0.3)  # a while after the answer: the connection lingers on
        assert gw.connections == 1
        writer.write(b"GET / HTTP/1.0\r\n\r\n")  # read and discarded, nothing reset
        await writer.drain()
    finally:
        writer.close()
    await eventually(lambda: gw.connections == 0, timeout=2, what="the connection closed")


async def test_http10_keep_alive_is_honoured(pool, raw_upstream, gateway):
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, OK))
    gw = await gateway()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            for _ in range(2):
                writer.write(b"GET / HTTP/1.0\r\nHost: h\r\nConnection: keep-alive\r\n\r\n")
                head, body = await read_response(reader)
                assert b"Connection: keep-alive" in head
                assert body == b"ok"
    finally:
        writer.close()


async def test_close_delimited_upstream_answer_is_rechunked_for_the_client(
    pool, raw_upstream, gateway
):
    async def until_close(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await raw_upstream(until_close))
    gw = await gateway()

    answer = await raw_request(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")

    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"9\r\nall of it\r\n0\r\n\r\n"


async def test_interim_answers_are_not_passed_on(pool, raw_upstream, gateway):
    early = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n" + OK
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await _raw_upstream_answering(raw_upstream, early))
    gw = await gateway()

    answer = await raw_request(gw.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")

    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.count(b"HTTP/1.1") == 1
    assert answer.endswith(b"ok")


async def test_absolute_form_target_is_routed_on_its_path(pool, raw_upstream, gateway):
    heads: list[bytes] = []
    pool.set_service(routing("api", prefix="/api"))
    add(pool, "api", "u1", await _raw_upstream_answering(raw_upstream, OK, heads))
    gw = await gateway()

    answer = await raw_request(
        gw.port,
        b"GET http://h.example/api/x?y=1 HTTP/1.1\r\nHost: h.example\r\nConnection: close\r\n\r\n",
    )

    assert answer.startswith(b"HTTP/1.1 200")
    assert heads[0].startswith(b"GET /api/x?y=1 HTTP/1.1\r\n")


async def test_connect_is_refused_with_405(pool, gateway):
    gw = await gateway()

    answer = await raw_request(
        gw.port, b"CONNECT a.example:443 HTTP/1.1\r\nHost: a.example:443\r\n\r\n"
    )

    assert answer.startswith(b"HTTP/1.1 405")
    assert b"Connection: close" in answer


async def test_a_chunked_body_already_received_is_forwarded_with_a_length(
    pool, raw_upstream, gateway
):
    received: list[bytes] = []

    async def record(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        received.append(head)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        received.append(await reader.readexactly(length))
        writer.write(OK)
        await writer.drain()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await raw_upstream(record))
    gw = await gateway()

    answer = await raw_request(
        gw.port,
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
    )

    assert answer.endswith(b"ok")
    assert b"transfer-encoding" not in received[0].lower()
    assert received[1] == b"abcde"


async def test_a_large_body_then_another_answer_on_the_same_upstream_connection(
    pool, raw_upstream, gateway
):
    big = bytes(range(256)) * 1024  # 256 KiB: past the parser once its head is read
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big),
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nsmall",
    ]
    connections = 0

    async def serve(reader, writer):
        nonlocal connections
        connections += 1
        for answer in answers:
            await reader.readuntil(b"\r\n\r\n")
            # Split so that the body arrives over several reads after its head.
            for i in range(0, len(answer), 50_000):
                writer.write(answer[i : i + 50_000])
                await writer.drain()
        await reader.read()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await raw_upstream(serve))
    gw = await gateway()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            writer.write(b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\n")
            _, body = await read_response(reader)
            assert body == big
            writer.write(b"GET /2 HTTP/1.1\r\nHost: h\r\n\r\n")
            _, body = await read_response(reader)
            assert body == b"small"
    finally:
        writer.close()
    assert connections == 1


async def test_an_upstream_sending_past_its_content_length_is_cut_off(
    pool, raw_upstream, gateway, recorder
):
    first_part_seen = asyncio.Event()

    async def overflow(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"a" * 1000)
        await writer.drain()
        await first_part_seen.wait()  # the rest arrives apart, past the parser
        writer.write(b"a" * 200_000)  # more than it announced
        await writer.drain()
        await reader.read()
        writer.close()

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", await raw_upstream(overflow))
    gw = await gateway()
    finished = recorder.next()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(1000)
            first_part_seen.set()
            body += await reader.read()  # until the gateway drops the connection
            record = await finished
    finally:
        writer.close()

    assert head.startswith(b"HTTP/1.1 200")
    assert len(body) < 100_000  # cut off short of its length: never shown complete
    assert record.error == "upstream_protocol_error"


async def test_a_large_upload_then_a_pipelined_request(pool, upstream, gateway):
    pool.set_service(routing("web", prefix="/", limits=LimitsConfig(max_body_size=0)))
    await upstream("web", "u1")
    gw = await gateway()
    body = bytes(range(256)) * 800  # 200 KiB: past the parser once its head is read

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        async with asyncio.timeout(5):
            head = b"POST /up HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body)
            writer.write(head + body[:1000])
            await writer.drain()
            # The rest in pieces, the last one followed at once by the next request.
            for i in range(1000, len(body) - 5000, 50_000):
                writer.write(body[i : min(i + 50_000, len(body) - 5000)])
                await writer.drain()
            writer.write(body[-5000:] + b"GET /next HTTP/1.1\r\nHost: h\r\n\r\n")
            _, first = await read_response(reader)
            _, second = await read_response(reader)
    finally:
        writer.close()

    assert b'"body": %d' % len(body) in first
    assert b'"path": "/next"' in second
