"""FrameCursor: frame boundaries of a WebSocket byte stream, fed in any split."""

from __future__ import annotations

import os
import struct

import pytest

from gateway.proxy.websocket import FrameCursor, close_frame


def frame(opcode: int, payload: bytes, *, masked: bool = False) -> bytes:
    n = len(payload)
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head = bytes((0x80 | opcode, mask_bit | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, mask_bit | 126)) + struct.pack("!H", n)
    else:
        head = bytes((0x80 | opcode, mask_bit | 127)) + struct.pack("!Q", n)
    if masked:
        mask = os.urandom(4)
        return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + payload


STREAM = (
    frame(1, b"hello")
    + frame(9, b"ping", masked=True)
    + frame(2, b"x" * 300)
    + frame(2, b"y" * 70_000, masked=True)
    + frame(0xA, b"")
)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 100, 65_536, len(STREAM)])
def test_payload_of_data_frames_is_counted_in_any_split(piece):
    cursor = FrameCursor()
    for i in range(0, len(STREAM), piece):
        cursor.feed(STREAM[i : i + piece])
    assert cursor.payload == 5 + 300 + 70_000
    assert cursor.at_boundary
    assert not cursor.closed


def test_boundary_and_close_are_seen():
    cursor = FrameCursor()
    data = frame(1, b"abc") + close_frame(1001, masked=True)
    cursor.feed(data[:3])
    assert not cursor.at_boundary
    cursor.feed(data[3:6])
    assert not cursor.closed
    cursor.feed(data[6:])
    assert cursor.at_boundary
    assert cursor.closed


@pytest.mark.parametrize("masked", [False, True])
def test_close_frame_carries_the_code(masked):
    data = close_frame(1001, masked=masked)
    assert data[0] == 0x88
    assert bool(data[1] & 0x80) is masked
    payload = data[6:] if masked else data[2:]
    if masked:
        mask = data[2:6]
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    assert struct.unpack("!H", payload)[0] == 1001
