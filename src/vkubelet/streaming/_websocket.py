"""The client end of a WebSocket: our h11 handshake, then `vkubelet.sdk.websocket` for the frames.

Doing the handshake with the same `upgrade` as SPDY gives both transports one error path (the
apiserver's Status on a refusal).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence

from wsproto.utilities import generate_accept_token

from ..sdk.websocket import WebSocket
from ._connect import Endpoint, upgrade
from ._errors import StreamingError


async def open_websocket(
    endpoint: Endpoint,
    target: str,
    subprotocols: Sequence[str],
    *,
    ping_interval: float | None = 5.0,
) -> tuple[WebSocket, str]:
    """GET `target` as a WebSocket offering `subprotocols`; the server must pick one of them,
    which is returned with the WebSocket."""
    key = base64.b64encode(os.urandom(16)).decode("ascii")
    headers = [
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Key", key),
        ("Sec-WebSocket-Protocol", ", ".join(subprotocols)),
    ]
    upgraded = await upgrade(endpoint, "GET", target, headers)
    try:
        if upgraded.headers.get("upgrade", "").lower() != "websocket":
            raise StreamingError(f"{endpoint.server} switched to {upgraded.headers.get('upgrade')}")
        expected = generate_accept_token(key.encode("ascii")).decode("ascii")
        if upgraded.headers.get("sec-websocket-accept") != expected:
            raise StreamingError(f"{endpoint.server} sent a wrong Sec-WebSocket-Accept")
        chosen = upgraded.headers.get("sec-websocket-protocol", "")
        if chosen not in subprotocols:
            raise StreamingError(
                f"{endpoint.server} chose subprotocol {chosen!r}, not one of {list(subprotocols)}"
            )
    except BaseException:
        await upgraded.aclose()
        raise
    reader, writer = upgraded.reader, upgraded.writer
    ws = WebSocket(reader, writer, upgraded.trailing, client=True, ping_interval=ping_interval)
    return ws, chosen
