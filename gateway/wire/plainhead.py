"""Plain heads: the common request and answer read whole without llhttp. PURE.

Most reads on a keep-alive connection hold one whole message of the plainest shape: a
client's request head with no body, an upstream's answer with a small body framed by its
Content-Length. For those, a call of llhttp costs less than the Python around it: a parser
callback per field, the head found again in its bytes, each field sliced twice. These
functions read such a message in one pass over its bytes and return what the callbacks
would have gathered, or None for anything else, which then goes to llhttp as before.

What they accept is a strict subset of what llhttp accepts, read the same way (the tests
hold them to that, field by field, against llhttp on every shape they refuse and on
mutations of those they take):

- exactly one message, ending at the end of the read (no partial head, nothing after it);
  or an answer's head with a chunked body, all of the head in the read, the body begun or
  not (``chunked`` reads it);
- HTTP/1.1; a request's method one of ``METHODS`` and its target in origin form, printable
  ASCII; an answer's status 200 to 599 but 204 and 304, with a phrase;
- each field a token, a colon, then printable ASCII or HTAB up to CRLF (leading spaces
  and tabs are not part of the value, trailing ones are, as llhttp reports them);
- none of the fields that change framing or the connection's fate beyond keep-alive:
  no Transfer-Encoding, Upgrade, Proxy-Connection or ``Sec-WebSocket-Key``, but an answer's
  one ``Transfer-Encoding: chunked``; a request without Content-Length, an answer with
  exactly one, of digits only, or none with ``chunked``; Connection only as
  ``keep-alive`` or ``close``, once;
- the limits the callbacks enforce (``max_field`` bytes for the request target and for a
  field's name and value, fewer than ``MAX_FIELDS`` fields), so that whatever would be
  refused is left to the path that refuses it.
"""

from __future__ import annotations

from typing import Final

from mypy_extensions import i64

from .headers import Fields

COMPILED: Final = not __file__.endswith(".py")
"""Whether this module runs compiled with mypyc (``native.py``). Only then do the callers
read plain heads here: interpreted, a loop over each byte costs more than llhttp and its
callbacks (bench/RESULTS.md `code-figures`)."""

MAX_FIELDS: Final = 128
"""Header fields a head may hold (``http1.MAX_HEADERS`` is this); one with more goes to
llhttp, which refuses it."""

METHODS: Final = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH")
"""The methods read here."""


def _token(c: i64) -> bool:
    """Whether ``c`` is a byte of a field name (RFC 9110 ``tchar``).

    Comparisons, not a table: a bytes table indexed is a call a byte, compiled."""
    if 97 <= c <= 122 or 65 <= c <= 90 or 48 <= c <= 57 or c == 45:  # letters, digits, -
        return True
    return (
        c == 95  # _
        or c == 46  # .
        or c == 33  # !
        or 35 <= c <= 39  # # $ % & '
        or c == 42  # *
        or c == 43  # +
        or c == 94  # ^
        or c == 96  # `
        or c == 124  # |
        or c == 126  # ~
    )


_CR: Final = 13
_LF: Final = 10
_SP: Final = 32
_HT: Final = 9
_COLON: Final = 58
_SLASH: Final = 47

# What a field is to these functions, by lower-cased name (``_kind``).
# (Final literals: constants of the C code compiled, where others are looked up by name.)
_PLAIN: Final = 0
_DROPPED: Final = 1
"""Hop-by-hop: dropped from an answer and from a request."""
_HOST: Final = 2
_CONNECTION: Final = 3
_REQUEST_ID: Final = 4
_CONTENT_LENGTH: Final = 5
_REFUSED: Final = 6
_EXPECT: Final = 7
_FORWARDED: Final = 8
"""X-Forwarded-For, -Host, -Proto: rewritten in a request, passed on in an answer."""
_AUTHORIZATION: Final = 9
"""Noted in a request (a service's bearer token: ``proxy.guard``), passed on as it is."""
_TRANSFER_ENCODING: Final = 10
"""Refused in a request; in an answer, read if it is ``chunked`` alone (``answer``)."""
_TRACEPARENT: Final = 11
_TRACESTATE: Final = 12
"""W3C Trace Context: read and left out of a request's lines when it is traced (``request``'s
``trace``, ``tracing``), else passed on as they are; passed on in an answer."""

TWICE: Final = b"\r"
"""What ``request`` gives as the Authorization value of a head that holds the field more
than once: never a value (a value holds no CR)."""


def _kind(data: bytes, start: i64, end: i64) -> int:
    """What the field named ``data[start:end]`` is: one read or noted here, one dropped or rewritten
    (``headers.RESPONSE_DROPPED``, ``headers.upstream_request``), one that sends the head to
    llhttp, or plain.

    By length first, then compared with literals (constants, compiled)."""
    n: i64 = end - start
    if n == 4:
        return _HOST if _is(data, start, b"host") else _PLAIN
    if n == 10:
        if _is(data, start, b"connection"):
            return _CONNECTION
        if _is(data, start, b"tracestate"):
            return _TRACESTATE
        return _DROPPED if _is(data, start, b"keep-alive") else _PLAIN
    if n == 11:
        return _TRACEPARENT if _is(data, start, b"traceparent") else _PLAIN
    if n == 14:
        return _CONTENT_LENGTH if _is(data, start, b"content-length") else _PLAIN
    if n == 12:
        return _REQUEST_ID if _is(data, start, b"x-request-id") else _PLAIN
    if n == 13:
        return _AUTHORIZATION if _is(data, start, b"authorization") else _PLAIN
    if n == 17:
        if _is(data, start, b"transfer-encoding"):
            return _TRANSFER_ENCODING
        if _is(data, start, b"sec-websocket-key"):
            return _REFUSED
        return _FORWARDED if _is(data, start, b"x-forwarded-proto") else _PLAIN
    if n == 15:
        return _FORWARDED if _is(data, start, b"x-forwarded-for") else _PLAIN
    if n == 16:
        if _is(data, start, b"proxy-connection"):
            return _REFUSED
        return _FORWARDED if _is(data, start, b"x-forwarded-host") else _PLAIN
    if n == 7:
        if _is(data, start, b"upgrade"):
            return _REFUSED
        return _DROPPED if _is(data, start, b"trailer") else _PLAIN
    if n == 6:
        return _EXPECT if _is(data, start, b"expect") else _PLAIN
    if n == 2:
        return _DROPPED if _is(data, start, b"te") else _PLAIN
    if n == 18:
        return _DROPPED if _is(data, start, b"proxy-authenticate") else _PLAIN
    if n == 19:
        return _DROPPED if _is(data, start, b"proxy-authorization") else _PLAIN
    return _PLAIN


PlainRequest = tuple[
    str,
    bytes,
    bytes,
    "bytes | None",
    bytes,
    "bytes | None",
    bool,
    bool,
    "bytes | None",
    int,
    "bytes | None",
    "bytes | None",
]
"""A request head read here: method, target, its field lines (``fields`` makes the list of
them), those of its lines that go upstream as they are (``headers.plain_upstream_request``;
None unless every field is spelled ``name: value``, with one space, as they go upstream),
Host (empty if none), X-Request-Id (the last one, or None), whether the connection is kept
alive after it, whether it holds an X-Forwarded-* field, the value of its Authorization
field (None if none, ``TWICE`` if more than one; trailing spaces and tabs kept, as llhttp
reports them), where that field's line begins in the lines that go upstream (-1 if
there are none), and, when read with ``trace``, its traceparent (``TWICE`` if more than one)
and its tracestate (several joined with ``,``), None if none."""

PlainAnswer = tuple[int, bytes, bytes, int, Fields, bool, int]
"""An answer read here: status, phrase, the block of its end-to-end fields (as
``headers.response_fields`` keeps them), Content-Length (-1: ``Transfer-Encoding: chunked``),
its hop-by-hop fields (``NO_HOP``), whether the connection is kept alive, and where the body
begins."""

NO_HOP: Final[Fields] = []
"""The hop-by-hop fields of every plain answer: none to pass on or to act on. A plain
answer's only Connection field says keep-alive or close (anything else is not plain), which
names no field (``headers.names_fields``), and a plain answer is no 101: so the field is
read (``keep_alive``) and not kept. Shared: nothing adds to it."""
_OK: Final = b"OK"


def _is(data: bytes, start: i64, name: bytes) -> bool:
    """Whether ``data`` holds ``name`` (lower case, letters and ``-``) at ``start``, in any
    case (the caller checked the length).

    Each byte is compared ORed with 0x20, which lowers a letter; of the token bytes only
    letters become a letter or ``-`` that way."""
    k: i64 = 0
    n: i64 = len(name)
    while k < n and (data[start + k] | 0x20) == name[k]:
        k += 1
    return k == n


def _at(data: bytes, start: i64, text: bytes) -> bool:
    """Whether ``data`` holds ``text`` at ``start`` (a loop: ``startswith`` is a call)."""
    n: i64 = len(text)
    if start + n > len(data):
        return False
    k: i64 = 0
    while k < n and data[start + k] == text[k]:
        k += 1
    return k == n


def _connection(value: bytes) -> int:
    """1 for ``keep-alive``, 0 for ``close`` (in any case), -1 for anything else."""
    if value == b"keep-alive":
        return 1
    if value == b"close":
        return 0
    lower = value.lower()
    if lower == b"keep-alive":
        return 1
    if lower == b"close":
        return 0
    return -1


def _method(data: bytes) -> str:
    """The method ``data`` begins with, and a space, if it is one of ``METHODS``; else ""."""
    c = data[0]
    if c == 71:
        return "GET" if _at(data, 1, b"ET ") else ""
    if c == 80:
        if _at(data, 1, b"OST "):
            return "POST"
        if _at(data, 1, b"UT "):
            return "PUT"
        return "PATCH" if _at(data, 1, b"ATCH ") else ""
    if c == 72:
        return "HEAD" if _at(data, 1, b"EAD ") else ""
    if c == 68:
        return "DELETE" if _at(data, 1, b"ELETE ") else ""
    if c == 79:
        return "OPTIONS" if _at(data, 1, b"PTIONS ") else ""
    return ""


def _field_end(data: bytes, i: i64, n: i64) -> i64:
    """Where the field value from ``i`` ends (its CR, followed by LF), or -1 if a byte up to
    there is not read here or ``data`` ends first (it ends at ``n``)."""
    while i < n:
        c: i64 = data[i]
        if (c < 32 or c > 126) and c != 9:
            break  # not HTAB, SP or printable ASCII (llhttp takes obs-text too: not here)
        i += 1
    if i + 1 >= n or data[i] != _CR or data[i + 1] != _LF:
        return -1
    return i


def _name_end(data: bytes, i: i64, n: i64) -> i64:
    """Where the field name from ``i`` ends: its colon; -1 if there is none after a token."""
    start = i
    while i < n:
        c: i64 = data[i]
        if not 97 <= c | 0x20 <= 122 and not _token(c):  # letters first, without a call
            break
        i += 1
    if i == start or i >= n or data[i] != _COLON:
        return -1
    return i


def _skip_space(data: bytes, i: i64, n: i64) -> i64:
    while i < n and (data[i] == _SP or data[i] == _HT):
        i += 1
    return i


def request(data: bytes, max_field: int, trace: bool = False) -> PlainRequest | None:
    """The request head that is the whole of ``data``, if it is plain; else None.

    ``trace``: its traceparent and tracestate fields are read, and left out of the lines that
    go upstream as they are (the gateway writes its own: ``tracing``)."""
    n: i64 = len(data)
    if n < 18 or not _at(data, n - 4, b"\r\n\r\n"):
        return None
    method = _method(data)
    if not method:
        return None
    limit: i64 = max_field
    i: i64 = len(method) + 1
    if data[i] != _SLASH:
        return None
    start: i64 = i
    while 33 <= data[i] <= 126:  # stops at the end's CR at the latest
        i += 1
    if i - start > limit or not _at(data, i, b" HTTP/1.1\r\n"):
        return None
    target = data[start:i]
    i += 11
    block_at: i64 = i
    run: i64 = i  # the start of the run of kept lines before the current line
    cut_at: i64 = -1  # the first run a left-out line ended: data[cut_at:cut_end] (``_kept``)
    cut_end: i64 = -1
    more: list[bytes] | None = None  # the runs cut off after it
    count: i64 = 0
    host = b""
    has_host = False  # an empty Host is one too
    request_id: bytes | None = None
    keep_alive = True
    connection = False
    forwarded = False
    spelled = True  # every field spelled "name: value", as ``upstream_request`` writes it
    authorization: bytes | None = None
    authorization_at: i64 = -1
    traceparent: bytes | None = None
    tracestate: bytes | None = None
    kept_length: i64 = 0  # of the runs cut off so far, each with the CRLF that joins them
    while i < n and data[i] != _CR:
        # A field line: its name up to the colon, its value, its CR (``_field_end``).
        start = i
        colon = _name_end(data, i, n)
        count += 1
        if colon < 0 or count > MAX_FIELDS:
            return None
        value_at = _skip_space(data, colon + 1, n)
        end = _field_end(data, value_at, n)
        if end < 0 or colon - i + end - value_at > limit:
            return None
        i = end + 2
        if value_at != colon + 2 or data[colon + 1] != _SP:
            spelled = False
        kind = _kind(data, start, colon)
        if kind == _PLAIN:
            continue  # goes upstream as it is: part of the run
        if kind == _AUTHORIZATION:  # goes upstream as it is too, unless a guard strips it
            if authorization is None:
                authorization = data[value_at:end]
                authorization_at = kept_length + start - run
            else:
                authorization = TWICE
            continue
        if kind == _HOST:
            if has_host:
                return None
            has_host = True
            host = data[value_at:end]
            continue
        if kind == _REQUEST_ID:
            request_id = data[value_at:end]
        elif kind == _TRACEPARENT or kind == _TRACESTATE:
            if not trace:
                continue  # passed on as it is
            if kind == _TRACEPARENT:
                traceparent = data[value_at:end] if traceparent is None else TWICE
            elif tracestate is None:
                tracestate = data[value_at:end]
            else:
                tracestate = tracestate + b"," + data[value_at:end]
        elif kind == _CONNECTION:
            alive = _connection(data[value_at:end])
            if connection or alive < 0:
                return None
            connection = True
            keep_alive = alive == 1
        elif kind == _FORWARDED:
            forwarded = True
        elif kind == _REFUSED or kind == _CONTENT_LENGTH or kind == _TRANSFER_ENCODING:
            return None  # framing, an upgrade: llhttp's
        if start > run:
            cut_at, cut_end, more = _cut(data, run, start - 2, cut_at, cut_end, more)
            kept_length += start - run
        run = i
    if i + 2 != n:
        return None  # a blank line before the end: more follows the head
    block_end = i - 2 if i > block_at else i
    block = data[block_at:block_end]
    # Unless a field is spelled otherwise: then ``upstream_request`` writes them all.
    if not spelled:
        lines = None
    elif run == block_at:  # no line left out
        lines = block
    else:
        lines = _kept(data, block_end, run, cut_at, cut_end, more)
    return (
        method,
        target,
        block,
        lines,
        host,
        request_id,
        keep_alive,
        forwarded,
        authorization,
        authorization_at if spelled else -1,
        traceparent,
        tracestate,
    )


def fields(block: bytes) -> Fields:
    """The fields of a block of field lines ``request`` read: name and value as llhttp
    reports them (no space or tab before the value)."""
    out: Fields = []
    if block:
        for line in block.split(b"\r\n"):
            name, _, value = line.partition(b":")
            out.append((name, value.lstrip(b" \t")))
    return out


def answer(data: bytes, max_field: int) -> PlainAnswer | None:
    """The answer that is the whole of ``data``, head and body, if it is plain; or the head
    of a plain answer with a chunked body (its Content-Length -1), which ``chunked`` reads
    from where the body begins; else None.

    Not for the answer to a HEAD request (its Content-Length describes no body here)."""
    n: i64 = len(data)
    if n < 17 or not _at(data, 0, b"HTTP/1.1 "):
        return None
    d0, d1, d2 = data[9] - 48, data[10] - 48, data[11] - 48
    if not (0 <= d0 <= 9 and 0 <= d1 <= 9 and 0 <= d2 <= 9) or data[12] != _SP:
        return None
    status = d0 * 100 + d1 * 10 + d2
    if status < 200 or status > 599 or status == 204 or status == 304:
        return None
    limit: i64 = max_field
    i = _field_end(data, 13, n)  # the phrase is read as a value is
    if i < 0:
        return None
    phrase = _OK if i == 15 and data[13] == 79 and data[14] == 75 else data[13:i]
    i += 2
    block_at: i64 = i
    run: i64 = i  # the start of the run of kept lines before the current line
    cut_at: i64 = -1  # as in ``request``
    cut_end: i64 = -1
    more: list[bytes] | None = None
    count: i64 = 0
    content_length: i64 = -1
    chunked = False
    keep_alive = True
    connection = False
    while i < n and data[i] != _CR:
        start = i  # a field line, read as ``request`` reads one
        colon = _name_end(data, i, n)
        count += 1
        if colon < 0 or count > MAX_FIELDS:
            return None
        value_at = _skip_space(data, colon + 1, n)
        end = _field_end(data, value_at, n)
        if end < 0 or colon - i + end - value_at > limit:
            return None
        i = end + 2
        kind = _kind(data, start, colon)
        if (
            kind == _PLAIN
            or kind == _HOST
            or kind == _EXPECT
            or kind == _FORWARDED
            or kind == _AUTHORIZATION
            or kind == _TRACEPARENT
            or kind == _TRACESTATE
        ):
            continue  # kept: part of the run
        if kind == _REFUSED:
            return None
        if kind == _TRANSFER_ENCODING:
            if chunked or end - value_at != 7 or not _is(data, value_at, b"chunked"):
                return None  # twice, or another coding: llhttp's
            chunked = True
        elif kind == _CONTENT_LENGTH:
            if content_length >= 0 or value_at == end or end - value_at > 15:
                return None
            content_length = 0
            k = value_at
            while k < end:
                c: i64 = data[k] - 48
                if c < 0 or c > 9:
                    return None
                content_length = content_length * 10 + c
                k += 1
        elif kind == _CONNECTION:
            if end - value_at == 10 and _at(data, value_at, b"keep-alive"):
                alive = 1  # the usual spelling, read in place
            else:
                alive = _connection(data[value_at:end])
            if connection or alive < 0:
                return None
            connection = True
            keep_alive = alive == 1
        if start > run:
            cut_at, cut_end, more = _cut(data, run, start - 2, cut_at, cut_end, more)
        run = i
    if i + 1 >= n or data[i + 1] != _LF:
        return None  # not a blank line
    if chunked:
        if content_length >= 0:
            return None  # both: llhttp refuses it
    elif content_length != n - i - 2:
        return None  # not the whole body
    block_end = i - 2 if i > block_at else i
    if run == block_at:  # no line left out
        block = data[block_at:block_end]
    else:
        block = _kept(data, block_end, run, cut_at, cut_end, more)
    return status, phrase, block, content_length, NO_HOP, keep_alive, i + 2


def _cut(
    data: bytes, run: i64, end: i64, cut_at: i64, cut_end: i64, more: list[bytes] | None
) -> tuple[i64, i64, list[bytes] | None]:
    """The run of kept lines ``data[run:end]``, cut off by a line left out, noted: as the
    first run's bounds (``cut_at``, ``cut_end``) if it is the first, else in ``more``."""
    if cut_at < 0:
        return run, end, more
    if more is None:
        return cut_at, cut_end, [data[run:end]]
    more.append(data[run:end])
    return cut_at, cut_end, more


def _kept(
    data: bytes, block_end: int, run: int, cut_at: int, cut_end: int, more: list[bytes] | None
) -> bytes:
    """The lines kept of a block ending at ``block_end`` that left lines out: the first run
    cut off by a left-out line, ``data[cut_at:cut_end]`` (``cut_at`` -1 if none), the runs
    cut off after it (``more``), and the last run, from ``run`` to the block's end. One run
    is one slice: no list, no join."""
    last = data[run:block_end] if run < block_end else b""
    if cut_at < 0:
        return last
    first = data[cut_at:cut_end]
    if more is None and not last:
        return first
    pieces = [first]
    if more is not None:
        pieces += more
    if last:
        pieces.append(last)
    return b"\r\n".join(pieces)
