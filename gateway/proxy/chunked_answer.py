"""The chunked body of one upstream answer after a plain head, on its way to the client.

``wire.chunked`` reads the framing. A read of the plainest chunks goes to a client that takes
chunks as it came (``ResponseStream.relay``: one write of the bytes uvloop read, no copy, no
new chunk header); otherwise each piece of chunk data goes to the connection's ``on_body``,
as llhttp's callback would give it (framed again for the client, or kept until the client's
stream is in place). Where the reader stops (a chunk extension, trailer fields, anything not
the plainest), a new llhttp parser reads the rest, from that size line on, as the whole body
was read before.

What a read comes to is told to the connection (``UpstreamConnection``), which owns the
answer's fate: the body goes on, ended, ended with bytes after it (the connection is not
used again), or is broken.
"""

from __future__ import annotations

from typing import Final, Protocol

import httptools

from ..wire import chunked
from ..wire.chunked import ChunkedBody
from .messages import AfterAnswer
from .streams import ResponseStream

MORE: Final = 0
"""The body goes on past this read."""
END: Final = 1
"""The body ended with this read."""
AFTER: Final = 2
"""The body ended, and more bytes came after it (no request asked for them)."""
BAD: Final = 3
"""Not a chunked body: ``error`` says why."""

TAIL_HEAD: Final = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
"""What the llhttp parser for the rest of a body is given first (``wire.chunked.HANDOFF``):
the head it needs to read a body from a chunk's size line on."""


class BodyReceiver(Protocol):
    """Who takes the pieces of chunk data that are not written as they came."""

    def on_body(self, data: bytes) -> None: ...


class ChunkedAnswer:
    """One answer's chunked body, read by ``wire.chunked`` and, from where it stops, llhttp."""

    __slots__ = (
        "_after",
        "_begun",
        "_body",
        "_complete",
        "_pieces",
        "_raw",
        "_receiver",
        "_tail",
        "error",
    )

    def __init__(self, receiver: BodyReceiver) -> None:
        self._receiver = receiver
        self._body = ChunkedBody()
        self._raw = False
        """Whether the chunk under way goes on as it came: a chunk's data is written the
        way its size line was."""
        self._pieces: list[int] = []
        """Where the chunk data of a read is, when it is not written as it came."""
        self._tail: httptools.HttpResponseParser | None = None
        """The parser that reads the rest of the body, once ``wire.chunked`` handed it over."""
        self._begun = False
        self._complete = False
        self._after = False
        self.error = ""

    def read(self, data: bytes, at: int, sink: ResponseStream | None) -> int:
        """``data[at:]``, the next read of the body: its chunks written to ``sink`` as they
        came if it takes chunks (once a chunk is begun that way, to its end), else their
        data given to the receiver. Returns ``MORE``, ``END``, ``AFTER`` or ``BAD``."""
        if self._tail is not None:
            return self._tail_read(data)
        body = self._body
        if body.in_chunk:
            raw = self._raw
        else:
            raw = self._raw = sink is not None and sink.chunked
        carry = body.carry
        if raw:
            assert sink is not None
            scanned = sink.tokens is not None
            status = body.read(data, at, self._pieces if scanned else None)
            if status == chunked.BAD:
                self._pieces.clear()
                self.error = body.error
                return BAD
            if scanned:  # the chunks' data, read for tokens (the relay stays as it came)
                pieces = self._pieces
                for k in range(0, len(pieces), 2):
                    sink.scan(data[pieces[k] : pieces[k + 1]])
                pieces.clear()
            safe = body.safe
            if body.emit_carry:
                out = carry + data[at:safe]
            elif at == 0 and safe == len(data):
                out = data  # the whole read, as it came (most)
            else:
                out = data[at:safe]
            if out:
                sink.relay(out, body.body)
            else:
                sink.bytes_out += body.body
        else:
            pieces = self._pieces
            status = body.read(data, at, pieces)
            receiver = self._receiver
            for k in range(0, len(pieces), 2):
                receiver.on_body(data[pieces[k] : pieces[k + 1]])
            pieces.clear()
        if status == chunked.MORE:
            return MORE
        if status == chunked.END:
            return AFTER if body.end < len(data) else END
        if status == chunked.HANDOFF:
            tail = self._tail = httptools.HttpResponseParser(self)
            tail.feed_data(TAIL_HEAD)
            safe = body.safe
            return self._tail_read(carry + data[safe:] if safe == at else data[safe:])
        self.error = body.error
        return BAD

    def _tail_read(self, data: bytes) -> int:
        """The rest of the body, read by llhttp."""
        assert self._tail is not None
        try:
            self._tail.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self._complete:
                self.error = str(exc)
                return BAD
            self._after = True  # refused after the answer, or another message begun
        if not self._complete:
            return MORE
        return AFTER if self._after else END

    # -- llhttp's callbacks, for the rest of the body ------------------------------------------

    def on_message_begin(self) -> None:
        if self._begun:
            # Another message after the answer: llhttp reads no further (its body would go
            # to the client after the last chunk).
            self._after = True
            raise AfterAnswer
        self._begun = True

    def on_body(self, data: bytes) -> None:
        self._receiver.on_body(data)

    def on_message_complete(self) -> None:
        self._complete = True
