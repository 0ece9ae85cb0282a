"""Plain heads read without llhttp: what they take, llhttp takes and reads the same way.

Each head ``plainhead`` reads is checked against llhttp (``httptools``) field by field, and
so is every mutation of the plain heads below that it still reads (a byte changed, put in,
left out; a line doubled; the end cut), with a fixed seed. The smuggling shapes and
everything else outside the subset must go to llhttp (None).
"""

from __future__ import annotations

import random

import httptools
import pytest

from gateway.proxy import messages
from gateway.proxy.request import IncomingRequest
from gateway.wire import headers, plainhead

MAX_FIELD = 1024


class _Request:
    """What llhttp's callbacks report of the requests in some bytes."""

    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.messages.append({"url": b"", "headers": [], "body": b"", "complete": False})

    def on_url(self, url: bytes) -> None:
        self.messages[-1]["url"] += url  # type: ignore[operator]

    def on_header(self, name: bytes, value: bytes) -> None:
        self.messages[-1]["headers"].append((name, value))  # type: ignore[attr-defined]

    def on_headers_complete(self) -> None:
        message = self.messages[-1]
        message["method"] = self.parser.get_method().decode()
        message["version"] = self.parser.get_http_version()
        message["keep_alive"] = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.messages[-1]["body"] += body  # type: ignore[operator]

    def on_message_complete(self) -> None:
        self.messages[-1]["complete"] = True


def llhttp_request(data: bytes) -> list[dict[str, object]] | None:
    """The requests llhttp reads in ``data``, or None if it refuses it."""
    reader = _Request()
    try:
        reader.parser.feed_data(data)
    except httptools.HttpParserError:
        return None
    return reader.messages


class _Answer:
    def __init__(self) -> None:
        self.phrase = b""
        self.body = b""
        self.complete = 0
        self.keep_alive: bool | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_status(self, phrase: bytes) -> None:
        self.phrase += phrase

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete += 1


TRACE = b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
"""The gateway's trace lines, as ``tracing.context`` makes them (any lines do here)."""


def check_request(data: bytes) -> bool:
    """Whether ``plainhead`` reads ``data``; if it does, llhttp must read the same."""
    untraced = plainhead.request(data, MAX_FIELD)
    traced = plainhead.request(data, MAX_FIELD, trace=True)
    if untraced is None:
        assert traced is None, data
        return False
    assert traced is not None, data
    same = (0, 1, 2, 4, 5, 6, 7, 8)  # but the kept lines and where Authorization is in them
    assert [untraced[i] for i in same] == [traced[i] for i in same], data
    assert untraced[10:] == (None, None), data
    check_traced(traced)
    check_plain(data, untraced, False)
    check_plain(data, traced, True)
    return True


def check_traced(plain: plainhead.PlainRequest) -> None:
    """The traceparent and tracestate noted as read with ``trace``."""
    fields = plainhead.fields(plain[2])
    parents = [value for name, value in fields if name.lower() == b"traceparent"]
    states = [value for name, value in fields if name.lower() == b"tracestate"]
    traceparent, tracestate = plain[10:]
    assert traceparent == (
        None if not parents else parents[0] if len(parents) == 1 else plainhead.TWICE
    )
    assert tracestate == (b",".join(states) if states else None)


def check_plain(data: bytes, plain: plainhead.PlainRequest, traced: bool) -> None:
    """What goes upstream of a plain head read with ``trace`` or not: the same lines from
    the kept ones as from all the fields."""
    method, target, block, kept, host, request_id, keep_alive, forwarded, auth, auth_at = plain[:10]
    trace = TRACE if traced else b""
    fields = plainhead.fields(block)
    messages = llhttp_request(data)
    assert messages is not None, data
    assert len(messages) == 1, data
    [message] = messages
    assert message["complete"], data
    assert message["body"] == b""
    assert message["version"] == "1.1"
    assert (message["method"], message["url"], message["headers"]) == (method, target, fields)
    assert message["keep_alive"] == keep_alive, data
    names = [name.lower() for name, _ in fields]
    hosts = [value for name, value in fields if name.lower() == b"host"]
    assert len(hosts) <= 1
    assert host == (hosts[0] if hosts else b"")
    ids = [value for name, value in fields if name.lower() == b"x-request-id"]
    assert request_id == (ids[-1] if ids else None)
    for framing in (b"content-length", b"transfer-encoding", b"upgrade", b"proxy-connection"):
        assert framing not in names
    assert len(target) <= MAX_FIELD
    assert all(len(name) + len(value) <= MAX_FIELD for name, value in fields)
    assert all(value.isascii() for _, value in fields)
    # What goes upstream: the same lines from the kept ones as from all the fields.
    spelled = all(
        line.partition(b":")[2][:1] == b" " and line.partition(b":")[2][1:2] not in (b" ", b"\t")
        for line in block.split(b"\r\n")
        if block
    )
    assert (kept is not None) == spelled, data
    for peer in ("10.0.0.1", None) if kept is not None else ():
        for trust in (False, True):
            if trust and forwarded:
                continue  # the fields' way (their values are read)
            assert b"\r\n".join(
                headers.plain_upstream_request(
                    kept, host=host, peer=peer, request_id="r1", trace=trace
                )
            ) == b"\r\n".join(
                headers.upstream_request(
                    fields,
                    host=host,
                    peer=peer,
                    request_id="r1",
                    trust_forwarded=trust,
                    trace=trace,
                )
            ), data
            check_whole_head(plain, peer, trust, trace)
    assert forwarded == any(name.startswith(b"x-forwarded-") for name in names)
    # Authorization, noted as read: its value, and where its line is in the kept lines.
    tokens = [value for name, value in fields if name.lower() == b"authorization"]
    assert auth == (None if not tokens else tokens[0] if len(tokens) == 1 else plainhead.TWICE)
    if auth is None or auth == plainhead.TWICE or kept is None:
        assert auth_at == -1 or kept is None or auth == plainhead.TWICE, data
    else:
        line = kept[auth_at:].partition(b"\r\n")[0]
        assert auth_at == 0 or kept[auth_at - 2 : auth_at] == b"\r\n", data
        assert line.lower() == b"authorization: " + auth.lower(), data


def check_whole_head(
    plain: plainhead.PlainRequest, peer: str | None, trust: bool, trace: bytes = b""
) -> None:
    """``messages.plain_upstream_head`` makes the bytes ``upstream_request`` makes of
    ``upstream_head``'s lines (the framing and the blank line), for the request of a plain
    head."""
    method, target, block, kept, host, request_id, keep_alive, forwarded, _, _ = plain[:10]
    request = IncomingRequest(None)
    request.method, request.target, request.raw_fields = method, target, block
    request.plain_lines, request.host, request.forwarded = kept, host, forwarded
    request.request_id, request.keep_alive = request_id, keep_alive
    for secure in (False, True):
        for empty_body in (False, True):
            lines = messages.upstream_head(
                request,
                b"/t?q",
                peer=peer,
                request_id="r1",
                trust_forwarded=trust,
                address="10.1.1.1:80",
                secure=secure,
                trace=trace,
            )
            framed = messages.upstream_request(lines, 0 if empty_body else None)
            whole = messages.plain_upstream_head(
                request,
                b"/t?q",
                peer=peer,
                request_id=b"r1",
                secure=secure,
                address="10.1.1.1:80",
                empty_body=empty_body,
                trace=trace,
            )
            assert whole == framed, plain
            end = b"\r\nContent-Length: 0\r\n\r\n" if empty_body else b"\r\n\r\n"
            assert framed.endswith(end), plain


def check_answer(data: bytes) -> bool:
    """Whether ``plainhead`` reads ``data``; if it does, llhttp must read the same, and the
    fields be sorted out as ``headers.response_fields`` sorts llhttp's."""
    plain = plainhead.answer(data, MAX_FIELD)
    if plain is None:
        return False
    status, phrase, block, length, hop, keep_alive, body_at = plain
    reader = _Answer()
    try:
        # A chunked body is ``wire.chunked``'s to read (tests/gateway/test_chunked.py): the
        # head is held to llhttp here.
        reader.parser.feed_data(data if length >= 0 else data[:body_at])
    except httptools.HttpParserError as exc:
        raise AssertionError(f"llhttp refuses {data!r}: {exc}") from None
    if length < 0:
        assert reader.keep_alive is not None, data  # the head is complete, where it ends
        assert data[body_at - 4 : body_at] == b"\r\n\r\n"
        head = data[: body_at - 4]
        _, _, raw_block = head.partition(b"\r\n")
        fields, content_length, chunked, _ = headers.response_fields(raw_block)
        assert (fields, content_length, chunked) == (block, None, True)
        assert reader.parser.get_status_code() == status
        assert reader.phrase == phrase
        assert reader.keep_alive == keep_alive, data
        assert hop is plainhead.NO_HOP
        return True
    assert reader.complete == 1, data
    assert reader.parser.get_status_code() == status
    assert reader.phrase == phrase
    assert reader.keep_alive == keep_alive, data
    assert reader.body == data[body_at:]
    assert len(reader.body) == length
    head = data[: data.index(b"\r\n\r\n")]
    _, _, raw_block = head.partition(b"\r\n")
    fields, content_length, chunked, connection = headers.response_fields(raw_block)
    assert (fields, content_length, chunked) == (block, length, False)
    # Its Connection field (keep-alive or close) names no field to drop: none is kept.
    assert hop is plainhead.NO_HOP
    assert hop == []
    assert not headers.names_fields(connection)
    return True


def test_forwarded_for_lines_come_from_a_bounded_cache_the_same() -> None:
    plain = plainhead.request(b"GET / HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n\r\n", MAX_FIELD)
    assert plain is not None
    for n in range(3 * messages.FORWARDED_FOR_CACHED):
        peer = f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}" if n % 3 else f"2001:db8::{n:x}"
        for _ in range(2):  # made, then from the cache
            check_whole_head(plain, peer, trust=False)
        assert len(messages._FORWARDED_FOR) <= messages.FORWARDED_FOR_CACHED


REQUESTS = [
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-"
    b"b7ad6b7169203331-01\r\ntracestate: a=1\r\nAuthorization: Bearer t\r\n\r\n",
    b"GET / HTTP/1.1\r\nTraceParent: x\r\nX-A: 1\r\ntraceparent: y\r\nTRACESTATE: a=1\r\n"
    b"tracestate:b=2\r\n\r\n",
    b"GET / HTTP/1.1\r\ntracestate: a=1\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"HEAD /a/b?c=d&e=%20#f HTTP/1.1\r\nhost: example.com\r\nAccept: */*\r\n\r\n",
    b"DELETE /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\nX-Request-Id: abc-1\r\n\r\n",
    b"OPTIONS /x HTTP/1.1\r\nHost: h\r\nconnection: Keep-Alive\r\nx-request-id: a\r\n"
    b"X-Request-ID: b\r\n\r\n",
    b"GET /api/items?page=2 HTTP/1.1\r\nHost: example.com\r\nUser-Agent: Mozilla/5.0 (X11)\r\n"
    b"Accept: text/html,application/xhtml+xml\r\nAccept-Language: en-US,en;q=0.5\r\n"
    b"Cookie: session=abc123; theme=dark\r\nEmpty:\r\nTabbed:\t x \t\r\n\r\n",
    b"PUT /f HTTP/1.1\r\nTE: trailers\r\nHost: h\r\nX-Forwarded-For: 1.2.3.4\r\n"
    b"Keep-Alive: 5\r\nX-A: 1\r\nExpect: nothing\r\nX-Forwarded-Proto: https\r\n"
    b"x-forwarded-host: o\r\nTrailer: x\r\nProxy-Authorization: b\r\nX-B: 2\r\n\r\n",
    # Authorization, noted where it is among the kept lines (after dropped ones, twice).
    b"GET /v1/chat HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer k3y-abc\r\nAccept: */*\r\n\r\n",
    b"GET / HTTP/1.1\r\nKeep-Alive: 1\r\nX-A: 1\r\nX-Request-Id: q\r\nX-B: 2\r\n"
    b"authorization: Bearer z \r\nX-C: 3\r\n\r\n",
    b"POST /x HTTP/1.1\r\nX-Request-Id: r\r\nAuthorization:  Bearer t\r\nX-A: 1\r\n"
    b"AUTHORIZATION: Basic x\r\n\r\n",
]

ANSWERS = [
    b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: text/plain\r\nContent-Length: 13\r\n"
    b"Connection: keep-alive\r\n\r\nHello, world\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 404 \r\nX-Request-Id: up\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n"
    b"Connection: close\r\nHost: kept\r\n\r\nno",
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 5\r\nTE: x\r\nTrailer: y\r\n"
    b"Proxy-Authenticate: z\r\nRetry-After: 1\r\n\r\nbusy!",
    b"HTTP/1.1 201 Created\r\nLocation: /x\r\nContent-Length: 4\r\nA: b\r\n\r\n\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nAuthorization: x\r\nContent-Length: 2\r\n\r\nok",
    # A chunked body: the head is read here, the body by ``wire.chunked``.
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\ntransfer-encoding: Chunked\r\n"
    b"Cache-Control: no-cache\r\nConnection: keep-alive\r\n\r\n",
    b"HTTP/1.1 502 Bad Gateway\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhe",
]

# As many fields as a head may hold: read here, requests and answers alike (one more: llhttp).
REQUESTS.append(b"GET / HTTP/1.1\r\n" + b"X: a\r\n" * plainhead.MAX_FIELDS + b"\r\n")
ANSWERS.append(
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
    + b"X: a\r\n" * (plainhead.MAX_FIELDS - 1)
    + b"\r\nok"
)


@pytest.mark.parametrize("data", REQUESTS)
def test_plain_requests_are_read_as_llhttp_reads_them(data: bytes) -> None:
    assert check_request(data)


@pytest.mark.parametrize("data", ANSWERS)
def test_plain_answers_are_read_as_llhttp_reads_them(data: bytes) -> None:
    assert check_answer(data)


@pytest.mark.parametrize(
    "data",
    [
        # Smuggling shapes (the hardening tests send each to the gateway as well).
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n",  # obs-fold
        b"GET / HTTP/1.1\nHost: h\r\n\r\n",  # bare LF
        b"GET / HTTP/1.1\r\nHost: h\n\r\n",
        b"GET / HTTP/1.1\r\nHost : h\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nX: caf\xc3\xa9\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost:\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nProxy-Connection: close\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close, x\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\nConnection: close\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\nSec-WebSocket-Key: x\r\n\r\n",
        # Not the subset: other versions, forms, methods, spacing, more than one head.
        b"GET / HTTP/1.0\r\nHost: h\r\n\r\n",
        b"GET http://h/ HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET * HTTP/1.1\r\n\r\n",
        b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
        b"get / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\n\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\n",
        b"GET / HTTP/1.1\r\nHost: h\r\n\r\nx",
        b"GET /" + b"a" * MAX_FIELD + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_FIELD + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X: a\r\n" * (plainhead.MAX_FIELDS + 1) + b"\r\n",
    ],
)
def test_other_requests_are_left_to_llhttp(data: bytes) -> None:
    assert plainhead.request(data, MAX_FIELD) is None


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked \r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2 \r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\nclose-delimited",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok",  # not all of the body yet
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nok",  # more than the body
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: a\r\n b\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\nX: a\r\n\r\nok",
        b"HTTP/1.1 200 O\x00K\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nUpgrade: h2c\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x-private\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: caf\xc3\xa9\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX : a\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: " + b"a" * MAX_FIELD + b"\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"
        + b"X: a\r\n" * plainhead.MAX_FIELDS
        + b"\r\nok",
    ],
)
def test_other_answers_are_left_to_llhttp(data: bytes) -> None:
    assert plainhead.answer(data, MAX_FIELD) is None


_NOISE = b'\r\n \t:\x00\x7f\x80\xff,;=/?#%"()AZaz09-_.~HTTP/1.1'


def _mutants(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(b)) if b else 0
            what = rng.randrange(6)
            if what == 0 and b:
                b[at] = rng.choice(_NOISE)
            elif what == 1:
                b.insert(at, rng.choice(_NOISE))
            elif what == 2 and b:
                del b[at]
            elif what == 3:
                b[at:at] = rng.choice([b"\r\n", b"\n", b"\r", b" ", b"\t", b": "])
            elif what == 4:
                lines = bytes(b).split(b"\r\n")
                k = rng.randrange(len(lines))
                lines.insert(k, lines[k])
                b = bytearray(b"\r\n".join(lines))
            else:
                del b[at:]
        out.append(bytes(b))
    return out


@pytest.mark.parametrize(
    ("plain", "check", "seed"),
    [(REQUESTS, check_request, 20261204), (ANSWERS, check_answer, 20261205)],
    ids=["requests", "answers"],
)
def test_mutations_are_read_as_llhttp_reads_them_or_left_to_it(plain, check, seed) -> None:
    rng = random.Random(seed)
    read = total = 0
    for data in plain:
        for mutant in _mutants(data, rng, 3000):
            total += 1
            read += check(mutant)
    # The mutations exercise both ways: some still plain (a value changed), most not.
    assert 0 < read < total


def test_every_byte_in_every_place_of_a_request() -> None:
    """Each of the 256 bytes put in each place of a plain request: read as llhttp reads it,
    or left to llhttp."""
    data = b"GET /p?q HTTP/1.1\r\nHost: h\r\nA-b: v w\r\n\r\n"
    for at in range(len(data) - 3):
        for byte in range(256):
            check_request(data[:at] + bytes([byte]) + data[at:])
            check_request(data[:at] + bytes([byte]) + data[at + 1 :])


def test_every_byte_in_every_place_of_an_answer() -> None:
    data = b"HTTP/1.1 200 OK\r\nA-b: v w\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    for at in range(len(data) - 3):
        for byte in range(256):
            check_answer(data[:at] + bytes([byte]) + data[at:])
            check_answer(data[:at] + bytes([byte]) + data[at + 1 :])
