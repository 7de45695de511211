"""Fakes of the kubelet server's stream ends, a pod for the mock, and kubectl cp's archives."""

from __future__ import annotations

import asyncio
import io
import tarfile

import msgspec
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ResolvedPod
from vkubelet.node.resolve import EmptyDirVolume, FileContent, FilesVolume
from vkubelet.sdk.capabilities import AttachIO

NS, POD, UID = "default", "web", "uid-web"


# --- fakes for the kubelet server's side of the streams --------------------------------------


class Input:
    """What the client sends: read() waits for data, and returns b"" once closed."""

    def __init__(self, data: bytes = b"", *, closed: bool = False) -> None:
        self._buffer = bytearray(data)
        self._closed = closed
        self._changed = asyncio.Event()

    def feed(self, data: bytes) -> None:
        self._buffer += data
        self._changed.set()

    def end(self) -> None:
        self._closed = True
        self._changed.set()

    async def read(self, max_bytes: int = 65536) -> bytes:
        while not self._buffer:
            if self._closed:
                return b""
            self._changed.clear()
            await self._changed.wait()
        chunk = bytes(self._buffer[:max_bytes])
        del self._buffer[:max_bytes]
        return chunk


class Output:
    """What the client receives."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self._changed = asyncio.Event()

    async def write(self, data: bytes) -> None:
        self.data += data
        self._changed.set()

    async def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def wait_for(self, needle: bytes, within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while needle not in self.data:
                self._changed.clear()
                await self._changed.wait()


class Connection(Input, Output):
    """Both directions of one forwarded connection (a ByteStream)."""

    def __init__(self) -> None:
        Input.__init__(self)
        Output.__init__(self)


def stdio(stdin: Input | None, *, tty: bool = False) -> tuple[AttachIO, Output, Output | None]:
    out, err = Output(), None if tty else Output()
    io_ = AttachIO(stdin=stdin, stdout=out, stderr=err, tty=tty)
    if not tty:
        io_.resizes.close()
    return io_, out, err


# --- a pod ----------------------------------------------------------------------------------


def resolved(settings: bytes = b'{"replicas": 1}') -> ResolvedPod:
    pod = msgspec.convert(
        {
            "metadata": {"namespace": NS, "name": POD, "uid": UID},
            "spec": {
                "nodeName": "n1",
                "initContainers": [{"name": "setup", "image": "busybox"}],
                "containers": [
                    {
                        "name": "app",
                        "image": "busybox",
                        "env": [{"name": "GREETING", "value": "hello there"}],
                        "volumeMounts": [
                            {"name": "config", "mountPath": "/etc/config"},
                            {
                                "name": "config",
                                "mountPath": "/app/settings.json",
                                "subPath": "settings.json",
                            },
                            {"name": "scratch", "mountPath": "/scratch"},
                        ],
                    },
                    {"name": "sidecar", "image": "busybox"},
                ],
            },
        },
        Pod,
    )
    config = FilesVolume(
        "config",
        "configMap",
        {
            "mode": FileContent(b"fast", 0o644),
            "settings.json": FileContent(settings, 0o644),
            "nested/deep.txt": FileContent(b"deep", 0o644),
        },
    )
    return ResolvedPod(pod, {"config": config, "scratch": EmptyDirVolume("scratch")})


def make_tar(entries: dict[str, bytes | None]) -> bytes:
    """An archive as kubectl's makeTar writes it: names relative to `-C`, no leading slash;
    None is an (empty) directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                archive.addfile(info)
            else:
                info.size, info.mode = len(data), 0o600
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def read_tar(data: bytes) -> dict[str, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        result: dict[str, bytes | None] = {}
        for member in archive:
            extracted = archive.extractfile(member) if member.isfile() else None
            result[member.name] = None if extracted is None else extracted.read()
        return result
