"""One device, one virtual node: its pods run as supervised process groups over SSH.

The device keeps the truth: each pod's supervisor (`_remote`) writes container states, exit
codes and logs to files in the pod's directory, so they survive SSH drops and agent restarts.
The provider mirrors those files: a `tail -F` of the device's event file tells it within
milliseconds that something changed, a status sweep (one SSH channel for all pods) reads what,
and a periodic sweep catches up after a disconnect. Nothing about a pod lives only here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import logging
import math
import re
import shlex
import signal
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Hashable
from datetime import UTC, datetime
from typing import Any, Literal

import asyncssh
import msgspec
from lightkube.models.core_v1 import NodeSpec, NodeStatus, PodStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from ...sdk import ContainerLogOptions, ProviderError, ResolvedPod
from ...sdk.capabilities import AttachIO, ByteStream
from ...sdk.logs import LogParser, previous_not_found, render_chunks
from ...sdk.probes import PodProbes, ProbeEvent
from ...sdk.provider import EventSink
from ...sdk.quantity import QuantityError, parse_quantity
from ...sdk.retry import Backoff
from ...sdk.stats import ContainerUsage, CpuCounters, NodeUsage, PodUsage, Usage
from ...sdk.stats import resource_metrics as format_metrics
from ...sdk.stats import summary as format_summary
from ...sdk.status import (
    ContainerReport,
    Running,
    Terminated,
    Waiting,
    build_pod_status,
    ephemeral_run_before,
)
from ...sdk.stdio import forward_connection, initial_size, relay
from ...sdk.tasks import TaskSet
from ...sdk.volumes import EmptyDirVolume, FilesVolume, HostPathVolume
from . import _lifecycle, _remote, _usage
from ._inventory import DeviceConfig
from ._link import Completed, DeviceLink, Unreachable
from ._probes import DEFAULT_HOST, DeviceProbes

log = logging.getLogger(__name__)

_ARCHIVE_END = "VKUBELET_ARCHIVE_END"  # base64 never contains it
_UID = re.compile(r"[a-z0-9][-a-z0-9]{0,62}")
_SWEEP_INTERVAL = 5.0  # catch-up sweep; changes normally arrive through the event file
_SAMPLE_REUSE = 1.0  # seconds a usage sample answers for: /stats and /metrics of one scrape
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "armv6l": "arm", "i686": "386"}


class _PodEntry:
    """What the provider knows of one pod: the API object and the device's last report."""

    def __init__(self, pod: Pod, uid: str) -> None:
        self.pod = pod
        self.uid = uid
        self.remote: _remote.RemotePod | None = None
        self.created = datetime.now(UTC)
        self.deleting = False
        self.removing = False  # a task removes it once its processes are gone
        self.prober: PodProbes | None = None
        self.status: PodStatus | None = None  # the last one reported
        # Ephemeral containers (`kubectl debug`): their state, and what those without stdin
        # printed (their log). Kept by the agent: their process is its SSH session.
        self.debug: dict[str, ContainerReport] = {}
        self.debug_output: dict[str, bytearray] = {}
        self.debug_attached: set[str] = set()
        self.debug_plans: dict[str, tuple[_remote.ContainerPlan, str | None]] = {}  # and target
        # Starting its supervisor: create_pod, or a revival after it died. One at a time.
        self.starting = asyncio.Lock()
        self.revivals: Backoff | None = None  # a supervisor that died: its revivals' back-off
        self.revive_at = 0.0  # monotonic: not revived again before


class DeviceProvider:
    """Pod lifecycle, node description and kubectl verbs for one SSH device."""

    def __init__(
        self,
        config: DeviceConfig,
        *,
        link: DeviceLink | None = None,
        events: EventSink | None = None,
        probe_second: float = 1.0,
    ) -> None:
        self.config = config
        self.link = link or DeviceLink(config)
        self.events = events
        self.probe_second = probe_second  # how long a second of probe settings lasts (tests)
        self._removals = TaskSet(f"removals {config.name}", logger=log)
        self._debug_runs = TaskSet(f"debug containers {config.name}", logger=log)
        self._revivals = TaskSet(f"revivals {config.name}", logger=log)
        self.root = config.pod_dir
        self._pods: dict[str, _PodEntry] = {}  # "namespace/name"
        self._notify: Callable[[Pod], None] | None = None
        self._node_notify: Callable[[Node], None] | None = None
        self._facts: dict[str, str] = {}
        self._rediscover = True  # a (re)connected device may have changed: read its facts again
        self._counters = CpuCounters()
        self._sampling = asyncio.Lock()
        self._sample: tuple[float, float, NodeUsage, list[PodUsage]] | None = None  # (monotonic,
        # epoch seconds, node, pods) of the last usage sample
        self._tasks: list[asyncio.Task[None]] = []
        self._poked: set[str] = set()
        self._poke = asyncio.Event()
        self._swept = asyncio.Event()  # set after the first full sweep of a connection
        self.link.on_connected.append(self._on_connected)

    # -- running ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self.link.maintain(), name=f"ssh {self.config.name}"),
            asyncio.create_task(self._follow_events(), name=f"events {self.config.name}"),
            asyncio.create_task(self._sweep_forever(), name=f"sweep {self.config.name}"),
        ]

    async def aclose(self) -> None:
        for entry in self._pods.values():
            if entry.prober is not None:
                await entry.prober.aclose()
        await self._removals.aclose()
        await self._debug_runs.aclose()
        await self._revivals.aclose()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        self.link.close()

    def _on_connected(self) -> None:
        self._swept.clear()
        self._rediscover = True
        self._poke.set()

    async def _follow_events(self) -> None:
        """Tail the device's event file: a line per container state change, a poke to sweep."""
        while True:
            await self.link.wait_connected()
            events = f"{_remote.root_word(self.root)}/events"
            # Only pokes: the file is emptied when it grows large (the sweeps have the truth).
            command = (
                f"mkdir -p {_remote.root_word(self.root)} && touch {events} && "
                f"{{ [ $(wc -c < {events}) -lt 1048576 ] || : > {events}; }} && "
                f"exec tail -n 0 -F {events} 2>/dev/null"
            )
            try:
                async with self.link.process(command, stdin=False, reserved=True) as proc:
                    async for line in proc.stdout:
                        uid = line.split(b" ", 1)[0].decode(errors="replace").strip()
                        if _UID.fullmatch(uid):
                            self._poked.add(uid)
                            self._poke.set()
            except (Unreachable, OSError, asyncssh.Error) as e:
                log.debug("device %s: event stream ended: %s", self.config.name, e)
            await asyncio.sleep(1)

    async def _sweep_forever(self) -> None:
        while True:
            # Not wait_for: on Python 3.11 it may swallow a cancellation that comes as the event
            # is set, and aclose() then waits for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_SWEEP_INTERVAL):
                    await self._poke.wait()
            self._poke.clear()
            await asyncio.sleep(0.01)  # a burst of events costs one sweep
            uids = None if not self._swept.is_set() else (set(self._poked) or None)
            self._poked.clear()
            try:
                await self._sweep(uids)
            except (Unreachable, RuntimeError) as e:
                log.debug("device %s: sweep failed: %s", self.config.name, e)
                await asyncio.sleep(1)
                continue
            if uids is None:
                self._swept.set()
                if self._rediscover:
                    await self._discover()

    async def _sweep(self, uids: set[str] | None) -> None:
        if not self.link.connected:
            return
        script = _remote.sweep_script(self.root, sorted(uids) if uids else None)
        result = await self.link.run(script)
        found = _remote.parse_sweep(result.check("status sweep"))
        by_uid = {entry.uid: entry for entry in self._pods.values()}
        for uid, remote in found.items():
            entry = by_uid.get(uid)
            if entry is None:
                entry = self._adopt(remote)
                if entry is None:
                    continue
                entry.remote = remote  # adopted: what happened before is no news
            self._record_events(entry, remote)
            entry.remote = remote
            self._probe(entry)
            self._publish(entry)
            self._revive_if_lost(entry, remote)

    def _revive_if_lost(self, entry: _PodEntry, remote: _remote.RemotePod) -> None:
        """A supervisor that died (killed on the device, OOM-killed) restarts nothing and leaves
        "running" states of runs that have ended: like a kubelet whose container's shim died,
        the agent ends them (ContainerStatusUnknown, 137) and starts the supervisor again, which
        restarts them by the pod's restartPolicy. A supervisor that keeps dying is revived with
        the restart back-off (the first time at once), reset once one lived for as long as the
        kubelet's reset period."""
        now = time.monotonic()
        if not remote.supervisor_lost:
            reset_after = 2 * self.config.backoff_max
            if entry.revivals is not None and now - entry.revive_at > reset_after:
                entry.revivals = None
            return
        if entry.starting.locked() or now < entry.revive_at:
            return
        if entry.revivals is None:
            entry.revivals = Backoff(self.config.backoff_initial, self.config.backoff_max)
            entry.revive_at = now  # the first revival at once
        entry.revive_at = now + entry.revivals.next_delay()
        self._revivals.spawn(self._revive(entry), name=f"revive {_key(entry)}")

    async def _revive(self, entry: _PodEntry) -> None:
        async with entry.starting:
            script = self._backoff_env() + _remote.revive_pod_script(self.root, entry.uid)
            try:
                result = await self.link.run(script)
            except Unreachable:
                return  # the next sweep after reconnecting tells again
        if result.exit_status != 0:
            detail = result.stderr.decode(errors="replace").strip()[-500:]
            log.warning(
                "device %s: pod %s: its supervisor died and cannot be restarted: %s",
                self.config.name,
                _key(entry),
                detail or f"exit {result.exit_status}",
            )
        elif result.stdout.strip():
            log.warning(
                "device %s: pod %s: its supervisor had died: restarted",
                self.config.name,
                _key(entry),
            )
        self._poked.add(entry.uid)
        self._poke.set()

    def _backoff_env(self) -> str:
        """The restart back-off's settings, for the supervisor a script starts (see run.sh)."""
        return (
            f"export VKUBELET_BACKOFF_BASE={max(1, round(self.config.backoff_initial))}\n"
            f"export VKUBELET_BACKOFF_MAX={max(1, round(self.config.backoff_max))}\n"
            f"export VKUBELET_BACKOFF_RESET={max(2, round(2 * self.config.backoff_max))}\n"
        )

    def _record_events(self, entry: _PodEntry, remote: _remote.RemotePod) -> None:
        """The Events a kubelet records as containers enter the states this sweep found."""
        if self.events is None:
            return
        before = _statuses(entry.remote)
        names = _names(entry)
        for after in [*remote.init_containers, *remote.containers]:
            image = _image_of(entry.pod, after.name)
            for record in _lifecycle.events(before.get(after.name), after, image, names):
                self.events.pod_event(entry.pod, record.type, record.reason, record.message)

    def _adopt(self, remote: _remote.RemotePod) -> _PodEntry | None:
        """A pod found on the device that this process did not start: after an agent restart."""
        try:
            meta = json.loads(remote.metadata_json)
            pod = msgspec.convert(meta, Pod)
        except (ValueError, msgspec.ValidationError):
            log.warning("device %s: pod %s has unreadable metadata", self.config.name, remote.uid)
            return None
        if pod.metadata is None:
            return None
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if key in self._pods:  # an older pod of the same name: kept apart by uid
            return None
        entry = _PodEntry(pod, remote.uid)
        entry.created = pod.metadata.creationTimestamp or entry.created
        self._pods[key] = entry
        log.info("device %s: adopted pod %s (%s)", self.config.name, key, remote.uid)
        return entry

    async def _discover(self) -> None:
        """CPU count, memory, architecture and OS, for the node's capacity and labels."""
        script = (
            "echo cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)\n"
            "echo mem=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)\n"
            "echo arch=$(uname -m)\necho kernel=$(uname -r)\necho os=$(uname -s)\n"
            "echo hz=$(getconf CLK_TCK 2>/dev/null)\necho page=$(getconf PAGESIZE 2>/dev/null)\n"
            "( . /etc/os-release 2>/dev/null && echo image=$PRETTY_NAME )\n"
            "for r in podman docker; do\n"
            "\tif command -v $r >/dev/null 2>&1; then echo runtime=$r; break; fi\n"
            "done\n"
        )
        try:
            out = (await self.link.run(script, deadline=10)).check("discovery")
        except (Unreachable, RuntimeError) as e:
            log.warning("device %s: cannot discover its resources: %s", self.config.name, e)
            return
        facts = dict(line.partition("=")[::2] for line in out.decode(errors="replace").splitlines())
        self._rediscover = False
        self._set_facts({k: v.strip() for k, v in facts.items() if v.strip()})

    def _set_facts(self, facts: dict[str, str]) -> None:
        """New facts of the device; the node is told when they change (its capacity follows)."""
        if facts == self._facts:
            return
        self._facts = facts
        if self._node_notify is not None:
            node = Node(metadata=ObjectMeta(labels={}), spec=NodeSpec(), status=NodeStatus())
            self.configure_node(node)
            self._node_notify(node)

    # -- node ---------------------------------------------------------------------------------
    def configure_node(self, node: Node) -> None:
        assert node.status is not None and node.metadata is not None
        capacity: dict[str, str] = {"cpu": "1", "memory": "1Gi", "pods": "110"}
        if "cpus" in self._facts:
            capacity["cpu"] = self._facts["cpus"]
        if self._facts.get("mem", "").isdigit():
            capacity["memory"] = f"{self._facts['mem']}Ki"
        capacity.update(dict(self.config.capacity))
        node.status.capacity = dict(capacity)
        node.status.allocatable = dict(capacity)
        labels = dict(node.metadata.labels or {})
        arch = _ARCH.get(self._facts.get("arch", ""), self._facts.get("arch"))
        if arch:
            labels["kubernetes.io/arch"] = labels["beta.kubernetes.io/arch"] = arch
        node.metadata.labels = labels
        info = node.status.nodeInfo
        if info is not None:
            info.architecture = arch or info.architecture
            info.kernelVersion = self._facts.get("kernel", info.kernelVersion)
            info.osImage = self._facts.get("image", info.osImage)
            info.containerRuntimeVersion = "vkubelet-ssh://host"

    def notify_node_status(self, callback: Callable[[Node], None]) -> None:
        self._node_notify = callback

    async def ping(self) -> None:
        await self.link.ping()

    # -- lifecycle ----------------------------------------------------------------------------
    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    async def create_pod(self, pod: ResolvedPod) -> None:
        uid = pod.uid
        plan = self._plan(pod)  # a uid that is no Kubernetes UID fails here (InvalidPod)
        key = f"{pod.namespace}/{pod.name}"
        self._check_ports(key, pod.pod)  # before any await: two creations cannot both pass
        # One SSH session: volumes, then the supervisor. Starting is idempotent on the device
        # (a pod it runs already, e.g. after an agent restart, is left alone), so there is
        # nothing to ask first.
        script = (
            self._backoff_env()
            + self._volume_script(pod, uid, replace=False)
            + _remote.start_pod_script(self.root, plan)
        )
        entry = self._pods.get(key)
        if entry is None or entry.uid != uid:  # an older pod of that name may still be leaving
            self._pods[key] = _PodEntry(pod.pod, uid)
        else:  # adopted: the API's spec replaces what the device kept of it
            entry.pod = pod.pod
        try:
            async with self._pods[key].starting:  # not while a revival starts it
                result = await self.link.run(script)
        except BaseException:
            if (entry := self._pods.get(key)) is not None and entry.remote is None:
                del self._pods[key]
            raise
        if result.exit_status != 0:
            await self._start_failed(key, uid, result)
        self._poked.add(uid)
        self._poke.set()

    async def _start_failed(self, key: str, uid: str, result: Completed) -> None:
        """The device could not write the pod's files or start its supervisor (a full disk, a
        directory it may not write): CreateContainerError with the device's words, retried by
        the pod controller. A pod that never ran there leaves nothing behind."""
        detail = result.stderr.decode(errors="replace").strip()[-500:]
        entry = self._pods.get(key)
        if entry is not None and entry.remote is None:
            del self._pods[key]
            with contextlib.suppress(Unreachable, RuntimeError):
                await self.link.run(_remote.remove_pod_script(self.root, uid))
        full = "no space left on device" if "no space left on device" in detail.lower() else ""
        raise ProviderError(
            "CreateContainerError",
            f"device {self.config.name}: cannot start the pod in its podDir {self.root}"
            + (f": {full}" if full else "")
            + f" ({detail or f'exit {result.exit_status}'})",
            permanent=False,
        )

    def _check_ports(self, key: str, pod: Pod) -> None:
        """Refuse a pod that declares a port another pod of this device declares.

        A device's pods share its address (their pod IP), so of two pods serving one port the
        second could never bind it: without this it would crash-loop without saying why. A
        holder that is stopping will let go: the pod waits (a transient error, retried)."""
        others = {
            other_key: entry
            for other_key, entry in self._pods.items()
            if other_key != key and not _finished(entry)
        }
        for (port, protocol), container in declared_ports(pod).items():
            for other_key, entry in others.items():
                if (port, protocol) not in declared_ports(entry.pod):
                    continue
                waiting = ", which is stopping: waiting for it" if entry.deleting else ""
                raise ProviderError(
                    "PortInUse",
                    f"container {container}: port {port}/{protocol} is already used by pod "
                    f"{other_key} on device {self.config.name}{waiting}; the pods of a device "
                    "share its address, so one port serves one pod",
                    permanent=not entry.deleting,
                )

    def _plan(self, resolved: ResolvedPod) -> _remote.PodPlan:
        pod = resolved.pod
        spec = pod.spec
        assert spec is not None and pod.metadata is not None
        for volume in resolved.volumes.values():
            if isinstance(volume, HostPathVolume) and not self.config.allow_host_path:
                raise ProviderError(
                    "HostPathNotAllowed",
                    f"volume {volume.name}: hostPath volumes are not allowed on device "
                    f"{self.config.name} (allowHostPath in the inventory)",
                )
        mounts = {
            m.name: m
            for c in [*(spec.initContainers or []), *spec.containers]
            for m in (c.volumeMounts or [])
        }
        for name in mounts:
            if name not in resolved.volumes:
                raise ProviderError("VolumeNotSupported", f"volume {name}: not available")

        def plan(container: Any) -> _remote.ContainerPlan:
            image = container.image or ""
            if not self.config.runs_image(image):
                return self._image_plan(resolved, container)
            argv = [*(container.command or []), *(container.args or [])]
            if not argv:
                raise ProviderError(
                    "NoCommand",
                    f"container {container.name}: a device runs commands, not images: "
                    "set command (and args)",
                )
            env = {e.name: e.value or "" for e in container.env or []}
            return _remote.ContainerPlan(
                name=container.name,
                argv=argv,
                env=env,
                working_dir=container.workingDir,
                stdin=bool(container.stdin),
                tty=bool(container.tty),
            )

        metadata = {
            "metadata": {
                "name": pod.metadata.name,
                "namespace": pod.metadata.namespace,
                "uid": pod.metadata.uid,
                "annotations": pod.metadata.annotations or {},
                "creationTimestamp": _rfc3339(pod.metadata.creationTimestamp),
            },
            "spec": {
                "nodeName": spec.nodeName,
                "restartPolicy": spec.restartPolicy or "Always",
                "terminationGracePeriodSeconds": spec.terminationGracePeriodSeconds,
                "containers": [_adoptable(c) for c in spec.containers],
                "initContainers": [_adoptable(c) for c in spec.initContainers or []],
            },
        }
        try:
            return _remote.PodPlan(
                uid=resolved.uid,
                restart_policy=spec.restartPolicy or "Always",
                init_containers=[plan(c) for c in spec.initContainers or []],
                containers=[plan(c) for c in spec.containers],
                metadata_json=json.dumps(metadata).encode(),
            )
        except ValueError as e:
            raise ProviderError("InvalidPod", str(e)) from None

    def runtime(self) -> _remote.Runtime | None:
        """The device's container runtime as the inventory names it (`auto`: as discovered), or
        None. Raises a transient error while `auto` has not looked yet."""
        name = self.config.container_runtime
        if name == "auto":
            if not self._facts:
                raise ProviderError(
                    "ContainerRuntimeUnknown",
                    f"device {self.config.name}: its container runtime is not detected yet "
                    "(containerRuntime: auto)",
                    permanent=False,
                )
            name = self._facts.get("runtime", "none")
        if name not in ("podman", "docker"):
            return None
        command = list(self.config.runtime_command) or [name]
        kind: Literal["podman", "docker"] = "podman" if name == "podman" else "docker"
        return _remote.Runtime(command, list(self.config.runtime_run_args), kind)

    def _image_plan(self, resolved: ResolvedPod, container: Any) -> _remote.ContainerPlan:
        """A container of an image that is not a host image: a container of the device's
        runtime, with the pod's volumes as bind mounts. Refused without a runtime."""
        image = container.image or ""
        runtime = self.runtime()
        if runtime is None:
            how = self.config.container_runtime
            found = " found neither podman nor docker" if how == "auto" else f" is {how}"
            raise ProviderError(
                "ImageNotSupported",
                f"container {container.name}: image {image!r} cannot run on device "
                f"{self.config.name}: it has no container runtime (containerRuntime in the "
                f"inventory{found}); name one (podman, docker, auto), or use an image named in "
                f"hostImages ({', '.join(self.config.host_images)}) to run a command on the host",
            )
        mounts = []
        for mount in container.volumeMounts or []:
            volume = resolved.volumes.get(mount.name)
            sub = (mount.subPath or "").strip("/")
            if ".." in sub.split("/"):
                raise ProviderError(
                    "InvalidMountPath", f"volume {mount.name}: subPath {mount.subPath!r} leaves it"
                )
            if isinstance(volume, HostPathVolume):
                source = f"{volume.path.rstrip('/')}/{sub}" if sub else volume.path
            else:
                source = f"volumes/{mount.name}/{sub}" if sub else f"volumes/{mount.name}"
            mounts.append(_remote.Mount(source, mount.mountPath, bool(mount.readOnly)))
        limits = (container.resources.limits if container.resources else None) or {}
        try:
            memory = limits.get("memory")
            memory_bytes = math.ceil(parse_quantity(memory).to_fraction()) if memory else None
            cpu = limits.get("cpu")
            cpus = f"{float(parse_quantity(cpu).to_fraction()):.3f}" if cpu else None
        except QuantityError as e:
            raise ProviderError("InvalidPod", f"container {container.name}: limits: {e}") from None
        tagged = "@" in image or ":" in image.rsplit("/", 1)[-1]
        default_policy = "IfNotPresent" if tagged and not image.endswith(":latest") else "Always"
        run = _remote.ImageRun(
            runtime=runtime,
            image=image,
            pull_policy=container.imagePullPolicy or default_policy,
            entrypoint=list(container.command) if container.command else None,
            mounts=mounts,
            memory_bytes=memory_bytes,
            cpus=cpus,
        )
        try:
            return _remote.ContainerPlan(
                name=container.name,
                argv=list(container.args or []),
                env={e.name: e.value or "" for e in container.env or []},
                working_dir=container.workingDir,
                stdin=bool(container.stdin),
                tty=bool(container.tty),
                image=run,
            )
        except ValueError as e:
            reason = "InvalidImageName" if "image reference" in str(e) else "InvalidPod"
            raise ProviderError(reason, str(e)) from None

    def in_runtime(self, entry: _PodEntry, container: str) -> _remote.Runtime | None:
        """The runtime a container of this pod runs in, or None for a host process."""
        spec = entry.pod.spec
        for c in [*(spec.initContainers or []), *spec.containers] if spec else []:
            if c.name == container and not self.config.runs_image(c.image or ""):
                with contextlib.suppress(ProviderError):
                    return self.runtime()
        return None

    def exec_line(
        self, entry: _PodEntry, container: str, argv: list[str], *, stdin: bool, tty: bool
    ) -> str:
        """The SSH command line of an exec in a container: a host process with the container's
        env, or the runtime's exec."""
        runtime = self.in_runtime(entry, container)
        if runtime is None:
            return _remote.exec_command(self.root, entry.uid, container, argv)
        return _remote.runtime_exec_command(
            runtime, entry.uid, container, argv, stdin=stdin, tty=tty
        )

    def _volume_script(self, resolved: ResolvedPod, uid: str, *, replace: bool) -> str:
        """A script part that writes the volumes' files on the device (a tar, in base64 in a
        quoted here-document: nothing of it is expanded, nor in any command line); mount paths
        become links into them.

        Without a mount namespace a process cannot see a file at its mountPath, so the pod's
        working directory (`$VKUBELET_POD_DIR/fs`) holds the mount paths as symlinks:
        `/etc/config` is `fs/etc/config`.
        """
        spec = resolved.pod.spec
        assert spec is not None
        buffer = io.BytesIO()
        names: list[str] = []
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for volume in resolved.volumes.values():
                if not isinstance(volume, FilesVolume):
                    continue
                names.append(volume.name)
                for rel, content in volume.files.items():
                    info = tarfile.TarInfo(f"{volume.name}.new/{rel}")
                    info.size = len(content.data)
                    info.mode = content.mode & 0o700  # only the device user reads pod files
                    info.mtime = int(time.time())
                    tar.addfile(info, io.BytesIO(content.data))
        pod_dir = _remote.pod_word(self.root, uid)  # a shell word: joined, never quoted again
        archive = base64.encodebytes(buffer.getvalue()).decode()
        lines = [
            "set -e",
            "umask 077",
            f"mkdir -p {pod_dir}/volumes {pod_dir}/fs",
            f"cd {pod_dir}/volumes",
            *(f"rm -rf {shlex.quote(name)}.new" for name in names),
            f"base64 -d <<'{_ARCHIVE_END}' | tar -x -f -\n{archive}{_ARCHIVE_END}",
            'stamp="..$(date +%s)_$$"',
        ]
        for name in names:
            lines += _swap_volume_lines(shlex.quote(name))
        if not replace:
            for volume in resolved.volumes.values():
                if isinstance(volume, EmptyDirVolume):
                    lines.append(f"mkdir -p {shlex.quote(volume.name)}")
            for container in [*(spec.initContainers or []), *spec.containers]:
                for mount in container.volumeMounts or []:
                    link = mount.mountPath.strip("/")
                    sub = (mount.subPath or "").strip("/")
                    if not link or ".." in link.split("/") or ".." in sub.split("/"):
                        raise ProviderError(
                            "InvalidMountPath",
                            f"volume {mount.name}: mountPath {mount.mountPath!r} or subPath "
                            f"{mount.subPath!r} leaves the pod directory",
                        )
                    # Shell words: the pod directory's (it may expand $HOME), then quoted parts.
                    source = resolved.volumes.get(mount.name)
                    if isinstance(source, HostPathVolume):
                        q_target = shlex.quote(source.path)
                    else:
                        rest = f"{mount.name}/{sub}" if sub else mount.name
                        q_target = f"{pod_dir}/volumes/{shlex.quote(rest)}"
                    q_link = f"{pod_dir}/fs/{shlex.quote(link)}"
                    lines += [f'mkdir -p "$(dirname {q_link})"', f"ln -sfn {q_target} {q_link}"]
        # In a subshell: `set -e` and `cd` stay there; its failure fails the whole script.
        body = "\n".join(lines)
        return f"(\n{body}\n) || {{ echo 'writing the volumes failed' >&2; exit 1; }}\n"

    async def update_pod(self, pod: ResolvedPod) -> None:
        key = f"{pod.namespace}/{pod.name}"
        entry = self._pods.get(key)
        if entry is None or entry.uid != pod.uid:
            return
        entry.pod = pod.pod
        script = self._volume_script(pod, pod.uid, replace=True)
        (await self.link.run(script)).check("updating the volumes")

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        assert pod.metadata is not None
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        entry = self._pods.get(key)
        if entry is None or entry.uid != pod.metadata.uid:
            return
        entry.deleting = True
        self._probe(entry)
        await self.link.run(_remote.stop_pod_script(self.root, entry.uid, grace_period_seconds))
        self._poked.add(entry.uid)
        self._poke.set()
        if not entry.removing:  # delete_pod may come again: one removal is enough
            entry.removing = True
            self._removals.spawn(self._remove_when_stopped(key, entry), name=f"remove {key}")

    @property
    def pending_removals(self) -> int:
        """Removal tasks still running (finished ones are forgotten)."""
        return len(self._removals)

    async def _remove_when_stopped(self, key: str, entry: _PodEntry) -> None:
        """Once its processes are gone, the pod's directory goes too (logs included)."""
        while True:
            remote = entry.remote
            if remote is not None and not remote.supervisor_alive and _all_done(remote):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1)  # the final status is reported first
        while True:
            try:
                await self.link.run(_remote.remove_pod_script(self.root, entry.uid))
                break
            except Unreachable:
                await asyncio.sleep(5)
        if entry.prober is not None:
            entry.prober.stop()
        if self._pods.get(key) is entry:
            del self._pods[key]
            if self._notify is not None:
                self._notify(self._pod_object(entry))

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        entry = self._pods.get(f"{namespace}/{name}")
        return None if entry is None else self._pod_object(entry)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        entry = self._pods.get(f"{namespace}/{name}")
        return None if entry is None else pod_status(entry, self.config.address)

    async def list_pods(self) -> list[Pod]:
        # Right after a start, wait (a little) for the device so that its pods are adopted.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._swept.wait(), self.config.connect_timeout + 5)
        return [self._pod_object(e) for e in self._pods.values()]

    def _pod_object(self, entry: _PodEntry) -> Pod:
        pod = msgspec.convert(msgspec.to_builtins(entry.pod), Pod)
        pod.status = pod_status(entry, self.config.address)
        return pod

    def _probe(self, entry: _PodEntry) -> None:
        """Keep the pod's probe workers in step with the runs the device last reported."""
        if entry.prober is None:
            transport = DeviceProbes(
                self.link,
                self.root,
                entry.uid,
                exec_line=lambda c, argv: self.exec_line(entry, c, argv, stdin=False, tty=False),
            )

            def event(e: ProbeEvent) -> None:
                if self.events is not None:
                    self.events.pod_event(entry.pod, e.type, e.reason, e.message)

            entry.prober = PodProbes(
                entry.pod,
                transport,
                transport.restart,
                host=DEFAULT_HOST,
                on_change=lambda: self._publish(entry),
                on_event=event,
                second=self.probe_second,
            )
        entry.prober.update(entry.pod)
        remote = entry.remote
        running = {
            c.name: (c.restart_count, c.started_at)
            for c in (remote.containers if remote is not None else [])
            if c.state == "running"
        }
        stopping = entry.deleting or (remote is not None and remote.stopping)
        entry.prober.sync(running, terminating=stopping)

    def _publish(self, entry: _PodEntry) -> None:
        status = pod_status(entry, self.config.address)
        if status != entry.status:
            entry.status = status
            if self._notify is not None:
                self._notify(self._pod_object(entry))

    # -- ephemeral containers (kubectl debug) ---------------------------------------------------
    async def start_ephemeral_container(self, pod: ResolvedPod, name: str) -> None:
        """A process on the device, as `exec` runs one: in the pod's directory, with the
        ephemeral container's env (from a file, never a command line), in a PTY with `tty`.
        Without stdin it runs now (its output is its log); with stdin (`debug -it`) when a
        client attaches, and it ends with that session. Command mode only: the image must be
        named in `hostImages`, like any container's here."""
        entry = self._pods.get(f"{pod.namespace}/{pod.name}")
        if entry is None or entry.uid != pod.uid:
            raise ProviderError("NotFound", f"pod {pod.namespace}/{pod.name} does not run here")
        if name in entry.debug:
            return  # handed again after an agent restart
        spec = pod.pod.spec
        found = [c for c in (spec.ephemeralContainers if spec else None) or () if c.name == name]
        if not found:
            raise ProviderError("NotFound", f"pod {pod.name} has no ephemeral container {name}")
        plan = self._ephemeral_plan(pod, found[0])
        target = found[0].targetContainerName
        in_runtime = plan.image is not None and target and self.in_runtime(entry, target)
        entry.debug_plans[name] = (plan, target if in_runtime else None)
        script = _remote.ephemeral_script(self.root, entry.uid, plan)
        answer = await self.link.run(script)
        answer.check(f"starting ephemeral container {name}")
        entry.pod = pod.pod  # its spec names the ephemeral containers (the kubelet API checks)
        now = datetime.now(UTC)
        if answer.stdout.strip() == b"old":
            # Run by the agent before a restart: ended as the API shows it, or by this agent.
            message = "the agent that ran its process restarted: what was left of it was ended"
            ended = Terminated(137, now, now, reason="ContainerStatusUnknown", message=message)
            before = ephemeral_run_before(pod.pod, name, lost=message)
            entry.debug[name] = before or ContainerReport(state=ended)
        else:
            entry.debug[name] = ContainerReport(
                state=Running(now), container_id=f"ssh://{entry.uid}/{name}"
            )
        self._publish(entry)
        if not plan.stdin and isinstance(entry.debug[name].state, Running):
            output = entry.debug_output.setdefault(name, bytearray())
            io = AttachIO(stdin=None, stdout=_Output(output), stderr=_Output(output))
            self._debug_runs.spawn(self._run_ephemeral(entry, name, io), name=f"debug {name}")

    def _ephemeral_plan(self, resolved: ResolvedPod, container: Any) -> _remote.ContainerPlan:
        """A host image's ephemeral container is a process, as `exec` runs one; any other
        image's a container of the device's runtime (refused without one), in the process
        namespace of its `--target` when that is a runtime container too."""
        if not self.config.runs_image(container.image or ""):
            # Its terminal, if any, is its SSH session's (a PTY): not one `script` holds.
            return dataclasses.replace(self._image_plan(resolved, container), tty=False)
        argv = [*(container.command or []), *(container.args or [])]
        if not argv:
            raise ProviderError(
                "NoCommand",
                f"ephemeral container {container.name}: a device runs commands, not images: "
                "give one (kubectl debug ... -- sh)",
            )
        try:
            return _remote.ContainerPlan(
                name=container.name,
                argv=argv,
                env={e.name: e.value or "" for e in container.env or []},
                working_dir=container.workingDir,
                stdin=bool(container.stdin),
            )
        except ValueError as e:
            raise ProviderError("InvalidPod", str(e)) from None

    async def _run_ephemeral(self, entry: _PodEntry, name: str, io: AttachIO) -> None:
        """Run its process with `io` as its stdio; it has terminated when this returns."""
        plan, target = entry.debug_plans[name]
        report = entry.debug[plan.name]
        started = report.state.started_at if isinstance(report.state, Running) else None
        line = _remote.ephemeral_command(self.root, entry.uid, plan, tty=io.tty, target=target)
        try:
            code = await self._run_process(line, io)
        except asyncio.CancelledError:  # the client left: its session, so the process, ends
            message = "its client detached: the SSH session it ran in was closed"
            ended = Terminated(129, started, datetime.now(UTC), message=message)  # SIGHUP
            entry.debug[plan.name] = ContainerReport(state=ended, container_id=report.container_id)
            self._publish(entry)
            raise
        except Exception as e:
            ended = Terminated(137, started, datetime.now(UTC), message=str(e))
        else:
            ended = Terminated(code, started, datetime.now(UTC))
        entry.debug[plan.name] = ContainerReport(state=ended, container_id=report.container_id)
        self._publish(entry)

    async def _run_process(self, line: str, io: AttachIO) -> int:
        """`line` in an SSH session relayed to `io` (a PTY with its TTY); its exit code."""
        term = await initial_size(io) if io.tty else None  # the client sends it first
        async with self.link.process(line, term_size=term, stdin=io.stdin is not None) as proc:
            await relay(
                io,
                stdin=proc.stdin if io.stdin is not None else None,
                stdout=proc.stdout,
                stderr=None if io.tty else proc.stderr,
                resize=proc.change_terminal_size,
            )
            await proc.wait()
            return _exit_code(proc)

    async def _attach_ephemeral(self, entry: _PodEntry, name: str, io: AttachIO) -> None:
        """`debug -it`: the client's stdio is its process's, which starts now. One without
        stdin (or ended) shows what it printed."""
        spec = entry.pod.spec
        found = [c for c in (spec.ephemeralContainers if spec else None) or () if c.name == name]
        running = isinstance(entry.debug[name].state, Running)
        if not (found and found[0].stdin and running):
            out = io.stdout or io.stderr
            if out is not None:
                await out.write(bytes(entry.debug_output.get(name, b"")))
            return
        if name in entry.debug_attached:
            raise ProviderError("NotFound", f"ephemeral container {name} is attached already")
        entry.debug_attached.add(name)
        try:
            await self._run_ephemeral(entry, name, io)
        finally:
            entry.debug_attached.discard(name)

    # -- kubectl verbs -------------------------------------------------------------------------
    def _entry(self, namespace: str, pod: str, container: str | None = None) -> _PodEntry:
        entry = self._pods.get(f"{namespace}/{pod}")
        if entry is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} does not run here")
        if container is not None:
            spec = entry.pod.spec
            names = (
                [c.name for c in [*(spec.initContainers or []), *spec.containers]] if spec else []
            )
            if container not in names:
                raise ProviderError("NotFound", f"container {container} is not valid for pod {pod}")
        return entry

    def _container(self, entry: _PodEntry, name: str) -> _remote.ContainerStatus | None:
        remote = entry.remote
        statuses = [*remote.init_containers, *remote.containers] if remote else []
        return next((status for status in statuses if status.name == name), None)

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        debugged = self._pods.get(f"{namespace}/{pod}")
        if debugged is not None and container in debugged.debug:
            yield bytes(debugged.debug_output.get(container, b""))  # ephemeral: kept in memory
            return
        entry = self._entry(namespace, pod, container)
        state = self._container(entry, container)
        run = state.restart_count if state is not None else 0
        if options.previous:
            if run == 0:
                raise previous_not_found(container, pod)
            run -= 1
        path = _remote.log_path(self.root, entry.uid, container, run)
        since = options.earliest()
        tail = options.tail_lines
        pick = f" | tail -n {int(tail)}" if tail is not None and tail >= 0 else ""
        # The file's size first, then its bytes up to that size (the last lines only, for a
        # tail): streamed, never the whole log in memory. A follower goes on from that size.
        command = (
            f"size=$(wc -c 2>/dev/null < {path}) || size=0; echo $size; "
            f"head -c $size 2>/dev/null {path}{pick}"
        )
        parser = LogParser()  # a partial last line waits in it for its end
        async with self.link.process(command, stdin=False) as proc:
            size = (await proc.stdout.readline()).strip()
            offset = int(size) if size.isdigit() else 0

            async def chunks() -> AsyncIterator[bytes]:
                while data := await proc.stdout.read(65536):
                    yield data

            lines = render_chunks(
                chunks(), since=since, timestamps=options.timestamps, parser=parser
            )
            async for out in lines:
                yield out
        if not options.follow or options.previous:
            return
        followed = self._follow(entry, container, run, path, offset)
        lines = render_chunks(followed, since=since, timestamps=options.timestamps, parser=parser)
        async for out in lines:
            yield out

    async def _follow(
        self,
        entry: _PodEntry,
        container: str,
        run: int,
        path: str,
        offset: int,
    ) -> AsyncIterator[bytes]:
        """What run `run` adds to its log from `offset`, until it has ended and its log is
        complete."""

        def ended() -> bool:
            state = self._container(entry, container)
            if state is None or self._pods.get(_key(entry)) is not entry:
                return entry.remote is None and entry.deleting
            return state.restart_count != run or state.state == "terminated"

        while not ended():
            command = f"exec tail -c +{offset + 1} -f {path}"
            try:
                async with self.link.process(command, stdin=False) as proc:
                    reader = asyncio.ensure_future(proc.stdout.read(65536))
                    while True:
                        done, _ = await asyncio.wait({reader}, timeout=0.5)
                        if done:
                            data = reader.result()
                            if not data:
                                break
                            offset += len(data)
                            yield data
                            reader = asyncio.ensure_future(proc.stdout.read(65536))
                        elif ended():
                            reader.cancel()
                            break
            except Unreachable:
                await asyncio.sleep(1)
        # The run is over and its log complete: whatever tail had not shown yet.
        with contextlib.suppress(Unreachable):
            rest = await self.link.run(f"tail -c +{offset + 1} {path} 2>/dev/null || true\n")
            yield rest.stdout

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        entry = self._entry(namespace, pod, container)
        if not command:
            raise ProviderError("BadRequest", "no command given")
        try:
            line = self.exec_line(entry, container, command, stdin=io.stdin is not None, tty=io.tty)
        except ValueError as e:
            raise ProviderError("BadRequest", str(e)) from None
        return await self._run_process(line, io)

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        """The main process's output as it comes; with `stdin: true` in the container's spec,
        the client's stdin goes to the process (a FIFO on the device). A `tty: true` container
        runs in a terminal on the device (see `_remote`): `attach -t` gets that terminal's
        output as it comes and sets its size."""
        debugged = self._pods.get(f"{namespace}/{pod}")
        if debugged is not None and container in debugged.debug:
            await self._attach_ephemeral(debugged, container, io)
            return
        entry = self._entry(namespace, pod, container)
        spec = entry.pod.spec
        found = [c for c in (spec.containers if spec else []) if c.name == container]
        wants_stdin = io.stdin is not None and bool(found and found[0].stdin)
        in_terminal = io.tty and bool(found and found[0].tty)
        feeder: asyncio.Task[None] | None = None
        if wants_stdin:
            assert io.stdin is not None
            fifo = _remote.stdin_path(self.root, entry.uid, container)
            feeder = asyncio.create_task(self._feed_stdin(fifo, io.stdin))

        async def relay() -> None:
            options = ContainerLogOptions(follow=True, tail_lines=0)
            async for data in self.container_logs(namespace, pod, container, options):
                out = io.stdout or io.stderr
                if out is not None:
                    await out.write(data)

        output = asyncio.create_task(
            self._relay_terminal(entry, container, io) if in_terminal else relay()
        )
        try:
            if feeder is None:
                await output
                return
            # The client's stdin ended: it is leaving; let the answer to its input through.
            await asyncio.wait({output, feeder}, return_when=asyncio.FIRST_COMPLETED)
            if not output.done():
                await asyncio.wait({output}, timeout=1.0)
            if output.done():
                output.result()  # its error, if it failed
        finally:
            for task in (output, feeder):
                if task is not None:
                    task.cancel()

    async def _relay_terminal(self, entry: _PodEntry, container: str, io: AttachIO) -> None:
        """`attach -t`: the terminal's output from now on, unprocessed (a prompt shows before
        its line ends), until the run ends; the client's window size set on the terminal."""
        state = self._container(entry, container)
        run = state.restart_count if state is not None else 0
        output, pts, _ = _remote.terminal_paths(self.root, entry.uid, container)
        # Emptied once large (the log has it all); the script holds it in append mode.
        command = (
            f"{{ [ $(wc -c < {output}) -lt 1048576 ] || : > {output}; }} 2>/dev/null; "
            f"wc -c < {output} 2>/dev/null || echo 0"
        )
        size = (await self.link.run(command)).stdout.strip()
        offset = int(size) if size.isdigit() else 0

        async def resize() -> None:
            async for change in io.resizes:
                rows, cols = int(change.height), int(change.width)
                line = f'[ -s {pts} ] && stty -F "$(cat {pts})" rows {rows} cols {cols}'
                try:
                    (await self.link.run(line)).check("resizing the terminal")
                except (Unreachable, RuntimeError) as e:
                    log.info("device %s: %s", self.config.name, e)

        resizer = asyncio.create_task(resize())
        try:
            async for data in self._follow(entry, container, run, output, offset):
                if io.stdout is not None:
                    await io.stdout.write(data)
        finally:
            resizer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await resizer

    async def _feed_stdin(self, fifo: str, source: Any) -> None:
        # `fifo` is a shell word from `_remote` (it may expand $HOME): used as it is.
        command = f"[ -p {fifo} ] && exec cat > {fifo}"
        async with self.link.process(command) as proc:
            while data := await source.read():
                proc.stdin.write(data)
                await proc.stdin.drain()
            proc.stdin.write_eof()
            await proc.wait()

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        self._entry(namespace, pod)
        reader, writer = await self.link.open_connection("127.0.0.1", port)
        await forward_connection(stream, reader, writer)

    # -- usage (kubectl top) --------------------------------------------------------------------
    async def stats_summary(self) -> dict[str, Any]:
        when, node, pods = await self._current_usage()
        return format_summary(node, pods, when)

    async def metrics_resource(self) -> str:
        when, node, pods = await self._current_usage()
        return format_metrics(node, pods, when)

    async def _current_usage(self) -> tuple[float, NodeUsage, list[PodUsage]]:
        """The device's usage: one sample (one SSH command for every pod) per scrape, shared by
        the requests of that scrape (metrics-server and `/stats/summary` alike)."""
        async with self._sampling:
            if self._sample is None or time.monotonic() - self._sample[0] > _SAMPLE_REUSE:
                when, node, pods = await self._measure()
                self._sample = (time.monotonic(), when, node, pods)
            return self._sample[1:]

    async def _measure(self) -> tuple[float, NodeUsage, list[PodUsage]]:
        running: dict[int, tuple[str, str]] = {}  # pid -> (uid, container)
        starts: dict[tuple[str, str], tuple[int, float]] = {}  # (uid, container) -> pid, start
        groups: list[int] = []  # host processes: their process groups
        cidfiles: dict[int, str] = {}  # runtime containers (by their `run`'s pid): their cgroups
        terminals: dict[int, str] = {}  # tty: true host containers: their terminal's session
        for entry in self._pods.values():
            remote = entry.remote
            spec = entry.pod.spec
            ttys = {c.name for c in (spec.containers if spec else []) if c.tty}
            for state in [*remote.init_containers, *remote.containers] if remote else []:
                if state.state == "running" and state.pid and state.started_at is not None:
                    running[state.pid] = (entry.uid, state.name)
                    starts[(entry.uid, state.name)] = (state.pid, state.started_at.timestamp())
                    if self.in_runtime(entry, state.name) is None:
                        groups.append(state.pid)
                        if state.name in ttys:
                            paths = _remote.terminal_paths(self.root, entry.uid, state.name)
                            terminals[state.pid] = paths[2]
                    else:
                        cidfiles[state.pid] = _remote.cid_path(self.root, entry.uid, state.name)
        script = _usage.sample_script(sorted(groups), cidfiles, terminals)
        output = (await self.link.run(script, deadline=10)).check("usage sample")
        when = time.time()
        reading = _usage.parse_sample(
            output,
            running,
            ticks_per_second=_positive(self._facts.get("hz"), 100),
            page_size=_positive(self._facts.get("page"), 4096),
        )
        self._follow_capacity(reading)
        cpu, rate = self._counters.update("node", reading.cpu_ns, when)
        node = NodeUsage(
            name=self.config.name,
            started=reading.booted or when,
            usage=Usage(cpu, rate, reading.working_set),
            available_memory=reading.available if reading.memory else None,
        )
        pods: list[PodUsage] = []
        keys: list[Hashable] = ["node"]
        for entry in self._pods.values():
            meta = entry.pod.metadata
            assert meta is not None
            containers = []
            for (uid, name), used in reading.containers.items():
                if uid != entry.uid:
                    continue
                pid, started = starts[(uid, name)]
                key = (uid, name, pid)  # a new run is a new counter
                cpu, rate = self._counters.update(key, used.cpu_ns, when)
                keys.append(key)
                containers.append(ContainerUsage(name, started, Usage(cpu, rate, used.working_set)))
            if not containers:
                continue
            cpu, rate = self._counters.update(
                entry.uid, sum(c.usage.cpu_ns for c in containers), when
            )
            keys.append(entry.uid)
            memory = sum(c.usage.working_set for c in containers)
            pods.append(
                PodUsage(
                    namespace=str(meta.namespace),
                    name=str(meta.name),
                    uid=entry.uid,
                    started=entry.created.timestamp(),
                    containers=sorted(containers, key=lambda c: c.name),
                    usage=Usage(cpu, rate, memory),
                )
            )
        self._counters.keep_only(keys)
        return when, node, pods

    def _follow_capacity(self, reading: _usage.Reading) -> None:
        """The node's capacity follows the device's CPUs and memory as each sample reads them."""
        facts = dict(self._facts)
        if reading.cpus:
            facts["cpus"] = str(reading.cpus)
        if reading.memory:
            facts["mem"] = str(reading.memory // 1024)
        self._set_facts(facts)


def _positive(text: str | None, default: int) -> int:
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else default


def _swap_volume_lines(q: str) -> list[str]:
    """Shell lines that make `<q>.new` the content of volume directory `q`, as the kubelet's
    atomic writer does: the files live in `q/..<stamp>/`, `q/..data` links to the current
    one and is replaced by a rename, and each top-level entry of `q` links through `..data`.

    The directory `q` itself stays: a runtime container's bind mount of it (which holds the
    directory, not its path) sees every update, and a reader never sees half of one."""
    return [
        f"mkdir -p {q} {q}.new",
        f'mv {q}.new {q}/"$stamp"',
        f'ln -sfn "$stamp" {q}/..data_tmp',
        f"mv -fT {q}/..data_tmp {q}/..data",
        f'for e in {q}/"$stamp"/* {q}/"$stamp"/.[!.]*; do',
        '\tif [ -e "$e" ] || [ -L "$e" ]; then',
        "\t\tb=${e##*/}",
        f'\t\tif [ ! -L {q}/"$b" ]; then rm -rf {q}/"$b"; fi',
        f'\t\tln -sfn ..data/"$b" {q}/"$b"',
        "\tfi",
        "done",
        f"for e in {q}/* {q}/.[!.]*; do",
        f'\tif [ -L "$e" ] && [ ! -e {q}/..data/"${{e##*/}}" ]; then rm -f "$e"; fi',
        "done",
        f"for e in {q}/..[0-9]*; do",
        f'\tif [ "$e" != {q}/"$stamp" ]; then rm -rf "$e"; fi',
        "done",
    ]


def _exit_code(proc: asyncssh.SSHClientProcess[bytes]) -> int:
    """The exit status, or -N for a process killed by signal N (sshd reports its name)."""
    if proc.exit_status is not None and proc.exit_status >= 0:
        return proc.exit_status
    if proc.exit_signal is not None:
        name = proc.exit_signal[0]
        number = getattr(signal, f"SIG{name}", None)
        return -int(number) if number is not None else 255
    return 255


def _key(entry: _PodEntry) -> str:
    meta = entry.pod.metadata
    assert meta is not None
    return f"{meta.namespace}/{meta.name}"


# What the device keeps of a container, for a pod adopted after an agent restart: enough for its
# probes, ports and image. Never env or command: they hold resolved (Secret) values.
_ADOPTED_FIELDS = (
    "name",
    "image",
    "imagePullPolicy",
    "ports",
    "livenessProbe",
    "readinessProbe",
    "startupProbe",
    "stdin",
    "tty",
)


def _adoptable(container: Any) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(container)
    return {k: v for k, v in fields.items() if k in _ADOPTED_FIELDS and v is not None}


def _rfc3339(value: datetime | None) -> str | None:
    if value is None:
        return None
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def declared_ports(pod: Pod) -> dict[tuple[int, str], str]:
    """(port, protocol) -> the first container that declares it, for every container."""
    spec = pod.spec
    containers = [*(spec.initContainers or []), *spec.containers] if spec else []
    found: dict[tuple[int, str], str] = {}
    for container in containers:
        for port in container.ports or []:
            found.setdefault((port.containerPort, port.protocol or "TCP"), container.name)
    return found


def _finished(entry: _PodEntry) -> bool:
    """Whether the pod has ended for good (Succeeded or Failed): its ports are free again."""
    return entry.status is not None and entry.status.phase in ("Succeeded", "Failed")


def _all_done(remote: _remote.RemotePod) -> bool:
    return all(c.state != "running" for c in [*remote.init_containers, *remote.containers])


def pod_status(entry: _PodEntry, address: str) -> PodStatus:
    """The pod's status as a kubelet would report it, from the device's container states."""
    spec = entry.pod.spec
    assert spec is not None
    remote, meta = entry.remote, entry.pod.metadata
    assert meta is not None
    reports: dict[str, ContainerReport] = {}
    inits = {state.name for state in remote.init_containers} if remote else set()
    for state in [*remote.init_containers, *remote.containers] if remote else []:
        probes = None if state.name in inits else entry.prober  # the engine probes main ones
        current = _state(state)
        if isinstance(current, Waiting):
            image = _image_of(entry.pod, state.name)
            message = _lifecycle.waiting_message(state, image, _names(entry))
            current = Waiting(current.reason, message or "")
        reports[state.name] = ContainerReport(
            state=current,
            restart_count=state.restart_count,
            last_terminated=_terminated(state.last) if state.last is not None else None,
            ready=probes is None or probes.ready(state.name),
            started=probes is None or probes.started(state.name),
            container_id=f"ssh://{entry.uid}/{state.name}",
        )
    return build_pod_status(
        spec,
        {**reports, **entry.debug},
        host_ip=address,
        start_time=entry.created,
        previous=entry.status,
        terminating=entry.deleting,
    )


class _Output:
    """An ephemeral container's output with no client attached: its log, the last 64 KiB."""

    def __init__(self, kept: bytearray) -> None:
        self._kept = kept

    async def write(self, data: bytes) -> None:
        self._kept += data
        del self._kept[:-65536]


def _terminated(state: _remote.ContainerStatus) -> Terminated:
    code = state.exit_code if state.exit_code is not None else 0
    # the runtime could not start it (its words), or it was lost with its supervisor
    if state.reason in ("StartError", "ContainerStatusUnknown"):
        return Terminated(
            code, state.started_at, state.finished_at, state.reason, state.message or ""
        )
    return Terminated(code, state.started_at, state.finished_at)


def _statuses(remote: _remote.RemotePod | None) -> dict[str, _remote.ContainerStatus]:
    containers = [*remote.init_containers, *remote.containers] if remote else []
    return {state.name: state for state in containers}


def _names(entry: _PodEntry) -> _lifecycle.PodNames:
    meta = entry.pod.metadata
    assert meta is not None
    return _lifecycle.PodNames(str(meta.name), str(meta.namespace), entry.uid)


def _image_of(pod: Pod, container: str) -> str:
    spec = pod.spec
    containers = [*(spec.initContainers or []), *spec.containers] if spec else []
    return next((c.image or "" for c in containers if c.name == container), "")


def _state(state: _remote.ContainerStatus) -> Running | Terminated | Waiting:
    if state.state == "running" and state.started_at is not None:
        return Running(state.started_at)
    if state.state == "terminated":
        return _terminated(state)
    return Waiting(state.reason or "ContainerCreating")
