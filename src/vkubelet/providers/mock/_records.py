"""What the fake backend remembers of a pod, and the time stamps it writes.

A mock pod keeps only what it needs (names, images, env, mounted files, times), so the mock
itself is cheap enough not to distort memory figures in benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import Container, EphemeralContainer
from lightkube.resources.core_v1 import Pod

from ...sdk import ProviderError, ResolvedPod
from ...sdk.volumes import FilesVolume


def format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


@dataclass(slots=True)
class MockContainer:
    name: str
    image: str
    env: list[tuple[str, str]]
    init: bool = False
    mounts: list[tuple[str, str, str]] = field(default_factory=list)  # (volume, path, subPath)
    probes: dict[str, Any] = field(default_factory=dict)  # its probes and ports, as JSON
    restarts: int = 0  # by a failed liveness or startup probe
    restarted: str | None = None  # when it last was

    @classmethod
    def of(cls, c: Container, *, init: bool) -> MockContainer:
        fields: dict[str, Any] = msgspec.to_builtins(c)
        return cls(
            c.name,
            c.image or "",
            [(e.name, e.value or "") for e in c.env or []],
            init=init,
            mounts=[(m.name, m.mountPath, m.subPath or "") for m in c.volumeMounts or []],
            probes={k: v for k, v in fields.items() if k in _PROBE_FIELDS and v is not None},
        )


_PROBE_FIELDS = ("livenessProbe", "readinessProbe", "startupProbe", "ports")


@dataclass(slots=True)
class MockEphemeral:
    """An ephemeral container (`kubectl debug`): its command runs in the mock's shell, at once
    without stdin (its output is its log), else when a client attaches (`debug -it`)."""

    name: str
    image: str
    command: list[str]
    env: list[tuple[str, str]]
    stdin: bool
    started: str
    finished: str | None = None
    exit_code: int | None = None
    output: str = ""  # what it printed with no client attached (its log)
    reason: str = ""  # of its termination, when not its command's exit

    def lost(self, now: str) -> None:
        """Its command ran in the agent that saved it, and ended with it: terminated, as a
        kubelet reports a container it lost (one with stdin runs when a client attaches)."""
        if self.finished is None and not self.stdin:
            self.finished, self.exit_code, self.reason = now, 137, "ContainerStatusUnknown"

    @classmethod
    def of(cls, c: EphemeralContainer, started: str) -> MockEphemeral:
        return cls(
            c.name,
            c.image or "",
            [*(c.command or ["sh"]), *(c.args or [])],
            [(e.name, e.value or "") for e in c.env or []],
            bool(c.stdin),
            started,
        )

    def as_container(self) -> MockContainer:
        """The container whose files and env its command sees (its own, not its target's)."""
        return MockContainer(self.name, self.image, self.env)


@dataclass(slots=True)
class MockPod:
    """The little a fake backend must remember about a pod."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    containers: list[MockContainer]
    created: str
    print_env: bool = False
    files: dict[str, str] = field(default_factory=dict)  # "volume/path" -> text, as mounted
    started: str | None = None
    stopped: str | None = None
    updates: int = 0  # update_pod calls: the state file shows that an update reached the backend
    creates: int = 1  # create_pod calls for this very pod (its UID): more than one is a bug
    # The agent's digest of what it gave the pod (its `vkubelet.io/applied` annotation), handed
    # back by get_pod: after a restart the agent updates an adopted pod only when it differs.
    applied: str | None = None
    ephemeral: list[MockEphemeral] = field(default_factory=list)  # added by `kubectl debug`

    @property
    def running(self) -> bool:
        return self.started is not None and self.stopped is None

    def container(self, name: str) -> MockContainer:
        """The container called `name` (init containers included), or ProviderError NotFound."""
        for container in self.containers:
            if container.name == name:
                return container
        raise ProviderError("NotFound", f"pod {self.namespace}/{self.name} has no container {name}")


def containers_of(pod: Pod) -> list[MockContainer]:
    spec = pod.spec
    assert spec is not None
    result = [MockContainer.of(c, init=True) for c in spec.initContainers or []]
    result += [MockContainer.of(c, init=False) for c in spec.containers]
    return result


def files_of(resolved: ResolvedPod) -> dict[str, str]:
    """The resolved pod's volume files, keyed "volume/path"."""
    return {
        f"{name}/{path}": content.data.decode(errors="replace")
        for name, volume in resolved.volumes.items()
        if isinstance(volume, FilesVolume)
        for path, content in volume.files.items()
    }
