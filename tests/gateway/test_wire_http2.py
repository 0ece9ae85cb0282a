"""``wire.http2.FrameLengths``: a frame over the limit seen at its header, however the bytes
are cut into reads; whether a header block is open, from the frames' headers. And
``control_frames``: the control frames among those the gateway writes."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import pytest
from hyperframe.frame import PingFrame, RstStreamFrame, SettingsFrame

from gateway.wire.http2 import PREFACE, FrameLengths, control_frames


def frame(length: int, body: bool = True) -> bytes:
    """A DATA frame on stream 1 announcing ``length`` (its body too if ``body``)."""
    return length.to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01" + b"x" * length * body


def first_oversized(reads: list[bytes], limit: int = 16) -> tuple[int, int]:
    """The read at which an oversized frame was seen, and its length; (-1, -1) if none."""
    lengths = FrameLengths(limit)
    for index, data in enumerate(reads):
        length = lengths.oversized(data)
        if length >= 0:
            return index, length
    return -1, -1


def bytewise(data: bytes) -> list[bytes]:
    return [data[at : at + 1] for at in range(len(data))]


@pytest.mark.parametrize(
    ("reads", "seen"),
    [
        ([PREFACE + frame(16) + frame(0) + frame(16)], (-1, -1)),
        ([PREFACE + frame(16) + frame(17)], (0, 17)),
        ([PREFACE, frame(3), frame((1 << 24) - 1, body=False)], (2, (1 << 24) - 1)),
        (bytewise(PREFACE + frame(5) + frame(40, body=False)), (len(PREFACE) + 14 + 8, 40)),
        (bytewise(PREFACE + frame(16)), (-1, -1)),
        # The preface's bytes are never read as a frame header, whatever they announce.
        ([PREFACE[:10], PREFACE[10:] + frame(2)[:4], frame(2)[4:] + frame(99)], (2, 99)),
    ],
    ids=["within", "one_over", "announced", "byte_by_byte", "byte_by_byte_within", "split"],
)
def test_an_oversized_frame_is_seen_at_its_header(
    reads: list[bytes], seen: tuple[int, int]
) -> None:
    assert first_oversized(reads) == seen


def typed(kind: int, flags: int, body: bytes = b"h") -> bytes:
    return len(body).to_bytes(3, "big") + bytes([kind, flags]) + b"\x00\x00\x00\x01" + body


@pytest.mark.parametrize(
    ("frames", "open_after"),
    [
        ([typed(0x1, 0x4)], [False]),  # HEADERS with END_HEADERS
        ([typed(0x1, 0x1)], [True]),  # HEADERS with END_STREAM alone: CONTINUATION follows
        ([typed(0x1, 0x0), typed(0x9, 0x0), typed(0x9, 0x4)], [True, True, False]),
        ([typed(0x1, 0x0), typed(0x9, 0x4), typed(0x0, 0x1)], [True, False, False]),
        ([typed(0x0, 0x0), typed(0x6, 0x0)], [False, False]),  # DATA, PING
    ],
)
@pytest.mark.parametrize("cut", ["whole", "bytewise"])
def test_a_header_block_is_open_from_a_headers_frame_without_end_headers_to_its_end(
    frames: list[bytes], open_after: list[bool], cut: str
) -> None:
    lengths = FrameLengths(16)
    assert lengths.oversized(PREFACE) == -1
    seen = []
    for data in frames:
        for read in bytewise(data) if cut == "bytewise" else [data]:
            assert lengths.oversized(read) == -1
        seen.append(lengths.block_open)
    assert seen == open_after


def test_control_frames_are_counted_among_what_is_written() -> None:
    """PING, SETTINGS and RST_STREAM count; HEADERS, DATA, WINDOW_UPDATE and GOAWAY do not,
    whatever their length."""
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()  # SETTINGS
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "http"),
                            (":authority", "a")])  # fmt: skip
    server.receive_data(client.data_to_send())  # a SETTINGS acknowledgement made
    server.send_headers(1, [(":status", "200")])
    server.send_data(1, b"x" * 1000)
    server.acknowledge_received_data(0, 1)
    server.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    ping = PingFrame(0)
    ping.flags.add("ACK")
    written = server.data_to_send() + ping.serialize() + RstStreamFrame(3).serialize()
    assert control_frames(written) == 5  # SETTINGS twice, RST_STREAM twice, PING
    server.close_connection()
    assert control_frames(server.data_to_send()) == 0  # GOAWAY
    assert control_frames(SettingsFrame(0).serialize()[:8]) == 0  # no whole frame
