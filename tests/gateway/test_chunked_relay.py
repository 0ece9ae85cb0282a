"""A chunked answer through the gateway (``wire.chunked``): chunks that come after the head
reach the client as the upstream framed them; what the reader leaves to llhttp (extensions,
trailer fields) still reaches it whole; bytes after the answer retire the upstream
connection.

The pure modules read every chunked body with llhttp (``plainhead.COMPILED``): there the
body must arrive whole all the same, framed again."""

from __future__ import annotations

import asyncio
import contextlib

import httptools

from gateway.proxy.upstream_connection import LOOK
from gateway.wire import plainhead
from tests.support.eventually import eventually

from .conftest import add, raw_request, routing

RELAYED = plainhead.COMPILED
"""Whether chunks go on as they came (``wire.chunked`` runs where plain heads are read)."""

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
GET = b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"


class _Body:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.complete = False

    def on_body(self, data: bytes) -> None:
        self.pieces.append(data)

    def on_message_complete(self) -> None:
        self.complete = True


def decoded(answer: bytes) -> tuple[bytes, bytes]:
    """The answer's framing as the client got it (after the head) and its body as llhttp
    reads it, which must be complete."""
    body = _Body()
    httptools.HttpResponseParser(body).feed_data(answer)
    assert body.complete, answer
    return answer.partition(b"\r\n\r\n")[2], b"".join(body.pieces)


async def _scripted(
    raw_upstream, *steps: bytes | float, accepted: list[int] | None = None, body: int = 0
) -> int:
    """An upstream that answers each request (its head, and ``body`` bytes after it) with
    ``steps``: bytes written, pauses (seconds; a pause ends early, and the answer with it,
    if the gateway closes the connection)."""

    async def serve(reader, writer):
        if accepted is not None:
            accepted.append(1)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(body)
                for step in steps:
                    if isinstance(step, bytes):
                        writer.write(step)
                        await writer.drain()
                    else:
                        with contextlib.suppress(TimeoutError):
                            if not await asyncio.wait_for(reader.read(1), step):
                                return  # closed by the gateway
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await raw_upstream(serve)


async def _serve(pool, gateway, port: int):
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "u1", port)
    return await gateway()


async def test_chunks_after_the_head_reach_the_client_as_the_upstream_framed_them(
    pool, raw_upstream, gateway
):
    # Upper-case sizes, as the gateway never writes them: the chunks were not framed again.
    events = [b"%X\r\n%s\r\n" % (26 + i, b"e" * (26 + i)) for i in range(20)]
    steps: list[bytes | float] = [HEAD, 0.1]
    for event in events:
        steps += [event, 0.005]
    gw = await _serve(pool, gateway, await _scripted(raw_upstream, *steps, b"0\r\n\r\n"))

    framing, body = decoded(await raw_request(gw.port, GET))

    if RELAYED:
        assert framing == b"".join(events) + b"0\r\n\r\n"
    assert body == b"".join(b"e" * (26 + i) for i in range(20))


async def test_a_size_line_split_across_reads_reaches_the_client_whole(pool, raw_upstream, gateway):
    chunk = b"Z" * 26
    port = await _scripted(
        raw_upstream, HEAD, 0.1, b"1", 0.05, b"A\r\n" + chunk[:10], 0.05, chunk[10:] + b"\r\n0",
        0.05, b"\r\n", 0.05, b"\r\n",
    )  # fmt: skip
    gw = await _serve(pool, gateway, port)

    framing, body = decoded(await raw_request(gw.port, GET))

    if RELAYED:
        assert framing == b"1A\r\n" + chunk + b"\r\n0\r\n\r\n"
    assert body == chunk


async def test_extensions_and_trailer_fields_are_read_by_llhttp_and_the_body_arrives_whole(
    pool, raw_upstream, gateway
):
    accepted: list[int] = []
    port = await _scripted(
        raw_upstream, HEAD, 0.1, b"3\r\nabc\r\n", 0.02, b"5;name=value\r\nhello\r\n", 0.02,
        b"A\r\n0123456789\r\n0\r\nX-Trailer: t\r\n\r\n", accepted=accepted,
    )  # fmt: skip
    gw = await _serve(pool, gateway, port)

    for _ in range(2):
        framing, body = decoded(await raw_request(gw.port, GET))
        assert body == b"abchello0123456789"
        assert framing.startswith(b"3\r\nabc\r\n")  # before the extension: as it came
        assert b"name=value" not in framing
        assert b"X-Trailer" not in framing  # trailer fields are not passed on (as before)
        assert framing.endswith(b"\r\n0\r\n\r\n")

    assert accepted == [1]  # the upstream connection was kept for the second request


async def test_bytes_after_the_last_chunk_retire_the_upstream_connection(
    pool, raw_upstream, gateway
):
    accepted: list[int] = []
    port = await _scripted(
        raw_upstream, HEAD, 0.1, b"2\r\nok\r\n", 0.02, b"0\r\n\r\nHTTP/1.1 200 OK\r\n",
        accepted=accepted,
    )  # fmt: skip
    gw = await _serve(pool, gateway, port)

    for _ in range(2):
        framing, body = decoded(await raw_request(gw.port, GET))
        assert framing == b"2\r\nok\r\n0\r\n\r\n"
        assert body == b"ok"

    assert len(accepted) == 2  # not reused after what came after its answer


async def test_an_answer_after_the_last_chunk_never_reaches_the_client(pool, raw_upstream, gateway):
    # The extension hands the body to llhttp, which would read the next answer on: its body
    # must not follow the last chunk to the client (where it would be read as an answer).
    accepted: list[int] = []
    port = await _scripted(
        raw_upstream, HEAD, 0.1,
        b"5;x=1\r\nhello\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!",
        accepted=accepted,
    )  # fmt: skip
    gw = await _serve(pool, gateway, port)

    for _ in range(2):
        answer = await raw_request(gw.port, GET)
        framing, body = decoded(answer)
        assert body == b"hello"
        assert b"EVIL" not in answer
        assert framing.endswith(b"\r\n0\r\n\r\n")

    assert len(accepted) == 2  # not reused after what came after its answer


async def test_an_answer_whose_chunks_all_came_with_its_head_is_passed_on_whole(
    pool, raw_upstream, gateway
):
    # Read before the client's stream was in place: its data is framed again, piece by piece.
    port = await _scripted(raw_upstream, HEAD + b"5\r\nhello\r\nB\r\n world, 123\r\n0\r\n\r\n")
    gw = await _serve(pool, gateway, port)

    framing, body = decoded(await raw_request(gw.port, GET))

    assert framing == b"5\r\nhello\r\nb\r\n world, 123\r\n0\r\n\r\n"
    assert body == b"hello world, 123"


async def test_a_drain_waits_for_a_relayed_stream_and_ends_with_it(pool, raw_upstream, gateway):
    events = [b"%x\r\n%s\r\n" % (20, b"d" * 20)] * 5
    steps: list[bytes | float] = [HEAD, 0.1]
    for event in events:
        steps += [event, 0.05]
    gw = await _serve(pool, gateway, await _scripted(raw_upstream, *steps, b"0\r\n\r\n"))

    stream = asyncio.create_task(raw_request(gw.port, GET))
    await eventually(lambda: pool.service("web").inflight.get("u1"), what="the stream relayed")
    drained = pool.drain("web", "u1", timeout=5)
    await asyncio.sleep(0.05)  # a window for a drain that would end under the stream
    assert not drained.done()  # the stream is in flight

    async with asyncio.timeout(3):
        framing, body = decoded(await stream)
        assert await drained is True  # ended by the stream's end, not cut off

    assert framing == b"".join(events) + b"0\r\n\r\n"
    assert body == b"d" * 100
    assert pool.service("web").inflight == {}
    assert pool.service("web").leases == {}


async def test_a_drain_timeout_cuts_a_relayed_stream_off_without_its_last_chunk(
    pool, raw_upstream, gateway
):
    port = await _scripted(raw_upstream, HEAD, 0.1, b"5\r\nhello\r\n", 30.0)  # then silence
    gw = await _serve(pool, gateway, port)

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(GET)
        async with asyncio.timeout(3):
            answer = await reader.readuntil(b"5\r\nhello\r\n")  # the first chunk relayed
            assert await pool.drain("web", "u1", timeout=0.1) is False
            answer += await reader.read()  # the gateway closed it
    finally:
        writer.close()

    head, _, framing = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert framing == b"5\r\nhello\r\n"  # a client sees the body broke off: no last chunk
    assert pool.service("web").inflight == {}


async def test_a_stream_read_within_its_read_timeout_goes_on_and_one_that_stops_is_cut(
    pool, raw_upstream, gateway
):
    """The read timeout over a streamed body, whose reads are counted, not timed (``LOOK``):
    an event every 0.1 s for 1.4 s goes on under a 0.4 s timeout; when they stop, the
    stream is cut 0.4 s to 0.45 s after the last (and what the loop and the machine add)."""
    events = [b"5\r\nev%03d\r\n" % i for i in range(15)]
    steps: list[bytes | float] = [HEAD, events[0]]
    for event in events[1:]:
        steps += [0.1, event]
    port = await _scripted(raw_upstream, *steps, 30.0)  # then silence
    pool.set_service(routing("web", prefix="/", timeouts={"read": 0.4}))
    add(pool, "web", "u1", port)
    gw = await gateway()

    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(GET)
    received = b""
    last_event = 0.0
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while data := await reader.read(65536):
            received += data
            if b"ev014" in received and not last_event:
                last_event = loop.time()
    cut = loop.time() - last_event
    writer.close()

    body = received.partition(b"\r\n\r\n")[2]
    at = [body.find(b"ev%03d" % i) for i in range(15)]
    assert -1 not in at, body  # every event came: the stream went on for 3.5 timeouts
    assert at == sorted(at)
    assert not body.endswith(b"0\r\n\r\n")  # cut off: no last chunk
    assert 0.38 <= cut <= 0.4 * (1 + LOOK) + 0.3, cut


async def test_a_stream_on_a_model_path_is_relayed_as_it_came_and_its_tokens_counted(
    pool, raw_upstream, gateway, recorder
):
    """Events cut across chunks anywhere (a data line over two chunks, a chunk of two
    events): the chunks go on as they came, and the events are read from their data."""
    events = [b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n']
    events += [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(5)]
    text = b"".join(events) + b"data: [DONE]\n\n"
    chunks = [
        b"%X\r\n%s\r\n" % (len(text[i : i + 37]), text[i : i + 37]) for i in range(0, len(text), 37)
    ]
    steps: list[bytes | float] = [HEAD, 0.1]
    for chunk in chunks:
        steps += [chunk, 0.005]
    body = b'{"model": "llama", "stream": true}'
    port = await _scripted(raw_upstream, *steps, b"0\r\n\r\n", body=len(body))
    pool.set_service(routing("llama", prefix="/llama", model={"name": "llama"}))
    add(pool, "llama", "u1", port)
    gw = await gateway(models={"path_prefix": "/v1"})
    post = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    framing, relayed = decoded(await raw_request(gw.port, post))

    if RELAYED:
        assert framing == b"".join(chunks) + b"0\r\n\r\n"
    assert relayed == text
    await recorder.wait(1)
    (tokens,) = recorder.tokens
    assert tokens.output == 5
    assert tokens.ttft is not None
    assert tokens.ttft >= 0.1
    assert tokens.gaps is not None
    counts, total = tokens.gaps
    assert sum(counts) == 4
    assert total > 0  # the content chunks came in different reads
