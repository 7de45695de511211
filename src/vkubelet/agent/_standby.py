"""What a replica serves on the kubelet port while it runs no node there: `/healthz` (200, a
standby is healthy) and `/readyz` (200 "leading" or 503 "standby"), over TLS like the kubelet
API it stands in for, so that one probe definition (HTTPS, certificate unchecked, as the
kubelet probes) fits both. The certificate is self-signed and made in memory: it guards
nothing but the probe.

A hand-written responder rather than the kubelet server: the latter needs nodes, a serving
certificate from the cluster and an authenticator, none of which a standby has.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)


def _self_signed() -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vkubelet-standby")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory() as directory:  # ssl loads chains from files only
        pem = Path(directory) / "standby.pem"
        pem.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        context.load_cert_chain(pem)
    return context


class StandbyHealth:
    """Started while the replica is standby, closed before its kubelet API takes the port (or
    kept when no node of this replica serves there)."""

    def __init__(self, port: int, leading: Callable[[], bool] = lambda: False) -> None:
        self.port = port
        self._leading = leading
        self._context: ssl.SSLContext | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        if self._server is not None:
            return
        if self._context is None:
            self._context = _self_signed()
        for _ in range(50):  # the kubelet API that held the port may take a moment to let go
            try:
                self._server = await asyncio.start_server(
                    self._answer, port=self.port, ssl=self._context, reuse_address=True
                )
                return
            except OSError as e:
                log.debug("standby health on port %d: %s; retrying", self.port, e)
                await asyncio.sleep(0.2)
        log.warning("standby health: port %d stays busy; /healthz not served", self.port)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            parts = head.split(b" ", 2)
            path = parts[1].split(b"?")[0] if len(parts) > 1 else b""
            if path == b"/healthz":
                status, body = 200, b"ok"
            elif path == b"/readyz":
                status, body = (200, b"leading") if self._leading() else (503, b"standby")
            else:
                status, body = 404, b"not found: this port only answers /healthz and /readyz"
            reason = {200: b"OK", 503: b"Service Unavailable", 404: b"Not Found"}[status]
            writer.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (status, reason, len(body), body)
            )
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
