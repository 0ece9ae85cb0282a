"""``wire.h2_session`` held to RFC 9113 by an independent implementation: ``h2``'s
``H2Connection`` as the peer for well-behaved traffic (its bytes fed to a ``Session``, and the
``Session``'s read back by it), and frames made with ``hyperframe`` (or by hand) for broken or
hostile input. No sockets: bytes go from one side to the other in the test."""

from __future__ import annotations

import itertools
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.wire.h2_session import (
    CANCEL,
    COMPRESSION_ERROR,
    ENABLE_PUSH,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    NO_ERROR,
    PREFACE,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    STREAM_CLOSED,
    Event,
    ProtocolError,
    Session,
)

GET = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"a.test"), (b":path", b"/")]
POST = [(b":method", b"POST"), *GET[1:]]
OK = [(b":status", b"200")]
MAX_WINDOW = 2**31 - 1

# -- the harness --------------------------------------------------------------------------

ATTRIBUTES = (
    "stream_id",
    "headers",
    "data",
    "flow_controlled_length",
    "end_stream",
    "error_code",
    "remote_reset",
    "delta",
    "changed",
    "last_stream_id",
)


def described(events: list[Event]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples: the class's name, then its attributes."""
    out = []
    for event in events:
        connection = type(event).__name__ in ("RemoteSettingsChanged", "ConnectionTerminated")
        attributes = tuple(
            (name, getattr(event, name)) for name in ATTRIBUTES[connection:] if hasattr(event, name)
        )
        out.append((type(event).__name__, *attributes))
    return out


def kinds(events: list[Event]) -> list[str]:
    return [type(event).__name__ for event in events]


def parsed(data: bytes) -> list[Frame]:
    """The frames in ``data`` (whole frames only), read by hyperframe."""
    frames = []
    view = memoryview(data)
    at = 0
    while at < len(data):
        frame, length = Frame.parse_frame_header(view[at : at + 9])
        frame.parse_body(view[at + 9 : at + 9 + length])
        frames.append(frame)
        at += 9 + length
    assert at == len(data)
    return frames


def raw(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """A frame made by hand (for what hyperframe will not serialize)."""
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + payload
    )


def rsts(frames: list[Frame]) -> list[tuple[int, int]]:
    return [(f.stream_id, f.error_code) for f in frames if isinstance(f, RstStreamFrame)]


def updates(frames: list[Frame]) -> list[tuple[int, int]]:
    return [(f.stream_id, f.window_increment) for f in frames if isinstance(f, WindowUpdateFrame)]


class Peer:
    """The far end's frames made by hand, its header blocks by ``hpack``'s encoder (one for
    the connection: it indexes, so a block can name what an earlier one added)."""

    def __init__(self) -> None:
        self.encoder = hpack.Encoder()

    def headers(
        self, stream_id: int, fields: list[tuple[bytes, bytes]], end_stream: bool = False
    ) -> bytes:
        frame = HeadersFrame(stream_id, self.encoder.encode(fields))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame.serialize()

    @staticmethod
    def data(stream_id: int, data: bytes, end_stream: bool = False) -> bytes:
        frame = DataFrame(stream_id, data)
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame.serialize()


def server(**kwargs: int) -> tuple[Session, Peer]:
    """A server's session that read a client's preface and SETTINGS (what it sent taken)."""
    session = Session(False, **kwargs)
    session.initiate()
    session.receive(PREFACE + SettingsFrame(0).serialize())
    session.take()
    return session, Peer()


def client() -> tuple[Session, Peer]:
    """A client's session that read a server's SETTINGS (what it sent taken)."""
    session = Session(True)
    session.initiate()
    session.receive(SettingsFrame(0).serialize())
    session.take()
    return session, Peer()


def connection_error(session: Session, data: bytes, code: int) -> None:
    """``data`` is a connection error ``code``: raised, a GOAWAY with it queued (last), and
    nothing more is taken."""
    with pytest.raises(ProtocolError) as raised:
        session.receive(data)
    assert raised.value.code == code
    frames = parsed(session.take())
    assert isinstance(frames[-1], GoAwayFrame)
    assert frames[-1].error_code == code
    assert session.terminated
    assert session.receive(Peer().headers(101, GET, end_stream=True)) == []
    assert session.take() == b""


def codes(local: dict[str, int]) -> dict[Any, int] | None:
    """h2's settings by name (``initial_window_size=...``) as its codes."""
    return {h2.settings.SettingCodes[name.upper()]: v for name, v in local.items()} or None


def h2_client(**local: int) -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    conn = h2.connection.H2Connection(config)
    conn.local_settings = h2.settings.Settings(client=True, initial_values=codes(local))
    conn.initiate_connection()
    return conn


def h2_server(**local: int) -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    conn = h2.connection.H2Connection(config)
    conn.local_settings = h2.settings.Settings(client=False, initial_values=codes(local))
    conn.initiate_connection()
    return conn


def with_h2_client(**local: int) -> tuple[Session, h2.connection.H2Connection]:
    """A server's session and an h2 client, their SETTINGS exchanged and acknowledged."""
    session = Session(False)
    session.initiate()
    peer = h2_client(**local)
    session.receive(peer.data_to_send())
    peer.receive_data(session.take())
    assert session.receive(peer.data_to_send()) == []  # its SETTINGS' ACK
    return session, peer


def with_h2_server(**local: int) -> tuple[Session, h2.connection.H2Connection]:
    """A client's session and an h2 server, their SETTINGS exchanged and acknowledged."""
    session = Session(True)
    session.initiate()
    peer = h2_server(**local)
    peer.receive_data(session.take())
    session.receive(peer.data_to_send())
    peer.receive_data(session.take())
    assert peer.data_to_send() == b""
    return session, peer


def to_session(session: Session, peer: h2.connection.H2Connection) -> list[Event]:
    return session.receive(peer.data_to_send())


def to_peer(session: Session, peer: h2.connection.H2Connection) -> list[h2.events.Event]:
    return peer.receive_data(session.take())


# -- a server's session, an h2 client -----------------------------------------------------


def test_the_settings_are_exchanged_and_acknowledged():
    session = Session(False, max_concurrent_streams=7, max_header_list_size=3000)
    session.initiate()
    peer = h2_client(initial_window_size=1000, max_frame_size=20000)
    events = session.receive(peer.data_to_send())
    assert kinds(events) == ["RemoteSettingsChanged"]
    assert events[0].changed[4] == 1000
    assert events[0].changed[5] == 20000
    assert session.max_outbound_frame_size == 20000
    answers = to_peer(session, peer)
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in answers)
    changed = next(e for e in answers if isinstance(e, h2.events.RemoteSettingsChanged))
    assert changed.changed_settings[3].new_value == 7  # MAX_CONCURRENT_STREAMS
    assert changed.changed_settings[6].new_value == 3000  # MAX_HEADER_LIST_SIZE


def test_a_get():
    session, peer = with_h2_client()
    peer.send_headers(1, [*GET, (b"accept", b"*/*")], end_stream=True)
    assert described(to_session(session, peer)) == [
        (
            "RequestReceived",
            ("stream_id", 1),
            ("headers", [*GET, (b"accept", b"*/*")]),
            ("end_stream", True),
        ),
        ("StreamEnded", ("stream_id", 1)),
    ]
    assert session.highest_inbound_stream_id == 1


def test_the_answer_is_read_back_and_the_stream_forgotten_once_both_sides_ended():
    session, peer = with_h2_client()
    peer.send_headers(1, GET, end_stream=True)
    to_session(session, peer)
    assert 1 in session.streams  # our side is open
    session.send_headers(1, [*OK, (b"content-type", b"text/plain")])
    session.send_data(1, b"hello ")
    session.send_data(1, b"world")
    session.end_stream(1)
    assert session.streams == {}
    events = to_peer(session, peer)
    assert [type(e) for e in events] == [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.DataReceived,
        h2.events.DataReceived,
        h2.events.StreamEnded,
    ]
    assert events[0].headers == [*OK, (b"content-type", b"text/plain")]
    assert b"".join(e.data for e in events[1:4]) == b"hello world"
    with pytest.raises(ProtocolError):
        session.send_data(1, b"more")


def test_a_stream_is_forgotten_when_the_peer_ends_after_us():
    session, peer = with_h2_client()
    peer.send_headers(1, POST)
    to_session(session, peer)
    session.send_headers(1, OK, end_stream=True)
    assert 1 in session.streams  # the peer's side is open
    to_peer(session, peer)
    peer.send_data(1, b"late", end_stream=True)
    assert kinds(to_session(session, peer)) == ["DataReceived", "StreamEnded"]
    assert session.streams == {}


@pytest.mark.parametrize("length", [True, False])
def test_a_post_with_a_body(length):
    session, peer = with_h2_client()
    head = POST + ([(b"content-length", b"11")] if length else [])
    peer.send_headers(1, head)
    peer.send_data(1, b"hello ")
    peer.send_data(1, b"world", end_stream=True)
    assert described(to_session(session, peer)) == [
        ("RequestReceived", ("stream_id", 1), ("headers", head), ("end_stream", False)),
        (
            "DataReceived",
            ("stream_id", 1),
            ("data", b"hello "),
            ("flow_controlled_length", 6),
            ("end_stream", False),
        ),
        (
            "DataReceived",
            ("stream_id", 1),
            ("data", b"world"),
            ("flow_controlled_length", 5),
            ("end_stream", True),
        ),
        ("StreamEnded", ("stream_id", 1)),
    ]


def test_padded_data_counts_its_padding_in_the_windows():
    session, peer = with_h2_client()
    peer.send_headers(1, POST)
    peer.send_data(1, b"abc", pad_length=10)
    events = to_session(session, peer)
    assert described(events[1:]) == [
        (
            "DataReceived",
            ("stream_id", 1),
            ("data", b"abc"),
            ("flow_controlled_length", 14),
            ("end_stream", False),
        )
    ]


def test_many_streams_interleaved():
    session, peer = with_h2_client()
    ids = list(range(1, 100, 2))
    for stream_id in ids:
        peer.send_headers(stream_id, POST)
    for stream_id in ids:
        peer.send_data(stream_id, str(stream_id).encode(), end_stream=True)
    events = to_session(session, peer)
    requests = [e.stream_id for e in events if kinds([e]) == ["RequestReceived"]]
    bodies = {e.stream_id: e.data for e in events if kinds([e]) == ["DataReceived"]}
    assert requests == ids
    assert bodies == {i: str(i).encode() for i in ids}
    for stream_id in reversed(ids):
        session.send_headers(stream_id, OK)
        session.send_data(stream_id, b"to %d" % stream_id, end_stream=True)
    answers = to_peer(session, peer)
    got = {e.stream_id: e.data for e in answers if isinstance(e, h2.events.DataReceived)}
    assert got == {i: b"to %d" % i for i in ids}
    assert sum(isinstance(e, h2.events.StreamEnded) for e in answers) == len(ids)
    assert session.streams == {}


def test_trailers():
    session, peer = with_h2_client()
    peer.send_headers(1, [(b":method", b"POST"), *GET[1:], (b"te", b"trailers")])
    peer.send_data(1, b"body")
    peer.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    assert described(to_session(session, peer))[2:] == [
        ("TrailersReceived", ("stream_id", 1), ("headers", [(b"grpc-status", b"0")])),
        ("StreamEnded", ("stream_id", 1)),
    ]
    # Ours, read back as trailers.
    session.send_headers(1, OK)
    session.send_data(1, b"x")
    session.send_headers(1, [(b"grpc-status", b"5")], end_stream=True)
    events = to_peer(session, peer)
    trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers[0].headers == [(b"grpc-status", b"5")]
    assert session.streams == {}


def test_cookie_crumbs_are_joined_where_the_first_was():
    session, peer = with_h2_client()
    # h2 splits a cookie into crumbs (RFC 9113 8.2.3) as it sends it.
    peer.send_headers(
        1,
        [*GET, (b"cookie", b"a=1; b=2"), (b"accept", b"*/*"), (b"cookie", b"c=3")],
        end_stream=True,
    )
    data = peer.data_to_send()
    events = session.receive(data)
    assert events[0].headers == [*GET, (b"cookie", b"a=1; b=2; c=3"), (b"accept", b"*/*")]


def test_a_head_larger_than_a_frame_is_split_into_continuation_frames():
    session, peer = with_h2_client()
    peer.send_headers(1, GET, end_stream=True)
    to_session(session, peer)
    big = [*OK, (b"x-big", b"v" * 20000), (b"x-bigger", b"w" * 30000)]
    session.send_headers(1, big, end_stream=True)
    data = session.take()
    frames = parsed(data)
    assert [type(f) for f in frames] == [HeadersFrame, ContinuationFrame, ContinuationFrame]
    assert [len(f.data) for f in frames[:2]] == [16384, 16384]
    assert [sorted(f.flags) for f in frames] == [["END_STREAM"], [], ["END_HEADERS"]]
    events = peer.receive_data(data)
    assert isinstance(events[0], h2.events.ResponseReceived)
    assert events[0].headers == big
    assert isinstance(events[1], h2.events.StreamEnded)


def test_a_head_is_sent_in_frames_of_the_peers_max_frame_size():
    session, peer = with_h2_client(max_header_list_size=1 << 20)
    peer.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 65536})
    peer.send_headers(1, GET, end_stream=True)
    to_session(session, peer)
    to_peer(session, peer)  # (our ACK: h2 takes frames that large now)
    assert session.max_outbound_frame_size == 65536
    big = [*OK, (b"x-big", b"v" * 50000)]
    session.send_headers(1, big, end_stream=True)
    data = session.take()
    assert [type(f) for f in parsed(data)] == [HeadersFrame]
    assert peer.receive_data(data)[0].headers == big


# -- a client's session, an h2 server -----------------------------------------------------


def request(session: Session, method: bytes = b"GET", end_stream: bool = True) -> int:
    stream_id = session.open_stream()
    session.send_headers(stream_id, [(b":method", method), *GET[1:]], end_stream)
    return stream_id


def test_a_client_reads_the_servers_settings():
    session = Session(True)
    session.initiate()
    assert session.take().startswith(PREFACE)
    assert session.remote_max_concurrent_streams == 2**31
    peer = h2_server(max_concurrent_streams=7, initial_window_size=1000)
    events = session.receive(peer.data_to_send())
    assert kinds(events) == ["RemoteSettingsChanged"]
    assert events[0].changed[3] == 7
    assert session.remote_max_concurrent_streams == 7
    stream_id = request(session, end_stream=False)
    assert session.send_window(stream_id) == 1000


def test_an_answer_with_a_body_and_trailers():
    session, peer = with_h2_server()
    stream_id = request(session)
    assert stream_id == 1
    assert kinds(to_peer(session, peer)) == ["RequestReceived", "StreamEnded"]
    peer.send_headers(stream_id, [*OK, (b"content-length", b"5")])
    peer.send_data(stream_id, b"hello")
    peer.send_headers(stream_id, [(b"x-checksum", b"abc")], end_stream=True)
    assert described(to_session(session, peer)) == [
        (
            "ResponseReceived",
            ("stream_id", 1),
            ("headers", [*OK, (b"content-length", b"5")]),
            ("end_stream", False),
        ),
        (
            "DataReceived",
            ("stream_id", 1),
            ("data", b"hello"),
            ("flow_controlled_length", 5),
            ("end_stream", False),
        ),
        ("TrailersReceived", ("stream_id", 1), ("headers", [(b"x-checksum", b"abc")])),
        ("StreamEnded", ("stream_id", 1)),
    ]
    assert session.streams == {}
    assert request(session) == 3


def test_informational_answers_come_before_the_final_one():
    session, peer = with_h2_server()
    stream_id = request(session)
    to_peer(session, peer)
    peer.send_headers(stream_id, [(b":status", b"103"), (b"link", b"</a.css>")])
    peer.send_headers(stream_id, OK, end_stream=True)
    assert described(to_session(session, peer)) == [
        (
            "InformationalResponseReceived",
            ("stream_id", 1),
            ("headers", [(b":status", b"103"), (b"link", b"</a.css>")]),
        ),
        ("ResponseReceived", ("stream_id", 1), ("headers", OK), ("end_stream", True)),
        ("StreamEnded", ("stream_id", 1)),
    ]


def test_an_answer_to_head_has_a_content_length_and_no_data():
    session, peer = with_h2_server()
    stream_id = request(session, b"HEAD")
    to_peer(session, peer)
    peer.send_headers(stream_id, [*OK, (b"content-length", b"1234")], end_stream=True)
    assert kinds(to_session(session, peer)) == ["ResponseReceived", "StreamEnded"]
    assert rsts(parsed(session.take())) == []
    # The same answer to a GET is short of its body: malformed.
    stream_id = request(session)
    to_peer(session, peer)
    peer.send_headers(stream_id, [*OK, (b"content-length", b"1234")], end_stream=True)
    assert described(to_session(session, peer)) == [
        ("StreamReset", ("stream_id", 3), ("error_code", PROTOCOL_ERROR), ("remote_reset", False))
    ]
    assert rsts(parsed(session.take())) == [(3, PROTOCOL_ERROR)]


@pytest.mark.parametrize("code", [CANCEL, REFUSED_STREAM])
def test_a_reset_from_the_server(code):
    session, peer = with_h2_server()
    stream_id = request(session)
    to_peer(session, peer)
    peer.reset_stream(stream_id, code)
    assert described(to_session(session, peer)) == [
        ("StreamReset", ("stream_id", 1), ("error_code", code), ("remote_reset", True))
    ]
    assert session.streams == {}
    assert session.send_window(stream_id) == 0


def test_goaway_from_the_server():
    session, peer = with_h2_server()
    request(session)
    request(session)
    to_peer(session, peer)
    peer.close_connection(error_code=NO_ERROR, last_stream_id=1)
    assert described(to_session(session, peer)) == [
        ("ConnectionTerminated", ("error_code", NO_ERROR), ("last_stream_id", 1))
    ]


def test_a_malformed_answer_is_a_stream_reset_event():
    session, peer = client()
    stream_id = request(session)
    session.take()
    events = session.receive(peer.headers(stream_id, [(b"x-no-status", b"1")]))
    assert described(events) == [
        (
            "StreamReset",
            ("stream_id", stream_id),
            ("error_code", PROTOCOL_ERROR),
            ("remote_reset", False),
        )
    ]


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(lambda p: p.headers(1, [(b":status", b"100")], True), id="1xx-end-stream"),
        pytest.param(lambda p: p.data(1, b"x"), id="data-before-head"),
        pytest.param(
            lambda p: p.headers(1, [*OK, (b"content-length", b"x")]), id="bad-content-length"
        ),
        pytest.param(lambda p: p.headers(1, [(b":status", b"2000")]), id="bad-status"),
        pytest.param(lambda p: p.headers(1, [*OK, (b":status", b"200")]), id="duplicate-status"),
        pytest.param(
            lambda p: p.headers(1, [*OK, (b"connection", b"close")]), id="connection-field"
        ),
    ],
)
def test_each_malformed_answer_is_a_reset_the_owner_is_told_of(frames):
    session, peer = client()
    assert request(session) == 1
    session.take()
    events = session.receive(frames(peer))
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", PROTOCOL_ERROR), ("remote_reset", False))
    ]
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]


def test_a_server_may_not_open_streams():
    session, peer = client()
    connection_error(session, peer.headers(2, OK), PROTOCOL_ERROR)
    session, peer = client()
    connection_error(session, peer.headers(1, OK), PROTOCOL_ERROR)  # never opened


# -- flow control -------------------------------------------------------------------------


def test_send_window_is_the_least_of_the_streams_and_the_connections():
    session, peer = with_h2_server(initial_window_size=100_000)
    stream_id = request(session, b"POST", end_stream=False)
    assert session.send_window(stream_id) == 65535  # the connection's
    session.send_data(stream_id, b"x" * 16384)
    assert session.send_window(stream_id) == 65535 - 16384
    to_peer(session, peer)
    peer.increment_flow_control_window(50_000)
    assert described(to_session(session, peer)) == [
        ("WindowUpdated", ("stream_id", 0), ("delta", 50_000))
    ]
    assert session.send_window(stream_id) == 100_000 - 16384  # the stream's now


def test_the_peers_window_bounds_what_may_be_sent_and_opens_as_it_takes():
    session, peer = with_h2_server(initial_window_size=1000)
    stream_id = request(session, b"POST", end_stream=False)
    assert session.send_window(stream_id) == 1000
    session.send_data(stream_id, b"x" * 1000)
    assert session.send_window(stream_id) == 0
    with pytest.raises(ProtocolError) as raised:
        session.send_data(stream_id, b"x")
    assert raised.value.code == FLOW_CONTROL_ERROR
    events = to_peer(session, peer)
    data = next(e for e in events if isinstance(e, h2.events.DataReceived))
    assert len(data.data) == 1000
    peer.acknowledge_received_data(1000, stream_id)
    assert ("WindowUpdated", ("stream_id", 1), ("delta", 1000)) in described(
        to_session(session, peer)
    )
    assert session.send_window(stream_id) == 1000


def test_a_change_of_initial_window_size_moves_open_streams_windows_both_ways():
    session, peer = with_h2_server(initial_window_size=100_000)
    stream_id = request(session, b"POST", end_stream=False)
    session.send_data(stream_id, b"x" * 16384)
    session.send_data(stream_id, b"x" * 16384)
    to_peer(session, peer)
    # The stream's window is 100000 - 32768; lowered by 99000 it goes below 0.
    peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    events = to_session(session, peer)
    assert described(events) == [("RemoteSettingsChanged", ("changed", {4: 1000}))]
    assert session.send_window(stream_id) <= 0
    with pytest.raises(ProtocolError):
        session.send_data(stream_id, b"x")
    # The peer's WINDOW_UPDATEs count from below 0.
    to_peer(session, peer)
    peer.increment_flow_control_window(32768, stream_id)
    peer.increment_flow_control_window(40000)
    to_session(session, peer)
    assert session.send_window(stream_id) == 1000
    peer.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 3000})
    to_session(session, peer)
    assert session.send_window(stream_id) == 3000
    assert session.send_window(request(session, end_stream=False)) == 3000  # a new stream's


def test_a_one_mib_body_goes_through_the_default_window_as_the_owner_acknowledges():
    session, peer = with_h2_client()
    body = bytes(range(256)) * 4096
    peer.send_headers(1, POST)
    to_session(session, peer)
    sent = 0
    got = bytearray()
    ended = False
    for _ in range(1000):
        window = min(peer.local_flow_control_window(1), peer.max_outbound_frame_size)
        if window > 0 and sent < len(body):
            chunk = body[sent : sent + window]
            sent += len(chunk)
            peer.send_data(1, chunk, end_stream=sent == len(body))
        for event in to_session(session, peer):
            if kinds([event]) == ["DataReceived"]:
                got += event.data
                session.acknowledge(1, event.flow_controlled_length)
            ended = ended or kinds([event]) == ["StreamEnded"]
        to_peer(session, peer)
        if ended:
            break
    assert ended
    assert bytes(got) == body


def test_without_acknowledgement_the_peer_stops_at_the_window():
    session, peer = with_h2_client()
    peer.send_headers(1, POST)
    while (window := min(peer.local_flow_control_window(1), 16384)) > 0:
        peer.send_data(1, b"x" * window)
    events = to_session(session, peer)
    assert sum(e.flow_controlled_length for e in events if kinds([e]) == ["DataReceived"]) == 65535
    assert updates(parsed(session.take())) == []


def test_acknowledged_data_opens_the_windows_with_window_updates():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    session.receive(peer.data(1, b"x" * 16384) + peer.data(1, b"x" * 16383))
    session.acknowledge(1, 16384)
    assert updates(parsed(session.take())) == []  # under half a window: not yet
    session.acknowledge(1, 16383)
    assert updates(parsed(session.take())) == [(0, 32767), (1, 32767)]


def test_a_peer_beyond_the_connections_window_is_a_flow_control_error():
    session, peer = server()
    session.receive(peer.headers(1, POST) + peer.headers(3, POST))
    # Within each stream's window, and 65535 in all.
    session.receive(peer.data(1, b"x" * 16384) * 2 + peer.data(3, b"x" * 16384))
    session.receive(peer.data(3, b"x" * 16383))
    connection_error(session, peer.data(1, b"x"), FLOW_CONTROL_ERROR)


def test_a_peer_beyond_a_streams_window_is_a_flow_control_error():
    session, peer = server()
    post = POST
    # 40000 taken on two streams: the connection's window opens, stream 3's not yet.
    session.receive(peer.headers(1, post) + peer.headers(3, post))
    session.receive(peer.data(1, b"x" * 10000) + peer.data(3, b"x" * 10000) * 3)
    session.acknowledge(1, 10000)
    session.acknowledge(3, 30000)
    assert updates(parsed(session.take())) == [(0, 40000)]
    session.receive(peer.data(3, b"x" * 16384) * 2)  # 65535 - 30000 - 32768 left: 2767
    session.receive(peer.data(3, b"x" * 2767))
    connection_error(session, peer.data(3, b"x"), FLOW_CONTROL_ERROR)


def test_a_streams_unacknowledged_data_is_given_back_to_the_connection_when_we_reset_it():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    session.receive(peer.data(1, b"x" * 16384) * 2 + peer.data(1, b"x" * 7232))
    assert updates(parsed(session.take())) == []
    session.reset_stream(1, CANCEL)
    frames = parsed(session.take())
    assert rsts(frames) == [(1, CANCEL)]
    assert updates(frames) == [(0, 40000)]
    session.acknowledge(1, 40000)  # (the owner's late acknowledgement: given back once)
    assert session.take() == b""


def test_a_streams_unacknowledged_data_is_given_back_when_the_peer_resets_it():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    session.receive(peer.data(1, b"x" * 16384) * 2 + peer.data(1, b"x" * 7232))
    session.acknowledge(1, 5000)
    events = session.receive(RstStreamFrame(1, CANCEL).serialize())
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", CANCEL), ("remote_reset", True))
    ]
    assert updates(parsed(session.take())) == [(0, 40000)]


# -- connection errors --------------------------------------------------------------------


def test_a_bad_preface():
    session = Session(False)
    connection_error(session, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", PROTOCOL_ERROR)


def test_a_bad_preface_a_byte_at_a_time():
    session = Session(False)
    for octet in PREFACE[:10]:
        assert session.receive(bytes((octet,))) == []
    connection_error(session, b"X", PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(PingFrame(0, b"12345678").serialize(), id="ping"),
        pytest.param(SettingsFrame(0, flags=["ACK"]).serialize(), id="settings-ack"),
        pytest.param(Peer().headers(1, GET, end_stream=True), id="headers"),
    ],
)
@pytest.mark.parametrize("client_side", [False, True], ids=["server", "client"])
def test_a_preface_whose_first_frame_is_not_settings(first, client_side):
    """RFC 9113 3.4: the preface ends with the peer's SETTINGS, before any other frame."""
    session = Session(client_side)
    session.initiate()
    session.take()
    connection_error(session, (b"" if client_side else PREFACE) + first, PROTOCOL_ERROR)


def test_a_server_that_enables_push_is_refused():
    """RFC 9113 6.5.2: a client treats SETTINGS_ENABLE_PUSH 1 from a server as a connection
    error; a server takes it from a client (which may be pushed to: nothing is pushed)."""
    session = Session(True)
    session.initiate()
    session.take()
    connection_error(session, SettingsFrame(0, {ENABLE_PUSH: 1}).serialize(), PROTOCOL_ERROR)
    session, _ = server()
    assert kinds(session.receive(SettingsFrame(0, {ENABLE_PUSH: 1}).serialize())) == [
        "RemoteSettingsChanged"
    ]


def test_a_frame_over_the_max_frame_size_is_refused_at_its_header():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    header = raw(0, 0, 1, b"x" * 16385)[:9]
    connection_error(session, header, FRAME_SIZE_ERROR)
    session, peer = server()
    session.receive(peer.headers(1, POST))
    assert kinds(session.receive(raw(0, 0, 1, b"x" * 16384))) == ["DataReceived"]


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(raw(0, 0, 0, b"x"), id="data"),
        pytest.param(raw(1, 4, 0, b"\x82"), id="headers"),
        pytest.param(raw(2, 0, 0, b"\x00\x00\x00\x01\x10"), id="priority"),
        pytest.param(raw(3, 0, 0, b"\x00\x00\x00\x08"), id="rst_stream"),
    ],
)
def test_stream_frames_on_stream_0(frame):
    session, _ = server()
    connection_error(session, frame, PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(raw(4, 0, 1, b""), id="settings"),
        pytest.param(raw(6, 0, 1, b"12345678"), id="ping"),
        pytest.param(raw(7, 0, 1, b"\x00" * 8), id="goaway"),
    ],
)
def test_connection_frames_on_a_stream(frame):
    session, _ = server()
    connection_error(session, frame, PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(Peer.data(5, b"x"), id="data"),
        pytest.param(RstStreamFrame(5, CANCEL).serialize(), id="rst_stream"),
        pytest.param(WindowUpdateFrame(5, 10).serialize(), id="window_update"),
    ],
)
def test_frames_on_an_idle_stream(frame):
    session, peer = server()
    session.receive(peer.headers(3, GET, end_stream=True))
    connection_error(session, frame, PROTOCOL_ERROR)


def test_data_on_a_half_closed_stream_resets_it_and_credits_the_connection():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    events = session.receive(peer.data(1, b"x" * 16384) + peer.data(1, b"x" * 16383))
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", STREAM_CLOSED), ("remote_reset", False))
    ]
    frames = parsed(session.take())
    assert rsts(frames) == [(1, STREAM_CLOSED), (1, STREAM_CLOSED)]
    assert updates(frames) == [(0, 32767)]
    assert session.streams == {}


def test_data_on_a_closed_stream_is_answered_with_stream_closed_and_credited():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    session.send_headers(1, OK, end_stream=True)
    session.take()
    assert session.streams == {}
    events = session.receive(peer.data(1, b"x" * 16384) * 2)
    assert events == []
    frames = parsed(session.take())
    assert rsts(frames) == [(1, STREAM_CLOSED), (1, STREAM_CLOSED)]
    assert updates(frames) == [(0, 32768)]
    assert kinds(session.receive(peer.headers(3, GET, end_stream=True)))[0] == "RequestReceived"


def test_headers_on_a_closed_stream_are_decoded_and_answered_with_stream_closed():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    session.reset_stream(1, CANCEL)
    session.take()
    late = [(b"x-late", b"1")]
    assert session.receive(peer.headers(1, late, end_stream=True)) == []
    assert rsts(parsed(session.take())) == [(1, STREAM_CLOSED)]
    # The late block added x-late to the table: the next names it by index.
    events = session.receive(peer.headers(3, [*GET, *late], end_stream=True))
    assert events[0].headers == [*GET, *late]


@pytest.mark.parametrize(("kind", "stream_id"), [(0, 1), (1, 3)])
def test_padding_longer_than_the_frame(kind, stream_id):
    session, peer = server()
    session.receive(peer.headers(1, POST))
    frame = raw(kind, 0x8 | 0x4, stream_id, b"\x06abcde")
    connection_error(session, frame, PROTOCOL_ERROR)


def test_padding_up_to_the_frames_end_is_allowed():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    events = session.receive(raw(0, 0x8, 1, b"\x05abcde"))
    assert described(events) == [
        (
            "DataReceived",
            ("stream_id", 1),
            ("data", b""),
            ("flow_controlled_length", 6),
            ("end_stream", False),
        )
    ]


def test_an_even_stream_from_a_client():
    session, peer = server()
    connection_error(session, peer.headers(2, GET, end_stream=True), PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(PingFrame(0, b"12345678").serialize(), id="ping"),
        pytest.param(Peer.data(1, b"x"), id="data-same-stream"),
        pytest.param(ContinuationFrame(3, b"\x82").serialize(), id="continuation-elsewhere"),
        pytest.param(raw(0xEE, 0, 0, b""), id="unknown-type"),
    ],
)
def test_a_frame_inside_a_header_block(frame):
    session, peer = server()
    headers = HeadersFrame(1, peer.encoder.encode(GET))
    assert session.receive(headers.serialize()) == []
    assert session.block_open
    connection_error(session, frame, PROTOCOL_ERROR)


def test_a_continuation_without_a_header_block():
    session, _ = server()
    connection_error(session, ContinuationFrame(1, b"\x82").serialize(), PROTOCOL_ERROR)


def continued(block: bytes, continuations: int, stream_id: int = 1) -> bytes:
    """HEADERS with ``block``'s first octet, then ``continuations`` CONTINUATION frames with
    the rest (empty ones once it is all sent), the last with END_HEADERS."""
    out = HeadersFrame(stream_id, block[:1], flags=["END_STREAM"]).serialize()
    rest = block[1:]
    for i in range(continuations):
        piece, rest = rest[:1], rest[1:]
        flags = ["END_HEADERS"] if i == continuations - 1 else []
        out += ContinuationFrame(stream_id, piece, flags=flags).serialize()
    return out


def test_a_header_block_of_64_continuation_frames_is_taken():
    session, peer = server()
    events = session.receive(continued(peer.encoder.encode(GET), 64))
    assert described(events)[0] == (
        "RequestReceived",
        ("stream_id", 1),
        ("headers", GET),
        ("end_stream", True),
    )


def test_more_than_64_continuation_frames():
    session, peer = server()
    connection_error(session, continued(peer.encoder.encode(GET), 65), PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b"\x80", id="index-0"),
        pytest.param(b"\xff\x80", id="index-past-the-tables"),
        pytest.param(b"\x0f", id="truncated"),
        pytest.param(b"\x00\x85\xff\xff\xff\xff\xff\x00", id="bad-huffman"),
        pytest.param(b"\x82\x3f\xe1\x1f", id="size-update-late"),
    ],
)
def test_a_header_block_that_does_not_decode(block):
    session, _ = server()
    connection_error(session, raw(1, 0x5, 1, block), COMPRESSION_ERROR)


def test_a_header_list_over_its_limit():
    session, peer = server(max_header_list_size=1000)
    fields = [*GET, (b"x-big", b"v" * 1000)]
    connection_error(session, peer.headers(1, fields, end_stream=True), ENHANCE_YOUR_CALM)
    session, peer = server(max_header_list_size=1000)
    fields = [*GET, (b"x-big", b"v" * 700)]
    assert kinds(session.receive(peer.headers(1, fields, end_stream=True)))[0] == (
        "RequestReceived"
    )


@pytest.mark.parametrize("client_side", [False, True])
def test_push_promise(client_side):
    session, peer = client() if client_side else server()
    if client_side:
        request(session)
        session.take()
    promise = PushPromiseFrame(1, 2, peer.encoder.encode(GET), flags=["END_HEADERS"])
    connection_error(session, promise.serialize(), PROTOCOL_ERROR)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        pytest.param(raw(4, 0, 0, b"\x00\x04\x00\x00\x00"), FRAME_SIZE_ERROR, id="size"),
        pytest.param(raw(4, 1, 0, b"\x00" * 6), FRAME_SIZE_ERROR, id="ack-with-payload"),
        pytest.param(
            SettingsFrame(0, {5: 16383}).serialize(), PROTOCOL_ERROR, id="max-frame-size-low"
        ),
        pytest.param(
            SettingsFrame(0, {5: 2**24}).serialize(), PROTOCOL_ERROR, id="max-frame-size-high"
        ),
        pytest.param(
            SettingsFrame(0, {4: 2**31}).serialize(), FLOW_CONTROL_ERROR, id="window-too-large"
        ),
        pytest.param(SettingsFrame(0, {2: 2}).serialize(), PROTOCOL_ERROR, id="enable-push-2"),
    ],
)
def test_bad_settings(frame, code):
    session, _ = server()
    connection_error(session, frame, code)


def test_settings_at_their_limits_are_taken():
    session, _ = server()
    frame = SettingsFrame(0, {5: 2**24 - 1, 4: MAX_WINDOW, 0x99: 7})  # (an unknown one too)
    events = session.receive(frame.serialize())
    assert described(events) == [
        ("RemoteSettingsChanged", ("changed", {5: 2**24 - 1, 4: MAX_WINDOW}))
    ]
    assert parsed(session.take())[0].flags == {"ACK"}
    assert session.max_outbound_frame_size == 2**24 - 1


@pytest.mark.parametrize("size", [7, 9])
def test_a_ping_of_the_wrong_size(size):
    session, _ = server()
    connection_error(session, raw(6, 0, 0, b"x" * size), FRAME_SIZE_ERROR)


def test_a_window_update_of_0_on_the_connection():
    session, _ = server()
    connection_error(session, WindowUpdateFrame(0, 0).serialize(), PROTOCOL_ERROR)


def test_a_window_update_of_0_on_a_stream_resets_it():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    events = session.receive(WindowUpdateFrame(1, 0).serialize())
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", PROTOCOL_ERROR), ("remote_reset", False))
    ]
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]
    assert not session.terminated


def test_the_connections_window_over_its_limit():
    session, _ = server()
    assert kinds(session.receive(WindowUpdateFrame(0, MAX_WINDOW - 65535).serialize())) == [
        "WindowUpdated"
    ]
    connection_error(session, WindowUpdateFrame(0, 1).serialize(), FLOW_CONTROL_ERROR)


def test_a_streams_window_over_its_limit_resets_it():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    session.receive(WindowUpdateFrame(1, MAX_WINDOW - 65535).serialize())
    events = session.receive(WindowUpdateFrame(1, 1).serialize())
    assert described(events) == [
        (
            "StreamReset",
            ("stream_id", 1),
            ("error_code", FLOW_CONTROL_ERROR),
            ("remote_reset", False),
        )
    ]
    assert rsts(parsed(session.take())) == [(1, FLOW_CONTROL_ERROR)]


def test_an_initial_window_size_that_takes_a_stream_over_the_limit():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    session.receive(WindowUpdateFrame(1, MAX_WINDOW - 65535).serialize())
    connection_error(session, SettingsFrame(0, {4: 65536}).serialize(), FLOW_CONTROL_ERROR)


def test_a_second_head_without_end_stream():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    connection_error(session, peer.headers(1, [(b"x-more", b"1")]), PROTOCOL_ERROR)


# -- malformed heads: the stream alone is reset -------------------------------------------

MALFORMED = {
    "upper-case-name": [*GET, (b"Accept", b"*/*")],
    "space-in-name": [*GET, (b"x a", b"1")],
    "colon-in-name": [*GET, (b"x:a", b"1")],
    "empty-name": [*GET, (b"", b"1")],
    "connection": [*GET, (b"connection", b"keep-alive")],
    "keep-alive": [*GET, (b"keep-alive", b"5")],
    "transfer-encoding": [*GET, (b"transfer-encoding", b"chunked")],
    "upgrade": [*GET, (b"upgrade", b"websocket")],
    "te-gzip": [*GET, (b"te", b"gzip")],
    "pseudo-after-regular": [*GET[:3], (b"accept", b"*/*"), GET[3]],
    "unknown-pseudo": [*GET, (b":protocol", b"websocket")],
    "status-in-request": [*GET, (b":status", b"200")],
    "duplicate-pseudo": [*GET, (b":path", b"/again")],
    "no-path": GET[:3],
    "no-scheme": [GET[0], *GET[2:]],
    "no-method": GET[1:],
    "empty-path": [*GET[:3], (b":path", b"")],
    "cr-in-value": [*GET, (b"x-a", b"a\rb")],
    "lf-in-value": [*GET, (b"x-a", b"a\nb")],
    "nul-in-value": [*GET, (b"x-a", b"a\x00b")],
    "leading-space": [*GET, (b"x-a", b" a")],
    "trailing-tab": [*GET, (b"x-a", b"a\t")],
    "crlf-in-path": [*GET[:3], (b":path", b"/ HTTP/1.1\r\nx-smuggled: 1\r\n\r\nGET /")],
    "lf-in-method": [(b":method", b"GET\n"), *GET[1:]],
    "crlf-in-authority": [GET[0], GET[1], (b":authority", b"a\r\nx: y"), GET[3]],
    "space-in-path": [*GET[:3], (b":path", b"/a HTTP/1.1 b")],
    "tab-in-path": [*GET[:3], (b":path", b"/a\tb")],
    "space-in-method": [(b":method", b"GET /x"), *GET[1:]],
    "del-in-path": [*GET[:3], (b":path", b"/a\x7fb")],
    "host-not-authority": [*GET, (b"host", b"b.test")],
    "connect-with-path": [(b":method", b"CONNECT"), (b":authority", b"a:443"), (b":path", b"/")],
    "bad-content-length": [*GET, (b"content-length", b"1x")],
    "two-content-lengths": [*GET, (b"content-length", b"1"), (b"content-length", b"2")],
}


@pytest.mark.parametrize("fields", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_request_head_resets_its_stream_and_the_next_is_served(fields):
    session, peer = server()
    assert session.receive(peer.headers(1, fields, end_stream=True)) == []
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]
    assert session.streams == {}
    events = session.receive(peer.headers(3, GET, end_stream=True))
    assert kinds(events) == ["RequestReceived", "StreamEnded"]
    assert events[0].headers == GET


def test_well_formed_variants_are_taken():
    session, peer = server()
    heads = [
        [*GET, (b"te", b"trailers"), (b"host", b"a.test"), (b"x-empty", b"")],
        [(b":method", b"CONNECT"), (b":authority", b"a.test:443")],
        [GET[0], GET[1], GET[3], (b"host", b"a.test")],
    ]
    for i, head in enumerate(heads):
        events = session.receive(peer.headers(2 * i + 1, head, end_stream=True))
        assert kinds(events) == ["RequestReceived", "StreamEnded"]
    assert rsts(parsed(session.take())) == []


def test_a_body_longer_than_its_content_length():
    session, peer = server()
    session.receive(peer.headers(1, [(b":method", b"POST"), *GET[1:], (b"content-length", b"3")]))
    assert kinds(session.receive(peer.data(1, b"ab"))) == ["DataReceived"]
    events = session.receive(peer.data(1, b"cd"))
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", PROTOCOL_ERROR), ("remote_reset", False))
    ]
    frames = parsed(session.take())
    assert rsts(frames) == [(1, PROTOCOL_ERROR)]
    assert session.streams == {}


@pytest.mark.parametrize("trailers", [False, True])
def test_a_body_shorter_than_its_content_length(trailers):
    session, peer = server()
    session.receive(peer.headers(1, [(b":method", b"POST"), *GET[1:], (b"content-length", b"3")]))
    if trailers:
        session.receive(peer.data(1, b"ab"))
        events = session.receive(peer.headers(1, [(b"x-t", b"1")], end_stream=True))
    else:
        events = session.receive(peer.data(1, b"ab", end_stream=True))
    assert described(events) == [
        ("StreamReset", ("stream_id", 1), ("error_code", PROTOCOL_ERROR), ("remote_reset", False))
    ]
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]


def test_a_content_length_with_end_stream_on_the_head():
    session, peer = server()
    head = [(b":method", b"POST"), *GET[1:], (b"content-length", b"3")]
    assert session.receive(peer.headers(1, head, end_stream=True)) == []
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]
    head = [(b":method", b"POST"), *GET[1:], (b"content-length", b"0")]
    assert kinds(session.receive(peer.headers(3, head, end_stream=True)))[0] == "RequestReceived"


@pytest.mark.parametrize(
    "trailers",
    [[(b":path", b"/x")], [(b"connection", b"close")], [(b"X-Upper", b"1")]],
    ids=["pseudo", "connection-specific", "upper-case"],
)
def test_malformed_trailers_reset_the_stream(trailers):
    """Trailers go to an HTTP/2 upstream as they came: what HTTP/2 forbids in them resets
    the stream instead."""
    session, peer = server()
    session.receive(peer.headers(1, POST))
    events = session.receive(peer.headers(1, trailers, end_stream=True))
    assert kinds(events) == ["StreamReset"]
    assert rsts(parsed(session.take())) == [(1, PROTOCOL_ERROR)]


# -- refusals -----------------------------------------------------------------------------


def test_streams_beyond_max_concurrent_streams_are_refused_and_their_heads_decoded():
    session, peer = server(max_concurrent_streams=2)
    post = POST
    session.receive(peer.headers(1, post) + peer.headers(3, post))
    # Stream 5's head adds a field to the peer's table; refused, it must still be read.
    indexed = [(b"x-session", b"s" * 40)]
    events = session.receive(peer.headers(5, [*post, *indexed]))
    assert events == []
    assert rsts(parsed(session.take())) == [(5, REFUSED_STREAM)]
    assert sorted(session.streams) == [1, 3]
    assert session.receive(peer.data(5, b"late")) == []  # (its body, sent before the reset)
    session.receive(peer.data(1, b"", end_stream=True))
    session.send_headers(1, OK, end_stream=True)
    events = session.receive(peer.headers(7, [*GET, *indexed], end_stream=True))
    assert described(events)[0] == (
        "RequestReceived",
        ("stream_id", 7),
        ("headers", [*GET, *indexed]),
        ("end_stream", True),
    )


def test_after_goaway_new_streams_are_refused_and_open_ones_go_on():
    session, peer = server()
    session.receive(peer.headers(1, POST))
    session.goaway(NO_ERROR)
    assert [(f.last_stream_id, f.error_code) for f in parsed(session.take())] == [(1, NO_ERROR)]
    assert not session.terminated
    assert session.receive(peer.headers(3, GET, end_stream=True)) == []
    assert rsts(parsed(session.take())) == [(3, REFUSED_STREAM)]
    assert kinds(session.receive(peer.data(1, b"body", end_stream=True))) == [
        "DataReceived",
        "StreamEnded",
    ]
    session.send_headers(1, OK, end_stream=True)
    assert [type(f) for f in parsed(session.take())] == [HeadersFrame]
    assert session.streams == {}


def test_goaway_with_an_error_ends_the_session():
    session, peer = server()
    session.receive(peer.headers(1, GET, end_stream=True))
    session.goaway(PROTOCOL_ERROR)
    assert session.terminated
    assert session.receive(peer.headers(3, GET, end_stream=True)) == []
    with pytest.raises(ProtocolError):
        session.send_headers(1, OK)


# -- the others ---------------------------------------------------------------------------


def test_a_ping_is_answered_with_its_payload():
    session, _ = server()
    assert session.receive(PingFrame(0, b"\x01\x02\x03\x04\x05\x06\x07\x08").serialize()) == []
    frames = parsed(session.take())
    assert [(type(f), f.flags, f.opaque_data) for f in frames] == [
        (PingFrame, {"ACK"}, b"\x01\x02\x03\x04\x05\x06\x07\x08")
    ]
    assert session.receive(PingFrame(0, b"x" * 8, flags=["ACK"]).serialize()) == []
    assert session.take() == b""


def test_frames_of_unknown_type_are_ignored():
    session, peer = server()
    assert session.receive(raw(0xEE, 0xFF, 0, b"whatever") + raw(0x10, 0, 1, b"")) == []
    assert session.take() == b""
    assert kinds(session.receive(peer.headers(1, GET, end_stream=True)))[0] == "RequestReceived"


def test_priority_frames_are_taken_and_a_self_dependency_refused():
    session, _ = server()
    priority = PriorityFrame(3, depends_on=1, stream_weight=16).serialize()
    assert described(session.receive(priority)) == [("PriorityUpdated", ("stream_id", 3))]
    connection_error(session, PriorityFrame(3, depends_on=3).serialize(), PROTOCOL_ERROR)


# -- the frames at every byte boundary ----------------------------------------------------


def conversation() -> bytes:
    """What an h2 client sends for a few requests of every kind, recorded."""
    peer = h2_client()
    peer.send_headers(1, [(b":method", b"POST"), *GET[1:], (b"content-length", b"10")])
    peer.send_data(1, b"0123456789", end_stream=True)
    peer.send_headers(3, [*GET, (b"cookie", b"a=1; b=2"), (b"x-long", b"y" * 300)])
    peer.ping(b"pingping")
    peer.send_data(3, b"abc", pad_length=20)
    peer.send_headers(5, [*GET, (b"x-long", b"y" * 300)], end_stream=True, priority_weight=10)
    peer.send_headers(3, [(b"x-trailer", b"t")], end_stream=True)
    peer.reset_stream(5)
    peer.increment_flow_control_window(1000)
    return peer.data_to_send()


def replayed(chunks: list[bytes]) -> tuple[list[tuple[Any, ...]], bytes]:
    session = Session(False)
    session.initiate()
    events = []
    out = session.take()
    for chunk in chunks:
        events += described(session.receive(chunk))
        out += session.take()
    return events, out


def test_the_conversation_makes_the_events_expected():
    events, _ = replayed([conversation()])
    assert [e[0] for e in events] == [
        "RemoteSettingsChanged",
        "RequestReceived",
        "DataReceived",
        "StreamEnded",
        "RequestReceived",
        "DataReceived",
        "PriorityUpdated",
        "RequestReceived",
        "StreamEnded",
        "TrailersReceived",
        "StreamEnded",
        "StreamReset",
        "WindowUpdated",
    ]


def test_the_frames_a_byte_at_a_time_make_the_same_events():
    data = conversation()
    whole = replayed([data])
    assert replayed([data[i : i + 1] for i in range(len(data))]) == whole


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4000), max_size=30))
def test_the_frames_in_any_chunks_make_the_same_events(cuts):
    data = conversation()
    points = sorted({min(cut, len(data)) for cut in cuts})
    edges = [0, *points, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(edges)]
    assert replayed(chunks) == replayed([data])


def test_a_lowered_header_table_size_is_answered_with_a_size_update():
    session, peer = with_h2_client()
    peer.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    peer.send_headers(1, GET, end_stream=True)
    to_session(session, peer)
    to_peer(session, peer)  # (our ACK: h2's decoder now refuses a table left at 4096)
    session.send_headers(1, [*OK, (b"x-a", b"1")], end_stream=True)
    data = session.take()
    assert parsed(data)[0].data[:1] == b"\x20"
    assert peer.receive_data(data)[0].headers == [*OK, (b"x-a", b"1")]


def test_send_data_is_held_to_the_peers_frame_size():
    session, peer = with_h2_server(initial_window_size=100_000)
    peer.increment_flow_control_window(100_000)
    to_session(session, peer)
    stream_id = request(session, b"POST", end_stream=False)
    with pytest.raises(ProtocolError) as raised:
        session.send_data(stream_id, b"x" * 16385)
    assert raised.value.code == FRAME_SIZE_ERROR
    session.send_data(stream_id, b"x" * 16384, end_stream=True)
    events = to_peer(session, peer)
    assert sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived)) == 16384


# -- any bytes --------------------------------------------------------------------------

hostile_frames = st.lists(
    st.builds(
        raw,
        st.one_of(st.integers(0, 10), st.integers(0, 255)),
        st.integers(0, 255),
        st.sampled_from([0, 1, 2, 3, 5, 7, MAX_WINDOW]),
        st.one_of(
            st.binary(max_size=40),
            st.sampled_from([hpack.Encoder().encode(GET), hpack.Encoder().encode(OK)]),
        ),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), hostile_frames)
def test_any_frames_make_events_or_a_protocol_error_and_nothing_else(client_side, frames):
    session, _ = client() if client_side else server()
    if client_side:
        request(session, b"POST", end_stream=False)
        session.take()
    code = -1
    try:
        for data in frames:
            session.receive(data)
    except ProtocolError as error:
        code = error.code
    out = parsed(session.take())  # whole frames, which hyperframe reads
    if code >= 0:
        assert isinstance(out[-1], GoAwayFrame)
        assert out[-1].error_code == code
