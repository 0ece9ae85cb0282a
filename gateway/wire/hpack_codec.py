"""HPACK (RFC 7541) for the gateway's HTTP/2 connections, compiled: ``Encoder`` and
``Decoder`` for each HTTP/2 session (``h2_session``), both legs.

The encoder never indexes: a field is sent as an index into the static table when the whole
field is there, else as a literal "without indexing" (or "never indexed", for a field its
sender marked sensitive), naming the field by its static index when the name is there; a
string is Huffman-coded when that is shorter, as nginx sends its answers. The dynamic table
is never used: the encoder keeps no state between header blocks (a decoder's table stays
empty), and so nothing to search or to evict for each field. The cost is bytes: a field sent
again is sent whole again, where ``hpack.Encoder`` would send its index.

The decoder reads what any encoder sends, the dynamic table included, as ``hpack.Decoder``
does and with errors of the same names (``hpack.exceptions``'), which the session turns into
COMPRESSION_ERROR or, for a list over ``max_header_list_size``, into the refusal the
hostile-client defences count on. Huffman strings are decoded with ``hpack_tables``' state
table. A field a peer sent as "never indexed" comes out as a plain pair: the gateway makes
its own fields for the other leg, and its encoder indexes none.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from .hpack_tables import (
    HUFFMAN_CODES,
    HUFFMAN_COMPLETE,
    HUFFMAN_EMIT_SYMBOL,
    HUFFMAN_FAIL,
    HUFFMAN_LENGTHS,
    HUFFMAN_STATES,
    STATIC_TABLE,
)

STATIC_COUNT: Final = len(STATIC_TABLE)


class HPACKError(Exception):
    """A header block that cannot be decoded (``hpack.exceptions``' classes, by name)."""


class HPACKDecodingError(HPACKError):
    """A block cut short, an integer too long, a Huffman string that is no code."""


class InvalidTableIndex(HPACKDecodingError):
    """An index into neither table."""


class InvalidTableSizeError(HPACKDecodingError):
    """A dynamic table size over the one our SETTINGS allow."""


class OversizedHeaderListError(HPACKDecodingError):
    """A header list over ``max_header_list_size``, as it is decoded."""


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
    """Header blocks without a dynamic table, a session's (``h2_session.Session.encoder``):
    it calls ``encode`` for each header block it sends and sets ``header_table_size`` when
    the peer's ``SETTINGS_HEADER_TABLE_SIZE`` changes."""

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


class Decoder:
    """Header blocks read as ``hpack.Decoder`` reads them, a session's
    (``h2_session.Session.decoder``): the dynamic table (RFC 7541 §2.3, §4), Huffman
    strings (with ``hpack_tables``' automaton), and errors of the same names, which the session
    turns into COMPRESSION_ERROR (``HPACKError``) or a refusal of the header list
    (``OversizedHeaderListError``: counted as each field is decoded, so a block of references
    to one large entry stops at the limit). The session sets ``max_header_list_size`` from the
    SETTINGS it sends (``max_allowed_table_size`` stays the default, 4,096)."""

    def __init__(self, max_header_list_size: int = 65536) -> None:
        self.max_header_list_size = max_header_list_size
        """The most a block may decode to: names, values and 32 octets a field."""
        self.max_allowed_table_size = 4096
        """The table size our SETTINGS allow the peer's encoder (acknowledged)."""
        self._limit = 4096
        """The table's size now, as the peer's size updates set it."""
        self._size = 0
        self._entries: deque[tuple[bytes, bytes]] = deque()
        """The dynamic table, newest first (index 62 is its first entry)."""

    @property
    def header_table_size(self) -> int:
        return self._limit

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self._limit = value
        self._shrink()

    def decode(self, data: bytes, raw: bool = False) -> list[tuple[bytes, bytes]]:
        """The fields of one whole header block (bytes: ``raw`` must be true, as ``h2``
        asks)."""
        if not raw:
            raise TypeError("this decoder gives bytes only (raw=True)")
        fields: list[tuple[bytes, bytes]] = []
        inflated = 0
        at = 0
        end = len(data)
        while at < end:
            first = data[at]
            if first & 0x80:
                index, at = integer_at(data, at, 7)
                name, value = self._field(index)
            elif first & 0x40:
                name, value, at = self._literal(data, at, 6)
                self._add(name, value)
            elif first & 0x20:
                if fields:
                    raise HPACKDecodingError("Table size update not at the start of the block")
                size, at = integer_at(data, at, 5)
                if size > self.max_allowed_table_size:
                    raise InvalidTableSizeError("Encoder exceeded max allowable table size")
                self.header_table_size = size
                continue
            else:
                name, value, at = self._literal(data, at, 4)  # never indexed or not
            fields.append((name, value))
            inflated += len(name) + len(value) + 32
            if inflated > self.max_header_list_size:
                raise OversizedHeaderListError(
                    f"A header list larger than {self.max_header_list_size} has been received"
                )
        if self._limit > self.max_allowed_table_size:
            raise InvalidTableSizeError("Encoder did not shrink table size to within the max")
        return fields

    def _field(self, index: int) -> tuple[bytes, bytes]:
        """The field at ``index`` of the static table, then the dynamic one."""
        if 0 < index <= STATIC_COUNT:
            return STATIC_TABLE[index - 1]
        at = index - STATIC_COUNT - 1
        if 0 <= at < len(self._entries):
            return self._entries[at]
        raise InvalidTableIndex(f"Invalid table index {index}")

    def _literal(self, data: bytes, at: int, prefix: int) -> tuple[bytes, bytes, int]:
        """A literal field whose first octet is at ``at`` with a ``prefix``-bit name index:
        name, value and where the next representation begins."""
        if data[at] & ((1 << prefix) - 1):
            index, at = integer_at(data, at, prefix)
            name = self._field(index)[0]
        else:
            name, at = string_at(data, at + 1)
        value, at = string_at(data, at)
        return name, value, at

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 32
        if size > self._limit:
            self._entries.clear()
            self._size = 0
            return
        self._entries.appendleft((name, value))
        self._size += size
        self._shrink()

    def _shrink(self) -> None:
        while self._size > self._limit:
            name, value = self._entries.pop()
            self._size -= len(name) + len(value) + 32


MAX_INTEGER_OCTETS: Final = 5
"""Continuation octets an integer may take (RFC 7541 §5.1 lets a decoder set a limit):
enough for 2^35, where no length or index of a header block can reach."""


def integer_at(data: bytes, at: int, prefix: int) -> tuple[int, int]:
    """The integer with a ``prefix``-bit prefix whose first octet is at ``at``, and where
    what follows it begins."""
    top = (1 << prefix) - 1
    end = len(data)
    if at >= end:
        raise HPACKDecodingError("Truncated header block")
    value = data[at] & top
    at += 1
    if value < top:
        return value, at
    shift = 0
    for _ in range(MAX_INTEGER_OCTETS):
        if at >= end:
            raise HPACKDecodingError("Truncated header block")
        octet = data[at]
        at += 1
        value += (octet & 0x7F) << shift
        if not octet & 0x80:
            return value, at
        shift += 7
    raise HPACKDecodingError("Variable integer representation is too long")


def string_at(data: bytes, at: int) -> tuple[bytes, int]:
    """The string literal whose first octet is at ``at`` (Huffman-coded or not), and where
    what follows it begins."""
    length, start = integer_at(data, at, 7)  # raises for a block cut before it
    end = start + length
    if end > len(data):
        raise HPACKDecodingError("Truncated header block")
    if data[at] & 0x80:
        return huffman_decode(data, start, end), end
    return data[start:end], end


def huffman_decode(data: bytes, at: int, end: int) -> bytes:
    """``data[at:end]`` Huffman-decoded, by ``hpack``'s table of states a nibble at a time
    (``huffman_table``): a code that is no symbol, EOS, or padding that is not the start of
    EOS is an error."""
    out = bytearray()
    state = 0
    flags = HUFFMAN_COMPLETE
    for i in range(at, end):
        octet = data[i]
        entry = HUFFMAN_STATES[(state << 4) + (octet >> 4)]
        flags = (entry >> 8) & 0xFF
        if flags & HUFFMAN_FAIL:
            raise HPACKDecodingError("Invalid Huffman string")
        if flags & HUFFMAN_EMIT_SYMBOL:
            out.append(entry & 0xFF)
        entry = HUFFMAN_STATES[((entry >> 16) << 4) + (octet & 0x0F)]
        flags = (entry >> 8) & 0xFF
        if flags & HUFFMAN_FAIL:
            raise HPACKDecodingError("Invalid Huffman string")
        if flags & HUFFMAN_EMIT_SYMBOL:
            out.append(entry & 0xFF)
        state = entry >> 16
    if not flags & HUFFMAN_COMPLETE:
        raise HPACKDecodingError("Incomplete Huffman string")
    return bytes(out)
