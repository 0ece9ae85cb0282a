"""Splice buffers: never read into while a transport holds what was written from them."""

from __future__ import annotations

from gateway.wire.splice import READ_SIZE, SPLICE_SIZE, Buffers, Reader, Splice


class _Transport:
    """Holds what it is given, without copying it, until ``send(n)`` sends the oldest bytes."""

    def __init__(self) -> None:
        self.held: list[memoryview] = []
        self.sent = bytearray()

    def write(self, data: memoryview) -> None:
        self.held.append(data)

    def get_write_buffer_size(self) -> int:
        return sum(len(data) for data in self.held)

    def send(self, nbytes: int) -> None:
        while nbytes and self.held:
            data = self.held[0]
            taken = data[:nbytes]
            self.sent += taken
            nbytes -= len(taken)
            if len(taken) == len(data):
                self.held.pop(0)
            else:
                self.held[0] = data[len(taken) :]


def _read(splice: Splice, transport: _Transport, data: bytes) -> None:
    """What a protocol does: a read into ``buffer()``, then a write of it."""
    buffer = splice.buffer(transport)  # type: ignore[arg-type]
    buffer[: len(data)] = data
    transport.write(splice.view(len(data)))
    splice.wrote(len(data))


def test_a_buffer_is_read_into_again_only_once_the_transport_sent_it() -> None:
    transport, pool = _Transport(), Buffers()
    splice = Splice(pool)
    pieces = [bytes([n]) * 1000 for n in range(20)]
    for n, piece in enumerate(pieces):
        _read(splice, transport, piece)
        transport.send(1500 if n % 3 else 0)  # sometimes nothing, never all
    transport.send(len(pieces) * 1000)
    assert bytes(transport.sent) == b"".join(pieces)


def test_buffers_are_reused_and_go_back_to_the_pool() -> None:
    transport, pool = _Transport(), Buffers()
    splice = Splice(pool)
    seen = set()
    for n in range(10):
        _read(splice, transport, bytes([n]) * SPLICE_SIZE)
        seen.add(id(transport.held[-1].obj))
        transport.send(SPLICE_SIZE if n else 0)  # the transport lags one write behind
    assert len(seen) == 2
    transport.send(SPLICE_SIZE)
    splice.close(transport)  # type: ignore[arg-type]
    assert id(pool.take().obj) in seen


def test_a_buffer_still_held_at_the_end_is_left_to_the_transport() -> None:
    transport, pool = _Transport(), Buffers()
    splice = Splice(pool)
    _read(splice, transport, b"x" * 10)
    held = transport.held[-1].obj
    splice.close(transport)  # type: ignore[arg-type]
    assert pool.take().obj is not held


def test_the_scratch_buffer_is_made_at_the_first_read_copied_out_of_it() -> None:
    """A loop whose connections splice no large body holds no read buffer of its own (uvloop
    reads into its own): the scratch one is made by the first read that goes into it, then
    kept for every later one."""
    pool = Buffers()
    assert pool._scratch is None
    reader, copied = Reader(pool), []
    first = reader.buffer(None)
    assert len(first) == READ_SIZE
    assert pool._scratch is first
    first[:3] = b"abc"
    assert reader.spliced(3, copied.append) is None
    assert copied == [b"abc"]
    assert Reader(pool).buffer(None) is first
