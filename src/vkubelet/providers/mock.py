"""A configurable fake node: pods "run" in memory. For trying vkubelet out, tests and benchmarks.

The config file is compatible with the Go reference's mock provider — a JSON object keyed by node
name with `cpu`, `memory`, `pods`, `others` and `providerID` — plus options of our own:

    {"vk-mock-0": {"cpu": "8", "memory": "32Gi", "pods": "10000",
                   "startDelay": 0.5, "failureRatio": 0.0, "podCIDR": "10.244.0.0/16",
                   "stateFile": "/var/lib/vkubelet/mock-0.json", "pingFailFile": "/tmp/sick"}}

`stateFile` makes the fake backend outlive the agent (pods survive an agent restart, as they would
on a real backend). `pingFailFile` makes the provider unhealthy while that file exists.

Every mock pod stores only what it needs (names, images, env, times), so the mock itself is cheap
enough not to distort memory figures in benchmarks. All state changes happen on the event loop,
so concurrent calls for different pods cannot race (the reference mock's map has no lock).

Every kubectl verb works against the mock, so that each can be tested end to end:

- `kubectl exec` runs a small set of built-in commands (`MockProvider.exec_in_container` lists
  them, including a little `sh` and the `tar` that `kubectl cp` needs) against an in-memory
  filesystem per container, created on first use and seeded with the pod's volume files at
  their mount paths. With `-t` a line discipline echoes what is typed, ^C interrupts and the
  window size is tracked (`stty size`). Nothing there outlives the agent.
- `kubectl attach` reaches a "main process" that echoes stdin upper-cased.
- `kubectl port-forward` connects to the port on 127.0.0.1: the mock's pods "are" the host.
- `kubectl logs -f` prints `mock: tick N` every second until the pod stops.
- `/stats/summary` and `/metrics/resource` report deterministic, plausible usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import math
import os
import posixpath
import random
import re
import tarfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import BytesIO
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from lightkube.models.core_v1 import Container, PodStatus
from lightkube.resources.core_v1 import Node, Pod

from ..node import ContainerLogOptions, ProviderContext, ProviderError, ResolvedPod
from ..node.capabilities import AttachIO, ByteStream, InputStream, OutputStream, TerminalSize
from ..node.resolve import FilesVolume, parse_quantity

T = TypeVar("T")

PRINT_ENV_ANNOTATION = "mock.vkubelet.io/print-env"
# Makes create_pod fail with this reason: lets tests prove how rejected pods are reported.
FAIL_ANNOTATION = "mock.vkubelet.io/fail"
_KNOWN_KEYS = {
    "cpu",
    "memory",
    "pods",
    "others",
    "providerID",
    "startDelay",
    "failureRatio",
    "podCIDR",
    "stateFile",
    "pingFailFile",
}


class ConfigError(ValueError):
    """A bad provider config; the message names the file and the field."""


@dataclass(frozen=True)
class MockConfig:
    cpu: str = "20"
    memory: str = "100Gi"
    pods: str = "110"
    others: dict[str, str] = field(default_factory=dict)
    provider_id: str | None = None
    start_delay: float = 0.0
    failure_ratio: float = 0.0
    pod_cidr: str = "10.244.0.0/16"
    state_file: Path | None = None
    ping_fail_file: Path | None = None

    @classmethod
    def load(cls, path: Path | None, node_name: str) -> MockConfig:
        """Read the entry for `node_name`; without a file, the reference's defaults."""
        if path is None:
            return cls()
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object keyed by node name")
        if node_name not in data:
            raise ConfigError(
                f"{where}: no entry for node {node_name!r} (entries: {', '.join(data) or 'none'})"
            )
        entry = data[node_name]
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: {node_name}: expected an object")
        unknown = set(entry) - _KNOWN_KEYS
        if unknown:
            raise ConfigError(
                f"{where}: {node_name}.{sorted(unknown)[0]}: unknown field "
                f"(known: {', '.join(sorted(_KNOWN_KEYS))})"
            )
        for name in ("cpu", "memory", "pods"):
            if name in entry:
                _check_quantity(where, f"{node_name}.{name}", entry[name])
        others = entry.get("others") or {}
        if not isinstance(others, dict):
            raise ConfigError(f"{where}: {node_name}.others: expected an object")
        for name, value in others.items():
            _check_quantity(where, f"{node_name}.others.{name}", value)
        ratio = entry.get("failureRatio", 0.0)
        if not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise ConfigError(f"{where}: {node_name}.failureRatio: expected a number in [0, 1]")
        delay = entry.get("startDelay", 0.0)
        if not isinstance(delay, int | float) or delay < 0:
            raise ConfigError(f"{where}: {node_name}.startDelay: expected seconds >= 0")
        cidr = entry.get("podCIDR", cls.pod_cidr)
        try:
            ipaddress.ip_network(cidr)
        except ValueError as e:
            raise ConfigError(f"{where}: {node_name}.podCIDR: {e}") from None
        return cls(
            cpu=str(entry.get("cpu", cls.cpu)),
            memory=str(entry.get("memory", cls.memory)),
            pods=str(entry.get("pods", cls.pods)),
            others={k: str(v) for k, v in others.items()},
            provider_id=entry.get("providerID"),
            start_delay=float(delay),
            failure_ratio=float(ratio),
            pod_cidr=cidr,
            state_file=Path(entry["stateFile"]) if entry.get("stateFile") else None,
            ping_fail_file=Path(entry["pingFailFile"]) if entry.get("pingFailFile") else None,
        )


def _check_quantity(where: str, name: str, value: object) -> None:
    try:
        parse_quantity(str(value))
    except ValueError:
        raise ConfigError(f"{where}: {name}: {value!r} is not a Kubernetes quantity") from None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class _Container:
    name: str
    image: str
    env: list[tuple[str, str]]
    init: bool = False
    mounts: list[tuple[str, str, str]] = field(default_factory=list)  # (volume, path, subPath)


@dataclass(slots=True)
class _MockPod:
    """The little a fake backend must remember about a pod."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    containers: list[_Container]
    created: str
    print_env: bool = False
    files: dict[str, str] = field(default_factory=dict)  # "volume/path" -> text, as mounted
    started: str | None = None
    stopped: str | None = None
    updates: int = 0


class MockProvider:
    """Implements the pod lifecycle, push notifications, node configuration and every optional
    capability: logs, exec, attach, port-forward, stats and resource metrics."""

    def __init__(self, node_name: str, config: MockConfig, *, host_ip: str = "127.0.0.1") -> None:
        self.node_name = node_name
        self.config = config
        self.host_ip = host_ip
        self._pods: dict[str, _MockPod] = {}
        self._notify: Callable[[Pod], None] | None = None
        self._network = ipaddress.ip_network(config.pod_cidr)
        self._next_ip = 0
        self._ips: dict[str, str] = {}  # uid -> reserved IP
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}  # uid -> set when the pod stops
        self._random = random.Random(node_name)  # noqa: S311 - deterministic fake failures
        self._filesystems: dict[str, dict[str, _Filesystem]] = {}  # uid -> container -> files
        self._booted = datetime.now(UTC)
        self._retired_cpu = 0  # core-nanoseconds used by pods that are gone (node counter)
        # How often `logs -f` and an attach without stdin print a line; tests shorten it.
        self.tick_seconds = 1.0
        self.creates = 0
        self._save_pending = False
        self._load_state()

    # -- persistence (optional) -------------------------------------------------------------------
    def _load_state(self) -> None:
        path = self.config.state_file
        if path is None or not path.exists():
            return
        state = json.loads(path.read_text())
        self.creates = state["creates"]
        for raw in state["pods"]:
            raw["containers"] = [_Container(**c) for c in raw["containers"]]
            for c in raw["containers"]:
                c.env = [tuple(pair) for pair in c.env]
                c.mounts = [tuple(mount) for mount in c.mounts]
            pod = _MockPod(**raw)
            self._pods[f"{pod.namespace}/{pod.name}"] = pod
            self._ips[pod.uid] = pod.ip

    def _save_state(self) -> None:
        """Write the state file soon; many changes in a burst cost one write."""
        if self.config.state_file is None or self._save_pending:
            return
        self._save_pending = True
        asyncio.get_running_loop().call_later(0.1, self._write_state)

    def _write_state(self) -> None:
        self._save_pending = False
        path = self.config.state_file
        assert path is not None
        tmp = path.with_suffix(".tmp")
        state = {"creates": self.creates, "pods": [asdict(p) for p in self._pods.values()]}
        # The fake backend's disk holds secret-derived env and files: owner-only, like a kubelet's.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        tmp.replace(path)

    # -- node -------------------------------------------------------------------------------------
    def configure_node(self, node: Node) -> None:
        capacity = {"cpu": self.config.cpu, "memory": self.config.memory, "pods": self.config.pods}
        capacity.update(self.config.others)
        assert node.status is not None and node.spec is not None
        node.status.capacity = dict(capacity)
        node.status.allocatable = dict(capacity)
        if self.config.provider_id:
            node.spec.providerID = self.config.provider_id

    async def ping(self) -> None:
        fail = self.config.ping_fail_file
        if fail is not None and fail.exists():
            raise RuntimeError(f"mock backend unhealthy ({fail} exists)")

    # -- network ----------------------------------------------------------------------------------
    async def pod_ips(self, pod: Pod) -> list[str]:
        """Reserve the pod's IP before it starts, so `status.podIP` env vars can be resolved."""
        uid = str(pod.metadata.uid)  # type: ignore[union-attr]
        if uid not in self._ips:
            self._next_ip += 1
            self._ips[uid] = str(self._network[self._next_ip % self._network.num_addresses])
        return [self._ips[uid]]

    # -- lifecycle --------------------------------------------------------------------------------
    async def create_pod(self, resolved: ResolvedPod) -> None:
        pod = resolved.pod
        annotations = pod.metadata.annotations or {}  # type: ignore[union-attr]
        if FAIL_ANNOTATION in annotations:
            raise ProviderError(
                annotations[FAIL_ANNOTATION], f"rejected because of {FAIL_ANNOTATION}"
            )
        if self.config.failure_ratio and self._random.random() < self.config.failure_ratio:
            raise ProviderError("MockFailure", "the mock provider failed this pod on purpose")
        key = f"{resolved.namespace}/{resolved.name}"
        spec = pod.spec
        assert spec is not None
        mock = _MockPod(
            namespace=resolved.namespace,
            name=resolved.name,
            uid=resolved.uid,
            node=self.node_name,
            ip=(await self.pod_ips(pod))[0],
            containers=_containers(pod),
            created=_now(),
            print_env=annotations.get(PRINT_ENV_ANNOTATION) == "true",
            files=_files(resolved),
        )
        self._pods[key] = mock
        self.creates += 1
        if self.config.start_delay:
            self._report(mock)  # Pending first
            self._starting[key] = asyncio.create_task(self._start_later(key, mock))
        else:
            mock.started = _now()
            self._report(mock)
            self._save_state()

    async def _start_later(self, key: str, mock: _MockPod) -> None:
        await asyncio.sleep(self.config.start_delay)
        self._starting.pop(key, None)
        if self._pods.get(key) is mock and mock.stopped is None:
            mock.started = _now()
            self._report(mock)
            self._save_state()

    async def update_pod(self, resolved: ResolvedPod) -> None:
        key = f"{resolved.namespace}/{resolved.name}"
        mock = self._pods.get(key)
        if mock is None or mock.uid != resolved.uid:
            raise ProviderError("NotFound", f"mock provider does not run {key}", permanent=False)
        mock.containers = _containers(resolved.pod)
        mock.files = _files(resolved)
        mock.updates += 1
        for container in mock.containers:  # the kubelet updates mounted volumes in place too
            fs = self._filesystems.get(mock.uid, {}).get(container.name)
            if fs is not None:
                _mount_volumes(fs, mock, container, refresh=True)
        self._save_state()

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        mock = self._pods.get(key)
        if mock is None or mock.uid != pod.metadata.uid:  # type: ignore[union-attr]
            return
        task = self._starting.pop(key, None)
        if task:
            task.cancel()
        if mock.started is not None and mock.stopped is None:
            self._retired_cpu += sum(u.cpu for _, u in _usage(mock, datetime.now(UTC)))
        mock.stopped = _now()
        self._stop_event(mock.uid).set()
        self._stops.pop(mock.uid, None)
        self._filesystems.pop(mock.uid, None)
        self._report(mock)
        del self._pods[key]
        self._ips.pop(mock.uid, None)
        self._save_state()

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        mock = self._pods.get(f"{namespace}/{name}")
        return None if mock is None else self._to_pod(mock)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = await self.get_pod(namespace, name)
        return None if pod is None else pod.status

    async def list_pods(self) -> list[Pod]:
        return [self._to_pod(m) for m in self._pods.values()]

    def _stop_event(self, uid: str) -> asyncio.Event:
        return self._stops.setdefault(uid, asyncio.Event())

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    def _report(self, mock: _MockPod) -> None:
        if self._notify is not None:
            self._notify(self._to_pod(mock))

    # -- views ------------------------------------------------------------------------------------
    def _to_pod(self, mock: _MockPod) -> Pod:
        return msgspec.convert(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"namespace": mock.namespace, "name": mock.name, "uid": mock.uid},
                "spec": {
                    "nodeName": mock.node,
                    "containers": [
                        {"name": c.name, "image": c.image} for c in mock.containers if not c.init
                    ],
                },
                "status": _status(mock, self.host_ip),
            },
            Pod,
        )

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        remaining = options.limit_bytes
        async with contextlib.aclosing(self._log_lines(namespace, pod, container, options)) as it:
            async for line in it:
                if remaining is not None:
                    line = line[:remaining]
                    remaining -= len(line)
                yield line
                if remaining == 0:
                    return

    async def _log_lines(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncGenerator[bytes, None]:
        mock = self._pods.get(f"{namespace}/{pod}")
        if mock is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running here")
        found = next((c for c in mock.containers if c.name == container), None)
        if found is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} has no container {container}")
        if options.previous:  # mock containers never restart
            raise ProviderError(
                "NotFound", f'previous terminated container "{container}" in pod "{pod}" not found'
            )
        lines = [
            f"mock: container {container} of {namespace}/{pod} started",
            f"mock: image {found.image}",
        ]
        if mock.print_env:
            lines += [f"{name}={value}" for name, value in found.env]
        lines.append(f"mock: {len(lines) - 1} lines")
        if options.tail_lines is not None:
            lines = lines[-options.tail_lines :] if options.tail_lines else []
        written = mock.started or mock.created  # when the container "printed" these lines
        since = _since(options)
        if since is not None and _parse_time(written) < since:
            lines = []
        for line in lines:
            stamp = f"{written} " if options.timestamps else ""
            yield f"{stamp}{line}\n".encode()
        if options.follow and mock.stopped is None:
            stopped = self._stop_event(mock.uid)  # a follower ends when the pod stops
            tick = 0
            while not await _wait(stopped, self.tick_seconds):
                tick += 1
                stamp = f"{_now()} " if options.timestamps else ""
                yield f"{stamp}mock: tick {tick}\n".encode()

    # -- exec, attach, port-forward -----------------------------------------------------------
    def _running_pod(self, namespace: str, pod: str) -> _MockPod:
        mock = self._pods.get(f"{namespace}/{pod}")
        if mock is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running here")
        if mock.started is None or mock.stopped is not None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running")
        return mock

    def _running_container(
        self, namespace: str, pod: str, container: str
    ) -> tuple[_MockPod, _Container]:
        mock = self._running_pod(namespace, pod)
        found = next((c for c in mock.containers if c.name == container), None)
        if found is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} has no container {container}")
        if found.init:
            raise ProviderError(
                "NotFound", f"container {container} of {namespace}/{pod} has completed"
            )
        return mock, found

    def _filesystem(self, mock: _MockPod, container: _Container) -> _Filesystem:
        per_pod = self._filesystems.setdefault(mock.uid, {})
        fs = per_pod.get(container.name)
        if fs is None:
            fs = per_pod[container.name] = _Filesystem()
            for directory in (*_BASE_DIRECTORIES, _TMP):
                fs.makedirs(directory)
            fs.write("/etc/hostname", f"{mock.name}\n".encode())
            fs.write("/etc/hosts", f"127.0.0.1\tlocalhost\n{mock.ip}\t{mock.name}\n".encode())
            _mount_volumes(fs, mock, container)
        return fs

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        """Run one of the built-in commands against the container's in-memory filesystem:

        `true`, `false`, `exit N`, `echo [-n]`, `env`, `printenv`, `cat`, `ls`, `hostname`,
        `whoami`, `pwd`, `cd`, `sleep`, `test`/`[`, `mkdir`, `rm`, `head`, `tail`, `wc`,
        `stty size`, `tar` (c/x/t with f, C, z: what `kubectl cp` runs) and `sh`/`bash`: with
        `-c SCRIPT` or interactively, understanding quotes, `$VAR`, `$?`, `|`, `;`, `&&`, `||`
        and `<`, `>`, `>>`, `2>`, `2>&1`, `>&2`. Pipelines run one stage after the other.
        Anything else exits 127 with `mock: NAME: command not found`. With a TTY, ^C ends the
        command with 130; it is killed (137) if the pod stops.
        """
        mock, found = self._running_container(namespace, pod, container)
        fs = self._filesystem(mock, found)
        async with _Terminal(io) as terminal:
            shell = _Shell(fs, _environment(mock, found), mock.name, terminal)

            async def run() -> int:
                code = await terminal.foreground(shell.main(command, terminal.stdio))
                return 128 + 2 if code is None else code  # ^C: killed by SIGINT

            code = await _unless(self._stop_event(mock.uid), run())
            return 128 + 9 if code is None else code  # the pod stopped: SIGKILL

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        """The container's main process echoes each line of stdin upper-cased, until stdin
        ends (or ^C with a TTY); without stdin it prints a line every `tick_seconds`."""
        mock, _ = self._running_container(namespace, pod, container)
        async with _Terminal(io) as terminal:
            main = _main_process(container, terminal, io.stdin is not None, self.tick_seconds)
            await _unless(self._stop_event(mock.uid), main)

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        """Connect to `port` on 127.0.0.1 (the mock's pods "are" this machine; a real backend
        would dial the pod's own address) and copy both ways. When the server closes first
        the client gets a moment to finish, as containerd gives it; when the client finishes
        sending, the server decides when the connection ends."""
        self._running_pod(namespace, pod)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
            raise ConnectionError(
                f"failed to connect to localhost:{port} inside the mock pod {namespace}/{pod}: "
                f"dial tcp4 127.0.0.1:{port}: connect: {reason.lower()}"
            ) from None

        async def upstream() -> None:  # client -> server
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async def downstream() -> None:  # server -> client
            while data := await reader.read(65536):
                await stream.write(data)
            await stream.close()

        up, down = asyncio.create_task(upstream()), asyncio.create_task(downstream())
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            if not _failed(up) and not _failed(down):
                if down.done() and not up.done():
                    await asyncio.wait({up}, timeout=_FORWARD_LINGER)
                elif up.done() and not down.done():
                    await asyncio.wait({down})
            for task in (down, up):
                if _failed(task) and (error := task.exception()) is not None:
                    raise error
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    # -- stats and metrics ----------------------------------------------------------------------
    def _snapshot(self, now: datetime) -> _Snapshot:
        pods = [
            (mock, _usage(mock, now))
            for mock in self._pods.values()
            if mock.started is not None and mock.stopped is None
        ]
        system_cpu = int(_SYSTEM_NANOCORES * max((now - self._booted).total_seconds(), 0.0))
        node = _Usage(
            nanocores=_SYSTEM_NANOCORES + sum(u.nanocores for _, us in pods for _, u in us),
            cpu=system_cpu + self._retired_cpu + sum(u.cpu for _, us in pods for _, u in us),
            working_set=_SYSTEM_MEMORY + sum(u.working_set for _, us in pods for _, u in us),
        )
        return _Snapshot(now, node, pods)

    def _memory_capacity(self) -> int:
        return int(parse_quantity(self.config.memory).to_fraction())

    async def stats_summary(self) -> dict[str, Any]:
        """A `stats/v1alpha1` Summary. Usage is derived from a hash of each container's pod UID
        and name (5-200m CPU, 16-256 MiB): constant rates, so the cumulative CPU counters grow
        steadily and `kubectl top` shows stable numbers. The node adds 50m and 256 MiB of its
        own, and its CPU counter keeps what deleted pods used."""
        now = datetime.now(UTC).replace(microsecond=0)  # the JSON has whole seconds
        snapshot = self._snapshot(now)
        stamp = _format_time(now)
        node = snapshot.node
        available = max(self._memory_capacity() - node.working_set, 0)
        pods = []
        for mock, usages in snapshot.pods:
            total = _Usage(
                sum(u.nanocores for _, u in usages),
                sum(u.cpu for _, u in usages),
                sum(u.working_set for _, u in usages),
            )
            pods.append(
                {
                    "podRef": {"name": mock.name, "namespace": mock.namespace, "uid": mock.uid},
                    "startTime": mock.created,
                    "containers": [
                        {
                            "name": c.name,
                            "startTime": mock.started,
                            "cpu": _cpu_stats(stamp, u),
                            "memory": _memory_stats(stamp, u),
                        }
                        for c, u in usages
                    ],
                    "cpu": _cpu_stats(stamp, total),
                    "memory": _memory_stats(stamp, total),
                    "process_stats": {"process_count": len(usages)},
                }
            )
        return {
            "node": {
                "nodeName": self.node_name,
                "startTime": _format_time(self._booted),
                "cpu": _cpu_stats(stamp, node),
                "memory": _memory_stats(stamp, node, available),
            },
            "pods": pods,
        }

    async def metrics_resource(self) -> str:
        """The kubelet's `/metrics/resource` (v1.37): the summary's numbers as Prometheus text,
        families sorted by name, samples stamped in milliseconds."""
        return _resource_metrics(self._snapshot(datetime.now(UTC)))


def _files(resolved: ResolvedPod) -> dict[str, str]:
    return {
        f"{name}/{path}": content.data.decode(errors="replace")
        for name, volume in resolved.volumes.items()
        if isinstance(volume, FilesVolume)
        for path, content in volume.files.items()
    }


def _containers(pod: Pod) -> list[_Container]:
    spec = pod.spec
    assert spec is not None
    result = [_container(c, init=True) for c in spec.initContainers or []]
    result += [_container(c, init=False) for c in spec.containers]
    return result


def _container(c: Container, *, init: bool) -> _Container:
    return _Container(
        c.name,
        c.image or "",
        [(e.name, e.value or "") for e in c.env or []],
        init=init,
        mounts=[(m.name, m.mountPath, m.subPath or "") for m in c.volumeMounts or []],
    )


def _status(mock: _MockPod, host_ip: str) -> dict[str, Any]:
    running = mock.started is not None and mock.stopped is None
    if mock.stopped is not None:
        phase = "Succeeded"
    elif running:
        phase = "Running"
    else:
        phase = "Pending"
    since = mock.started or mock.created

    def state(c: _Container) -> dict[str, Any]:
        if mock.stopped is not None and not c.init:
            return {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": since,
                    "finishedAt": mock.stopped,
                }
            }
        if c.init and mock.started is not None:
            return {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": mock.created,
                    "finishedAt": mock.started,
                }
            }
        if running:
            return {"running": {"startedAt": mock.started}}
        return {"waiting": {"reason": "ContainerCreating"}}

    def status_of(c: _Container) -> dict[str, Any]:
        return {
            "name": c.name,
            "image": c.image,
            "imageID": f"mock://{c.image}",
            "containerID": f"mock://{mock.uid}/{c.name}",
            "ready": running and not c.init,
            "started": running and not c.init,
            "restartCount": 0,
            "state": state(c),
        }

    ready = "True" if running else "False"
    conditions = [
        {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": mock.created},
        {
            "type": "Initialized",
            "status": "True" if mock.started else "False",
            "lastTransitionTime": since,
        },
        {"type": "ContainersReady", "status": ready, "lastTransitionTime": since},
        {"type": "Ready", "status": ready, "lastTransitionTime": since},
    ]
    status: dict[str, Any] = {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": mock.ip,
        "podIPs": [{"ip": mock.ip}],
        "startTime": mock.created,
        "conditions": conditions,
        "containerStatuses": [status_of(c) for c in mock.containers if not c.init],
    }
    inits = [status_of(c) for c in mock.containers if c.init]
    if inits:
        status["initContainerStatuses"] = inits
    return status


# -- helpers for the capabilities -----------------------------------------------------------------
_CHUNK = 65536
_FORWARD_LINGER = 1.0  # seconds a client may go on sending after the server closed (containerd's)
FILESYSTEM_LIMIT = 64 * 2**20  # bytes of files one mock container may hold
_BASE_DIRECTORIES = ("/bin", "/dev", "/etc", "/home", "/proc", "/root", "/usr/bin", "/var")
_TMP = "/tmp"  # noqa: S108 - the mock container's own /tmp, in memory
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _since(options: ContainerLogOptions) -> datetime | None:
    if options.since_time is not None:
        since = options.since_time
        return since if since.tzinfo is not None else since.replace(tzinfo=UTC)
    if options.since_seconds is not None:
        return datetime.now(UTC) - timedelta(seconds=options.since_seconds)
    return None


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Whether `event` was set within `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def _unless(event: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if `event` is set first (`work` is then cancelled)."""
    finished, result = await _race(event, work)
    return result if finished else None


async def _race(event: asyncio.Event, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, result) if `work` ends first, else (False, None) and `work` is cancelled."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


def _failed(task: asyncio.Task[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None


# -- a container's files --------------------------------------------------------------------------
class _FsError(Exception):
    """A failed file operation; the message is what a shell would say ("No such file...")."""


class _NoSpace(Exception):
    """The container's filesystem is full."""


def _join(base: str, path: str) -> str:
    """`path` made absolute against `base` and normalised (no "..", no "//")."""
    joined = posixpath.normpath(posixpath.join(base, path))
    return "/" + joined.lstrip("/")


class _Filesystem:
    """A container's files in memory: absolute path -> contents, and the set of directories.

    Modification times are kept (so that `tar` makes the same archive twice, which
    `kubectl cp --retries` relies on); modes and owners are not: 0644 files, 0755 directories.
    """

    def __init__(self, limit: int = FILESYSTEM_LIMIT) -> None:
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = {"/"}
        self.mtimes: dict[str, int] = {}
        self.limit = limit
        self.used = 0

    def is_dir(self, path: str) -> bool:
        return path in self.dirs

    def is_file(self, path: str) -> bool:
        return path in self.files

    def exists(self, path: str) -> bool:
        return path in self.dirs or path in self.files

    def makedirs(self, path: str) -> None:
        missing = []
        while path not in self.dirs:
            if path in self.files:
                raise _FsError("Not a directory")
            missing.append(path)
            path = posixpath.dirname(path)
        self.dirs.update(missing)
        now = int(time.time())
        self.mtimes.update((directory, now) for directory in missing)

    def read(self, path: str) -> bytes:
        if path in self.dirs:
            raise _FsError("Is a directory")
        if path not in self.files:
            raise _FsError("No such file or directory")
        return bytes(self.files[path])

    def write(self, path: str, data: bytes, *, append: bool = False) -> None:
        """Create or replace (or append to) a file, creating its directories."""
        if path in self.dirs:
            raise _FsError("Is a directory")
        old = self.files.get(path)
        growth = len(data) - (0 if append or old is None else len(old))
        if self.used + growth > self.limit:
            raise _NoSpace
        self.makedirs(posixpath.dirname(path))
        if old is not None and append:
            old += data
        else:
            self.files[path] = bytearray(data)
        self.used += growth
        self.mtimes[path] = int(time.time())

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        names = {
            entry[len(prefix) :]
            for entry in (*self.files, *self.dirs)
            if entry.startswith(prefix) and entry != prefix and "/" not in entry[len(prefix) :]
        }
        return sorted(names)

    def walk(self, path: str) -> Iterator[str]:
        """`path` and, for a directory, everything below it, parents first, sorted."""
        yield path
        if path in self.dirs:
            for name in self.listdir(path):
                yield from self.walk(posixpath.join(path, name))

    def remove(self, path: str) -> None:
        """A file, or a directory with all it holds (never the root itself)."""
        if path in self.files:
            self.used -= len(self.files.pop(path))
            self.mtimes.pop(path, None)
            return
        prefix = path.rstrip("/") + "/"
        for name in [f for f in self.files if f.startswith(prefix)]:
            self.used -= len(self.files.pop(name))
        self.dirs -= {d for d in self.dirs if d.startswith(prefix)}
        if path != "/":
            self.dirs.discard(path)
        for name in [m for m in self.mtimes if m.startswith(prefix) or m == path]:
            del self.mtimes[name]


def _mount_volumes(
    fs: _Filesystem, mock: _MockPod, container: _Container, *, refresh: bool = False
) -> None:
    """Put the files of the container's volumes where they are mounted. `refresh` replaces
    the contents of whole-volume mounts (subPath mounts are never updated, as on a kubelet)."""
    for volume, mount_path, sub_path in container.mounts:
        target = _join("/", mount_path)
        sub = sub_path.strip("/")
        if refresh:
            if sub:
                continue
            fs.remove(target)
        if not sub or f"{volume}/{sub}" not in mock.files:  # a directory is mounted
            with contextlib.suppress(_FsError):
                fs.makedirs(target)
        for key, text in mock.files.items():
            name, _, rel = key.partition("/")
            if name != volume:
                continue
            if sub and rel == sub:
                destination = target
            elif not sub or rel.startswith(sub + "/"):
                destination = _join(target, rel[len(sub) + 1 :] if sub else rel)
            else:
                continue
            with contextlib.suppress(_FsError, _NoSpace):
                fs.write(destination, text.encode())


def _environment(mock: _MockPod, container: _Container) -> dict[str, str]:
    """What `env` shows in a container: PATH and HOSTNAME first, then the resolved env."""
    env = {"PATH": _PATH, "HOSTNAME": mock.name}
    env.update(container.env)
    env.setdefault("HOME", "/root")
    return env


# -- streams --------------------------------------------------------------------------------------
class _NoInput:
    async def read(self, max_bytes: int = _CHUNK) -> bytes:
        return b""


class _BytesInput:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._offset = 0

    async def read(self, max_bytes: int = _CHUNK) -> bytes:
        chunk = self._data[self._offset : self._offset + max_bytes]
        self._offset += len(chunk)
        return chunk


class _Discard:
    async def write(self, data: bytes) -> None:
        pass


class _Collector:
    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, data: bytes) -> None:
        self.data += data


class _FileOutput:
    """`> file`: each write appends to the file (which the redirection created empty)."""

    def __init__(self, fs: _Filesystem, path: str) -> None:
        self._fs = fs
        self._path = path

    async def write(self, data: bytes) -> None:
        self._fs.write(self._path, data, append=True)


class _TtyOutput:
    """Output through a terminal: each LF goes out as CR LF (the pty's onlcr)."""

    def __init__(self, target: OutputStream) -> None:
        self._target = target

    async def write(self, data: bytes) -> None:
        await self._target.write(data.replace(b"\n", b"\r\n"))


async def _write_all(out: OutputStream, data: bytes) -> None:
    for start in range(0, len(data), _CHUNK):
        await out.write(data[start : start + _CHUNK])


async def _read_all(source: InputStream, limit: int) -> bytes:
    """All of `source`; _NoSpace past `limit` bytes."""
    data = bytearray()
    while chunk := await source.read():
        data += chunk
        if len(data) > limit:
            raise _NoSpace
    return bytes(data)


_MAX_LINE = 1 << 20


class _LineReader:
    """Lines from a stream, for a shell; commands it runs read the rest through it too."""

    def __init__(self, source: InputStream) -> None:
        self._source = source
        self._buffer = bytearray()

    async def read(self, max_bytes: int = _CHUNK) -> bytes:
        if self._buffer:
            chunk = bytes(self._buffer[:max_bytes])
            del self._buffer[:max_bytes]
            return chunk
        return await self._source.read(max_bytes)

    async def readline(self) -> bytes:
        """The next line with its newline; at the end, what is left without one; b"" after."""
        while b"\n" not in self._buffer and len(self._buffer) < _MAX_LINE:
            data = await self._source.read()
            if not data:
                break
            self._buffer += data
        end = self._buffer.find(b"\n") + 1 or len(self._buffer)
        line = bytes(self._buffer[:end])
        del self._buffer[:end]
        return line


class _LineDiscipline:
    """A pty in canonical mode, as a container's would be: it echoes what is typed, lets the
    line be edited (backspace, ^U), hands it over on Enter; ^D ends the input once (the next
    reader gets more) and ^C interrupts the foreground command."""

    def __init__(
        self, source: InputStream, echo: OutputStream, interrupt: Callable[[], None]
    ) -> None:
        self._source = source
        self._echo = echo
        self._interrupt = interrupt
        self._lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._pending = b""
        self._ended = False

    async def read(self, max_bytes: int = _CHUNK) -> bytes:
        if not self._pending:
            if self._ended and self._lines.empty():
                return b""
            self._pending = await self._lines.get()
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def pump(self) -> None:
        line = bytearray()
        try:
            while data := await self._source.read():
                echo = bytearray()
                ready: list[bytes | None] = []  # lines to hand over, None: ^C; after the echo
                for byte in data:
                    if byte == 0x03:  # ^C
                        echo += b"^C\r\n"
                        line.clear()
                        ready.append(None)
                    elif byte == 0x04:  # ^D: the line so far, or end of input if there is none
                        ready.append(bytes(line))
                        line.clear()
                    elif byte in (0x7F, 0x08):  # erase one (UTF-8) character
                        if line:
                            while line and line[-1] & 0xC0 == 0x80:
                                del line[-1]
                            if line:
                                del line[-1]
                            echo += b"\b \b"
                    elif byte == 0x15:  # ^U: erase the line
                        echo += b"\b \b" * len(line.decode(errors="replace"))
                        line.clear()
                    elif byte in (0x0D, 0x0A):  # Enter (icrnl)
                        line += b"\n"
                        echo += b"\r\n"
                        ready.append(bytes(line))
                        line.clear()
                    elif byte < 0x20 and byte != 0x09:  # other control characters show as ^X
                        line.append(byte)
                        echo += b"^" + bytes([byte + 0x40])
                    else:
                        line.append(byte)
                        echo.append(byte)
                if echo:  # as a pty: the echo is out before a reader can answer the line
                    await self._echo.write(bytes(echo))
                for item in ready:
                    if item is None:
                        self._interrupt()
                    else:
                        self._lines.put_nowait(item)
        finally:
            if line:
                self._lines.put_nowait(bytes(line))
            self._ended = True
            self._lines.put_nowait(b"")


@dataclass(frozen=True, slots=True)
class _Stdio:
    stdin: InputStream
    stdout: OutputStream
    stderr: OutputStream


class _Terminal:
    """The stdio of one exec or attach session. With a TTY: a line discipline on stdin,
    stderr merged into stdout, LF sent as CR LF, ^C, and the window size as last resized."""

    def __init__(self, io: AttachIO) -> None:
        self._io = io
        self.tty = io.tty
        self.size: TerminalSize | None = None
        self._sized = asyncio.Event()
        self._foreground: list[asyncio.Event] = []  # innermost last: ^C interrupts that one
        self._pending_interrupt = False
        self._tasks: list[asyncio.Task[None]] = []
        raw = io.stdout if io.stdout is not None else _Discard()
        self._discipline: _LineDiscipline | None = None
        if io.tty:
            tty_out = _TtyOutput(raw)
            if io.stdin is not None:
                self._discipline = _LineDiscipline(io.stdin, raw, self._interrupt)
            stdin: InputStream = self._discipline or _NoInput()
            self.stdio = _Stdio(stdin, tty_out, tty_out)
        else:
            self.stdio = _Stdio(
                io.stdin if io.stdin is not None else _NoInput(),
                raw,
                io.stderr if io.stderr is not None else _Discard(),
            )

    async def __aenter__(self) -> _Terminal:
        self._tasks.append(asyncio.create_task(self._track_size()))
        if self._discipline is not None:
            self._tasks.append(asyncio.create_task(self._discipline.pump()))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _track_size(self) -> None:
        async for size in self._io.resizes:
            self.size = size
            self._sized.set()

    async def window_size(self) -> tuple[int, int]:
        """(rows, columns); the client sends its size right away, so wait a moment for it."""
        if self.size is None:
            await _wait(self._sized, 1.0)
        size = self.size
        return (0, 0) if size is None else (size.height, size.width)

    def _interrupt(self) -> None:
        if self._foreground:
            self._foreground[-1].set()

    async def foreground(self, work: Awaitable[T]) -> T | None:
        """`work`, unless ^C comes first: then it is cancelled and the result is None.
        Calls nest (a shell's command runs in the foreground of the shell's session). A ^C
        that came as `work` was ending anyway (typed right after Enter, say) goes to the
        next foreground work: the command that line starts."""
        if not self.tty:
            return await work
        interrupted = asyncio.Event()
        if self._pending_interrupt:
            self._pending_interrupt = False
            interrupted.set()
        self._foreground.append(interrupted)
        finished = True
        try:
            finished, result = await _race(interrupted, work)
        finally:
            self._foreground.remove(interrupted)
            if finished and interrupted.is_set():
                self._pending_interrupt = True
        return result


async def _main_process(container: str, terminal: _Terminal, has_stdin: bool, tick: float) -> None:
    """What `kubectl attach` reaches: a line echo, or a ticker without stdin."""
    stdout = terminal.stdio.stdout
    if has_stdin:
        reader = _LineReader(terminal.stdio.stdin)
        while line := await terminal.foreground(reader.readline()):
            await stdout.write(line.upper())
        return
    count = 0
    while True:
        count += 1
        await stdout.write(f"mock: {container} is running ({count})\n".encode())
        await asyncio.sleep(tick)


# -- a little shell: enough for kubectl cp, scripts in tests and an interactive session -----------
@dataclass(frozen=True, slots=True)
class _Var:
    name: str


@dataclass(frozen=True, slots=True)
class _Op:
    value: str


_Word = tuple[str | _Var, ...]
_REDIRECTIONS = {"<", ">", ">>", "2>", "2>>"}
_DUPLICATIONS = {"2>&1": "stderr to stdout", "1>&2": "stdout to stderr", ">&2": "stdout to stderr"}
_OPERATORS = (*_DUPLICATIONS, "2>>", "&&", "||", ">>", "2>", "|", ";", "&", ">", "<", "\n")
_VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*|[0-9?$#])\}|([A-Za-z_][A-Za-z0-9_]*|[0-9?$#])")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


class _SyntaxError(Exception):
    pass


class _Lexer:
    """Words and operators of a script, quotes and escapes resolved. `$NAME` stays a _Var, to
    be expanded when its command runs (so that `false; echo $?` sees the right status)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.tokens: list[_Op | _Word] = []
        self.parts: list[str | _Var] = []
        self.chars: list[str] = []
        self.in_word = False

    def run(self) -> list[_Op | _Word]:
        text = self.text
        while self.pos < len(text):
            c = text[self.pos]
            if c in " \t\r":
                self._end_word()
                self.pos += 1
            elif c == "#" and not self.in_word:
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif c == "\\":
                following = text[self.pos + 1 : self.pos + 2]
                if following != "\n":  # a backslash-newline continues the line
                    self._literal(following or "\\")
                self.pos += 2
            elif c == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise _SyntaxError("unterminated quoted string")
                self._literal(text[self.pos + 1 : end])
                self.pos = end + 1
            elif c == '"':
                self._double_quoted()
            elif c == "$":
                self._dollar()
            elif c == "`":
                raise _SyntaxError("command substitution is not supported by the mock")
            elif (op := self._operator()) is not None:
                self._end_word()
                self.tokens.append(_Op(op))
                self.pos += len(op)
            else:
                self._literal(c)
                self.pos += 1
        self._end_word()
        return self.tokens

    def _literal(self, text: str) -> None:
        self.chars.append(text)
        self.in_word = True

    def _flush(self) -> None:
        if self.chars:
            self.parts.append("".join(self.chars))
            self.chars = []

    def _end_word(self) -> None:
        self._flush()
        if self.in_word:
            self.tokens.append(tuple(self.parts))
        self.parts = []
        self.in_word = False

    def _double_quoted(self) -> None:
        text = self.text
        self.in_word = True
        self.pos += 1
        while self.pos < len(text):
            c = text[self.pos]
            if c == '"':
                self.pos += 1
                return
            following = text[self.pos + 1 : self.pos + 2]
            if c == "\\" and following in ('"', "\\", "$", "`", "\n"):
                if following != "\n":
                    self._literal(following)
                self.pos += 2
            elif c == "$":
                self._dollar()
            elif c == "`":
                raise _SyntaxError("command substitution is not supported by the mock")
            else:
                self._literal(c)
                self.pos += 1
        raise _SyntaxError("unterminated quoted string")

    def _dollar(self) -> None:
        if self.text.startswith("$(", self.pos):
            raise _SyntaxError("command substitution is not supported by the mock")
        match = _VARIABLE.match(self.text, self.pos + 1)
        if match is None:
            self._literal("$")
            self.pos += 1
            return
        self._flush()
        self.parts.append(_Var(match.group(1) or match.group(2)))
        self.in_word = True
        self.pos = match.end()

    def _operator(self) -> str | None:
        for op in _OPERATORS:
            if op[0] in "12" and self.in_word:
                continue  # "a2>f" is the word "a2", then ">"
            if self.text.startswith(op, self.pos):
                return op
        return None


@dataclass
class _Command:
    words: list[_Word] = field(default_factory=list)
    redirections: list[tuple[str, _Word | None]] = field(default_factory=list)  # None: dup


# Pipelines, each with what connects it to the one before: None (";", newline), "&&" or "||".
_Program = list[tuple[str | None, list[_Command]]]


def _describe(token: _Op | _Word | None) -> str:
    if token is None:
        return "end of input"
    if isinstance(token, _Op):
        return "newline" if token.value == "\n" else repr(token.value)
    return "word"


def _parse(script: str) -> _Program:
    tokens = _Lexer(script).run()
    program: _Program = []
    pipeline: list[_Command] = []
    command = _Command()
    connector: str | None = None
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not isinstance(token, _Op):
            command.words.append(token)
            continue
        op = token.value
        if op in _DUPLICATIONS:
            command.redirections.append((op, None))
        elif op in _REDIRECTIONS:
            target = tokens[index] if index < len(tokens) else None
            if target is None or isinstance(target, _Op):
                raise _SyntaxError(f"unexpected {_describe(target)} after {op}")
            command.redirections.append((op, target))
            index += 1
        elif op == "&":
            raise _SyntaxError("background jobs (&) are not supported by the mock")
        elif not (command.words or command.redirections):
            if op != "\n":  # blank lines, and a newline after "|", "&&" or "||", are fine
                raise _SyntaxError(f"unexpected {_describe(token)}")
        elif op == "|":
            pipeline.append(command)
            command = _Command()
        else:
            pipeline.append(command)
            program.append((connector, pipeline))
            pipeline, command = [], _Command()
            connector = op if op in ("&&", "||") else None
    if command.words or command.redirections:
        pipeline.append(command)
        program.append((connector, pipeline))
    elif pipeline or connector:
        raise _SyntaxError("unexpected end of input")
    return program


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


async def _say(out: OutputStream, text: str) -> None:
    await out.write(f"{text}\n".encode())


_Builtin = Callable[[list[str], _Stdio], Awaitable[int]]


class _Shell:
    """Runs commands as a shell in the container would, with built-in commands only."""

    def __init__(
        self, fs: _Filesystem, env: dict[str, str], hostname: str, terminal: _Terminal
    ) -> None:
        self.fs = fs
        self.env = env
        self.hostname = hostname
        self.terminal = terminal
        self.cwd = "/"
        self.status = 0
        self._builtins: dict[str, _Builtin] = {
            ":": self._true,
            "[": self._bracket,
            "bash": self._sh,
            "cat": self._cat,
            "cd": self._cd,
            "echo": self._echo,
            "env": self._env,
            "exit": self._exit,
            "export": self._export,
            "false": self._false,
            "head": self._head,
            "hostname": self._hostname,
            "ls": self._ls,
            "mkdir": self._mkdir,
            "printenv": self._printenv,
            "pwd": self._pwd,
            "rm": self._rm,
            "sh": self._sh,
            "sleep": self._sleep,
            "stty": self._stty,
            "tail": self._tail,
            "tar": self._tar,
            "test": self._test,
            "true": self._true,
            "wc": self._wc,
            "whoami": self._whoami,
        }

    def _path(self, name: str) -> str:
        return _join(self.cwd, name)

    async def main(self, argv: list[str], stdio: _Stdio) -> int:
        """The session's command; `exit N` included."""
        try:
            return await self.run(argv, stdio)
        except _Exit as done:
            return done.code

    async def run(self, argv: list[str], stdio: _Stdio) -> int:
        name = posixpath.basename(argv[0]) if argv else ""
        builtin = self._builtins.get(name)
        if builtin is None:
            await _say(stdio.stderr, f"mock: {argv[0] if argv else ''}: command not found")
            return 127
        try:
            return await builtin(argv[1:], stdio)
        except _NoSpace:
            await _say(stdio.stderr, f"{name}: write error: No space left on device")
            return 1

    async def run_script(self, script: str, stdio: _Stdio) -> int:
        try:
            program = _parse(script)
        except _SyntaxError as exc:
            await _say(stdio.stderr, f"sh: syntax error: {exc}")
            self.status = 2
            return 2
        for connector, pipeline in program:
            if (connector == "&&" and self.status != 0) or (connector == "||" and self.status == 0):
                continue
            self.status = await self._pipeline(pipeline, stdio)
        return self.status

    async def interactive(self, stdio: _Stdio) -> int:
        """Commands line by line (with a prompt on a terminal) until `exit` or end of input."""
        reader = _LineReader(stdio.stdin)
        session = _Stdio(reader, stdio.stdout, stdio.stderr)
        tty = self.terminal.tty
        while True:
            if tty:
                await stdio.stdout.write(f"{self.cwd} # ".encode())
            line = await self.terminal.foreground(reader.readline())
            if line is None:
                continue  # ^C at the prompt: a fresh one
            if not line:
                if tty:
                    await stdio.stdout.write(b"exit\n")
                return self.status
            script = line.decode(errors="replace")
            if await self.terminal.foreground(self.run_script(script, session)) is None:
                self.status = 128 + 2

    async def _pipeline(self, pipeline: list[_Command], stdio: _Stdio) -> int:
        """The stages run one after the other, each reading all the one before wrote."""
        status = 0
        stdin = stdio.stdin
        for index, command in enumerate(pipeline):
            out: OutputStream = stdio.stdout if index == len(pipeline) - 1 else _Collector()
            status = await self._simple(command, _Stdio(stdin, out, stdio.stderr))
            if isinstance(out, _Collector):
                stdin = _BytesInput(bytes(out.data))
        return status

    async def _simple(self, command: _Command, stdio: _Stdio) -> int:
        words = [self._expand(word) for word in command.words]
        assignments: dict[str, str] = {}
        while words and _ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            assignments[name] = value
        stdin, stdout, stderr = stdio.stdin, stdio.stdout, stdio.stderr
        for op, target in command.redirections:
            if target is None:  # 2>&1, >&2
                if op == "2>&1":
                    stderr = stdout
                else:
                    stdout = stderr
                continue
            name = self._expand(target)
            path = self._path(name)
            if op == "<":
                try:
                    stdin = _BytesInput(self.fs.read(path))
                except _FsError as exc:
                    await _say(stderr, f"sh: can't open {name}: {exc}")
                    return 1
                continue
            if self.fs.is_dir(path) or not self.fs.is_dir(posixpath.dirname(path)):
                reason = "Is a directory" if self.fs.is_dir(path) else "nonexistent directory"
                await _say(stderr, f"sh: can't create {name}: {reason}")
                return 1
            if not op.endswith(">>") or not self.fs.is_file(path):
                self.fs.write(path, b"")
            if op.startswith("2"):
                stderr = _FileOutput(self.fs, path)
            else:
                stdout = _FileOutput(self.fs, path)
        if not words:
            self.env.update(assignments)
            return 0
        saved = self.env
        self.env = {**saved, **assignments}
        try:
            return await self.run(words, _Stdio(stdin, stdout, stderr))
        finally:
            self.env = saved

    def _expand(self, word: _Word) -> str:
        return "".join(p if isinstance(p, str) else self._variable(p.name) for p in word)

    def _variable(self, name: str) -> str:
        special = {"?": str(self.status), "$": "1", "#": "0", "0": "sh"}
        return special.get(name) or self.env.get(name, "")

    # -- built-in commands: each takes its arguments and stdio and returns an exit code -------
    async def _true(self, args: list[str], stdio: _Stdio) -> int:
        return 0

    async def _false(self, args: list[str], stdio: _Stdio) -> int:
        return 1

    async def _exit(self, args: list[str], stdio: _Stdio) -> int:
        code = self.status
        if args:
            try:
                code = int(args[0])
            except ValueError:
                await _say(stdio.stderr, f"sh: exit: {args[0]}: numeric argument required")
                code = 2
        raise _Exit(code & 0xFF)

    async def _echo(self, args: list[str], stdio: _Stdio) -> int:
        end = "\n"
        if args and args[0] == "-n":
            args, end = args[1:], ""
        await stdio.stdout.write((" ".join(args) + end).encode())
        return 0

    async def _env(self, args: list[str], stdio: _Stdio) -> int:
        env = dict(self.env)
        while args and _ASSIGNMENT.match(args[0]):
            name, _, value = args[0].partition("=")
            env[name] = value
            args = args[1:]
        if args:
            saved, self.env = self.env, env
            try:
                return await self.run(args, stdio)
            finally:
                self.env = saved
        await stdio.stdout.write("".join(f"{k}={v}\n" for k, v in env.items()).encode())
        return 0

    async def _printenv(self, args: list[str], stdio: _Stdio) -> int:
        if not args:
            return await self._env([], stdio)
        values = [self.env[name] for name in args if name in self.env]
        await stdio.stdout.write("".join(f"{v}\n" for v in values).encode())
        return 0 if len(values) == len(args) else 1

    async def _export(self, args: list[str], stdio: _Stdio) -> int:
        for arg in args:
            name, assigned, value = arg.partition("=")
            if assigned:
                self.env[name] = value
        return 0

    async def _hostname(self, args: list[str], stdio: _Stdio) -> int:
        await _say(stdio.stdout, self.hostname)
        return 0

    async def _whoami(self, args: list[str], stdio: _Stdio) -> int:
        await _say(stdio.stdout, "root")
        return 0

    async def _pwd(self, args: list[str], stdio: _Stdio) -> int:
        await _say(stdio.stdout, self.cwd)
        return 0

    async def _cd(self, args: list[str], stdio: _Stdio) -> int:
        name = args[0] if args else self.env.get("HOME", "/")
        path = self._path(name)
        if not self.fs.is_dir(path):
            reason = "Not a directory" if self.fs.is_file(path) else "No such file or directory"
            await _say(stdio.stderr, f"sh: cd: {name}: {reason}")
            return 1
        self.cwd = path
        return 0

    async def _sleep(self, args: list[str], stdio: _Stdio) -> int:
        if not args:
            await _say(stdio.stderr, "sleep: missing operand")
            return 1
        total = 0.0
        units = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
        for arg in args:
            match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+|infinity)([smhd]?)", arg)
            if match is None:
                await _say(stdio.stderr, f"sleep: invalid time interval '{arg}'")
                return 1
            total += float(match.group(1).replace("infinity", "inf")) * units[match.group(2)]
        await asyncio.sleep(min(total, 1e9))
        return 0

    async def _cat(self, args: list[str], stdio: _Stdio) -> int:
        status = 0
        for name in [a for a in args if a != "-u"] or ["-"]:
            if name == "-":
                while data := await stdio.stdin.read():
                    await stdio.stdout.write(data)
                continue
            try:
                data = self.fs.read(self._path(name))
            except _FsError as exc:
                await _say(stdio.stderr, f"cat: {name}: {exc}")
                status = 1
                continue
            await _write_all(stdio.stdout, data)
        return status

    async def _ls(self, args: list[str], stdio: _Stdio) -> int:
        show_all = any(a.startswith("-") and "a" in a for a in args)
        names = [a for a in args if not a.startswith("-") or a == "-"] or ["."]
        status = 0
        files: list[str] = []
        directories: list[tuple[str, str]] = []
        for name in names:
            path = self._path(name)
            if self.fs.is_dir(path):
                directories.append((name, path))
            elif self.fs.is_file(path):
                files.append(name)
            else:
                await _say(stdio.stderr, f"ls: cannot access '{name}': No such file or directory")
                status = 2
        lines = sorted(files)
        for name, path in directories:
            entries = self.fs.listdir(path)
            entries = [".", "..", *entries] if show_all else [e for e in entries if e[0] != "."]
            if len(names) > 1:
                lines += ["", f"{name}:"] if lines else [f"{name}:"]
            lines += entries
        await stdio.stdout.write("".join(f"{line}\n" for line in lines).encode())
        return status

    async def _bracket(self, args: list[str], stdio: _Stdio) -> int:
        if not args or args[-1] != "]":
            await _say(stdio.stderr, "[: missing ]")
            return 2
        return await self._test(args[:-1], stdio)

    async def _test(self, args: list[str], stdio: _Stdio) -> int:
        try:
            return 0 if self._evaluate(args) else 1
        except ValueError as exc:
            await _say(stdio.stderr, f"test: {exc}")
            return 2

    def _evaluate(self, args: list[str]) -> bool:
        fs = self.fs
        match args:
            case []:
                return False
            case ["!", *rest]:
                return not self._evaluate(rest)
            case [value]:
                return value != ""
            case ["-n", value]:
                return value != ""
            case ["-z", value]:
                return value == ""
            case ["-e" | "-r" | "-w", name]:
                return fs.exists(self._path(name))
            case ["-d" | "-x", name]:
                return fs.is_dir(self._path(name))
            case ["-f", name]:
                return fs.is_file(self._path(name))
            case ["-s", name]:
                return bool(fs.files.get(self._path(name)))
            case [left, "=" | "==", right]:
                return left == right
            case [left, "!=", right]:
                return left != right
            case [left, "-eq" | "-ne" | "-lt" | "-le" | "-gt" | "-ge" as op, right]:
                try:
                    a, b = int(left), int(right)
                except ValueError:
                    raise ValueError("integer expression expected") from None
                results = {"-eq": a == b, "-ne": a != b, "-lt": a < b}
                results |= {"-le": a <= b, "-gt": a > b, "-ge": a >= b}
                return results[op]
            case _:
                raise ValueError(f"unknown condition: {' '.join(args)}")

    async def _mkdir(self, args: list[str], stdio: _Stdio) -> int:
        parents = any(a.startswith("-") and "p" in a for a in args)
        names = [a for a in args if not a.startswith("-")]
        if not names:
            await _say(stdio.stderr, "mkdir: missing operand")
            return 1
        status = 0
        for name in names:
            path = self._path(name)
            if self.fs.exists(path):
                if parents and self.fs.is_dir(path):
                    continue
                reason = "File exists"
            elif not parents and not self.fs.is_dir(posixpath.dirname(path)):
                reason = "No such file or directory"
            else:
                try:
                    self.fs.makedirs(path)
                    continue
                except _FsError as exc:
                    reason = str(exc)
            await _say(stdio.stderr, f"mkdir: cannot create directory '{name}': {reason}")
            status = 1
        return status

    async def _rm(self, args: list[str], stdio: _Stdio) -> int:
        flags = "".join(a[1:] for a in args if a.startswith("-") and a != "-")
        recursive, force = "r" in flags or "R" in flags, "f" in flags
        status = 0
        for name in [a for a in args if not a.startswith("-") or a == "-"]:
            path = self._path(name)
            if not self.fs.exists(path):
                if force:
                    continue
                reason = "No such file or directory"
            elif self.fs.is_dir(path) and not recursive:
                reason = "Is a directory"
            else:
                self.fs.remove(path)
                continue
            await _say(stdio.stderr, f"rm: cannot remove '{name}': {reason}")
            status = 1
        return status

    async def _inputs(
        self, tool: str, names: list[str], stdio: _Stdio
    ) -> tuple[list[tuple[str, bytes]], int]:
        """The contents of the named files ("-": stdin; none: stdin) and an exit status."""
        found: list[tuple[str, bytes]] = []
        status = 0
        for name in names or ["-"]:
            if name == "-":
                found.append((name, await _read_all(stdio.stdin, 4 * self.fs.limit)))
                continue
            try:
                found.append((name, self.fs.read(self._path(name))))
            except _FsError as exc:
                await _say(stdio.stderr, f"{tool}: {name}: {exc}")
                status = 1
        return found, status

    async def _head(self, args: list[str], stdio: _Stdio) -> int:
        return await self._slice("head", args, stdio)

    async def _tail(self, args: list[str], stdio: _Stdio) -> int:
        return await self._slice("tail", args, stdio)

    async def _slice(self, tool: str, args: list[str], stdio: _Stdio) -> int:
        """head and tail: -n N / -c N, and for tail +N (from the Nth line or byte on)."""
        unit, spec, names = "n", "10", []
        index = 0
        while index < len(args):
            arg = args[index]
            index += 1
            if arg in ("-c", "-n"):
                if index >= len(args):
                    await _say(stdio.stderr, f"{tool}: option requires an argument -- '{arg[1]}'")
                    return 1
                unit, spec = arg[1], args[index]
                index += 1
            elif re.fullmatch(r"-[cn].+", arg):
                unit, spec = arg[1], arg[2:]
            elif re.fullmatch(r"-\d+", arg):
                spec = arg[1:]
            else:
                names.append(arg)
        match = re.fullmatch(r"([+-]?)(\d+)", spec)
        if match is None:
            what = "bytes" if unit == "c" else "lines"
            await _say(stdio.stderr, f"{tool}: invalid number of {what}: '{spec}'")
            return 1
        count = int(match.group(2))
        from_start = tool == "tail" and match.group(1) == "+"
        found, status = await self._inputs(tool, names, stdio)
        data = b"".join(content for _, content in found)
        items: list[bytes] | bytes = data if unit == "c" else data.splitlines(keepends=True)
        if tool == "head":
            items = items[:count]
        elif from_start:
            items = items[max(count - 1, 0) :]
        else:
            items = items[-count:] if count else items[:0]
        await _write_all(stdio.stdout, items if isinstance(items, bytes) else b"".join(items))
        return status

    async def _wc(self, args: list[str], stdio: _Stdio) -> int:
        flags = "".join(a[1:] for a in args if a.startswith("-") and a != "-")
        names = [a for a in args if not a.startswith("-") or a == "-"]
        chosen = [f for f in "lwc" if f in flags] or ["l", "w", "c"]
        found, status = await self._inputs("wc", names, stdio)
        lines = []
        for name, data in found:
            counts = {"l": data.count(b"\n"), "w": len(data.split()), "c": len(data)}
            label = f" {name}" if names else ""
            lines.append(" ".join(str(counts[f]) for f in chosen) + label)
        await stdio.stdout.write("".join(f"{line}\n" for line in lines).encode())
        return status

    async def _stty(self, args: list[str], stdio: _Stdio) -> int:
        if not self.terminal.tty:
            await _say(stdio.stderr, "stty: 'standard input': Inappropriate ioctl for device")
            return 1
        if args == ["size"]:
            rows, columns = await self.terminal.window_size()
            await _say(stdio.stdout, f"{rows} {columns}")
        return 0  # other settings are accepted and ignored

    async def _sh(self, args: list[str], stdio: _Stdio) -> int:
        """`sh -c SCRIPT`, `sh FILE`, or interactive (a prompt with a TTY), in a subshell."""
        shell = _Shell(self.fs, dict(self.env), self.hostname, self.terminal)
        shell.cwd = self.cwd
        script: str | None = None
        index = 0
        while index < len(args) and args[index].startswith("-") and args[index] != "-":
            flags = args[index]
            index += 1
            if flags == "--":
                break
            if "c" in flags:
                if index >= len(args):
                    await _say(stdio.stderr, "sh: -c requires an argument")
                    return 2
                script = args[index]
                break
        try:
            if script is not None:
                return await shell.run_script(script, stdio)
            if index < len(args) and args[index] != "-":
                try:
                    text = self.fs.read(self._path(args[index]))
                except _FsError as exc:
                    await _say(stdio.stderr, f"sh: {args[index]}: {exc}")
                    return 127
                return await shell.run_script(text.decode(errors="replace"), stdio)
            return await shell.interactive(stdio)
        except _Exit as done:
            return done.code

    async def _tar(self, args: list[str], stdio: _Stdio) -> int:
        """What `kubectl cp` runs: `tar cf - PATH` from the pod, `tar -xmf - -C DIR` to it."""
        try:
            options = _TarOptions.parse(args)
        except ValueError as exc:
            await _say(stdio.stderr, f"tar: {exc}")
            return 2
        if options.mode == "c":
            return await self._tar_create(options, stdio)
        return await self._tar_read(options, stdio)

    async def _tar_create(self, options: _TarOptions, stdio: _Stdio) -> int:
        if not options.paths:
            await _say(stdio.stderr, "tar: Cowardly refusing to create an empty archive")
            return 2
        base = self._path(options.directory or ".")
        to_stdout = options.archive in (None, "-")
        listing = stdio.stderr if to_stdout else stdio.stdout
        status = 0
        warned = False
        buffer = BytesIO()
        with tarfile.open(
            fileobj=buffer, mode="w:gz" if options.gzip else "w", format=tarfile.GNU_FORMAT
        ) as archive:
            for name in options.paths:
                path = _join(base, name)
                if not self.fs.exists(path):
                    await _say(stdio.stderr, f"tar: {name}: Cannot stat: No such file or directory")
                    status = 2
                    continue
                member = name.lstrip("/")
                if member != name and not warned:
                    await _say(stdio.stderr, "tar: Removing leading `/' from member names")
                    warned = True
                for entry in self.fs.walk(path):
                    info = tarfile.TarInfo(posixpath.join(member, entry[len(path) :].lstrip("/")))
                    info.name = info.name.rstrip("/") or "."
                    info.mtime = self.fs.mtimes.get(entry, 0)
                    info.uname = info.gname = "root"
                    content = None
                    if self.fs.is_dir(entry):
                        info.type, info.mode = tarfile.DIRTYPE, 0o755
                    else:
                        data = self.fs.read(entry)
                        info.size, info.mode, content = len(data), 0o644, BytesIO(data)
                    archive.addfile(info, content)
                    if options.verbose:
                        await _say(listing, info.name + ("/" if info.isdir() else ""))
        if to_stdout:
            await _write_all(stdio.stdout, buffer.getvalue())
        else:
            self.fs.write(_join(self.cwd, options.archive or "-"), buffer.getvalue())
        if status:
            await _say(stdio.stderr, "tar: Exiting with failure status due to previous errors")
        return status

    async def _tar_read(self, options: _TarOptions, stdio: _Stdio) -> int:
        """`x` (extract) or `t` (list)."""
        if options.archive in (None, "-"):
            source = await _read_all(stdio.stdin, 2 * self.fs.limit)
        else:
            try:
                source = self.fs.read(self._path(options.archive or "-"))
            except _FsError as exc:
                await _say(stdio.stderr, f"tar: {options.archive}: Cannot open: {exc}")
                return 2
        base = self._path(options.directory or ".")
        if not self.fs.is_dir(base):
            await _say(stdio.stderr, f"tar: {options.directory}: Cannot open: No such directory")
            await _say(stdio.stderr, "tar: Error is not recoverable: exiting now")
            return 2
        status = 0
        warned = False
        try:
            with tarfile.open(fileobj=BytesIO(source), mode="r:*") as archive:
                for member in archive:
                    shown = member.name + ("/" if member.isdir() else "")
                    if options.mode == "t" or options.verbose:
                        await _say(stdio.stdout, shown)
                    if options.mode == "t":
                        continue
                    name = member.name.lstrip("/")
                    if name != member.name and not warned:
                        await _say(stdio.stderr, "tar: Removing leading `/' from member names")
                        warned = True
                    if ".." in name.split("/"):
                        await _say(stdio.stderr, f"tar: {member.name}: Member name contains '..'")
                        status = 2
                        continue
                    target = _join(base, name)
                    try:
                        if member.isdir():
                            self.fs.makedirs(target)
                        elif member.isfile():
                            extracted = archive.extractfile(member)
                            assert extracted is not None
                            self.fs.write(target, extracted.read())
                        else:
                            await _say(
                                stdio.stderr, f"tar: {member.name}: links are skipped by the mock"
                            )
                    except _FsError as exc:
                        await _say(stdio.stderr, f"tar: {member.name}: Cannot open: {exc}")
                        status = 2
                    except _NoSpace:
                        await _say(
                            stdio.stderr,
                            f"tar: {member.name}: Cannot write: No space left on device",
                        )
                        return 2
        except tarfile.TarError:
            await _say(stdio.stderr, "tar: This does not look like a tar archive")
            status = 2
        if status:
            await _say(stdio.stderr, "tar: Exiting with failure status due to previous errors")
        return status


_TAR_IGNORED = {
    "no-same-owner",
    "no-same-permissions",
    "same-owner",
    "same-permissions",
    "preserve-permissions",
    "touch",
    "overwrite",
    "numeric-owner",
    "no-overwrite-dir",
}


@dataclass
class _TarOptions:
    mode: str = ""  # c, x or t
    archive: str | None = None  # "-" or None: stdin/stdout
    directory: str | None = None
    gzip: bool = False
    verbose: bool = False
    paths: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, args: list[str]) -> _TarOptions:
        """GNU tar's options, old style (`tar cf - x`) included."""
        args = list(args)
        if args and not args[0].startswith("-"):
            args[0] = "-" + args[0]
        options = cls()
        index = 0
        while index < len(args):
            arg = args[index]
            index += 1
            if arg == "--":
                options.paths += args[index:]
                break
            if arg.startswith("--"):
                name, has_value, value = arg[2:].partition("=")
                if name in ("directory", "file") and not has_value:
                    if index >= len(args):
                        raise ValueError(f"option '--{name}' requires an argument")
                    value, index = args[index], index + 1
                if name == "directory":
                    options.directory = value
                elif name == "file":
                    options.archive = value
                elif name in ("create", "extract", "list"):
                    options._set_mode(name[0].replace("l", "t"))
                elif name == "gzip":
                    options.gzip = True
                elif name == "verbose":
                    options.verbose = True
                elif name not in _TAR_IGNORED:
                    raise ValueError(f"unrecognized option '--{name}'")
                continue
            if not arg.startswith("-") or arg == "-":
                options.paths.append(arg)
                continue
            letters = arg[1:]
            for position, letter in enumerate(letters):
                if letter in "cxt":
                    options._set_mode(letter)
                elif letter in "fC":
                    value = letters[position + 1 :]
                    if not value:
                        if index >= len(args):
                            raise ValueError(f"option requires an argument -- '{letter}'")
                        value, index = args[index], index + 1
                    if letter == "f":
                        options.archive = value
                    else:
                        options.directory = value
                    break
                elif letter == "z":
                    options.gzip = True
                elif letter == "v":
                    options.verbose = True
                elif letter not in "mpoh":
                    raise ValueError(f"invalid option -- '{letter}'")
        if not options.mode:
            raise ValueError("You must specify one of the '-Acdtrux' options")
        return options

    def _set_mode(self, mode: str) -> None:
        if self.mode and self.mode != mode:
            raise ValueError("You may not specify more than one '-Acdtrux' option")
        self.mode = mode


# -- usage, for stats and metrics -----------------------------------------------------------------
_SYSTEM_NANOCORES = 50_000_000  # the node's own CPU use (50m) ...
_SYSTEM_MEMORY = 256 * 2**20  # ... and memory


@dataclass(frozen=True, slots=True)
class _Usage:
    nanocores: int  # the current rate
    cpu: int  # cumulative core-nanoseconds
    working_set: int  # bytes


@dataclass(frozen=True, slots=True)
class _Snapshot:
    time: datetime
    node: _Usage
    pods: list[tuple[_MockPod, list[tuple[_Container, _Usage]]]]


def _usage(mock: _MockPod, now: datetime) -> list[tuple[_Container, _Usage]]:
    """Each running container's usage: rates from a hash of the pod's UID and the container's
    name (5-200m CPU, 16-256 MiB), so they stay put for the container's life."""
    assert mock.started is not None
    elapsed = max((now - _parse_time(mock.started)).total_seconds(), 0.0)
    result = []
    for container in mock.containers:
        if container.init:
            continue
        digest = hashlib.sha256(f"{mock.uid}/{container.name}".encode()).digest()
        nanocores = (5 + int.from_bytes(digest[:2]) % 196) * 1_000_000
        working_set = (16 + int.from_bytes(digest[2:4]) % 241) * 2**20
        result.append((container, _Usage(nanocores, int(nanocores * elapsed), working_set)))
    return result


def _cpu_stats(stamp: str, usage: _Usage) -> dict[str, Any]:
    return {"time": stamp, "usageNanoCores": usage.nanocores, "usageCoreNanoSeconds": usage.cpu}


def _memory_stats(stamp: str, usage: _Usage, available: int | None = None) -> dict[str, Any]:
    working_set = usage.working_set
    stats: dict[str, Any] = {"time": stamp}
    if available is not None:  # the kubelet reports it where there is a limit (the node's)
        stats["availableBytes"] = available
    stats |= {
        "usageBytes": working_set + working_set // 8,  # plus some inactive page cache
        "workingSetBytes": working_set,
        "rssBytes": working_set * 3 // 4,
        "pageFaults": working_set // 4096,
        "majorPageFaults": 0,
    }
    return stats


_RESOURCE_HELP = {
    "container_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
    ),
    "container_memory_working_set_bytes": (
        "gauge",
        "Current working set of the container in bytes",
    ),
    "container_start_time_seconds": (
        "gauge",
        "Start time of the container since unix epoch in seconds",
    ),
    "node_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
    ),
    "node_memory_working_set_bytes": ("gauge", "Current working set of the node in bytes"),
    "pod_cpu_usage_seconds_total": (
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
    ),
    "pod_memory_working_set_bytes": ("gauge", "Current working set of the pod in bytes"),
    "resource_scrape_error": (
        "gauge",
        "1 if there was an error while getting container metrics, 0 otherwise",
    ),
}


def _resource_metrics(snapshot: _Snapshot) -> str:
    """The text a v1.37 kubelet serves on /metrics/resource for the same numbers."""
    ms = str(int(snapshot.time.timestamp() * 1000))
    samples: dict[str, list[tuple[str, float, str | None]]] = {name: [] for name in _RESOURCE_HELP}

    def add(name: str, labels: dict[str, str], value: float, stamp: str | None = ms) -> None:
        text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items()))
        samples[name].append((f"{{{text}}}" if text else "", value, stamp))

    add("node_cpu_usage_seconds_total", {}, snapshot.node.cpu / 1e9)
    add("node_memory_working_set_bytes", {}, snapshot.node.working_set)
    for mock, usages in snapshot.pods:
        pod = {"namespace": mock.namespace, "pod": mock.name}
        assert mock.started is not None
        started = _parse_time(mock.started).timestamp()
        for container, usage in usages:
            labels = {**pod, "container": container.name}
            add("container_start_time_seconds", labels, started, None)
            add("container_cpu_usage_seconds_total", labels, usage.cpu / 1e9)
            add("container_memory_working_set_bytes", labels, usage.working_set)
        add("pod_cpu_usage_seconds_total", pod, sum(u.cpu for _, u in usages) / 1e9)
        add("pod_memory_working_set_bytes", pod, sum(u.working_set for _, u in usages))
    add("resource_scrape_error", {}, 0, None)
    lines = []
    for name, (kind, text) in _RESOURCE_HELP.items():
        if not samples[name]:
            continue  # as Go's registry: no family without samples
        lines += [f"# HELP {name} [STABLE] {text}", f"# TYPE {name} {kind}"]
        for label_text, value, stamp in sorted(samples[name]):
            tail = f" {stamp}" if stamp is not None else ""
            lines.append(f"{name}{label_text} {_go_float(value)}{tail}")
    return "\n".join(lines) + "\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _go_float(value: float) -> str:
    """As Go's strconv.FormatFloat(value, 'g', -1, 64), which the Prometheus text format uses:
    the shortest digits, in exponent form from 1e+06 up and below 1e-04."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    sign, digit_tuple, exponent = Decimal(repr(float(value))).as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    exponent += len("".join(map(str, digit_tuple))) - len(digits)
    point = len(digits) + exponent  # digits before the decimal point
    prefix = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        power = point - 1
        return f"{prefix}{mantissa}e{'-' if power < 0 else '+'}{abs(power):02d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return prefix + digits + "0" * (point - len(digits))
    return f"{prefix}{digits[:point]}.{digits[point:]}"


def create(context: ProviderContext) -> MockProvider:
    """Entry point (`vkubelet.providers`: mock)."""
    config = MockConfig.load(context.config_path, context.node_name)
    return MockProvider(context.node_name, config, host_ip=context.internal_ip)
