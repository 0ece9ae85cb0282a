"""``wire.chunked`` against llhttp: a chunked body read here (``proxy.chunked_answer``), and
handed to llhttp where it is not the plainest, gives the client what llhttp alone would have
given, chunk for chunk, whatever the reads; a body llhttp refuses is refused."""

from __future__ import annotations

import random

import httptools
import pytest

from gateway.proxy import chunked_answer
from gateway.proxy.chunked_answer import ChunkedAnswer
from gateway.proxy.streams import ResponseStream
from gateway.wire import chunked
from gateway.wire.chunked import ChunkedBody

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Llhttp:
    """llhttp reading an answer: its body, whether it completed, whether it refused."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = 0
        self.error: str | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, data: bytes) -> None:
        if not self.complete:  # the first answer's: what came after it is no part of it
            self.body.append(data)

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


class _Client:
    """A client connection that takes chunks: what is written to it, in order."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.transport = self
        self.writing_paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def writelines(self, lines: list[bytes]) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        pass

    def socket_fd(self) -> int:
        return -1  # no socket: what is relayed is written here


class _Receiver:
    """The connection's ``on_body``: pieces to the client's stream, framed again."""

    def __init__(self, stream: ResponseStream) -> None:
        self.stream = stream

    def on_body(self, data: bytes) -> None:
        self.stream.response_data(data)


def relay(reads: list[bytes], raw: bool) -> tuple[bytes, str, int]:
    """What ``ChunkedAnswer`` writes to a client that takes chunks, read by read (``raw``:
    its stream is in place, so chunks go as they came; else each piece of data is framed
    again, as before the stream is in place), how the body ended (``end``; ``end+``: with
    more in its read; ``more``; ``bad``), and the body's bytes the stream counted."""
    client = _Client()
    stream = ResponseStream(client, chunked=True)
    answer = ChunkedAnswer(_Receiver(stream))
    for n, data in enumerate(reads):
        status = answer.read(data, 0, stream if raw else None)
        if status == chunked_answer.BAD:
            return b"".join(client.written), "bad", stream.bytes_out
        if status != chunked_answer.MORE:
            stream.response_end()
            if status == chunked_answer.AFTER:
                ended = "end+"
            else:  # reads after it are the connection's (an idle one must stay silent)
                ended = "end" if n == len(reads) - 1 else "end, then more"
            return b"".join(client.written), ended, stream.bytes_out
    return b"".join(client.written), "more", stream.bytes_out


def check(body: bytes, splits: list[int], raw: bool) -> str:
    """The body read in the reads that ``splits`` make of it: what the client gets must be
    a chunked body that llhttp reads as it reads the upstream's. Returns how it ended."""
    reads = [body[a:b] for a, b in zip([0, *splits], [*splits, len(body)], strict=True)]
    written, ended, counted = relay(reads, raw)
    reference = llhttp(body)
    client = llhttp(written)
    assert client.error is None, (body, splits, written, client.error)
    assert counted == len(b"".join(client.body))
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
    # More after the end, once the body went to llhttp: its body must not reach the client.
    b"5;x\r\nhello\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nEVIL!",
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
    written, ended, _ = relay(reads, raw=True)
    assert ended == "end"
    assert written == b"".join(reads)


def test_a_size_line_split_across_reads_is_written_whole() -> None:
    chunks = ChunkedBody()
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
