"""``wire.hpack_encoder``: header blocks without a dynamic table, read back by ``hpack``'s
decoder (an independent implementation of RFC 7541)."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.wire.hpack_encoder import STATIC_TABLE, Encoder

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


@given(fields, st.booleans())
def test_any_block_decodes_to_the_fields_it_was_made_of(block, huffman):
    decoder = hpack.Decoder(max_header_list_size=1 << 30)
    encoded = Encoder().encode(block, huffman=huffman)
    assert decoder.decode(encoded, raw=True) == block
    assert len(decoder.header_table.dynamic_entries) == 0  # nothing was indexed


@given(st.lists(fields, min_size=2, max_size=5))
def test_blocks_keep_no_state_between_them(blocks):
    encoder, decoder = Encoder(), hpack.Decoder(max_header_list_size=1 << 30)
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
