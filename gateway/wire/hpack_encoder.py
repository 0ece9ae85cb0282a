"""An HPACK encoder (RFC 7541) that never indexes: what the gateway sends in header blocks,
in place of ``hpack.Encoder`` on its HTTP/2 connections (``Encoder``).

A field is sent as an index into the static table when the whole field is there, else as a
literal "without indexing" (or "never indexed", for a field its sender marked sensitive),
naming the field by its static index when the name is there; a string is Huffman-coded when
that is shorter, as nginx sends its answers. The dynamic table is never used: the encoder
keeps no state between header blocks (a decoder's table stays empty), and so nothing to
search or to evict for each field. The cost is bytes: a field sent again is sent whole
again, where ``hpack.Encoder`` would send its index.

Decoding stays ``hpack``'s (through ``h2``): a peer's encoder may use its table as it likes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

STATIC_TABLE: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)
HUFFMAN_CODES: Final[tuple[int, ...]] = (
    0x1FF8,
    0x7FFFD8,
    0xFFFFFE2,
    0xFFFFFE3,
    0xFFFFFE4,
    0xFFFFFE5,
    0xFFFFFE6,
    0xFFFFFE7,
    0xFFFFFE8,
    0xFFFFEA,
    0x3FFFFFFC,
    0xFFFFFE9,
    0xFFFFFEA,
    0x3FFFFFFD,
    0xFFFFFEB,
    0xFFFFFEC,
    0xFFFFFED,
    0xFFFFFEE,
    0xFFFFFEF,
    0xFFFFFF0,
    0xFFFFFF1,
    0xFFFFFF2,
    0x3FFFFFFE,
    0xFFFFFF3,
    0xFFFFFF4,
    0xFFFFFF5,
    0xFFFFFF6,
    0xFFFFFF7,
    0xFFFFFF8,
    0xFFFFFF9,
    0xFFFFFFA,
    0xFFFFFFB,
    0x14,
    0x3F8,
    0x3F9,
    0xFFA,
    0x1FF9,
    0x15,
    0xF8,
    0x7FA,
    0x3FA,
    0x3FB,
    0xF9,
    0x7FB,
    0xFA,
    0x16,
    0x17,
    0x18,
    0x0,
    0x1,
    0x2,
    0x19,
    0x1A,
    0x1B,
    0x1C,
    0x1D,
    0x1E,
    0x1F,
    0x5C,
    0xFB,
    0x7FFC,
    0x20,
    0xFFB,
    0x3FC,
    0x1FFA,
    0x21,
    0x5D,
    0x5E,
    0x5F,
    0x60,
    0x61,
    0x62,
    0x63,
    0x64,
    0x65,
    0x66,
    0x67,
    0x68,
    0x69,
    0x6A,
    0x6B,
    0x6C,
    0x6D,
    0x6E,
    0x6F,
    0x70,
    0x71,
    0x72,
    0xFC,
    0x73,
    0xFD,
    0x1FFB,
    0x7FFF0,
    0x1FFC,
    0x3FFC,
    0x22,
    0x7FFD,
    0x3,
    0x23,
    0x4,
    0x24,
    0x5,
    0x25,
    0x26,
    0x27,
    0x6,
    0x74,
    0x75,
    0x28,
    0x29,
    0x2A,
    0x7,
    0x2B,
    0x76,
    0x2C,
    0x8,
    0x9,
    0x2D,
    0x77,
    0x78,
    0x79,
    0x7A,
    0x7B,
    0x7FFE,
    0x7FC,
    0x3FFD,
    0x1FFD,
    0xFFFFFFC,
    0xFFFE6,
    0x3FFFD2,
    0xFFFE7,
    0xFFFE8,
    0x3FFFD3,
    0x3FFFD4,
    0x3FFFD5,
    0x7FFFD9,
    0x3FFFD6,
    0x7FFFDA,
    0x7FFFDB,
    0x7FFFDC,
    0x7FFFDD,
    0x7FFFDE,
    0xFFFFEB,
    0x7FFFDF,
    0xFFFFEC,
    0xFFFFED,
    0x3FFFD7,
    0x7FFFE0,
    0xFFFFEE,
    0x7FFFE1,
    0x7FFFE2,
    0x7FFFE3,
    0x7FFFE4,
    0x1FFFDC,
    0x3FFFD8,
    0x7FFFE5,
    0x3FFFD9,
    0x7FFFE6,
    0x7FFFE7,
    0xFFFFEF,
    0x3FFFDA,
    0x1FFFDD,
    0xFFFE9,
    0x3FFFDB,
    0x3FFFDC,
    0x7FFFE8,
    0x7FFFE9,
    0x1FFFDE,
    0x7FFFEA,
    0x3FFFDD,
    0x3FFFDE,
    0xFFFFF0,
    0x1FFFDF,
    0x3FFFDF,
    0x7FFFEB,
    0x7FFFEC,
    0x1FFFE0,
    0x1FFFE1,
    0x3FFFE0,
    0x1FFFE2,
    0x7FFFED,
    0x3FFFE1,
    0x7FFFEE,
    0x7FFFEF,
    0xFFFEA,
    0x3FFFE2,
    0x3FFFE3,
    0x3FFFE4,
    0x7FFFF0,
    0x3FFFE5,
    0x3FFFE6,
    0x7FFFF1,
    0x3FFFFE0,
    0x3FFFFE1,
    0xFFFEB,
    0x7FFF1,
    0x3FFFE7,
    0x7FFFF2,
    0x3FFFE8,
    0x1FFFFEC,
    0x3FFFFE2,
    0x3FFFFE3,
    0x3FFFFE4,
    0x7FFFFDE,
    0x7FFFFDF,
    0x3FFFFE5,
    0xFFFFF1,
    0x1FFFFED,
    0x7FFF2,
    0x1FFFE3,
    0x3FFFFE6,
    0x7FFFFE0,
    0x7FFFFE1,
    0x3FFFFE7,
    0x7FFFFE2,
    0xFFFFF2,
    0x1FFFE4,
    0x1FFFE5,
    0x3FFFFE8,
    0x3FFFFE9,
    0xFFFFFFD,
    0x7FFFFE3,
    0x7FFFFE4,
    0x7FFFFE5,
    0xFFFEC,
    0xFFFFF3,
    0xFFFED,
    0x1FFFE6,
    0x3FFFE9,
    0x1FFFE7,
    0x1FFFE8,
    0x7FFFF3,
    0x3FFFEA,
    0x3FFFEB,
    0x1FFFFEE,
    0x1FFFFEF,
    0xFFFFF4,
    0xFFFFF5,
    0x3FFFFEA,
    0x7FFFF4,
    0x3FFFFEB,
    0x7FFFFE6,
    0x3FFFFEC,
    0x3FFFFED,
    0x7FFFFE7,
    0x7FFFFE8,
    0x7FFFFE9,
    0x7FFFFEA,
    0x7FFFFEB,
    0xFFFFFFE,
    0x7FFFFEC,
    0x7FFFFED,
    0x7FFFFEE,
    0x7FFFFEF,
    0x7FFFFF0,
    0x3FFFFEE,
    0x3FFFFFFF,
)
HUFFMAN_LENGTHS: Final[tuple[int, ...]] = (
    13,
    23,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    24,
    30,
    28,
    28,
    30,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    30,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    28,
    6,
    10,
    10,
    12,
    13,
    6,
    8,
    11,
    10,
    10,
    8,
    11,
    8,
    6,
    6,
    6,
    5,
    5,
    5,
    6,
    6,
    6,
    6,
    6,
    6,
    6,
    7,
    8,
    15,
    6,
    12,
    10,
    13,
    6,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    7,
    8,
    7,
    8,
    13,
    19,
    13,
    14,
    6,
    15,
    5,
    6,
    5,
    6,
    5,
    6,
    6,
    6,
    5,
    7,
    7,
    6,
    6,
    6,
    5,
    6,
    7,
    6,
    5,
    5,
    6,
    7,
    7,
    7,
    7,
    7,
    15,
    11,
    14,
    13,
    28,
    20,
    22,
    20,
    20,
    22,
    22,
    22,
    23,
    22,
    23,
    23,
    23,
    23,
    23,
    24,
    23,
    24,
    24,
    22,
    23,
    24,
    23,
    23,
    23,
    23,
    21,
    22,
    23,
    22,
    23,
    23,
    24,
    22,
    21,
    20,
    22,
    22,
    23,
    23,
    21,
    23,
    22,
    22,
    24,
    21,
    22,
    23,
    23,
    21,
    21,
    22,
    21,
    23,
    22,
    23,
    23,
    20,
    22,
    22,
    22,
    23,
    22,
    22,
    23,
    26,
    26,
    20,
    19,
    22,
    23,
    22,
    25,
    26,
    26,
    26,
    27,
    27,
    26,
    24,
    25,
    19,
    21,
    26,
    27,
    27,
    26,
    27,
    24,
    21,
    21,
    26,
    26,
    28,
    27,
    27,
    27,
    20,
    24,
    20,
    21,
    22,
    21,
    21,
    23,
    22,
    22,
    25,
    25,
    24,
    24,
    26,
    23,
    26,
    27,
    26,
    26,
    27,
    27,
    27,
    27,
    27,
    28,
    27,
    27,
    27,
    27,
    27,
    26,
    30,
)
"""RFC 7541 Appendix A: the static table (index 1 is its first entry) and Appendix B: the
Huffman code of each octet (and of EOS, 256) and its length in bits."""

STATIC_FIELDS: Final[dict[tuple[bytes, bytes], int]] = {}
"""A field of the static table (name, value) -> its index."""
STATIC_NAMES: Final[dict[bytes, int]] = {}
"""A name of the static table -> its first index."""
for _index, _field in enumerate(STATIC_TABLE, 1):
    STATIC_FIELDS.setdefault(_field, _index)
    STATIC_NAMES.setdefault(_field[0], _index)

SIZE_UPDATE_TO_ZERO: Final = b"\x20"
"""A dynamic table size update (RFC 7541 §6.3) to 0: the encoder's table is empty and stays
so, which any maximum a peer sets allows."""

WITHOUT_INDEXING: Final = 0x00
NEVER_INDEXED: Final = 0x10
"""The first octet of a literal field (RFC 7541 §6.2.2, §6.2.3); its name's index in the low
four bits (0: the name follows as a string)."""


class Encoder:
    """Header blocks without a dynamic table, for ``h2.connection.H2Connection.encoder``:
    ``h2`` calls ``encode`` for each header block it sends and sets ``header_table_size``
    when the peer's ``SETTINGS_HEADER_TABLE_SIZE`` changes."""

    def __init__(self) -> None:
        self._limit = 4096
        self._limit_changed = False

    @property
    def header_table_size(self) -> int:
        """The peer's limit on the table (``SETTINGS_HEADER_TABLE_SIZE``)."""
        return self._limit

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # A peer that lowers its limit may expect a size update in the next block (nghttp2
        # does): one to 0 is always within it.
        if value != self._limit:
            self._limit = value
            self._limit_changed = True

    def encode(self, headers: Iterable[Any], huffman: bool = True) -> bytes:
        """A header block of ``headers``: (name, value) pairs of bytes or str, in order;
        ``hpack``'s ``NeverIndexedHeaderTuple`` or a third item true for a sensitive field.
        ``huffman``: whether a string may be Huffman-coded (when shorter)."""
        block = bytearray()
        if self._limit_changed:
            self._limit_changed = False
            block += SIZE_UPDATE_TO_ZERO
        for header in headers:
            name = header[0]
            value = header[1]
            if isinstance(name, str):
                name = name.encode()
            if isinstance(value, str):
                value = value.encode()
            sensitive = not getattr(header, "indexable", True) or (
                len(header) > 2 and bool(header[2])
            )
            field(block, name, value, sensitive, huffman)
        return bytes(block)


def field(block: bytearray, name: bytes, value: bytes, sensitive: bool, huffman: bool) -> None:
    """Append one field's representation to ``block``."""
    index = STATIC_FIELDS.get((name, value), 0)
    if index:
        block.append(0x80 | index)  # the static table has 61 entries: one octet
        return
    first = NEVER_INDEXED if sensitive else WITHOUT_INDEXING
    index = STATIC_NAMES.get(name, 0)
    if index:
        integer(block, first, 4, index)
    else:
        block.append(first)
        string(block, name, huffman)
    string(block, value, huffman)


def integer(block: bytearray, first: int, prefix: int, value: int) -> None:
    """Append ``value`` as an integer with a ``prefix``-bit prefix (RFC 7541 §5.1), the
    first octet's high bits from ``first``."""
    top = (1 << prefix) - 1
    if value < top:
        block.append(first | value)
        return
    block.append(first | top)
    value -= top
    while value >= 0x80:
        block.append((value & 0x7F) | 0x80)
        value >>= 7
    block.append(value)


def string(block: bytearray, data: bytes, huffman: bool) -> None:
    """Append ``data`` as a string literal (RFC 7541 §5.2): Huffman-coded if ``huffman`` and
    that is shorter."""
    if huffman and data:
        bits = 0
        for octet in data:
            bits += HUFFMAN_LENGTHS[octet]
        size = (bits + 7) >> 3
        if size < len(data):
            integer(block, 0x80, 7, size)
            huffman_code(block, data)
            return
    integer(block, 0x00, 7, len(data))
    block += data


def huffman_code(block: bytearray, data: bytes) -> None:
    """Append ``data`` Huffman-coded, padded with the EOS code's leading ones."""
    pending = 0
    count = 0
    for octet in data:
        pending = (pending << HUFFMAN_LENGTHS[octet]) | HUFFMAN_CODES[octet]
        count += HUFFMAN_LENGTHS[octet]
        while count >= 8:
            count -= 8
            block.append((pending >> count) & 0xFF)
        pending &= (1 << count) - 1
    if count:
        block.append(((pending << (8 - count)) | ((1 << (8 - count)) - 1)) & 0xFF)
