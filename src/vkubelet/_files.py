"""Files that hold secrets: private keys and kubeconfigs, readable by their owner only."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import yaml


def write_private(path: Path, data: bytes) -> None:
    """Create a file that only its owner can read, without a window where it is world-readable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_kubeconfig(
    path: Path,
    *,
    cluster: str,
    server: str,
    ca_pem: bytes,
    user: str,
    cert_pem: bytes | None = None,
    key_pem: bytes | None = None,
    token: str | None = None,
) -> None:
    """A self-contained kubeconfig (credentials embedded), so it can be copied elsewhere."""
    credentials: dict[str, str] = {}
    if cert_pem is not None and key_pem is not None:
        credentials["client-certificate-data"] = base64.b64encode(cert_pem).decode()
        credentials["client-key-data"] = base64.b64encode(key_pem).decode()
    if token is not None:
        credentials["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    write_private(path, yaml.safe_dump(config, sort_keys=False).encode())
