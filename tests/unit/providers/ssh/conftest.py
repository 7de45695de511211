"""The local "device" of the provider tests: this machine, over a `LocalLink`."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from vkubelet.devcluster import processes_mentioning

from .test_provider import Device


@pytest.fixture
async def device(tmp_path: Path) -> AsyncIterator[Device]:
    home = tmp_path / "home"
    home.mkdir()
    dev = Device(home)
    yield dev
    for provider in dev.providers:
        await provider.aclose()
    await dev.link.aclose()
    # A device keeps its pods when the agent stops (that is the point); the test's device is this
    # machine, so its pods' supervisors and everything under them end with the test.
    kill_trees(processes_mentioning(str(home)))


def kill_trees(roots: list[int]) -> None:
    """SIGKILL the processes `roots` and all their descendants."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    doomed: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in doomed:
            doomed.add(pid)
            todo += [child for child, ppid in parent.items() if ppid == pid]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
