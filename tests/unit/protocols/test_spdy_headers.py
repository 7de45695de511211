import hashlib
import struct
import zlib

import pytest

from vkubelet.protocols.spdy.headers import (
    SPDY3_DICTIONARY,
    HeaderBlockError,
    HeaderDecoder,
    HeaderEncoder,
    pack_header_block,
    unpack_header_block,
)

from .spdy_peer import GO_BLOCKS


def test_dictionary_is_the_1423_byte_spdy3_constant() -> None:
    assert len(SPDY3_DICTIONARY) == 1423
    # SHA-256 of the headerDictionary bytes in moby/spdystream v0.5.1 spdy/dictionary.go.
    assert (
        hashlib.sha256(SPDY3_DICTIONARY).hexdigest()
        == "51d27341373f923f3cd88e1eb7162aeaa3723d7585ff2399201dc06498407f02"
    )
    assert SPDY3_DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert SPDY3_DICTIONARY.endswith(b",*,enq=0.")


def test_go_written_header_blocks_decode_in_sequence() -> None:
    decoder = HeaderDecoder()
    assert [decoder.decode(b) for b in GO_BLOCKS] == [
        {"streamtype": "error"},
        {"streamtype": "stdout"},
        {"port": "8080", "requestid": "0", "streamtype": "data"},
        {},
    ]


def test_go_blocks_need_the_shared_context_so_a_fresh_decoder_fails_midstream() -> None:
    with pytest.raises(HeaderBlockError):
        HeaderDecoder().decode(GO_BLOCKS[1])


def test_encoded_blocks_round_trip_through_one_shared_context() -> None:
    encoder, decoder = HeaderEncoder(), HeaderDecoder()
    blocks = [{"streamtype": "error"}, {}, {"a": "1", "b": "x\x00y"}, {"streamtype": "error"}]
    wire = [encoder.encode(h) for h in blocks]
    assert [decoder.decode(w) for w in wire] == blocks
    # The context is shared: repeating a block costs far less than its first appearance.
    assert len(wire[3]) < len(wire[0])


def test_each_encoded_block_ends_with_a_sync_flush_marker() -> None:
    encoder = HeaderEncoder()
    for headers in ({}, {"streamtype": "stdin"}):
        assert encoder.encode(headers).endswith(b"\x00\x00\xff\xff")


def test_encoder_output_inflates_with_plain_zlib_and_the_same_dictionary() -> None:
    block = HeaderEncoder().encode({"streamtype": "resize"})
    raw = zlib.decompressobj(zdict=SPDY3_DICTIONARY).decompress(block)
    assert unpack_header_block(raw) == {"streamtype": "resize"}


def test_header_names_are_lower_cased_both_ways() -> None:
    assert unpack_header_block(pack_header_block([("StreamType", "Error")])) == {
        "streamtype": "Error"
    }
    raw = struct.pack(">I", 1) + struct.pack(">I", 4) + b"PORT" + struct.pack(">I", 2) + b"80"
    assert unpack_header_block(raw) == {"port": "80"}


def test_header_block_that_inflates_past_the_limit_is_refused_without_inflating_it_all() -> None:
    # A 16 MiB value compresses to ~16 KiB; the decoder must stop at its limit.
    encoder = HeaderEncoder()
    bomb = encoder.encode({"x": "a" * (16 << 20)})
    assert len(bomb) < 32 * 1024
    decoder = HeaderDecoder(max_size=4096)
    with pytest.raises(HeaderBlockError, match="beyond 4096"):
        decoder.decode(bomb)


def test_block_exactly_at_the_limit_is_accepted() -> None:
    headers = {"k": "v" * 100}
    size = len(pack_header_block(headers.items()))
    assert HeaderDecoder(max_size=size).decode(HeaderEncoder().encode(headers)) == headers
    with pytest.raises(HeaderBlockError):
        HeaderDecoder(max_size=size - 1).decode(HeaderEncoder().encode(headers))


def test_garbage_that_is_not_zlib_is_refused() -> None:
    with pytest.raises(HeaderBlockError, match="does not inflate"):
        HeaderDecoder().decode(b"\x00\x01\x02\x03garbage")


def test_a_finished_zlib_stream_is_refused_since_later_blocks_could_not_follow() -> None:
    z = zlib.compressobj(zdict=SPDY3_DICTIONARY)
    block = z.compress(pack_header_block([])) + z.flush(zlib.Z_FINISH)
    with pytest.raises(HeaderBlockError, match="ended"):
        HeaderDecoder().decode(block)


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x00\x00", "shorter than its count"),
        (u32(0xFFFFFFFF), "claims"),
        (u32(1) + u32(1) + b"a" + u32(5) + b"ab", "truncated in a name or value"),
        (u32(1) + u32(1) + b"a" + b"\x00\x00", "claims"),
        (u32(2) + (u32(1) + b"a" + u32(0)) * 2, "duplicate"),
        (u32(2) + u32(1) + b"a" + u32(0) + u32(1) + b"A" + u32(0), "duplicate"),
        (u32(1) + u32(0) + u32(1) + b"v", "empty header name"),
        (u32(0) + b"\x00", "stray"),
        (u32(1) + u32(1) + b"a" + u32(0) + b"zz", "stray"),
    ],
)
def test_malformed_uncompressed_blocks_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(HeaderBlockError, match=message):
        unpack_header_block(raw)


def test_values_keep_their_nul_separators_and_arbitrary_bytes() -> None:
    raw = u32(1) + u32(1) + b"v" + u32(5) + b"a\x00\xffb\x00"
    assert unpack_header_block(raw) == {"v": "a\x00\xffb\x00"}
