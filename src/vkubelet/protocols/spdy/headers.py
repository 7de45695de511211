"""SPDY/3 header blocks: the name/value layout and its connection-wide zlib compression.

Each direction of a connection is one zlib stream, primed with the SPDY/3 dictionary and
sync-flushed after every block. The context carries over from block to block, so every header
block must pass through the same encoder/decoder in frame order, including blocks of frames we
otherwise ignore. Losing one block desynchronises the rest, which is why any decoding failure
is fatal to the connection rather than to a stream.

Uncompressed layout: ``u32 count``, then per pair ``u32 len, name, u32 len, value``. Names are
lower-case; several values for one name travel NUL-joined in a single value.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Mapping

_U32 = struct.Struct(">I")

# The dictionary of SPDY/3 (draft-mbelshe-httpbis-spdy-00, section 2.6.10.1): 65 length-prefixed
# words followed by raw text. It must match the peer's byte for byte (1423 bytes), or the peer's
# inflater rejects our very first header block. Written as data rather than as a hex dump so a
# reader can check it; a unit test pins its length and SHA-256.
_DICTIONARY_WORDS = (
    "options", "head", "post", "put", "delete", "trace", "accept", "accept-charset",
    "accept-encoding", "accept-language", "accept-ranges", "age", "allow", "authorization",
    "cache-control", "connection", "content-base", "content-encoding", "content-language",
    "content-length", "content-location", "content-md5", "content-range", "content-type",
    "date", "etag", "expect", "expires", "from", "host", "if-match", "if-modified-since",
    "if-none-match", "if-range", "if-unmodified-since", "last-modified", "location",
    "max-forwards", "pragma", "proxy-authenticate", "proxy-authorization", "range", "referer",
    "retry-after", "server", "te", "trailer", "transfer-encoding", "upgrade", "user-agent",
    "vary", "via", "warning", "www-authenticate", "method", "get", "status", "200 OK",
    "version", "HTTP/1.1", "url", "public", "set-cookie", "keep-alive", "origin",
)  # fmt: skip
_DICTIONARY_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505"
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request"
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented"
    "503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 "
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,"
    "application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age="
    "gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
)
SPDY3_DICTIONARY: bytes = b"".join(
    _U32.pack(len(w)) + w.encode("ascii") for w in _DICTIONARY_WORDS
) + _DICTIONARY_TAIL.encode("ascii")

DEFAULT_MAX_HEADER_BLOCK = 64 * 1024


class HeaderBlockError(Exception):
    """A header block could not be decoded; the compression context is no longer trustworthy."""


def pack_header_block(headers: Iterable[tuple[str, str]]) -> bytes:
    """Lay out name/value pairs uncompressed. Names are lower-cased, as SPDY requires."""
    pairs = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
    out = bytearray(_U32.pack(len(pairs)))
    for name, value in pairs:
        out += _U32.pack(len(name)) + name + _U32.pack(len(value)) + value
    return bytes(out)


def unpack_header_block(raw: bytes) -> dict[str, str]:
    """Parse an uncompressed block. Bytes map to str through latin-1, which cannot fail and
    loses nothing; values keep their NUL separators."""
    if len(raw) < 4:
        raise HeaderBlockError("header block shorter than its count field")
    (count,) = _U32.unpack_from(raw)
    # Each pair needs at least 8 bytes of lengths, so a huge count is refused before looping.
    if count > (len(raw) - 4) // 8:
        raise HeaderBlockError(f"header block claims {count} pairs in {len(raw)} bytes")
    headers: dict[str, str] = {}
    pos = 4
    for _ in range(count):
        name, pos = _read_string(raw, pos)
        value, pos = _read_string(raw, pos)
        if not name:
            raise HeaderBlockError("empty header name")
        key = name.decode("latin-1").lower()
        if key in headers:
            raise HeaderBlockError(f"duplicate header {key!r}")
        headers[key] = value.decode("latin-1")
    if pos != len(raw):
        raise HeaderBlockError(f"{len(raw) - pos} stray bytes after the last header")
    return headers


def _read_string(raw: bytes, pos: int) -> tuple[bytes, int]:
    if pos + 4 > len(raw):
        raise HeaderBlockError("header block truncated in a length field")
    (n,) = _U32.unpack_from(raw, pos)
    pos += 4
    if pos + n > len(raw):
        raise HeaderBlockError("header block truncated in a name or value")
    return raw[pos : pos + n], pos + n


class HeaderEncoder:
    """Compresses our outgoing header blocks. One per connection, used for every block we send."""

    def __init__(self) -> None:
        # Level 9 matches the Go peer's writer; the other arguments are zlib's defaults.
        self._z = zlib.compressobj(
            9, zlib.DEFLATED, 15, 8, zlib.Z_DEFAULT_STRATEGY, zdict=SPDY3_DICTIONARY
        )

    def encode(self, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> bytes:
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        raw = pack_header_block(pairs)
        return self._z.compress(raw) + self._z.flush(zlib.Z_SYNC_FLUSH)


class HeaderDecoder:
    """Decompresses the peer's header blocks, refusing any that inflate beyond ``max_size``.

    The limit is enforced while inflating (``max_length``), so a small frame that expands to
    gigabytes costs at most ``max_size + 1`` bytes before it is rejected.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_HEADER_BLOCK) -> None:
        if max_size < 4:
            raise ValueError("max_size must allow at least the 4-byte count")
        self.max_size = max_size
        self._z = zlib.decompressobj(15, zdict=SPDY3_DICTIONARY)

    def decode(self, block: bytes) -> dict[str, str]:
        return unpack_header_block(self.decompress(block))

    def decompress(self, block: bytes) -> bytes:
        """Inflate one block without parsing it; frames we ignore still go through here so the
        shared context stays in step with the peer's."""
        try:
            raw = self._z.decompress(block, self.max_size + 1)
        except zlib.error as exc:
            raise HeaderBlockError(f"header block does not inflate: {exc}") from None
        if len(raw) > self.max_size or self._z.unconsumed_tail:
            raise HeaderBlockError(f"header block inflates beyond {self.max_size} bytes")
        if self._z.eof:
            raise HeaderBlockError("peer ended its header compression stream")
        return raw
