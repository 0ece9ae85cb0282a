"""The head of an answer as the client gets it (``messages.client_head``): its one-join way
for most answers makes what the line-by-line way makes, with HSTS's field and the body."""

from __future__ import annotations

import sys
from http import HTTPStatus

import pytest

from gateway.proxy import messages
from gateway.proxy.messages import ResponseHead
from gateway.proxy.request import IncomingRequest
from gateway.wire import headers, http1

HSTS = b"Strict-Transport-Security: max-age=3600"


def reference(fields: bytes, length: int, extra: bytes, body: bytes, close: bool) -> bytes:
    """What the answer's head and body are, line by line."""
    lines = headers.client_response(fields, [], "r1")
    lines.append(b"Content-Length: %d" % length)
    if close:
        lines.append(b"Connection: close")
    if extra:
        lines.append(extra)
    return http1.response_head(200, b"OK", lines) + body


@pytest.mark.parametrize("fields", [b"", b"Server: x\r\nDate: y"])
@pytest.mark.parametrize("length", [0, 5, 1023, 1024, 10**6])
@pytest.mark.parametrize("extra", [b"", HSTS])
@pytest.mark.parametrize("keep_alive", [True, False])
def test_an_answer_framed_by_its_length(
    fields: bytes, length: int, extra: bytes, keep_alive: bool
) -> None:
    head = ResponseHead()
    head.status, head.phrase, head.fields, head.content_length = 200, b"OK", fields, length
    body = b"x" * min(length, 5)
    for given in (b"", body):
        chunked, kept, data = messages.client_head(
            IncomingRequest(None), head, b"r1", keep_alive, extra=extra, body=given
        )
        assert (chunked, kept) == (False, keep_alive)
        assert data == reference(fields, length, extra, given, close=not keep_alive)


def test_numbers_are_written_as_percent_d_writes_them() -> None:
    for n in [*range(0, 1100), 10**12]:
        assert http1.decimal(n) == b"%d" % n


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the phrases of Python 3.11's")
def test_reason_phrases_are_those_of_http_status() -> None:
    """The gateway's own table (a worker imports no ``http``) says what ``HTTPStatus`` says."""
    for status in HTTPStatus:
        assert http1.reason(status.value) == status.phrase.encode()
    assert http1.reason(299) == b"Unknown"
