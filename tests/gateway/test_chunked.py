"""``wire.chunked`` against llhttp: a chunked body read here, and handed to llhttp where it
is not the plainest, gives the client what llhttp alone would have given, chunk for chunk,
whatever the reads; a body llhttp refuses is refused."""

from __future__ import annotations

import random

import httptools
import pytest

from gateway.wire import chunked
from gateway.wire.chunked import ChunkedBody
from gateway.wire.http1 import LAST_CHUNK

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Llhttp:
    """llhttp reading an answer: its body, whether it completed, whether it refused."""

    def __init__(self, framed: list[bytes] | None = None) -> None:
        self.body: list[bytes] = []
        self.framed = framed
        """Where each piece goes as a chunk of its own, if given (the tail of a relay)."""
        self.complete = 0
        self.error: str | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, data: bytes) -> None:
        self.body.append(data)
        if self.framed is not None:
            self.framed.append(b"%x\r\n%b\r\n" % (len(data), data))

    def on_message_complete(self) -> None:
        self.complete += 1

    def feed(self, data: bytes) -> None:
        if self.error is None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self.error = str(exc)


def llhttp(data: bytes) -> _Llhttp:
    reader = _Llhttp()
    reader.feed(HEAD + data)
    return reader


def relay(reads: list[bytes], raw: bool) -> tuple[bytes, str]:
    """What ``UpstreamConnection._chunk_read`` writes to a client that takes chunks, read by
    read (``raw``: chunks as they came; else each piece of data as a chunk of its own), and
    how the body ended: ``end`` (``end+``: with more in its read), ``more``, ``bad``, or
    llhttp's after a handoff."""
    chunks = ChunkedBody()
    out: list[bytes] = []
    tail: _Llhttp | None = None
    sent = 0
    for n, data in enumerate(reads):
        if tail is not None:
            tail.feed(data)
            continue
        if not chunks.in_chunk:
            chunks.raw = raw
        carry = chunks.carry
        pieces: list[int] | None = None if chunks.raw else []
        status = chunks.read(data, 0, pieces)
        if status == chunked.BAD:
            return b"".join(out), "bad"
        if pieces is None:
            safe = chunks.safe
            out.append(carry + data[:safe] if chunks.emit_carry else data[:safe])
        else:
            for k in range(0, len(pieces), 2):
                piece = data[pieces[k] : pieces[k + 1]]
                if piece:
                    out.append(b"%x\r\n%b\r\n" % (len(piece), piece))
            assert sum(pieces[k + 1] - pieces[k] for k in range(0, len(pieces), 2)) == chunks.body
        sent += chunks.body
        if status == chunked.END:
            out.append(LAST_CHUNK)
            if chunks.end < len(data):
                return b"".join(out), "end+"
            # Reads after it are the connection's (an idle one must stay silent), not its.
            return b"".join(out), "end" if n == len(reads) - 1 else "end, then more"
        if status == chunked.HANDOFF:
            tail = _Llhttp(out)
            tail.feed(HEAD)
            safe = chunks.safe
            tail.feed(carry + data[safe:] if safe == 0 else data[safe:])
    if tail is not None:
        if tail.error is not None and not tail.complete:
            return b"".join(out), "bad"
        if tail.complete:
            out.append(LAST_CHUNK)
            return b"".join(out), "end" if tail.complete == 1 and tail.error is None else "end+"
    return b"".join(out), "more"


def check(body: bytes, splits: list[int], raw: bool) -> str:
    """The body read in the reads that ``splits`` make of it: what the client gets must be
    a chunked body that llhttp reads as it reads the upstream's. Returns how it ended."""
    reads = [body[a:b] for a, b in zip([0, *splits], [*splits, len(body)], strict=True)]
    written, ended = relay(reads, raw)
    reference = llhttp(body)
    client = llhttp(written)
    assert client.error is None, (body, splits, written, client.error)
    if ended == "bad":
        assert reference.error is not None, (body, splits)
        assert not reference.complete
        assert not client.complete
    elif ended.startswith("end"):
        assert reference.complete >= 1, (body, splits, reference.error)
        assert client.complete == 1
        assert b"".join(client.body) == b"".join(reference.body)
        if ended == "end":  # nothing after it: llhttp reads nothing more either
            assert reference.complete == 1
            assert reference.error is None
        # ``end+``: bytes after the end, in its read: the connection is not reused (llhttp
        # reads them as another answer, refuses them, or skips a stray CRLF).
    else:
        assert not reference.complete, (body, splits)
        assert reference.error is None
        assert not client.complete
        assert b"".join(reference.body).startswith(b"".join(client.body))
    return ended


BODIES = [
    b"5\r\nhello\r\n0\r\n\r\n",
    b"0\r\n\r\n",
    b"1a\r\n" + b"x" * 26 + b"\r\n3\r\nabc\r\n0\r\n\r\n",
    b"A\r\n0123456789\r\nF\r\n" + b"y" * 15 + b"\r\n0\r\n\r\n",
    b"000005\r\nhello\r\n0\r\n\r\n",
    b"64\r\n" + b"data: event\n\n".ljust(100, b".") + b"\r\n" * 1,
    # Left to llhttp: extensions, trailers, sizes that are long or spaced.
    b"5;name=value\r\nhello\r\n0\r\n\r\n",
    b"5\r\nhello\r\n3;a\r\nabc\r\n0\r\n\r\n",
    b"5\r\nhello\r\n0\r\nExpires: never\r\n\r\n",
    b"5\r\nhello\r\n0;x=1\r\n\r\n",
    b"0000000000000005\r\nhello\r\n0\r\n\r\n",
    b"5 \r\nhello\r\n0\r\n\r\n",
    # Refused: not CRLF after the data, a size that is not one.
    b"5\r\nhelloX\r\n0\r\n\r\n",
    b"5\r\nhello\n0\r\n\r\n",
    b"zz\r\nhello\r\n0\r\n\r\n",
    b"\r\n",
    b"5\nhello\r\n0\r\n\r\n",
    # More after the end.
    b"5\r\nhello\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    b"0\r\n\r\ngarbage",
]


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "pieces"])
@pytest.mark.parametrize("body", BODIES)
def test_every_split_gives_the_client_what_llhttp_reads(body: bytes, raw: bool) -> None:
    check(body, [], raw)
    for at in range(1, len(body)):
        check(body, [at], raw)
    for a in range(1, len(body), 3):
        for b in range(a + 1, len(body), 2):
            check(body, [a, b], raw)


def test_a_stream_of_plain_chunks_goes_on_as_it_came() -> None:
    events = [b"data: %d\n\n" % i for i in range(50)]
    reads = [b"%x\r\n%b\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    written, ended = relay(reads, raw=True)
    assert ended == "end"
    assert written == b"".join(reads)


def test_a_size_line_split_across_reads_is_written_whole() -> None:
    chunks = ChunkedBody()
    chunks.raw = True
    assert chunks.read(b"5\r\nhello\r\n1", 0, None) == chunked.MORE
    assert chunks.safe == 10  # "1" is held
    assert chunks.carry == b"1"
    carry = chunks.carry
    assert chunks.read(b"0\r\n" + b"z" * 16 + b"\r\n", 0, None) == chunked.MORE
    assert chunks.emit_carry
    assert carry + b"0\r\n" == b"10\r\n"
    assert chunks.body == 16


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "pieces"])
def test_mutations_give_the_client_what_llhttp_reads_or_are_refused(raw: bool) -> None:
    rng = random.Random(20261205 + raw)
    noise = b"\r\n \t;=0123456789abcdefABCDEFgxz:\x00\xff"
    ended: dict[str, int] = {}
    for _ in range(4000):
        parts = []
        for _ in range(rng.randint(0, 4)):
            data = bytes(rng.choice(b"abc\r\n") for _ in range(rng.randint(1, 40)))
            parts.append(b"%x\r\n%b\r\n" % (len(data), data))
        parts.append(b"0\r\n\r\n")
        body = bytearray(b"".join(parts))
        for _ in range(rng.randint(0, 3)):
            at = rng.randrange(len(body))
            what = rng.randrange(3)
            if what == 0:
                body[at] = rng.choice(noise)
            elif what == 1:
                body.insert(at, rng.choice(noise))
            else:
                del body[at]
        splits = sorted(rng.sample(range(1, len(body)), min(rng.randint(0, 4), len(body) - 1)))
        how = check(bytes(body), splits, raw)
        ended[how] = ended.get(how, 0) + 1
    # Both ways are exercised: bodies that end, that are refused, that need more.
    assert ended.get("end", 0) > 500
    assert ended.get("bad", 0) > 100
    assert ended.get("more", 0) > 10
