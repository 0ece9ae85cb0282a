"""The access log: its lines, and that the event loop never waits for the writer."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import threading
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from gateway.observability import accesslog
from gateway.observability.accesslog import (
    AccessLog,
    _tenths,
    format_json,
    format_plain,
    model_fields,
    model_plain,
    whole_lines,
)
from gateway.observability.scrape import AccessLogCollector
from gateway.pool.events import NO_TOKENS, RequestRecord, Tokens

AT = 1_700_000_000.25  # 2023-11-14T22:13:20.250Z


def record(**fields: object) -> RequestRecord:
    base: dict = {
        "request_id": "abc123",
        "service": "web",
        "revision": 2,
        "upstream_id": "web-2-aa",
        "method": "GET",
        "path": '/a b/"x"\n',
        "status": 200,
        "duration": 0.0123,
        "ttfb": 0.01,
        "bytes_in": 5,
        "bytes_out": 42,
        "retries": 1,
        "retry_reasons": ("connect",),
    }
    return RequestRecord(**{**base, **fields})


def test_plain_line_has_every_field_and_cannot_be_forged() -> None:
    line = format_plain(AT, record())
    assert line == (
        '2023-11-14T22:13:20.250Z abc123 web 2 web-2-aa "GET /a%20b/%22x%22%0A" 200 12.3ms '
        "in=5 out=42 retries=1 error=-"
    )
    assert "\n" not in line


def test_an_http2_requests_line_says_so_and_http1_lines_are_as_they_were() -> None:
    line = format_plain(AT, record(path="/x", http_version="2"))
    assert '"GET /x HTTP/2" 200 ' in line
    assert '"GET /x" 200 ' in format_plain(AT, record(path="/x", http_version="1.0"))
    assert json.loads(format_json(AT, record(http_version="2")))["protocol"] == "h2"
    assert "protocol" not in json.loads(format_json(AT, record()))


def test_a_grpc_requests_line_gives_its_status() -> None:
    grpc = record(path="/test.Echo/Unary", method="POST", http_version="2", grpc_status="5")
    assert format_plain(AT, grpc).endswith(" error=- grpc_status=5")
    line = json.loads(format_json(AT, grpc))
    assert (line["protocol"], line["grpc_status"]) == ("h2", 5)
    # Without a status (not gRPC, or cut off before one), the line is an HTTP/2 one as before.
    h2 = record(http_version="2")
    assert format_plain(AT, h2).endswith(" error=-")
    assert "grpc_status" not in json.loads(format_json(AT, h2))


def test_paths_are_written_the_same_from_the_cache_which_stays_bounded() -> None:
    paths = ['/a b/"x"\n', "/plain/path?q=1", "/caf\u00e9", "/" + "p" * 300]
    first = [format_plain(AT, record(path=p)) for p in paths]
    assert [format_plain(AT, record(path=p)) for p in paths] == first  # cached now
    assert '"GET /a%20b/%22x%22%0A"' in first[0]
    assert '"GET /caf%C3%A9"' in first[2]
    assert "/" + "p" * 300 not in accesslog._PATHS  # too long to keep
    for i in range(3 * accesslog.PATHS_CACHED):
        line = format_plain(AT, record(path=f"/n/{i} x"))
        assert f'"GET /n/{i}%20x"' in line
        assert len(accesslog._PATHS) <= accesslog.PATHS_CACHED


def test_plain_line_of_a_gateway_error() -> None:
    line = format_plain(
        AT, record(service="", revision=None, upstream_id=None, status=404, error="no_route")
    )
    assert ' - - - "GET ' in line
    assert line.endswith("error=no_route")


def test_statuses_and_counts_are_written_as_str_writes_them() -> None:
    """Small numbers come from a table, the rest are made: the same text either way."""
    for n in [*range(-2, 1100), 10**12]:
        line = format_plain(AT, record(status=n, bytes_in=n, bytes_out=n, retries=n))
        assert f" {n} 12.3ms in={n} out={n} retries={n} " in line, n


@given(
    ats=st.lists(st.floats(min_value=0, max_value=4_000_000_000), min_size=1, max_size=20),
    duration=st.floats(min_value=0, max_value=10_000),
)
def test_times_are_stamped_and_durations_rounded_as_their_format_specs_would(ats, duration):
    """The cached second and the millisecond table give what ``strftime`` and ``:03d`` do,
    in any order of times (a new second, an old one again); the duration what ``:.1f`` does."""
    for at in ats:
        second = int(at)
        expected = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        expected += f".{int((at - second) * 1000):03d}Z"
        line = format_plain(at, record(duration=duration))
        assert line.startswith(expected + " "), (at, line)
        assert f" {duration * 1000:.1f}ms " in line


@pytest.mark.parametrize(
    "seconds",
    [0.0, 0.00035, 0.0012345, 0.99995, 1.23456789, 86_400.00005, 1e11, 1e12, -0.5],
)
def test_a_duration_is_written_as_the_percent_format_writes_it(seconds: float) -> None:
    assert "".join(_tenths(seconds)) == "%.1f" % (seconds * 1000)


def test_durations_at_and_near_ties_are_written_as_the_percent_format_writes_them() -> None:
    # k / 20,000 s is a tie in tenths of a millisecond for every odd k (or a float near one).
    for seconds in [k / 20_000 for k in range(4000)] + [float("inf"), float("nan")]:
        assert "".join(_tenths(seconds)) == "%.1f" % (seconds * 1000), seconds


def test_json_line() -> None:
    line = format_json(AT, record())
    assert "\n" not in line
    assert line.startswith('{"time":"2023-11-14T22:13:20.250Z","request_id":"abc123",')  # compact
    assert json.loads(line) == {
        "time": "2023-11-14T22:13:20.250Z",
        "request_id": "abc123",
        "service": "web",
        "revision": 2,
        "upstream": "web-2-aa",
        "method": "GET",
        "path": '/a b/"x"\n',
        "status": 200,
        "duration_ms": 12.3,
        "bytes_in": 5,
        "bytes_out": 42,
        "retries": 1,
        "error": None,
    }


def test_a_model_paths_lines_end_with_its_first_token_and_output_tokens() -> None:
    r = record(path="/v1/chat/completions")
    tokens = Tokens(0.08765, 42, ((1,), 0.01))
    plain = format_plain(AT, r)
    assert model_plain(AT, r, tokens) == plain + " ttft=87.7ms output_tokens=42\n"
    assert model_plain(AT, r, NO_TOKENS) == plain + " ttft=- output_tokens=-\n"
    assert model_fields(AT, r, tokens) == {
        **json.loads(format_json(AT, r)),
        "ttft_ms": 87.65,
        "output_tokens": 42,
    }
    assert model_fields(AT, r, Tokens(output=7)) == {
        **json.loads(format_json(AT, r)),
        "ttft_ms": None,
        "output_tokens": 7,
    }


async def test_the_model_lines_are_queued_as_the_others_are() -> None:
    out = io.StringIO()
    log = AccessLog("json", stream=out, clock=lambda: AT)
    log.on_model_request(record(), Tokens(0.5, 3))
    log.on_request(record())
    log.start()
    await log.stop()
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (first["ttft_ms"], first["output_tokens"]) == (500.0, 3)
    assert "ttft_ms" not in second


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="plain"):
        AccessLog("xml")


@pytest.mark.parametrize("fmt", ["plain", "json"])
async def test_lines_reach_the_file_in_order(tmp_path, fmt) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(fmt, str(path), clock=lambda: AT)
    log.start()
    for i in range(100):
        log.on_request(record(request_id=f"r{i}"))
    await log.stop()
    lines = path.read_text().splitlines()
    assert len(lines) == 100
    assert log.written == 100
    if fmt == "json":
        assert [json.loads(line)["request_id"] for line in lines] == [f"r{i}" for i in range(100)]
    else:
        assert [line.split()[1] for line in lines] == [f"r{i}" for i in range(100)]


async def test_a_batch_goes_to_a_file_in_one_write(tmp_path, monkeypatch) -> None:
    """Each write lets go of the GIL and takes it back, a switch each way with the event
    loop: the lines of a batch go to a regular file in one."""
    writes: list[int] = []
    real_write = os.write

    def counting_write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counting_write)
    path = tmp_path / "access.log"
    log = AccessLog("plain", str(path), clock=lambda: AT)
    log.start()
    for i in range(500):  # about 60 KB: fifteen chunks of PIPE_BUF
        log.on_request(record(request_id=f"r{i}"))
    await log.stop()
    assert len(path.read_text().splitlines()) == 500
    assert writes == [path.stat().st_size]


async def test_lines_are_formatted_by_the_caller_not_the_writer_thread(monkeypatch) -> None:
    # A writer thread that formats holds the GIL for a whole batch while the event loop
    # waits to take a request: the line is made where on_request is called.
    formatted_in: list[threading.Thread] = []

    def spy(at: float, r: RequestRecord) -> str:
        formatted_in.append(threading.current_thread())
        return format_plain(at, r)

    monkeypatch.setitem(accesslog.FORMATTERS, "plain", spy)
    stream = io.StringIO()
    log = AccessLog("plain", stream=stream, clock=lambda: AT)
    log.start()
    for i in range(3):
        log.on_request(record(request_id=f"r{i}"))
    await log.stop()
    assert formatted_in == [threading.current_thread()] * 3
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["r0", "r1", "r2"]


class BlockedStream(io.StringIO):
    """A stream whose writes wait until the test lets them go: a disk that hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, s: str) -> int:
        self.entered.set()
        assert self.release.wait(10)
        return super().write(s)


async def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    stream = BlockedStream()
    log = AccessLog("plain", stream=stream, queue_size=3)
    registry = CollectorRegistry()
    registry.register(AccessLogCollector(log))
    log.start()
    log.on_request(record(request_id="first"))
    # The writer has taken the first record and hangs in write(); the queue fills behind it.
    assert stream.entered.wait(10)
    for i in range(10):
        log.on_request(record(request_id=f"r{i}"))  # returns at once: never waits
    assert log.dropped == 7
    assert registry.get_sample_value("gateway_access_log_dropped_total") == 7
    stream.release.set()
    await log.stop()
    assert log.written == 4
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == [
        "first",
        "r0",
        "r1",
        "r2",
    ]


class BrokenStream(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(28, "No space left on device")


async def test_a_write_error_loses_lines_but_not_the_writer(caplog) -> None:
    log = AccessLog("json", stream=BrokenStream())
    log.start()
    log.on_request(record())
    await log.stop()
    assert (log.written, log.lost) == (0, 1)
    assert "write failed" in caplog.text


# -- several processes, one output --------------------------------------------------------------


def test_whole_lines_makes_chunks_of_whole_lines_within_the_limit() -> None:
    lines = [f"{'x' * (i % 90)}é{i}\n" for i in range(500)]
    chunks = list(whole_lines(lines, limit=512))
    assert "".join(chunks) == "".join(lines)
    assert all(len(c.encode()) <= 512 and c.endswith("\n") for c in chunks)
    long = "y" * 2000 + "\n"
    assert list(whole_lines(["a\n", long, "b\n"], limit=512)) == ["a\n", long, "b\n"]


WRITER = """
import asyncio, sys, time
from gateway.observability.accesslog import AccessLog
from gateway.pool.events import NO_TOKENS, RequestRecord, Tokens

async def main(tag, start):
    log = AccessLog("json")
    log.start()
    await asyncio.sleep(max(0.0, start - time.time()))  # both writers at once
    for i in range(8000):
        log.on_request(RequestRecord(f"{tag}-{i}", "web", 1, "u", "GET", "/" + "p" * (i % 500),
                                     200, 0.001, 0.001, 0, 10, 0))
        if i % 400 == 399:
            await asyncio.sleep(0.03)  # batches of ~400 lines, ~200 KB: over a pipe's 64 KiB
    await log.stop()

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


async def test_workers_writing_to_one_pipe_never_cut_into_each_others_lines() -> None:
    """Two processes log to the same pipe (a container's stdout) at once: every line whole."""
    read, write = os.pipe()
    start = time.time() + 1.0
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WRITER,
            tag,
            str(start),
            stdout=write,
            stderr=asyncio.subprocess.PIPE,
        )
        for tag in ("a", "b")
    ]
    os.close(write)
    loop = asyncio.get_running_loop()
    with open(read, "rb") as pipe:
        data = await loop.run_in_executor(None, pipe.read)
    for proc in procs:
        _, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
    ids = [json.loads(line)["request_id"] for line in data.decode().splitlines()]
    assert sorted(ids) == sorted(f"{t}-{i}" for t in "ab" for i in range(8000))
