"""Chunked bodies read without llhttp, so that their chunks can go on as they came. PURE.

An answer's chunked body (RFC 9112 §7.1) streamed to a client that takes chunks too used to
cross llhttp, which handed each piece of chunk data to a callback as a new bytes object, and
the gateway framed it again (``http1.write_body``): a copy and a formatted chunk header for
every event of a server-sent events stream. ``ChunkedBody`` reads the framing itself, and
where it is the plainest (``1*15HEXDIG CRLF``, the data, CRLF; ``0 CRLF CRLF`` to end it),
the reads can be written to the client as they are (``ResponseStream.relay``).

What it accepts is a strict subset of what llhttp accepts, read the same way (the tests hold
it to that against llhttp, on every shape and on mutations):

- A size line that is anything else (a chunk extension, a space, more than 15 digits, a bare
  LF) or a last chunk with trailer fields is handed to llhttp from its first byte
  (``HANDOFF``), with what came before it already read: llhttp then reads the rest of the
  body as it did before, or refuses it.
- After a chunk's data, anything but CRLF is refused (``BAD``), as llhttp refuses it.

The bytes of a size line are not given out until the line is complete: a line split across
reads is kept (``carry``) and comes out with the rest of it, so that output never holds part
of a chunk header that is then handed over, nor the last chunk (the stream writes its own,
``http1.LAST_CHUNK``: trailer fields are not passed on, as before).
"""

from __future__ import annotations

from typing import Final

from mypy_extensions import i64

MORE: Final = 0
"""The body goes on past this read."""
END: Final = 1
"""The body ended in this read, at ``end``."""
HANDOFF: Final = 2
"""A size line not read here begins at ``safe`` (or began in an earlier read: ``carry``):
llhttp reads the body from there."""
BAD: Final = 3
"""Not a chunked body: ``error`` says why."""

SIZE_DIGITS: Final = 15
"""Hex digits of a chunk size read here: 15 make at most 2**60 - 1, a machine integer.
A longer size (leading zeros) is llhttp's to read."""

_CR: Final = 13
_LF: Final = 10

# Where the reader is.
_SIZE: Final = 0  # in a size line's digits (none yet at its start)
_SIZE_LF: Final = 1  # after the size line's CR
_DATA: Final = 2  # in a chunk's data
_DATA_CR: Final = 3  # after a chunk's data
_DATA_LF: Final = 4  # after that CR
_END_CR: Final = 5  # after the last chunk's line: CRLF ends the body
_END_LF: Final = 6


def _hex(c: i64) -> i64:
    """The value of the hex digit ``c``, or -1."""
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


class ChunkedBody:
    """Where a chunked body's framing is, from read to read.

    ``read`` takes each read of the body in turn. After it: ``body`` is how many bytes of
    chunk data that read held; ``safe`` where the bytes that may go on as they are end (the
    start of a size line not yet complete, or of the last chunk); ``emit_carry`` whether the
    ``carry`` of the read before (taken before calling) comes first; ``end`` where the body
    ended (``END``); ``error`` what was wrong (``BAD``).
    """

    __slots__ = (
        "body",
        "carry",
        "digits",
        "emit_carry",
        "end",
        "error",
        "remaining",
        "safe",
        "size",
        "state",
    )

    def __init__(self) -> None:
        self.state: i64 = _SIZE
        self.size: i64 = 0
        self.digits: i64 = 0
        self.remaining: i64 = 0
        """Bytes of the current chunk's data still to come."""
        self.carry = b""
        """The start of a size line the last read ended in (given out with the rest)."""
        self.body: i64 = 0
        self.safe: i64 = 0
        self.end: i64 = -1
        self.emit_carry = False
        self.error = ""

    @property
    def in_chunk(self) -> bool:
        """Whether the reader is inside a chunk's data or the CRLF after it."""
        return _DATA <= self.state <= _DATA_LF

    def read(self, data: bytes, at: i64, pieces: list[int] | None) -> i64:
        """Read ``data[at:]``; with ``pieces``, add the start and end of each run of chunk
        data in it to the list. Returns ``MORE``, ``END``, ``HANDOFF`` or ``BAD``."""
        n: i64 = len(data)
        i: i64 = at
        state = self.state
        body: i64 = 0
        self.emit_carry = False
        # Where the size line under way began; -1: in an earlier read (``carry`` holds it).
        line: i64 = at if state == _SIZE and self.digits == 0 else -1
        while i < n:
            if state == _DATA:
                take = self.remaining
                if take > n - i:
                    take = n - i
                if pieces is not None:
                    pieces.append(i)
                    pieces.append(i + take)
                body += take
                i += take
                self.remaining -= take
                if self.remaining == 0:
                    state = _DATA_CR
            elif state == _SIZE:
                c: i64 = data[i]
                d = _hex(c)
                if d >= 0 and self.digits < SIZE_DIGITS:
                    self.size = self.size * 16 + d
                    self.digits += 1
                    i += 1
                elif c == _CR and self.digits > 0:
                    state = _SIZE_LF
                    i += 1
                else:
                    return self._handoff(line, at, body)
            elif state == _SIZE_LF:
                if data[i] != _LF:
                    return self._handoff(line, at, body)
                i += 1
                if self.size == 0:
                    state = _END_CR
                else:
                    state = _DATA
                    self.remaining = self.size
                    self.size = 0
                    self.digits = 0
                    if line < 0:
                        self.emit_carry = True
                    line = -2  # no line under way
            elif state == _DATA_CR or state == _DATA_LF:
                if data[i] != (_CR if state == _DATA_CR else _LF):
                    self.state = state
                    self.body = body
                    self.error = "invalid character after chunk data"
                    return BAD
                i += 1
                if state == _DATA_CR:
                    state = _DATA_LF
                else:
                    state = _SIZE
                    line = i
            elif state == _END_CR:
                if data[i] != _CR:
                    return self._handoff(line, at, body)  # trailer fields: llhttp's
                state = _END_LF
                i += 1
            else:  # _END_LF
                if data[i] != _LF:
                    return self._handoff(line, at, body)
                self.state = _SIZE
                self.body = body
                self.end = i + 1
                self.safe = line if line >= 0 else at
                self.carry = b""
                return END
        self.state = state
        self.body = body
        if state == _SIZE or state == _SIZE_LF or state == _END_CR or state == _END_LF:
            if line >= 0:
                self.safe = line
                self.carry = data[line:] if line < n else b""
            else:  # the line began before this read, and goes on after it
                self.safe = at
                self.carry = self.carry + data[at:]
        else:
            self.safe = n
            if self.emit_carry:
                self.carry = b""  # given out with this read
        return MORE

    def _handoff(self, line: i64, at: i64, body: i64) -> i64:
        self.body = body
        self.safe = line if line >= 0 else at
        return HANDOFF
