"""``wire.hpack_codec``: the encoder's header blocks, read back by ``hpack``'s decoder, and
the decoder held to ``hpack``'s on the same blocks (an independent implementation of RFC
7541): the same fields, or an error of the same name from both. And ``wire.hpack_tables``:
RFC 7541's tables as ``hpack`` has them, and a Huffman automaton that reads every code."""

from __future__ import annotations

import hpack
import hpack.exceptions
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable
from hypothesis import given
from hypothesis import strategies as st

from gateway.wire.hpack_codec import (
    STATIC_TABLE,
    Decoder,
    Encoder,
    HPACKDecodingError,
    HPACKError,
    InvalidTableIndex,
    OversizedHeaderListError,
    huffman_decode,
)
from gateway.wire.hpack_tables import HUFFMAN_CODES, HUFFMAN_LENGTHS

names = st.one_of(
    st.sampled_from([name for name, _ in STATIC_TABLE]),
    st.binary(min_size=1, max_size=300),
)
values = st.one_of(
    st.sampled_from([value for _, value in STATIC_TABLE]),
    st.binary(max_size=5000),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-/=;, ", max_size=80).map(str.encode),
)
fields = st.lists(st.tuples(names, values), max_size=20)
BIG = 1 << 30


# -- the encoder --------------------------------------------------------------------------


@given(fields, st.booleans())
def test_any_block_decodes_to_the_fields_it_was_made_of(block, huffman):
    decoder = hpack.Decoder(max_header_list_size=BIG)
    encoded = Encoder().encode(block, huffman=huffman)
    assert decoder.decode(encoded, raw=True) == block
    assert len(decoder.header_table.dynamic_entries) == 0  # nothing was indexed


@given(st.lists(fields, min_size=2, max_size=5))
def test_blocks_keep_no_state_between_them(blocks):
    encoder, decoder = Encoder(), hpack.Decoder(max_header_list_size=BIG)
    for block in blocks:
        assert decoder.decode(encoder.encode(block), raw=True) == block


def test_a_whole_static_field_is_one_octet_and_a_static_name_is_named_by_its_index():
    assert Encoder().encode([(b":status", b"200"), (b":method", b"GET")]) == b"\x88\x82"
    # content-type is index 31: past the 4-bit prefix, so 0x0f then 31 - 15.
    assert Encoder().encode([(b"content-type", b"x")], huffman=False) == b"\x0f\x10\x01x"
    assert Encoder().encode([(b"age", b"x")], huffman=False) == b"\x0f\x06\x01x"  # 21


def test_strings_are_huffman_coded_only_when_that_is_shorter():
    # RFC 7541 C.4.1's "www.example.com": 12 octets Huffman-coded, 15 plain.
    block = Encoder().encode([(b":authority", b"www.example.com")])
    assert block == bytes.fromhex("018cf1e3c2e5f23a6ba0ab90f4ff")
    # Octets with long codes would grow: sent as they are.
    raw = bytes(range(1, 9))
    assert Encoder().encode([(b"x-raw", raw)]).endswith(b"\x08" + raw)


def test_sensitive_fields_are_never_indexed_literals():
    block = Encoder().encode(
        [hpack.NeverIndexedHeaderTuple(b"authorization", b"Bearer t"), (b"cookie", b"a=b", True)],
        huffman=False,
    )
    assert block[0] & 0xF0 == 0x10  # never indexed, name by index (23)
    decoded = hpack.Decoder().decode(block, raw=True)
    assert [type(field).__name__ for field in decoded] == ["NeverIndexedHeaderTuple"] * 2
    plain = hpack.Decoder().decode(Encoder().encode([(b"cookie", b"a=b")]), raw=True)
    assert type(plain[0]).__name__ == "HeaderTuple"


def test_str_fields_are_sent_as_utf8():
    assert hpack.Decoder().decode(Encoder().encode([("x-name", "é")]), raw=True) == [
        (b"x-name", "é".encode())
    ]


@pytest.mark.parametrize("limit", [0, 100, 65536])
def test_a_changed_table_limit_gets_a_size_update_to_zero_in_the_next_block_only(limit):
    encoder = Encoder()
    encoder.header_table_size = limit
    assert encoder.header_table_size == limit
    first = encoder.encode([(b":status", b"200")])
    assert first == b"\x20\x88"
    assert encoder.encode([(b":status", b"200")]) == b"\x88"
    decoder = hpack.Decoder()
    decoder.header_table_size = limit  # the limit the decoder's own SETTINGS gave
    assert decoder.decode(first, raw=True) == [(b":status", b"200")]


def test_the_same_limit_again_is_no_change():
    encoder = Encoder()
    encoder.header_table_size = 4096
    assert encoder.encode([(b":status", b"204")]) == b"\x89"


def test_long_names_and_values_take_multi_octet_lengths():
    name, value = b"x-" + b"n" * 200, b"\xff" * 70_000
    block = Encoder().encode([(name, value)])
    assert hpack.Decoder(max_header_list_size=1 << 20).decode(block, raw=True) == [(name, value)]


# -- the decoder --------------------------------------------------------------------------


def decode_both(theirs: hpack.Decoder, ours: Decoder, block: bytes) -> object:
    """What both make of ``block``: the same fields, or an HPACK error from both."""
    try:
        expected: object = [tuple(field) for field in theirs.decode(block, raw=True)]
    except hpack.exceptions.HPACKError as exc:
        expected = type(exc).__name__
    try:
        got: object = ours.decode(block, raw=True)
    except HPACKError as exc:
        got = type(exc).__name__
    assert got == expected
    return got


sizes = st.sampled_from([0, 64, 256, 4096])


@given(st.lists(st.tuples(fields, st.booleans(), st.none() | sizes), min_size=1, max_size=6))
def test_blocks_of_hpacks_encoder_read_as_hpack_reads_them(blocks):
    """The dynamic table included: hpack's encoder indexes as it goes, evicts, resizes."""
    encoder = hpack.Encoder()
    theirs, ours = hpack.Decoder(max_header_list_size=BIG), Decoder(max_header_list_size=BIG)
    for block, huffman, resize in blocks:
        if resize is not None:
            encoder.header_table_size = resize
        assert decode_both(theirs, ours, encoder.encode(block, huffman=huffman)) == block
    assert list(ours._entries) == list(theirs.header_table.dynamic_entries)


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4), sizes)
def test_any_bytes_are_read_as_hpack_reads_them_or_refused_as_it_refuses_them(blocks, allowed):
    theirs, ours = hpack.Decoder(max_header_list_size=4096), Decoder(max_header_list_size=4096)
    theirs.max_allowed_table_size = ours.max_allowed_table_size = allowed
    for block in blocks:
        if isinstance(decode_both(theirs, ours, block), type):
            break  # the connection ends at the first error


@given(fields, st.integers(0, 200))
def test_a_cut_block_is_an_error_or_fewer_fields(block, cut):
    encoded = hpack.Encoder().encode(block)
    decode_both(hpack.Decoder(max_header_list_size=BIG), Decoder(BIG), encoded[:cut])


def test_rfc_7541_c3_requests_without_huffman_coding():
    """Appendix C.3: three requests on one connection, the dynamic table as they leave it."""
    decoder = Decoder()
    first = decoder.decode(bytes.fromhex("828684410f7777772e6578616d706c652e636f6d"), raw=True)
    assert first == [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/"),
        (b":authority", b"www.example.com"),
    ]
    second = decoder.decode(bytes.fromhex("828684be58086e6f2d6361636865"), raw=True)
    assert second[-1] == (b"cache-control", b"no-cache")
    third = decoder.decode(
        bytes.fromhex("828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565"), raw=True
    )
    assert third[-1] == (b"custom-key", b"custom-value")
    assert decoder._size == 164  # C.3.3's table size


def test_rfc_7541_c4_requests_with_huffman_coding():
    decoder = Decoder()
    block = bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff")
    assert decoder.decode(block, raw=True)[-1] == (b":authority", b"www.example.com")


def test_a_bomb_stops_at_the_list_limit_as_it_is_decoded():
    """A 4,000-octet entry, then a million one-octet references to it: refused once the
    fields so far pass ``max_header_list_size``, never built whole."""
    encoder = hpack.Encoder()
    big = encoder.encode([(b"x-big", b"v" * 4000)], huffman=False)  # indexed: 62
    decoder = Decoder(max_header_list_size=65536)
    decoder.decode(big, raw=True)
    with pytest.raises(OversizedHeaderListError):
        decoder.decode(b"\xbe" * 1_000_000, raw=True)


def test_an_index_past_the_tables_is_refused():
    with pytest.raises(InvalidTableIndex):
        Decoder().decode(b"\xbe", raw=True)  # 62, the dynamic table is empty
    with pytest.raises(InvalidTableIndex):
        Decoder().decode(b"\x80", raw=True)  # 0


def test_an_integer_of_too_many_octets_is_refused():
    with pytest.raises(HPACKError):
        Decoder().decode(b"\xff" + b"\x80" * 10 + b"\x01", raw=True)


@given(fields, st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4))
def test_a_damaged_block_is_read_as_hpack_reads_it(block, damage):
    """Valid blocks with octets changed: the errors deep inside a block (a Huffman string
    cut short, an index past the table, a length past the end) are the same."""
    encoded = bytearray(hpack.Encoder().encode(block))
    for at, octet in damage:
        if encoded:
            encoded[at % len(encoded)] = octet
    decode_both(hpack.Decoder(max_header_list_size=BIG), Decoder(BIG), bytes(encoded))


# -- the tables ---------------------------------------------------------------------------


def test_the_tables_are_rfc_7541s_as_hpack_has_them():
    assert STATIC_TABLE == tuple(HeaderTable.STATIC_TABLE)
    assert (HUFFMAN_CODES, HUFFMAN_LENGTHS) == (tuple(REQUEST_CODES), tuple(REQUEST_CODES_LENGTH))


@given(st.binary(max_size=300))
def test_the_automaton_reads_back_every_huffman_string(data):
    """Any octets, Huffman-coded by ``hpack``'s encoder (padded with ones), decode to
    themselves."""
    coded = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(data)
    assert huffman_decode(coded, 0, len(coded)) == data


@pytest.mark.parametrize(
    "coded",
    [
        b"\xff\xff\xff\xff",  # EOS (30 ones), then 11: EOS decoded is an error
        b"\x00",  # '0' (00000) then 000: padding that is not ones
        b"\x1f\xff",  # 'a' (00011), then eleven ones: padding of eight bits or more
    ],
    ids=["eos", "zero-padding", "long-padding"],
)
def test_a_huffman_string_that_is_no_code_is_refused(coded):
    with pytest.raises(HPACKDecodingError):
        huffman_decode(coded, 0, len(coded))
    with pytest.raises(hpack.exceptions.HPACKDecodingError):
        decode_huffman(coded)  # (as hpack's)
