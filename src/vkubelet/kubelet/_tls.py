"""The TLS context of the kubelet port."""

from __future__ import annotations

import ssl
from pathlib import Path


def server_ssl_context(
    cert_file: Path | str, key_file: Path | str, client_ca_file: Path | str | None = None
) -> ssl.SSLContext:
    """A server context for the kubelet port.

    - ALPN offers only http/1.1: exec, attach and port-forward are HTTP/1.1 upgrades, and a
      client that negotiated h2 could not make them.
    - With `client_ca_file`, client certificates are *requested and verified* but not required
      (CERT_OPTIONAL): the apiserver proves itself with its kubelet client certificate, while
      bearer-token clients (metrics-server, Prometheus) can still connect. A certificate that
      does not verify fails the handshake. Without it no certificate is asked for, and only
      tokens can authenticate.

    To rotate the serving certificate, call `load_cert_chain` on the returned context again:
    new connections use the new one, open ones keep theirs.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(str(cert_file), str(key_file))
    if client_ca_file is not None:
        context.load_verify_locations(cafile=str(client_ca_file))
        context.verify_mode = ssl.CERT_OPTIONAL
    else:
        context.verify_mode = ssl.CERT_NONE
    return context
