"""W3C Trace Context (``gateway.observability.tracing``): the traceparent read, the one sent
upstream made, and tracestate's bounds; the rules are the specification's
(www.w3.org/TR/trace-context)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.observability import tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{PARENT}-01".encode()

SENT = re.compile(rb"traceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-0[01]")


def sent(lines: bytes) -> tuple[str, str, int, bytes | None]:
    """The trace id, parent id and flags of the traceparent line in ``lines``, and the
    tracestate sent with it, if any; fails if the traceparent is not a valid version 00."""
    first, _, rest = lines.partition(b"\r\n")
    match = SENT.fullmatch(first)
    assert match is not None, lines
    trace_id, parent_id = match[1].decode(), match[2].decode()
    assert trace_id != "0" * 32
    assert parent_id != "0" * 16
    assert tracing.parse(first.partition(b": ")[2]) is not None
    state = None
    if rest:
        name, _, state = rest.partition(b": ")
        assert name == b"tracestate"
        assert b"\r\n" not in state
    return trace_id, parent_id, int(first[-2:], 16), state


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (VALID, (TRACE.encode(), 1)),
        (f"00-{TRACE}-{PARENT}-00".encode(), (TRACE.encode(), 0)),
        (f"00-{TRACE}-{PARENT}-09".encode(), (TRACE.encode(), 9)),  # other flags: read
        (b" " + VALID + b" \t", (TRACE.encode(), 1)),  # spaces around a value are no part
        # A future version: its four first fields, then nothing or a dash and more.
        (f"cc-{TRACE}-{PARENT}-01".encode(), (TRACE.encode(), 1)),
        (f"cc-{TRACE}-{PARENT}-01-what-the-future-holds".encode(), (TRACE.encode(), 1)),
    ],
)
def test_a_valid_traceparent_is_read(header: bytes, expected: tuple[bytes, int]) -> None:
    assert tracing.parse(header) == expected


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\r",  # the mark of a header sent twice (``plainhead.TWICE``)
        VALID.upper(),  # upper-case hex
        f"00-{TRACE.upper()}-{PARENT}-01".encode(),
        f"00-{TRACE}-{PARENT.upper()}-01".encode(),
        f"00-{TRACE}-{PARENT}-0A".encode(),
        f"00-{'0' * 32}-{PARENT}-01".encode(),  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01".encode(),  # all-zero parent id
        f"ff-{TRACE}-{PARENT}-01".encode(),  # version ff: never valid
        f"0g-{TRACE}-{PARENT}-01".encode(),
        VALID + b"-",  # version 00 is exactly 55 characters
        VALID + b"0",
        VALID[:-1],
        f"cc-{TRACE}-{PARENT}-01x".encode(),  # a future version: a dash after the flags
        f"00-{TRACE}0-{PARENT[1:]}-01".encode(),  # fields of other lengths
        f"00_{TRACE}-{PARENT}-01".encode(),
        f"00-{TRACE}-{PARENT}_01".encode(),
        f"00-{TRACE[:-1]}g-{PARENT}-01".encode(),
        f"00-{TRACE}-{PARENT[:-1]}-01-".encode(),
        f"00-{TRACE}-{PARENT}-1".encode(),
    ],
)
def test_an_invalid_traceparent_is_none(header: bytes) -> None:
    assert tracing.parse(header) is None


def test_a_valid_traceparent_continues_its_trace_with_a_new_parent_id() -> None:
    request_id, lines = tracing.context(VALID, b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", 0.0)
    trace_id, parent_id, flags, state = sent(lines)
    assert trace_id == TRACE
    assert parent_id != PARENT
    assert flags == 1  # the caller's decision: the ratio is only for new traces
    assert state == b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"  # unchanged
    assert request_id == f"{trace_id}-{parent_id}"
    # Each request its own hop: a trace holds many requests, each its request id.
    assert tracing.context(VALID, None, 0.0)[0] != request_id


def test_unknown_flags_and_a_future_version_go_on_as_version_00_with_the_sampled_flag() -> None:
    _, lines = tracing.context(f"cc-{TRACE}-{PARENT}-0b-more".encode(), None, 0.0)
    assert sent(lines)[:1] == (TRACE,)
    assert sent(lines)[2] == 1
    _, lines = tracing.context(f"00-{TRACE}-{PARENT}-fe".encode(), None, 1.0)
    assert sent(lines)[2] == 0


@pytest.mark.parametrize("header", [None, VALID.upper(), b"00-junk"])
def test_no_valid_traceparent_starts_a_new_trace_and_drops_tracestate(
    header: bytes | None,
) -> None:
    request_id, lines = tracing.context(header, b"rojo=00f067aa0ba902b7", 0.0)
    trace_id, parent_id, flags, state = sent(lines)
    assert trace_id != TRACE
    assert state is None
    assert flags == 0
    assert request_id == f"{trace_id}-{parent_id}"
    assert tracing.context(header, None, 0.0)[0].split("-")[0] != trace_id


def test_a_new_trace_is_sampled_at_the_ratio() -> None:
    assert all(sent(tracing.context(None, None, 1.0)[1])[2] == 1 for _ in range(100))
    assert all(sent(tracing.context(None, None, 0.0)[1])[2] == 0 for _ in range(100))
    sampled = sum(sent(tracing.context(None, None, 0.25)[1])[2] for _ in range(4000))
    assert 700 < sampled < 1300


@pytest.mark.parametrize(
    ("state", "kept"),
    [
        (b"a=1", True),
        (b"a=1,b=2, c=3", True),
        (b",".join(b"k%d=v" % i for i in range(32)), True),
        (b",".join(b"k%d=v" % i for i in range(33)), False),  # over 32 members
        (b",".join(b"k%d=v" % i for i in range(32)) + b",,  ,", True),  # empty: no members
        (b"a=" + b"x" * 510, True),  # 512 characters
        (b"a=" + b"x" * 511, False),
        (b"", False),
    ],
)
def test_tracestate_goes_on_unchanged_within_its_bounds(state: bytes, kept: bool) -> None:
    assert tracing.tracestate_kept(state) == (state if kept else None)
    assert sent(tracing.context(VALID, state, 0.0)[1])[3] == (state if kept else None)


HEX = "0123456789abcdef"
hex_ids = st.text(alphabet=HEX + "ABCDEF", min_size=0, max_size=34)
traceparents = st.one_of(
    st.none(),
    st.binary(max_size=80),
    st.builds(
        lambda v, t, p, f, more: f"{v}-{t}-{p}-{f}{more}".encode(),
        st.text(alphabet=HEX + "FG", min_size=1, max_size=3),
        hex_ids,
        hex_ids,
        st.text(alphabet=HEX + "X", min_size=1, max_size=3),
        st.sampled_from(["", "-", "-x", "x"]),
    ),
)


@given(traceparents, st.one_of(st.none(), st.binary(max_size=600)), st.floats(0, 1))
def test_any_traceparent_is_continued_or_replaced_by_a_valid_one(
    header: bytes | None, state: bytes | None, ratio: float
) -> None:
    request_id, lines = tracing.context(header, state, ratio)
    trace_id, parent_id, flags, forwarded = sent(lines)
    assert request_id == f"{trace_id}-{parent_id}"
    parsed = tracing.parse(header)
    if parsed is None:  # a new trace: no tracestate goes with it
        assert forwarded is None
    else:
        assert trace_id.encode() == parsed[0]
        assert flags == parsed[1] & 1
        assert forwarded == tracing.tracestate_kept(state)
        assert forwarded is None or len(forwarded) <= tracing.MAX_TRACESTATE
