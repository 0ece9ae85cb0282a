"""The access log: one line per request, plain or JSON, written off the event loop.

``AccessLog`` is a ``RequestObserver``. ``on_request`` formats the line on the event loop
(after the answer went out) and appends it to a bounded queue; a writer thread takes what
the queue holds every ``GATHER`` seconds while lines come, joins it and writes it. So the
event loop never waits on the disk: when the writer falls behind and the queue is full, the
line is dropped and counted (``dropped``), never waited for.

The writer holds the GIL as little and as seldom as it can, since the event loop waits for
it meanwhile (on the same core, a switch each way): it formats nothing (a thread that
formatted held the GIL for whole batches, half of the gateway's p99 at one connection),
takes the queue's lines in one pass, and makes one ``write`` of a batch to a file; each
write lets go of the GIL and takes it back. Writing each 4 KiB chunk through a text file,
with a flush each, cost the gateway more CPU a request under load than the formatting
(bench/RESULTS.md `code-figures`).

To a pipe (standard output under a container runtime), lines are written in whole-line
chunks of at most ``PIPE_BUF`` (4 KiB) bytes, one ``write`` each: a write that small is
atomic, so the lines of several worker processes sharing the same output never cut into
each other. (To a regular file opened for appending, every write is.)

A line holds: time (the end of the request, UTC), request id, service, revision, upstream,
method, path, status, duration, bytes in and out, retries (and the error, if any); an
HTTP/2 request's says so (``"GET /p HTTP/2"``, ``"protocol": "h2"``), a gRPC request's
gives the status its answer carried (``grpc_status=0``, ``"grpc_status": 0``), and a
request's on a model path ends with its time to first token and output tokens
(``on_model_request``). The path is percent-encoded in plain lines and JSON-escaped in JSON
lines, so a request can never forge a line of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Final, Literal, TypeAlias
from urllib.parse import quote

from ..pool.events import ClientTimeout, RequestRecord, Tokens

log = logging.getLogger(__name__)

Format: TypeAlias = Literal["plain", "json"]
FORMATS: Final[tuple[Format, ...]] = ("plain", "json")
QUEUE_SIZE: Final = 8192
"""Lines held for the writer before new ones are dropped."""
GATHER: Final = 0.02
"""Once a line arrives, the writer waits this long for more before it writes them: one
wake-up of its thread per batch, not one per request (each costs the event loop the GIL)."""
ATOMIC: Final = select.PIPE_BUF
"""The largest write a pipe takes whole: a chunk of lines is at most this many bytes."""


class _Second:
    """The second last stamped, and its text (one ``strftime`` a second)."""

    at = -1
    text = ""


_last: Final = _Second()
_MILLIS: Final = tuple(f".{ms:03d}Z" for ms in range(1000))
"""The end of a stamp, by millisecond. (A format spec in an f-string costs more than the rest
of the line compiled with mypyc, which makes it a ``str.format`` call.)"""
_SMALL_END: Final = 600
_SMALL: Final = tuple(str(n) for n in range(_SMALL_END))
"""Small numbers as text (statuses, counts of retries, revisions, short bodies): looked up,
not made."""
_TENTHS: Final = tuple(f".{n}" for n in range(10))


def _second(at: float) -> str:
    """The stamp of ``at`` to the second (ISO 8601 UTC), made once a second."""
    second = int(at)
    last = _last
    if last.at != second:
        last.text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        last.at = second
    return last.text


def _stamp(at: float) -> str:
    """``at`` as ISO 8601 UTC with milliseconds; the part to the second is cached."""
    return _second(at) + _MILLIS[int((at - int(at)) * 1000)]


def _number(n: int) -> str:
    return _SMALL[n] if 0 <= n < _SMALL_END else str(n)


def fields(at: float, r: RequestRecord) -> dict[str, object]:
    """A record as the JSON line's object (the names the plain line uses too); an HTTP/2
    request's has ``"protocol": "h2"`` last, then a gRPC request's ``grpc_status`` (a
    number) if its answer carried one (HTTP/1.1's are as they were)."""
    line: dict[str, object] = {
        "time": _stamp(at),
        "request_id": r.request_id,
        "service": r.service,
        "revision": r.revision,
        "upstream": r.upstream_id,
        "method": r.method,
        "path": r.path,
        "status": r.status,
        "duration_ms": round(r.duration * 1000, 3),
        "bytes_in": r.bytes_in,
        "bytes_out": r.bytes_out,
        "retries": r.retries,
        "error": r.error,
    }
    if r.http_version == "2":
        line["protocol"] = "h2"
        if r.grpc_status is not None:
            line["grpc_status"] = int(r.grpc_status)
    return line


_encode_json: Final = json.JSONEncoder(separators=(",", ":")).encode
"""``json.dumps(..., separators=...)`` without the new encoder it makes on every call."""


def format_json(at: float, r: RequestRecord) -> str:
    return _encode_json(fields(at, r))


def model_fields(at: float, r: RequestRecord, tokens: Tokens) -> dict[str, object]:
    """A request on a model path's JSON object: ``fields``, then its time to first token
    (``ttft_ms``) and its output tokens (``output_tokens``), null when not known."""
    line = fields(at, r)
    ttft = tokens.ttft
    line["ttft_ms"] = None if ttft is None else round(ttft * 1000, 3)
    line["output_tokens"] = tokens.output
    return line


def model_plain(at: float, r: RequestRecord, tokens: Tokens) -> str:
    """A request on a model path's plain line: ``format_plain``'s, then ``ttft=`` and
    ``output_tokens=`` (``-`` when not known)."""
    ttft, output = tokens.ttft, tokens.output
    if ttft is None:
        first = "-"
    else:
        ms, tenth = _tenths(ttft)
        first = f"{ms}{tenth}ms"
    return _plain(
        at, r, f" ttft={first} output_tokens={'-' if output is None else _number(output)}\n"
    )


_PATH_SAFE: Final = "/:@!$&()*+,;=-._~"
_PLAIN_PATH: Final = re.compile(r"[A-Za-z0-9/:@!$&()*+,;=._~-]*")
"""A path that ``quote`` would leave as it is (most): checked in C instead of quoted."""


_PATHS: Final[dict[str, str]] = {}
"""Paths as a plain line writes them, by path, for the paths that come again and again
(a look-up costs a third of the regular expression's check)."""
PATHS_CACHED: Final = 1024
PATH_CACHED_MAX: Final = 256
"""Paths longer than this are not cached (the cache holds at most 256 KiB of them)."""


def _log_path(path: str) -> str:
    """``path`` percent-encoded where it needs to be, kept in ``_PATHS`` if it is short."""
    written = path if _PLAIN_PATH.fullmatch(path) else quote(path, safe=_PATH_SAFE)
    if len(path) <= PATH_CACHED_MAX:
        if len(_PATHS) >= PATHS_CACHED:
            _PATHS.clear()
        _PATHS[path] = written
    return written


def _tenths(seconds: float) -> tuple[str, str]:
    """``seconds`` in milliseconds to a tenth, as ``"%.1f" % (seconds * 1000)`` writes it, in
    two pieces: the milliseconds and the tenth (``".3"``), which the line puts in place (the
    two made one cost a string a line).

    From the number of tenths, rounded half up: a third of the cost of ``%`` (not a format
    spec either: see ``_MILLIS``). The two can differ only at a tie, where rounding the
    product's exact value half to even may go the other way: a product within 1e-4 of one
    is left to ``%``."""
    tenths = seconds * 10000.0
    if 0.0 <= tenths < 1e15:  # not negative, not so large a fraction is lost, not NaN
        whole = int(tenths)
        if not 0.4999 < tenths - whole < 0.5001:
            n = int(tenths + 0.5)
            return _number(n // 10), _TENTHS[n % 10]
    return "%.1f" % (seconds * 1000), ""


def format_plain(at: float, r: RequestRecord) -> str:
    return _plain(at, r, "")


def _plain(at: float, r: RequestRecord, end: str) -> str:
    """The plain line of ``r`` at ``at``, then ``end``: one string made of its pieces (each
    piece looked up where it can be: a small number, the stamp's second and millisecond)."""
    revision = r.revision
    ms, tenth = _tenths(r.duration)
    path = _PATHS.get(r.path)
    if path is None:
        path = _log_path(r.path)
    if r.http_version == "2":
        path += _PLAIN_HTTP2
        if r.grpc_status is not None:
            end = _PLAIN_GRPC + r.grpc_status + end
    return (
        f"{_second(at)}{_MILLIS[int((at - int(at)) * 1000)]} {r.request_id} "
        f"{r.service or '-'} {'-' if revision is None else _number(revision)} "
        f'{r.upstream_id or "-"} "{r.method} {path}" {_number(r.status)} {ms}{tenth}ms '
        f"in={_number(r.bytes_in)} out={_number(r.bytes_out)} retries={_number(r.retries)}"
        f" error={r.error or '-'}{end}"
    )


_PLAIN_HTTP2: Final = " HTTP/2"
"""After the path of an HTTP/2 request (as nginx's ``$request`` has it; HTTP/1.1's are
written without)."""
_PLAIN_GRPC: Final = " grpc_status="
"""After ``error=`` of a gRPC request whose answer carried a status (its code)."""


FORMATTERS: Final[dict[str, Callable[[float, RequestRecord], str]]] = {
    "plain": format_plain,
    "json": format_json,
}


def whole_lines(lines: Iterable[str], limit: int = ATOMIC) -> Iterator[str]:
    """``lines`` joined into chunks of at most ``limit`` bytes, each made of whole lines.

    A line longer than ``limit`` is a chunk of its own.
    """
    chunk: list[str] = []
    size = 0
    for line in lines:
        n = len(line) if line.isascii() else len(line.encode())
        if chunk and size + n > limit:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += n
    if chunk:
        yield "".join(chunk)


class AccessLog:
    """Writes request lines to ``path`` (appended) or to ``stream`` (default: stdout).

    ``start()`` starts the writer thread; ``await stop()`` writes what is queued and ends it.
    Lines of requests before ``start`` wait in the queue (up to ``queue_size``).
    """

    def __init__(
        self,
        format: str = "plain",
        path: str | None = None,
        *,
        stream: IO[str] | None = None,
        queue_size: int = QUEUE_SIZE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if format not in FORMATTERS:
            raise ValueError(f"access log format must be one of {FORMATS}, not {format!r}")
        self.format = format
        self.path = path
        self._format = FORMATTERS[format]
        self._plain = self._format is format_plain
        """Plain lines are made by a direct call, with their newline (``_plain``)."""
        self._stream = stream
        self._clock = clock
        self._queue: deque[str] = deque()
        """Lines for the writer: appended on the event loop, taken by the writer (each a
        single C call under the GIL: no lock)."""
        self._limit = queue_size
        self._wake = threading.Event()
        """Set when a line is appended to the empty queue, and to stop."""
        self._stopping = False
        self._failing = False
        """The last write failed (failures are logged once per streak)."""
        self._writer_thread: threading.Thread | None = None
        self.written = 0
        """Lines written (by the writer thread)."""
        self.dropped = 0
        """Records dropped because the queue was full (counted on the event loop)."""
        self.lost = 0
        """Lines lost to a write error (counted by the writer thread)."""

    # -- the hot path -------------------------------------------------------------------------

    def on_request(self, record: RequestRecord) -> None:
        queue = self._queue
        if len(queue) < self._limit:
            if not queue:
                self._wake.set()  # once a batch: the writer empties the queue
            if self._plain:
                queue.append(_plain(self._clock(), record, "\n"))
            else:
                queue.append(self._format(self._clock(), record) + "\n")
        else:
            self.dropped += 1

    def on_client_timeout(self, protocol: str, timeout: ClientTimeout) -> None:
        """Nothing: a line is a request's (a slow client's cut-off request has its own)."""

    def on_model_request(self, record: RequestRecord, tokens: Tokens) -> None:
        queue = self._queue
        if len(queue) < self._limit:
            if not queue:
                self._wake.set()
            if self._plain:
                queue.append(model_plain(self._clock(), record, tokens))
            else:
                queue.append(_encode_json(model_fields(self._clock(), record, tokens)) + "\n")
        else:
            self.dropped += 1

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._writer_thread is not None:
            return
        out, close = self._stream, False
        if out is None and self.path:
            # Opened here, once, before traffic: the only blocking open of the log.
            out, close = open(self.path, "a", encoding="utf-8"), True
        elif out is None:
            out = sys.stdout
        self._writer_thread = threading.Thread(
            target=self._write_loop, args=(out, close), name="access-log", daemon=True
        )
        self._writer_thread.start()

    async def stop(self, grace: float = 5.0) -> None:
        """Write what is queued (for up to ``grace`` seconds) and end the writer."""
        thread, self._writer_thread = self._writer_thread, None
        if thread is not None:
            # In a thread: waiting for the writer must not block the event loop, even here.
            await asyncio.to_thread(self._finish, thread, grace)

    def _finish(self, thread: threading.Thread, timeout: float) -> None:
        self._stopping = True
        self._wake.set()
        thread.join(timeout)
        if thread.is_alive():
            log.warning(
                "access log: writer did not finish within %gs; %d lines not written",
                timeout,
                len(self._queue),
            )

    # -- the writer thread --------------------------------------------------------------------

    def _write_loop(self, out: IO[str], close: bool) -> None:
        write = _writer(out)
        try:
            while True:
                self._wake.wait()
                if not self._stopping:
                    time.sleep(GATHER)
                self._wake.clear()  # before taking the lines: a line after it sets it again
                self._write_batch(write)
                if self._stopping:
                    self._write_batch(write)  # what came meanwhile
                    return
        finally:
            if close:
                out.close()

    def _write_batch(self, write: Callable[[list[str]], None]) -> None:
        queue = self._queue
        lines: list[str] = []
        while queue:
            lines.append(queue.popleft())
        if not lines:
            return
        try:
            write(lines)
            self.written += len(lines)
            self._failing = False
        except Exception:
            # Logged once per streak of failures: a full disk must not flood the log.
            if not self._failing:
                log.exception("access log: write failed; lines are being lost")
            self._failing = True
            self.lost += len(lines)

    def __repr__(self) -> str:
        return (
            f"<AccessLog {self.format} to {self.path or 'stdout'} queued={len(self._queue)} "
            f"written={self.written} dropped={self.dropped} lost={self.lost}>"
        )


def _writer(out: IO[str]) -> Callable[[list[str]], None]:
    """How a batch of lines is written to ``out``: to a regular file, in one ``write`` of its
    descriptor (appending: atomic); else in whole-line chunks of at most ``ATOMIC`` bytes
    through the stream (a pipe: each chunk atomic), flushed."""
    try:
        fd = out.fileno()
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is an OSError
        regular = False
    if regular:
        out.flush()

        def to_file(lines: list[str]) -> None:
            data = "".join(lines).encode()
            done = os.write(fd, data)
            while done < len(data):  # a write cut short (a signal, a full disk)
                done += os.write(fd, data[done:])

        return to_file

    def to_stream(lines: list[str]) -> None:
        for chunk in whole_lines(lines):
            out.write(chunk)
            out.flush()

    return to_stream
