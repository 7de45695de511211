"""`kubectl logs` of an ssh pod streams from the device with bounded memory: a tail is cut on
the device, a whole log comes in chunks, and a follower goes on from where the read ended."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.ssh import _remote
from vkubelet.providers.ssh._inventory import DeviceConfig
from vkubelet.providers.ssh._link import Completed
from vkubelet.providers.ssh._provider import DeviceProvider, _PodEntry
from vkubelet.sdk import ContainerLogOptions

from .local_link import LocalLink

UID = "u1"
T0 = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


class Counted:
    """A process's stdout that counts what crossed "the network"."""

    def __init__(self, stream: asyncio.StreamReader, link: CountingLink) -> None:
        self.stream, self.link = stream, link

    async def read(self, n: int = -1) -> bytes:
        data = await self.stream.read(n)
        self.link.received += len(data)
        return data

    async def readline(self) -> bytes:
        data = await self.stream.readline()
        self.link.received += len(data)
        return data


class CountingLink(LocalLink):
    """Counts the bytes the device hands over."""

    received = 0

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed:
        done = await super().run(script, deadline=deadline)
        self.received += len(done.stdout)
        return done

    @contextlib.asynccontextmanager
    async def process(self, command: str, **options: Any) -> AsyncIterator[Any]:
        async with super().process(command, **options) as proc:
            assert proc.stdout is not None
            yield SimpleNamespace(stdout=Counted(proc.stdout, self))


def provider_with_log(tmp_path: Path, lines: int) -> tuple[DeviceProvider, CountingLink]:
    link = CountingLink(tmp_path)
    config = DeviceConfig(name="d", address="127.0.0.1", pod_dir=str(tmp_path))
    provider = DeviceProvider(config, link=link)  # type: ignore[arg-type]
    pod = msgspec.convert(
        {
            "metadata": {"namespace": "default", "name": "p", "uid": UID},
            "spec": {"containers": [{"name": "main", "image": "host"}]},
        },
        Pod,
    )
    entry = _PodEntry(pod, UID)
    entry.remote = _remote.RemotePod(
        UID,
        True,
        False,
        b"{}",
        [],
        [_remote.ContainerStatus("main", "terminated", "", None, T0, T0, 0, 0)],
    )
    provider._pods["default/p"] = entry
    log = tmp_path / "pods" / UID / "c" / "main" / "0.log"
    log.parent.mkdir(parents=True)
    record = b"2024-05-01T10:00:00Z stdout F "
    with log.open("wb") as f:
        for i in range(lines):
            f.write(record + b"line %06d " % i + b"x" * 100 + b"\n")
    return provider, link


async def read(provider: DeviceProvider, options: ContainerLogOptions) -> list[bytes]:
    return [chunk async for chunk in provider.container_logs("default", "p", "main", options)]


async def test_a_tail_is_cut_on_the_device_not_after_transferring_the_whole_log(
    tmp_path: Path,
) -> None:
    provider, link = provider_with_log(tmp_path, 50_000)  # ~7 MB
    chunks = await read(provider, ContainerLogOptions(tail_lines=2))
    assert b"".join(chunks).splitlines()[0].startswith(b"line 049998 ")
    assert len(b"".join(chunks).splitlines()) == 2
    assert link.received < 1000


async def test_a_whole_log_streams_in_bounded_chunks(tmp_path: Path) -> None:
    provider, link = provider_with_log(tmp_path, 50_000)
    biggest, total, count, first_at = 0, 0, 0, None
    async for chunk in provider.container_logs("default", "p", "main", ContainerLogOptions()):
        biggest, total, count = max(biggest, len(chunk)), total + len(chunk), count + 1
        first_at = link.received if first_at is None else first_at
    assert first_at is not None and first_at < 1_000_000  # shown long before the log is read
    assert total == 50_000 * 113 and count > 10
    assert biggest <= 65536
