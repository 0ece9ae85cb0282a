"""``wire.http2.FrameLengths``: a frame over the limit seen at its header, however the bytes
are cut into reads."""

from __future__ import annotations

import pytest

from gateway.wire.http2 import PREFACE, FrameLengths


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
