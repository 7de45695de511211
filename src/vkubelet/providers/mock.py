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
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Node, Pod

from ..node import ContainerLogOptions, ProviderContext, ProviderError, ResolvedPod
from ..node.resolve import FilesVolume, parse_quantity

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
    """Implements the pod lifecycle, push notifications, node configuration and kubectl logs."""

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
        self._save_state()

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        mock = self._pods.get(key)
        if mock is None or mock.uid != pod.metadata.uid:  # type: ignore[union-attr]
            return
        task = self._starting.pop(key, None)
        if task:
            task.cancel()
        mock.stopped = _now()
        self._stop_event(mock.uid).set()
        self._stops.pop(mock.uid, None)
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
        mock = self._pods.get(f"{namespace}/{pod}")
        if mock is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running here")
        found = next((c for c in mock.containers if c.name == container), None)
        if found is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} has no container {container}")
        lines = [
            f"mock: container {container} of {namespace}/{pod} started",
            f"mock: image {found.image}",
        ]
        if mock.print_env:
            lines += [f"{name}={value}" for name, value in found.env]
        lines.append(f"mock: {len(lines) - 1} lines")
        if options.tail_lines is not None:
            lines = lines[-options.tail_lines :] if options.tail_lines else []
        for line in lines:
            stamp = f"{mock.started or mock.created} " if options.timestamps else ""
            yield f"{stamp}{line}\n".encode()
        if options.follow and mock.stopped is None:
            await self._stop_event(mock.uid).wait()  # a follower ends when the pod stops


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
    result = [
        _Container(c.name, c.image or "", [(e.name, e.value or "") for e in c.env or []], init=True)
        for c in spec.initContainers or []
    ]
    result += [
        _Container(c.name, c.image or "", [(e.name, e.value or "") for e in c.env or []])
        for c in spec.containers
    ]
    return result


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


def create(context: ProviderContext) -> MockProvider:
    """Entry point (`vkubelet.providers`: mock)."""
    config = MockConfig.load(context.config_path, context.node_name)
    return MockProvider(context.node_name, config, host_ip=context.internal_ip)
