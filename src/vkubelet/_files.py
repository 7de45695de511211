"""Files written whole, and files that hold secrets.

Every file the agent or the dev tools rewrite goes through `write_atomic`: readers (another
process, or this one after a crash) see the old content or the new, never a mix, and a private
file is owner-only from its first byte.
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

import yaml


def write_atomic(
    path: Path, data: bytes | str, *, mode: int = 0o666, durable: bool = False
) -> None:
    """Write a fresh file beside `path`, then rename it over `path`.

    The temporary name is unique, so concurrent writers (two processes sharing a cache) never
    write into each other's file. It is created with `mode` less the umask, as `open` would:
    an older file's mode is not kept, and 0o600 is never readable by others, even for a moment.
    `durable` waits for the disk (the file, then the rename in its directory) when what the
    file names must survive a power cut, not just a crash of this process.
    """
    content = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def private_dir(path: Path) -> Path:
    """A directory only its owner can enter (0700), made with its parents when missing; an
    existing one is tightened. The directories that hold a tenant's disks and memory images."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != 0o700:
        path.chmod(0o700)
    return path


def make_private(root: Path) -> None:
    """Tighten what an older version left readable: `root` and every directory below it 0700,
    every file 0600. Symlinks are neither followed nor changed (their target may be anyone's)."""
    if root.is_symlink():
        return
    for directory, _, files in os.walk(root, followlinks=False):
        Path(directory).chmod(0o700)
        for name in files:
            if not (path := Path(directory, name)).is_symlink():
                path.chmod(0o600)


def write_private(path: Path, data: bytes | str) -> None:
    """A file only its owner can read (private keys, kubeconfigs, state holding secrets)."""
    write_atomic(path, data, mode=0o600)


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
