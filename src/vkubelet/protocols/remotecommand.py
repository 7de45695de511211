"""Exec/attach semantics the kubelet owes its clients, whichever transport carries them.

Over SPDY each stdio stream is its own SPDY stream, named by a ``streamtype`` header; over
WebSocket each is a numbered channel (see ``channel``). Everything else is shared: which
protocol versions exist and what they change, which streams a request expects, how the exit
status is written, and how terminal resizes are encoded. The behaviour mirrors the kubelet's
CRI streaming server and client-go's executors, which are what the apiserver speaks.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Final

from .channel import ChannelFraming

HEADER_PROTOCOL_VERSION: Final = "X-Stream-Protocol-Version"
HEADER_ACCEPTED_PROTOCOL_VERSIONS: Final = "X-Accepted-Stream-Protocol-Versions"
# SPDY header names arrive lower-cased: client-go's "streamType" is "streamtype" on the wire.
HEADER_STREAM_TYPE: Final = "streamtype"


class StreamType(StrEnum):
    ERROR = "error"
    STDIN = "stdin"
    STDOUT = "stdout"
    STDERR = "stderr"
    RESIZE = "resize"


class Channel(IntEnum):
    """WebSocket channel numbers for exec/attach."""

    STDIN = 0
    STDOUT = 1
    STDERR = 2
    ERROR = 3
    RESIZE = 4


@dataclass(frozen=True, slots=True)
class ExecProtocol:
    """A negotiated exec/attach protocol. ``name`` is what to echo back ("" means the client
    asked for none, which only WebSocket allows)."""

    name: str
    version: int
    websocket: bool
    base64: bool = False

    @property
    def supports_resize(self) -> bool:
        # The WebSocket server always opens the resize channel; SPDY gained it in v3.
        return self.websocket or self.version >= 3

    @property
    def json_status(self) -> bool:
        """v4 and later write a metav1.Status JSON; earlier versions write plain text."""
        return self.version >= 4

    @property
    def framing(self) -> ChannelFraming:
        """How WebSocket messages are framed under this protocol."""
        return ChannelFraming(base64=self.base64, stream_close=self.websocket and self.version >= 5)


def _spdy(name: str, version: int) -> ExecProtocol:
    return ExecProtocol(name, version, websocket=False)


def _ws(name: str, version: int, base64: bool = False) -> ExecProtocol:
    return ExecProtocol(name, version, websocket=True, base64=base64)


# v5 over SPDY behaves exactly like v4 (client-go's v5 handler delegates to v4); offering it
# just saves the client a fallback step.
SPDY_EXEC_PROTOCOLS: Final[Mapping[str, ExecProtocol]] = {
    p.name: p
    for p in (
        _spdy("v5.channel.k8s.io", 5),
        _spdy("v4.channel.k8s.io", 4),
        _spdy("v3.channel.k8s.io", 3),
        _spdy("v2.channel.k8s.io", 2),
        _spdy("channel.k8s.io", 1),
    )
}

# The kubelet's own WebSocket server offers "", channel.k8s.io, base64.channel.k8s.io and the
# v4 pair. We add v5.channel.k8s.io, the apiserver's WebSocket dialect (v4 plus the stream-close
# signal on channel 255), so a v5 client that reaches us untranslated still gets a session.
WEBSOCKET_EXEC_PROTOCOLS: Final[Mapping[str, ExecProtocol]] = {
    p.name: p
    for p in (
        _ws("v5.channel.k8s.io", 5),
        _ws("v4.channel.k8s.io", 4),
        _ws("v4.base64.channel.k8s.io", 4, base64=True),
        _ws("channel.k8s.io", 1),
        _ws("base64.channel.k8s.io", 1, base64=True),
        _ws("", 1),
    )
}


# What a client offers. Over WebSocket only v5: a v4 server (reached when the apiserver proxies
# rather than translates) has no way to hear that stdin ended, so client-go refuses it and falls
# back to SPDY instead. Over SPDY everything, newest first, as client-go's SPDY executor does.
CLIENT_WEBSOCKET_EXEC_PROTOCOLS: Final = ("v5.channel.k8s.io",)
CLIENT_SPDY_EXEC_PROTOCOLS: Final = tuple(SPDY_EXEC_PROTOCOLS)


def split_protocol_header(values: Iterable[str]) -> list[str]:
    """Flatten repeated, comma-separated header values into a list, dropping blanks."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def choose_protocol(offered: Sequence[str], supported: Iterable[str]) -> str | None:
    """The first offered protocol we support. The client's order wins, as in the Go server."""
    allowed = set(supported)
    return next((p for p in offered if p in allowed), None)


def negotiate_spdy_exec(header_values: Iterable[str]) -> ExecProtocol | None:
    """Pick from the request's X-Stream-Protocol-Version values. None means: answer 400 if the
    header was missing, else 403, listing ours in X-Accepted-Stream-Protocol-Versions."""
    name = choose_protocol(split_protocol_header(header_values), SPDY_EXEC_PROTOCOLS)
    return None if name is None else SPDY_EXEC_PROTOCOLS[name]


def negotiate_websocket_exec(subprotocols: Sequence[str]) -> ExecProtocol | None:
    """Pick from Sec-WebSocket-Protocol. No subprotocol at all selects the unversioned binary
    protocol, as the Go server does."""
    offered = list(subprotocols) or [""]
    name = choose_protocol(offered, WEBSOCKET_EXEC_PROTOCOLS)
    return None if name is None else WEBSOCKET_EXEC_PROTOCOLS[name]


# --- which streams a request carries --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamOptions:
    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool

    @classmethod
    def from_query(cls, query: Mapping[str, Sequence[str]]) -> StreamOptions:
        """Read ``input``, ``output``, ``error`` and ``tty`` ("1" is true, first value wins).

        A TTY merges stderr into stdout, so stderr is dropped when both are asked for; the
        client opens no stderr stream in that case either. Raises ValueError when no stdio
        stream is requested, which the kubelet answers with 400.
        """

        def flag(name: str) -> bool:
            values = query.get(name) or ()
            return bool(values) and values[0] == "1"

        tty = flag("tty")
        opts = cls(flag("input"), flag("output"), flag("error") and not tty, tty)
        if not (opts.stdin or opts.stdout or opts.stderr):
            raise ValueError("you must specify at least 1 of stdin, stdout, stderr")
        return opts


def expected_stream_count(options: StreamOptions, protocol: ExecProtocol) -> int:
    """SPDY streams to wait for before starting the command: error, the requested stdio ones,
    and resize when a TTY is used on a protocol that has it."""
    count = 1 + options.stdin + options.stdout + options.stderr
    if options.tty and protocol.supports_resize:
        count += 1
    return count


def stream_type(headers: Mapping[str, str]) -> StreamType | None:
    """The role of an incoming SPDY stream, or None for a type we do not know (which the Go
    server logs and leaves out of the count)."""
    try:
        return StreamType(headers.get(HEADER_STREAM_TYPE, ""))
    except ValueError:
        return None


# --- exit status --------------------------------------------------------------------------


def _json(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_exit_status(protocol: ExecProtocol, exit_code: int, detail: str | None = None) -> bytes:
    """What to write on the error stream once the command has exited.

    v1-v3 send nothing on success and the message text otherwise; v4+ send a metav1.Status the
    client decodes into an exit code. client-go parses that code as a uint8, hence 0..255.
    ``detail`` completes the message; it defaults to what Go's exec error would print.
    """
    if not 0 <= exit_code <= 255:
        raise ValueError(f"exit code {exit_code} is outside 0..255")
    if exit_code == 0:
        return _json({"metadata": {}, "status": "Success"}) if protocol.json_status else b""
    message = "command terminated with non-zero exit code: " + (
        detail if detail is not None else f"exit status {exit_code}"
    )
    if not protocol.json_status:
        return message.encode()
    return _json(
        {
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(exit_code)}]},
        }
    )


def encode_internal_error(protocol: ExecProtocol, error: str) -> bytes:
    """What to write when the command could not be run at all (apierrors.NewInternalError)."""
    message = f"Internal error occurred: {error}"
    if not protocol.json_status:
        return message.encode()
    return _json(
        {
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "InternalError",
            "details": {"causes": [{"message": error}]},
            "code": 500,
        }
    )


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """What a client makes of the error stream once the command is over (client-go's rules).

    ``exit_code`` is None when the command failed for a reason other than its exit code (it
    could not be started, the container is gone...); ``message`` then says why.
    """

    exit_code: int | None
    message: str = ""


def decode_exit_status(protocol: ExecProtocol, payload: bytes) -> ExitStatus:
    """Read what the server wrote on the error stream or channel.

    v4 and later always write a metav1.Status, so an empty payload there means the session was
    cut short, which is reported as a failure rather than taken for success. v1-v3 write nothing
    on success and plain text otherwise, which carries no exit code.
    """
    text = payload.decode("utf-8", errors="replace").strip()
    if not protocol.json_status:
        return ExitStatus(0) if not text else ExitStatus(None, text)
    if not text:
        return ExitStatus(None, "the connection ended before the command's exit status arrived")
    try:
        status = json.loads(text)
    except ValueError:
        return ExitStatus(None, f"error stream: {text[:500]}")
    if not isinstance(status, dict):
        return ExitStatus(None, f"error stream: {text[:500]}")
    message = str(status.get("message") or "")
    if status.get("status") == "Success":
        return ExitStatus(0)
    if status.get("reason") == "NonZeroExitCode":
        causes = (status.get("details") or {}).get("causes") or []
        for cause in causes:
            if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
                code = str(cause.get("message", ""))
                if code.isdigit() and int(code) <= 255:
                    return ExitStatus(int(code), message)
    return ExitStatus(None, message or f"error stream: {text[:500]}")


# --- terminal resize -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TerminalSize:
    width: int
    height: int


class ResizeError(ValueError):
    """The resize stream carried something other than size objects; the Go server stops
    reading resizes at this point, and so should the caller."""


def encode_resize(size: TerminalSize) -> bytes:
    """One resize message as client-go writes it: Go field names, so capitalised."""
    return _json({"Width": size.width, "Height": size.height}) + b"\n"


class ResizeDecoder:
    """Turns the resize stream (a run of JSON objects, split anywhere) into sizes.

    Keys match case-insensitively and unknown keys are ignored, as Go's decoder does. A value
    must be an integer in 0..65535. Nothing larger than ``max_buffer`` is ever held.
    """

    def __init__(self, max_buffer: int = 4096) -> None:
        self.max_buffer = max_buffer
        self._text = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes) -> list[TerminalSize]:
        try:
            self._text += self._utf8.decode(data)
        except UnicodeDecodeError as exc:
            raise ResizeError(f"resize stream is not UTF-8: {exc}") from None
        sizes: list[TerminalSize] = []
        while True:
            self._text = self._text.lstrip(" \t\r\n")
            end = _end_of_object(self._text)
            if end is None:
                break
            sizes.append(_parse_size(self._text[:end]))
            self._text = self._text[end:]
        if len(self._text) > self.max_buffer:
            raise ResizeError(f"resize message longer than {self.max_buffer} bytes")
        return sizes


def _end_of_object(text: str) -> int | None:
    """Index just past the first complete JSON object in ``text``, or None if it is not
    complete yet. Only braces outside strings count."""
    if not text:
        return None
    if text[0] != "{":
        raise ResizeError(f"resize message must be a JSON object, got {text[:20]!r}")
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _parse_size(text: str) -> TerminalSize:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ResizeError(f"bad resize message: {exc}") from None
    if not isinstance(obj, dict):
        raise ResizeError("resize message must be a JSON object")
    size = {"width": 0, "height": 0}
    for key, value in obj.items():
        field = key.lower()
        if field not in size or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFF:
            raise ResizeError(f"terminal {field} must be an integer in 0..65535, got {value!r}")
        size[field] = value
    return TerminalSize(size["width"], size["height"])
