"""Port-forward bookkeeping: which streams or channels belong to which forwarded connection.

Over SPDY (``portforward.k8s.io``) every forwarded TCP connection is a pair of streams, data
and error, with headers ``streamtype``, ``port`` and ``requestid``. The client opens the error
stream first; pairs arrive interleaved when many connections start at once, so they are
matched by request id. Over WebSocket the ports come from the query string instead and each
port gets a fixed pair of channels (see ``channel``).

The ``StreamPairer`` only keeps books. Timers (the kubelet gives a pair 30 s to complete),
dialing and copying belong to the adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .channel import ChannelFraming, framing_for_subprotocol
from .remotecommand import choose_protocol, split_protocol_header

PORT_FORWARD_PROTOCOL: Final = "portforward.k8s.io"
# The kubelet's WebSocket port-forward offers these, and "" (no subprotocol), but not the
# unversioned channel.k8s.io names that exec accepts.
WEBSOCKET_PORT_FORWARD_PROTOCOLS: Final = ("v4.channel.k8s.io", "v4.base64.channel.k8s.io", "")

# Since 1.31 kubectl asks the apiserver for a WebSocket with this subprotocol and tunnels the
# SPDY connection through it, one SPDY byte run per binary message; the apiserver unwraps it.
WEBSOCKET_SPDY_TUNNEL_PROTOCOL: Final = "SPDY/3.1+" + PORT_FORWARD_PROTOCOL

HEADER_STREAM_TYPE: Final = "streamtype"
HEADER_PORT: Final = "port"
HEADER_REQUEST_ID: Final = "requestid"

_DIGITS = re.compile(r"[0-9]+")


class PortForwardStreamType(StrEnum):
    DATA = "data"
    ERROR = "error"


def negotiate_spdy_portforward(header_values: Iterable[str]) -> str | None:
    return choose_protocol(split_protocol_header(header_values), (PORT_FORWARD_PROTOCOL,))


def negotiate_websocket_portforward(
    subprotocols: Sequence[str],
) -> tuple[str, ChannelFraming] | None:
    """The chosen subprotocol and its framing, or None to refuse the upgrade."""
    name = choose_protocol(list(subprotocols) or [""], WEBSOCKET_PORT_FORWARD_PROTOCOLS)
    return None if name is None else (name, framing_for_subprotocol(name))


def parse_port(text: str) -> int:
    """A port as Go's ``strconv.ParseUint(s, 10, 16)`` plus ``> 0`` accepts it: plain decimal
    digits only, so no sign, spaces or underscores that Python's ``int`` would let through."""
    if not _DIGITS.fullmatch(text):
        raise ValueError(f"unable to parse {text!r} as a port")
    port = int(text)
    if not 0 < port <= 0xFFFF:
        raise ValueError(f"port {text!r} must be in 1..65535")
    return port


def parse_port_query(values: Sequence[str]) -> list[int]:
    """Ports of a WebSocket port-forward from repeated and/or comma-separated ``port`` params."""
    if not values:
        raise ValueError('query parameter "port" is required')
    ports: list[int] = []
    for value in values:
        if not value:
            raise ValueError('query parameter "port" cannot be empty')
        ports.extend(parse_port(p) for p in value.split(","))
    return ports


def forward_error_message(port: int, pod: str, uid: str, error: str) -> str:
    """The text the kubelet writes on a pair's error stream when forwarding fails."""
    return f"error forwarding port {port} to pod {pod}, uid {uid}: {error}"


def pair_headers(port: int, request_id: int) -> tuple[dict[str, str], dict[str, str]]:
    """The headers of a client's (error, data) streams for one forwarded connection. The
    error stream goes first, as client-go opens it."""
    if not 0 < port <= 0xFFFF:
        raise ValueError(f"port {port} is outside 1..65535")
    common = {HEADER_PORT: str(port), HEADER_REQUEST_ID: str(request_id)}
    return (
        {HEADER_STREAM_TYPE: PortForwardStreamType.ERROR.value, **common},
        {HEADER_STREAM_TYPE: PortForwardStreamType.DATA.value, **common},
    )


# --- SPDY stream pairing -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairPending:
    """Accepted; waiting for the other half of ``request_id``. Start its creation timer now."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PairComplete:
    """Both halves are here: dial ``port`` and copy between it and the data stream."""

    request_id: str
    port: int
    data_stream_id: int
    error_stream_id: int


@dataclass(frozen=True, slots=True)
class StreamRejected:
    """Refuse this stream (reset it). If ``error_stream_id`` is set, also write ``reason`` there
    so the client learns why its connection failed."""

    stream_id: int
    reason: str
    error_stream_id: int | None = None


@dataclass(frozen=True, slots=True)
class PairExpired:
    """A pair did not complete in time. Write ``reason`` on the error stream if there is one,
    then reset whatever streams it had."""

    request_id: str
    reason: str
    data_stream_id: int | None
    error_stream_id: int | None


PairResult = PairPending | PairComplete | StreamRejected


@dataclass(slots=True)
class _Pair:
    data: tuple[int, int] | None = None  # (stream id, port)
    error: int | None = None


class StreamPairer:
    def __init__(self) -> None:
        self._pending: dict[str, _Pair] = {}

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)

    def add_stream(self, stream_id: int, headers: Mapping[str, str]) -> PairResult:
        """Account for a newly opened stream, given its (lower-cased) SPDY headers."""
        try:
            port = parse_port(headers.get(HEADER_PORT, ""))
        except ValueError as exc:
            return StreamRejected(stream_id, str(exc))
        try:
            kind = PortForwardStreamType(headers.get(HEADER_STREAM_TYPE, ""))
        except ValueError:
            return StreamRejected(stream_id, f"invalid stream type {headers.get('streamtype')!r}")

        request_id = headers.get(HEADER_REQUEST_ID) or _legacy_request_id(stream_id, kind)
        pair = self._pending.setdefault(request_id, _Pair())
        if kind is PortForwardStreamType.ERROR:
            if pair.error is not None:
                return StreamRejected(
                    stream_id,
                    f"error processing stream for request {request_id}: "
                    "error stream already assigned",
                    pair.error,
                )
            pair.error = stream_id
        else:
            if pair.data is not None:
                return StreamRejected(
                    stream_id,
                    f"error processing stream for request {request_id}: "
                    "data stream already assigned",
                    pair.error,
                )
            pair.data = (stream_id, port)

        if pair.data is None or pair.error is None:
            return PairPending(request_id)
        del self._pending[request_id]
        data_stream_id, data_port = pair.data
        # As in the kubelet, the data stream's port is the one forwarded.
        return PairComplete(request_id, data_port, data_stream_id, pair.error)

    def expire(self, request_id: str) -> PairExpired | None:
        """Give up on an incomplete pair; None if it completed or was already dropped."""
        pair = self._pending.pop(request_id, None)
        if pair is None:
            return None
        return PairExpired(
            request_id,
            f"timed out waiting for streams of request {request_id}",
            pair.data[0] if pair.data else None,
            pair.error,
        )

    def stream_closed(self, stream_id: int) -> None:
        """Forget a half-pair whose stream went away (e.g. was reset) before pairing."""
        for request_id, pair in list(self._pending.items()):
            if pair.error == stream_id or (pair.data is not None and pair.data[0] == stream_id):
                del self._pending[request_id]


def _legacy_request_id(stream_id: int, kind: PortForwardStreamType) -> str:
    # Clients older than the requestID header open error then data with consecutive odd ids,
    # so the error stream's id names the pair. Best effort, exactly as the kubelet does it.
    if kind is PortForwardStreamType.ERROR:
        return str(stream_id)
    return str(stream_id - 2)
