"""The mock provider itself: pod lifecycle, node configuration, status, persistence, and the
entry points of the capabilities, which the sibling modules implement.

All state changes happen on the event loop, so concurrent calls for different pods cannot race
(the reference mock's map has no lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import msgspec
from lightkube.models.core_v1 import Container, EphemeralContainer, PodSpec, PodStatus
from lightkube.resources.core_v1 import Node, Pod

from ..._files import write_private
from ...sdk import ContainerLogOptions, ProviderContext, ProviderError, ResolvedPod
from ...sdk.capabilities import AttachIO, ByteStream
from ...sdk.clock import now_rfc3339
from ...sdk.logs import previous_not_found
from ...sdk.probes import PodProbes, ProbeEvent, ProbeKind
from ...sdk.provider import EventSink, PodTokens
from ...sdk.retry import Backoff
from ...sdk.status import ContainerReport, Running, Terminated, build_pod_status
from ._config import MockConfig
from ._fs import Filesystem, container_filesystem, mount_volumes, write_mounted
from ._probes import MockProbes
from ._records import (
    MockContainer,
    MockEphemeral,
    MockPod,
    containers_of,
    files_of,
    parse_time,
)
from ._shell import environment, run_command
from ._stats import NodeStats
from ._streams import attach, forward, log_lines
from ._terminal import Collector

log = logging.getLogger(__name__)

PRINT_ENV_ANNOTATION = "mock.vkubelet.io/print-env"
# Makes create_pod fail with this reason: lets tests prove how rejected pods are reported.
FAIL_ANNOTATION = "mock.vkubelet.io/fail"
# Put by the agent on the pods it gives a provider; handed back, it tells a restarted agent
# whether an adopted pod missed an update (see "Restarts" in docs/providers.md).
APPLIED_ANNOTATION = "vkubelet.io/applied"
# How long a change waits for others to share its write of the state file.
SAVE_DELAY = 0.01


class _State(msgspec.Struct):
    """What the state file holds."""

    creates: int
    pods: list[MockPod]


class MockProvider:
    """Implements the pod lifecycle, push notifications, node configuration and every optional
    capability: logs, exec, attach, port-forward, stats, resource metrics and ephemeral
    containers (`kubectl debug`)."""

    def __init__(
        self,
        node_name: str,
        config: MockConfig,
        *,
        host_ip: str = "127.0.0.1",
        events: EventSink | None = None,
    ) -> None:
        self.node_name = node_name
        self.config = config
        self.host_ip = host_ip
        self.events = events
        self._probes: dict[str, PodProbes] = {}  # uid -> the pod's probe workers
        self._probed: dict[str, datetime] = {}  # uid -> when a probe verdict last changed
        self.probe_second = 1.0  # how long a second of probe settings lasts; tests shorten it
        self._pods: dict[str, MockPod] = {}
        self._notify: Callable[[Pod], None] | None = None
        self._network = ipaddress.ip_network(config.pod_cidr)
        self._next_ip = 0
        self._ips: dict[str, str] = {}  # uid -> reserved IP
        # The values of `_ips`, counted: a state file from before IPs were unique may give
        # two pods one address, which is free only once both are gone.
        self._used_ips: Counter[str] = Counter()
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}  # uid -> set when the pod stops
        self._random = random.Random(node_name)  # noqa: S311 - deterministic fake failures
        self._filesystems: dict[str, dict[str, Filesystem]] = {}  # uid -> container -> files
        # Service-account tokens are asked for when a filesystem is used, not at every start:
        # a TokenRequest per pod would cost the apiserver as much as the pod's status write.
        self._tokens: PodTokens | None = None
        self._token_files: dict[str, dict[str, str]] = {}  # uid -> the last ones given
        self._token_fetches: dict[str, asyncio.Task[None]] = {}  # uid -> the one under way
        # uid -> (no fetch for probes before, the back-off that set it), after a failed fetch
        self._token_backoff: dict[str, tuple[float, Backoff]] = {}
        self._stats = NodeStats(node_name, config.memory)
        # How often `logs -f` and an attach without stdin print a line; tests shorten it.
        self.tick_seconds = 1.0
        self.creates = 0
        self._debugging: set[tuple[str, str]] = set()  # (uid, ephemeral container) attached
        self._debug_runs: set[asyncio.Task[None]] = set()  # those without stdin, running
        # The next write of the state file, shared by every change made until it runs.
        self._flush: asyncio.Future[None] | None = None
        self._load_state()

    # -- persistence (optional) -------------------------------------------------------------------
    def _load_state(self) -> None:
        path = self.config.state_file
        if path is None or not path.exists():
            return
        state = msgspec.json.decode(path.read_bytes(), type=_State)
        self.creates = state.creates
        for pod in state.pods:
            self._pods[f"{pod.namespace}/{pod.name}"] = pod
            for debug in pod.ephemeral:
                debug.lost(now_rfc3339())
            self._ips[pod.uid] = pod.ip
            self._used_ips[pod.ip] += 1

    def _save_state(self) -> None:
        """Write the state file soon; many changes in a burst cost one write."""
        if self.config.state_file is None or self._flush is not None:
            return
        loop = asyncio.get_running_loop()
        self._flush = loop.create_future()
        loop.call_later(SAVE_DELAY, self._write_state)

    async def _saved(self) -> None:
        """Return once the state file holds every change made so far (a group commit).

        A real backend has a pod once its create call returned, so the mock's lifecycle calls
        return (and report) only after their change is on disk: an agent killed at any moment
        finds, after its restart, every pod it was told about and none it deleted. Concurrent
        calls share the write.
        """
        self._save_state()
        if self._flush is not None:
            await asyncio.shield(self._flush)

    def _write_state(self) -> None:
        flush, self._flush = self._flush, None
        path = self.config.state_file
        assert path is not None and flush is not None
        try:
            state = _State(self.creates, list(self._pods.values()))
            # The fake backend's disk holds secret-derived env and files: owner-only, like a
            # kubelet's.
            write_private(path, msgspec.json.encode(state))
        except OSError as e:
            flush.set_exception(e)
            flush.exception()  # retrieved: a burst without waiters must not log it as lost
        else:
            flush.set_result(None)

    # -- node -------------------------------------------------------------------------------------
    def configure_node(self, node: Node) -> None:
        capacity = {"cpu": self.config.cpu, "memory": self.config.memory, "pods": self.config.pods}
        capacity.update(self.config.others)
        assert node.status is not None and node.spec is not None
        node.status.capacity = dict(capacity)
        node.status.allocatable = dict(capacity)
        if self.config.provider_id:
            node.spec.providerID = self.config.provider_id

    def use_tokens(self, tokens: PodTokens) -> None:
        self._tokens = tokens

    async def ping(self) -> None:
        fail = self.config.ping_fail_file
        if fail is not None and fail.exists():
            raise RuntimeError(f"mock backend unhealthy ({fail} exists)")

    # -- network ----------------------------------------------------------------------------------
    async def pod_ips(self, pod: Pod) -> list[str]:
        """Reserve the pod's IP before it starts, so `status.podIP` env vars can be resolved."""
        uid = str(pod.metadata.uid)  # type: ignore[union-attr]
        if uid not in self._ips:
            self._ips[uid] = address = self._free_ip()
            self._used_ips[address] += 1
        return [self._ips[uid]]

    async def release_pod_ips(self, namespace: str, name: str, uid: str) -> None:
        running = self._pods.get(f"{namespace}/{name}")
        if running is None or running.uid != uid:  # a running pod's delete_pod frees its IP
            self._release_ip(uid)

    def _release_ip(self, uid: str) -> None:
        address = self._ips.pop(uid, None)
        if address is not None:
            self._used_ips[address] -= 1
            if self._used_ips[address] <= 0:
                del self._used_ips[address]

    def _free_ip(self) -> str:
        """The next host address of the pod CIDR that no pod holds, round-robin (a freed IP is
        not handed out again at once). The pods of a state file hold theirs from the start, so
        a restarted agent's new pods never get the IP of one it adopted."""
        network = self._network
        # Hosts only: not the network's own address, nor its broadcast one (a /31 or /32 has
        # nothing else).
        offset, size = (0, network.num_addresses)
        if network.num_addresses > 2:
            offset, size = 1, network.num_addresses - 2
        used = self._used_ips
        for _ in range(min(size, len(used) + 1)):
            self._next_ip = self._next_ip % size + 1
            address = str(network[offset + self._next_ip - 1])
            if address not in used:
                return address
        raise ProviderError(
            "OutOfPodIPs", f"mock provider: every address of podCIDR {network} is in use"
        )

    # -- lifecycle --------------------------------------------------------------------------------
    async def create_pod(self, resolved: ResolvedPod) -> None:
        pod = resolved.pod
        annotations = pod.metadata.annotations or {}  # type: ignore[union-attr]
        failure: ProviderError | None = None
        if FAIL_ANNOTATION in annotations:
            failure = ProviderError(
                annotations[FAIL_ANNOTATION], f"rejected because of {FAIL_ANNOTATION}"
            )
        elif self.config.failure_ratio and self._random.random() < self.config.failure_ratio:
            failure = ProviderError("MockFailure", "the mock provider failed this pod on purpose")
        if failure is not None:  # the IP reserved when the pod was resolved is free again
            await self.release_pod_ips(resolved.namespace, resolved.name, resolved.uid)
            raise failure
        key = f"{resolved.namespace}/{resolved.name}"
        previous = self._pods.get(key)
        mock = MockPod(
            namespace=resolved.namespace,
            name=resolved.name,
            uid=resolved.uid,
            node=self.node_name,
            ip=(await self.pod_ips(pod))[0],
            containers=containers_of(pod),
            created=now_rfc3339(),
            print_env=annotations.get(PRINT_ENV_ANNOTATION) == "true",
            files=files_of(resolved),
            applied=annotations.get(APPLIED_ANNOTATION),
        )
        if previous is not None and previous.uid == mock.uid:
            # The agent promises never to do this (it adopts what runs); counted, so that tests
            # of restarts can prove it.
            mock.creates = previous.creates + 1
        self._pods[key] = mock
        self.creates += 1
        if not self.config.start_delay:
            mock.started = now_rfc3339()
        await self._saved()
        self._report(mock)  # with a start delay: Pending first
        if self.config.start_delay:
            self._starting[key] = asyncio.create_task(self._start_later(key, mock))

    async def _start_later(self, key: str, mock: MockPod) -> None:
        await asyncio.sleep(self.config.start_delay)
        self._starting.pop(key, None)
        if self._pods.get(key) is mock and mock.stopped is None:
            mock.started = now_rfc3339()
            self._report(mock)
            self._save_state()

    async def update_pod(self, resolved: ResolvedPod) -> None:
        key = f"{resolved.namespace}/{resolved.name}"
        mock = self._pods.get(key)
        if mock is None or mock.uid != resolved.uid:
            raise ProviderError("NotFound", f"mock provider does not run {key}", permanent=False)
        mock.containers = containers_of(resolved.pod)
        mock.files = files_of(resolved)
        meta = resolved.pod.metadata
        mock.applied = ((meta.annotations if meta else None) or {}).get(APPLIED_ANNOTATION)
        mock.updates += 1
        files = self._volume_files(mock)
        for container in mock.containers:  # the kubelet updates mounted volumes in place too
            fs = self._filesystems.get(mock.uid, {}).get(container.name)
            if fs is not None:
                mount_volumes(fs, files, container, refresh=True)
        await self._saved()

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"  # type: ignore[union-attr]
        mock = self._pods.get(key)
        if mock is None or mock.uid != pod.metadata.uid:  # type: ignore[union-attr]
            # Never run here (it failed, or its mount did), but its IP was reserved.
            self._release_ip(str(pod.metadata.uid))  # type: ignore[union-attr]
            return
        for task in (self._token_fetches.pop(mock.uid, None), self._starting.pop(key, None)):
            if task is not None:
                task.cancel()
        self._token_files.pop(mock.uid, None)
        self._token_backoff.pop(mock.uid, None)
        self._stats.retire(mock)
        mock.stopped = now_rfc3339()
        probes = self._probes.pop(mock.uid, None)
        self._probed.pop(mock.uid, None)
        if probes is not None:
            await probes.aclose()
        self._stop_event(mock.uid).set()
        self._stops.pop(mock.uid, None)
        self._filesystems.pop(mock.uid, None)
        del self._pods[key]
        self._release_ip(mock.uid)
        await self._saved()
        self._report(mock)

    async def start_ephemeral_container(self, resolved: ResolvedPod, name: str) -> None:
        """Running at once. Its command runs in the mock's shell (as `exec` does, in its own
        files): without stdin now, its output kept as its log; with stdin (`debug -it`) when a
        client attaches. It ends with its command, or with the pod (137)."""
        mock = self._running_pod(resolved.namespace, resolved.name)
        if mock.uid != resolved.uid or any(e.name == name for e in mock.ephemeral):
            return  # another pod's, or handed again after an agent restart
        spec = resolved.pod.spec
        found = [c for c in (spec.ephemeralContainers if spec else None) or () if c.name == name]
        if not found:
            raise ProviderError(
                "NotFound", f"pod {resolved.name} has no ephemeral container {name}"
            )
        debug = MockEphemeral.of(found[0], now_rfc3339())
        mock.ephemeral.append(debug)
        await self._saved()
        self._report(mock)
        if not debug.stdin:
            output = Collector()
            io = AttachIO(stdin=None, stdout=output, stderr=output)
            task = asyncio.create_task(self._run_ephemeral(mock, debug, io, output))
            self._debug_runs.add(task)
            task.add_done_callback(self._debug_runs.discard)

    async def _run_ephemeral(
        self, mock: MockPod, debug: MockEphemeral, io: AttachIO, output: Collector | None = None
    ) -> None:
        stopped = self._stop_event(mock.uid)
        fs = await self._filesystem(mock, debug.as_container())
        env = environment(mock, debug.as_container())
        code = await run_command(fs, env, mock.name, debug.command, io, stopped)
        if output is not None:
            debug.output = output.data[-65536:].decode(errors="replace")
        debug.finished, debug.exit_code = now_rfc3339(), code
        if self._pods.get(f"{mock.namespace}/{mock.name}") is mock:
            await self._saved()
            self._report(mock)

    async def _attach_ephemeral(self, mock: MockPod, debug: MockEphemeral, io: AttachIO) -> None:
        """`kubectl debug -it`: the client's stdio is its command's, which runs now."""
        key = (mock.uid, debug.name)
        pod = f"{mock.namespace}/{mock.name}"
        if debug.finished is not None or not debug.stdin:
            if io.stdout is not None:  # it ran on its own: what it printed
                await io.stdout.write(debug.output.encode())
            return
        if key in self._debugging:
            raise ProviderError("NotFound", f"container {debug.name} of {pod} is attached already")
        self._debugging.add(key)
        try:
            await self._run_ephemeral(mock, debug, io)
        finally:
            self._debugging.discard(key)

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        mock = self._pods.get(f"{namespace}/{name}")
        return None if mock is None else self._to_pod(mock)

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = await self.get_pod(namespace, name)
        return None if pod is None else pod.status

    async def list_pods(self) -> list[Pod]:
        for mock in self._pods.values():  # pods of the state file: their probes run again
            self._sync_probes(mock)
        return [self._to_pod(m) for m in self._pods.values()]

    async def aclose(self) -> None:
        probes, self._probes = list(self._probes.values()), {}
        for workers in probes:
            await workers.aclose()

    # -- probes -----------------------------------------------------------------------------------
    def _sync_probes(self, mock: MockPod) -> None:
        """Start, keep or stop the pod's probe workers as its containers run."""
        probes = self._probes.get(mock.uid)
        if probes is None:
            if not any(c.probes for c in mock.containers) or not mock.running:
                return
            pod = self._to_pod(mock, with_status=False)
            probes = PodProbes(
                pod,
                MockProbes(
                    mock,
                    lambda m, c: self._filesystem(m, c, wait_for_tokens=False),
                    self._stop_event(mock.uid),
                ),
                lambda name, grace, kind: self._restart(mock, name, kind),
                on_change=lambda: self._probe_changed(mock),
                on_event=lambda event: self._probe_event(mock, event),
                second=self.probe_second,
            )
            self._probes[mock.uid] = probes
        running = {c.name: c.restarts for c in mock.containers if not c.init and mock.running}
        probes.sync(running)

    def _probe_changed(self, mock: MockPod) -> None:
        """Remembered so the status's conditions change at the verdict's time, not at a poll's."""
        self._probed[mock.uid] = datetime.now(UTC)
        self._report(mock)

    async def _restart(self, mock: MockPod, container: str, kind: ProbeKind) -> None:
        """A failed liveness or startup probe: the container "restarts" at once (a new run with
        a fresh filesystem), whatever the restart policy, as the mock's processes are fake."""
        found = mock.container(container)
        found.restarts += 1
        found.restarted = now_rfc3339()
        self._filesystems.get(mock.uid, {}).pop(container, None)
        self._report(mock)
        self._save_state()

    def _probe_event(self, mock: MockPod, event: ProbeEvent) -> None:
        if self.events is not None:
            self.events.pod_event(self._to_pod(mock), event.type, event.reason, event.message)

    def _stop_event(self, uid: str) -> asyncio.Event:
        return self._stops.setdefault(uid, asyncio.Event())

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    def _report(self, mock: MockPod) -> None:
        self._sync_probes(mock)  # first: a new run is not ready before its probe says so
        if self._notify is not None:
            self._notify(self._to_pod(mock))

    # -- views ------------------------------------------------------------------------------------
    def _to_pod(self, mock: MockPod, *, with_status: bool = True) -> Pod:
        containers = [
            {"name": c.name, "image": c.image, **c.probes} for c in mock.containers if not c.init
        ]
        pod = msgspec.convert(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "namespace": mock.namespace,
                    "name": mock.name,
                    "uid": mock.uid,
                    "annotations": {APPLIED_ANNOTATION: mock.applied} if mock.applied else None,
                },
                "spec": {
                    "nodeName": mock.node,
                    "containers": containers,
                    "ephemeralContainers": [
                        {"name": e.name, "image": e.image} for e in mock.ephemeral
                    ]
                    or None,
                },
            },
            Pod,
        )
        if with_status:
            pod.status = _status(
                mock, self.host_ip, self._probes.get(mock.uid), self._probed.get(mock.uid)
            )
        return pod

    # -- logs, exec, attach, port-forward -------------------------------------------------------
    def _pod(self, namespace: str, pod: str) -> MockPod:
        mock = self._pods.get(f"{namespace}/{pod}")
        if mock is None:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running here")
        return mock

    def _running_pod(self, namespace: str, pod: str) -> MockPod:
        mock = self._pod(namespace, pod)
        if not mock.running:
            raise ProviderError("NotFound", f"pod {namespace}/{pod} is not running")
        return mock

    def _running_container(
        self, namespace: str, pod: str, container: str
    ) -> tuple[MockPod, MockContainer]:
        mock = self._running_pod(namespace, pod)
        found = mock.container(container)
        if found.init:
            raise ProviderError(
                "NotFound", f"container {container} of {namespace}/{pod} has completed"
            )
        return mock, found

    def _volume_files(self, mock: MockPod) -> dict[str, str]:
        """The pod's volume files, "volume/path" -> text, with the tokens given so far."""
        return {**mock.files, **self._token_files.get(mock.uid, {})}

    async def _filesystem(
        self, mock: MockPod, container: MockContainer, *, wait_for_tokens: bool = True
    ) -> Filesystem:
        """The container's files. Its service-account tokens are fetched, or renewed once due,
        as it is used: the first exec into a pod requests them. An exec probe does not wait
        for that (a slow apiserver must not fail probes, and so restart containers): it sees
        the files as they are, and the tokens join them when they come."""
        fetch = self._renew_tokens(mock, despite_failures=wait_for_tokens)
        if fetch is not None and wait_for_tokens:
            # Not cancelled with this caller (it is shared), and its end, even cancelled by the
            # pod's deletion, is not this caller's error: the check below is.
            await asyncio.wait({fetch})
            if self._pods.get(f"{mock.namespace}/{mock.name}") is not mock or not mock.running:
                raise ProviderError("NotFound", f"pod {mock.namespace}/{mock.name} is not running")
        per_pod = self._filesystems.setdefault(mock.uid, {})
        fs = per_pod.get(container.name)
        if fs is None:
            fs = per_pod[container.name] = container_filesystem(
                mock, container, self._volume_files(mock)
            )
        return fs

    def _renew_tokens(self, mock: MockPod, *, despite_failures: bool) -> asyncio.Task[None] | None:
        """The pod's token fetch: one at a time, shared by whoever needs it. After a failure,
        probes do not start another one until a back-off has passed (each probe run of every
        pod would otherwise be a TokenRequest to an apiserver in trouble); an exec does."""
        if self._tokens is None:
            return None
        fetch = self._token_fetches.get(mock.uid)
        backoff = self._token_backoff.get(mock.uid)
        waiting = backoff is not None and time.monotonic() < backoff[0]
        if fetch is None and waiting and not despite_failures:
            return None
        if fetch is None:
            fetch = asyncio.create_task(self._fetch_tokens(self._tokens, mock))
            self._token_fetches[mock.uid] = fetch
            fetch.add_done_callback(
                lambda done: (
                    self._token_fetches.pop(mock.uid, None)
                    if self._token_fetches.get(mock.uid) is done
                    else None
                )
            )
        return fetch

    async def _fetch_tokens(self, tokens: PodTokens, mock: MockPod) -> None:
        try:
            given = await tokens.token_files(mock.namespace, mock.name, mock.uid)
        except Exception as e:
            # The files keep the tokens they have, as a kubelet's would during an outage.
            _, backoff = self._token_backoff.get(mock.uid, (0.0, Backoff(initial=1.0, cap=300.0)))
            delay = backoff.next_delay()
            self._token_backoff[mock.uid] = (time.monotonic() + delay, backoff)
            message = e.message if isinstance(e, ProviderError) else f"{type(e).__name__}: {e}"
            pod = f"{mock.namespace}/{mock.name}"
            log.warning("pod %s: %s (probes try again in %.0fs)", pod, message, delay)
            return
        self._token_backoff.pop(mock.uid, None)
        if self._pods.get(f"{mock.namespace}/{mock.name}") is not mock:
            return  # deleted meanwhile
        files = {
            f"{volume}/{path}": content.data.decode(errors="replace")
            for volume, contents in given.items()
            for path, content in contents.items()
        }
        if files == self._token_files.get(mock.uid):
            return
        self._token_files[mock.uid] = files
        filesystems = self._filesystems.get(mock.uid, {})
        for container in mock.containers:
            fs = filesystems.get(container.name)
            if fs is not None:
                write_mounted(fs, files, container.mounts, renew=True)

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        """A few lines the container "printed" when it started (with the print-env annotation,
        its env too); `logs -f` then prints `mock: tick N` every `tick_seconds` until the pod
        stops."""
        mock = self._pod(namespace, pod)
        for debug in mock.ephemeral:
            if debug.name == container:
                yield debug.output.encode()
                return
        found = mock.container(container)
        if options.previous:  # mock containers never restart
            raise previous_not_found(container, pod)
        stopped = self._stop_event(mock.uid) if options.follow and mock.stopped is None else None
        remaining = options.limit_bytes
        lines = log_lines(mock, found, options, stopped, self.tick_seconds)
        async with contextlib.aclosing(lines):
            async for line in lines:
                if remaining is not None:
                    line = line[:remaining]
                    remaining -= len(line)
                yield line
                if remaining == 0:
                    return

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
        stopped = self._stop_event(mock.uid)  # before any wait: a deletion meanwhile sets it
        fs = await self._filesystem(mock, found)
        env = environment(mock, found)
        return await run_command(fs, env, mock.name, command, io, stopped)

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        """The container's main process echoes each line of stdin upper-cased, until stdin
        ends (or ^C with a TTY); without stdin it prints a line every `tick_seconds`."""
        mock = self._running_pod(namespace, pod)
        for debug in mock.ephemeral:
            if debug.name == container:
                await self._attach_ephemeral(mock, debug, io)
                return
        mock, _ = self._running_container(namespace, pod, container)
        await attach(container, io, self._stop_event(mock.uid), self.tick_seconds)

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        """Connect to `port` on 127.0.0.1 (the mock's pods "are" this machine; a real backend
        would dial the pod's own address) and copy both ways."""
        self._running_pod(namespace, pod)
        await forward(port, stream, f"{namespace}/{pod}")

    # -- stats and metrics ----------------------------------------------------------------------
    async def stats_summary(self) -> dict[str, Any]:
        """A `stats/v1alpha1` Summary of deterministic, plausible usage (see `_stats`)."""
        return self._stats.summary(self._pods.values())

    async def metrics_resource(self) -> str:
        """The kubelet's `/metrics/resource` (v1.37): the summary's numbers as Prometheus text."""
        return self._stats.resource_metrics(self._pods.values())


def _status(
    mock: MockPod,
    host_ip: str,
    probes: PodProbes | None = None,
    probed: datetime | None = None,
) -> PodStatus:
    """The kubelet's status for the mock's pod, replayed from its life: created, started (the
    init containers completed, the others running, not yet past their probes), the latest probe
    verdicts and liveness restarts (at `probed` or the last restart, whichever came later), and
    stopped (every container exited 0). The replay gives each condition its real transition time
    without keeping any status around."""
    spec = PodSpec(
        containers=[Container(name=c.name, image=c.image) for c in mock.containers if not c.init],
        initContainers=[Container(name=c.name, image=c.image) for c in mock.containers if c.init],
        ephemeralContainers=[EphemeralContainer(name=e.name, image=e.image) for e in mock.ephemeral]
        or None,
    )
    debugging = {e.name: _ephemeral_report(mock, e) for e in mock.ephemeral}
    created = parse_time(mock.created)

    def report(
        c: MockContainer,
        state: Running | Terminated,
        *,
        first: bool = False,  # the first run: no restart yet
        verdict: tuple[bool, bool] = (True, True),  # ready, started
    ) -> ContainerReport:
        restarted = None if first or c.restarted is None else parse_time(c.restarted)
        return ContainerReport(
            state=state,
            restart_count=0 if first else c.restarts,
            # killed after a failed liveness or startup probe: the kubelet's 137, as by SIGKILL
            last_terminated=None if restarted is None else Terminated(137, finished_at=restarted),
            ready=verdict[0],
            started=verdict[1],
            container_id=f"mock://{mock.uid}/{c.name}",
            image_id=f"mock://{c.image}",
        )

    def build(
        reports: dict[str, ContainerReport],
        now: datetime,
        previous: PodStatus | None,
        *,
        stopped: bool = False,  # only the replay's last step may end the pod
    ) -> PodStatus:
        return build_pod_status(
            spec,
            {**reports, **debugging},
            host_ip=host_ip,
            pod_ips=[mock.ip],
            start_time=created,
            previous=previous,
            now=now,
            terminating=stopped,
        )

    if mock.started is None:  # stopped before it started, maybe
        if mock.stopped is None:
            return build({}, created, None)
        return build({}, parse_time(mock.stopped), None, stopped=True)
    status = build({}, created, None)
    started = parse_time(mock.started)

    def run_of(c: MockContainer) -> Running:
        return Running(parse_time(c.restarted) if c.restarted else started)

    def unprobed(c: MockContainer) -> tuple[bool, bool]:
        """A run no probe has passed yet: neither started (with a startup probe) nor ready
        (with a readiness or startup probe)."""
        startup = "startupProbe" in c.probes
        return (not startup and "readinessProbe" not in c.probes, not startup)

    def verdict(c: MockContainer) -> tuple[bool, bool]:
        """The probe engine's, while it runs (none once the pod stopped)."""
        if probes is None:
            return unprobed(c)
        return (probes.ready(c.name), probes.started(c.name))

    # The first runs as they began, before any probe.
    reports = {
        c.name: report(c, Terminated(0, created, started), first=True)
        if c.init
        else report(c, Running(started), first=True, verdict=unprobed(c))
        for c in mock.containers
    }
    status = build(reports, started, status)
    # Then as they are now: liveness restarts, the probe engine's verdicts. Most pods have
    # neither: their status is the one just built (skipped: a third of a pod's start).
    first_runs = dict(reports)
    for c in mock.containers:
        if not c.init:
            reports[c.name] = report(c, run_of(c), verdict=verdict(c))
    latest = max([started, *(run_of(c).started_at for c in mock.containers)])
    moment = max(latest, probed or latest)
    if reports != first_runs or moment != started:
        status = build(reports, moment, status)
    if mock.stopped is not None:
        stopped = parse_time(mock.stopped)
        for c in mock.containers:
            if not c.init:
                reports[c.name] = replace(
                    reports[c.name], state=Terminated(0, run_of(c).started_at, stopped)
                )
        status = build(reports, stopped, status, stopped=True)
    return status


def _ephemeral_report(mock: MockPod, debug: MockEphemeral) -> ContainerReport:
    started = parse_time(debug.started)
    state: Running | Terminated = Running(started)
    if debug.finished is not None:
        ended = parse_time(debug.finished)
        state = Terminated(debug.exit_code or 0, started, ended, reason=debug.reason)
    elif mock.stopped is not None:  # ended with its pod
        state = Terminated(137, started, parse_time(mock.stopped))
    return ContainerReport(
        state=state,
        container_id=f"mock://{mock.uid}/{debug.name}",
        image_id=f"mock://{debug.image}",
    )


def create(context: ProviderContext) -> MockProvider:
    """Entry point (`vkubelet.providers`: mock)."""
    config = MockConfig.load(context.config_path, context.node_name)
    return MockProvider(
        context.node_name, config, host_ip=context.internal_ip, events=context.events
    )
