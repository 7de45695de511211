"""Liveness, readiness and startup probes, run by the agent against the device.

A kubelet probes the containers of its own machine; here the agent probes across the device's
SSH link. An exec probe is a command in the container's environment, in an SSH session; httpGet
and tcpSocket connect from the device itself (a direct-tcpip channel), so that a server which
only listens on the device's loopback answers as it would answer a kubelet on the device.

The semantics are the kubelet's (pkg/kubelet/prober): one worker per probe and container run,
consecutive results counted against the thresholds, liveness and readiness held back until the
startup probe has succeeded, and a failed liveness or startup probe ends the run (the restart
policy says what comes next) after which its worker waits for the next run. One difference: a
probe that cannot tell because the device is unreachable counts neither way. The node is
NotReady already, and a container must not be restarted because a network link failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, Protocol

import h11
from lightkube.models.core_v1 import Container, HTTPGetAction, Probe
from lightkube.resources.core_v1 import Pod

from . import _remote
from ._link import Completed, Unreachable

log = logging.getLogger(__name__)

__all__ = ["Link", "Prober"]

Kind = Literal["startup", "readiness", "liveness"]
Action = Callable[[float], Awaitable[tuple[bool, str]]]  # (time limit) -> (success, detail)

_DEFAULT_HOST = "127.0.0.1"  # the pod IP is the device's, but loopback is sure to be served
_MAX_RESPONSE = 64 * 1024  # the status line and headers must come within this much


class _Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...


class Link(Protocol):
    """What probes need of a `DeviceLink` (unit tests pass an in-memory one)."""

    @property
    def connected(self) -> bool: ...

    async def run(self, script: str, *, deadline: float = 30.0) -> Completed: ...

    async def open_connection(self, host: str, port: int) -> tuple[_Reader, _Writer]: ...


@dataclass
class _Run:
    """One run of a container: a new restart count or a new start time is a new run."""

    pod: Pod
    container: Container
    key: tuple[int, datetime | None]
    # Initial delays count from when the agent first saw the run, not from the start time the
    # device reports: the two clocks may differ.
    seen: float
    started: asyncio.Event = field(default_factory=asyncio.Event)  # the startup probe succeeded
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()

    def describe(self, kind: Kind) -> str:
        return f"pod {_name(self.pod)}: container {self.container.name}: {kind} probe"


class Prober:
    """The probe workers of one pod, kept in step with the device's reports by `sync`.

    `ready` is the pod entry's readiness by container, which this object owns from then on;
    `changed` is called when a probe changed it. `second` is how long a second of the probe
    settings lasts: tests shorten it.
    """

    def __init__(
        self,
        link: Link,
        root: str,
        uid: str,
        ready: dict[str, bool],
        changed: Callable[[], None],
        *,
        second: float = 1.0,
    ) -> None:
        self._link = link
        self._root = root
        self._uid = uid
        self._ready = ready
        self._changed = changed
        self._second = second
        self._runs: dict[str, _Run] = {}

    def sync(self, pod: Pod, remote: _remote.RemotePod | None, *, stopping: bool = False) -> None:
        """Start the workers of new runs and stop those of runs that have ended.

        Call it before publishing a new status: a new run with a readiness or startup probe is
        marked not ready here, so no status shows it ready before a probe said so.
        """
        running: dict[str, _remote.ContainerStatus] = {}
        if remote is not None and not stopping and not remote.stopping:
            running = {c.name: c for c in remote.containers if c.state == "running"}
        for name, run in list(self._runs.items()):
            current = running.get(name)
            if current is None or _run_key(current) != run.key:
                run.stop()
                del self._runs[name]
        assert pod.spec is not None
        for container in pod.spec.containers:
            current = running.get(container.name)
            if current is not None and container.name not in self._runs:
                self._runs[container.name] = self._start(pod, container, _run_key(current))

    def started(self, container: str) -> bool:
        """Whether the container's startup probe (if it has one) has succeeded in this run."""
        run = self._runs.get(container)
        return run is None or run.started.is_set()

    def stop(self) -> None:
        for run in self._runs.values():
            run.stop()
        self._runs.clear()

    def _start(self, pod: Pod, container: Container, key: tuple[int, datetime | None]) -> _Run:
        run = _Run(pod, container, key, asyncio.get_running_loop().time())
        if container.startupProbe is None:
            run.started.set()
        if container.readinessProbe is not None or container.startupProbe is not None:
            self._ready[container.name] = False
        else:
            self._ready.pop(container.name, None)  # ready while running
        probes: dict[Kind, Probe | None] = {
            "startup": container.startupProbe,
            "readiness": container.readinessProbe,
            "liveness": container.livenessProbe,
        }
        for kind, probe in probes.items():
            if probe is not None:
                name = f"{kind} probe {self._uid}/{container.name}"
                run.tasks.append(asyncio.create_task(self._work(run, kind, probe), name=name))
        return run

    # -- a worker ---------------------------------------------------------------------------
    async def _work(self, run: _Run, kind: Kind, probe: Probe) -> None:
        """Probe every period until the run ends, or until this probe's job for it is done."""
        try:
            action = self._action(probe, run.container)
        except ValueError as e:  # as for the kubelet, a probe that cannot run tells nothing
            log.warning("%s cannot run: %s", run.describe(kind), e)
            return
        loop = asyncio.get_running_loop()
        delay = (probe.initialDelaySeconds or 0) * self._second
        await asyncio.sleep(max(0.0, run.seen + delay - loop.time()))
        if kind != "startup":
            await run.started.wait()
        needed = {
            True: (probe.successThreshold or 1) if kind == "readiness" else 1,
            False: probe.failureThreshold or 3,
        }
        last: bool | None = None
        count = 0
        while True:
            result, detail = await self._probe(action, probe)
            if result is not None:  # an unknown result leaves the count as it was
                count = count + 1 if result == last else 1
                last = result
                if not result:  # at INFO once a streak reaches the threshold
                    level = logging.INFO if count == needed[False] else logging.DEBUG
                    log.log(level, "%s failed (%d in a row): %s", run.describe(kind), count, detail)
                if count >= needed[result] and await self._settle(run, kind, probe, result):
                    return
            await asyncio.sleep((probe.periodSeconds or 10) * self._second)

    async def _settle(self, run: _Run, kind: Kind, probe: Probe, success: bool) -> bool:
        """Act on a result that reached its threshold. True when the run needs no more of this
        probe: the startup probe has succeeded, or a failed probe ended the run."""
        name = run.container.name
        if kind == "readiness":
            self._set_ready(name, success)
            return False
        if success:
            if kind == "startup":
                run.started.set()
                if run.container.readinessProbe is None:
                    self._set_ready(name, True)
            return kind == "startup"
        log.info("%s: restarting the container", run.describe(kind))
        return await self._restart(run, probe)

    async def _probe(self, action: Action, probe: Probe) -> tuple[bool | None, str]:
        """Success, failure, or None when the device could not be asked."""
        timeout = (probe.timeoutSeconds or 1) * self._second
        try:
            async with asyncio.timeout(timeout):
                ok, detail = await action(timeout)
        except Unreachable as e:
            return None, str(e)
        except TimeoutError:
            ok, detail = False, f"no answer within {timeout:g}s"
        except (OSError, h11.ProtocolError) as e:  # refused, reset, not HTTP
            ok, detail = False, str(e) or type(e).__name__
        if not ok and not self._link.connected:
            return None, detail  # the link failed, not the container
        return ok, detail

    def _set_ready(self, name: str, ready: bool) -> None:
        if self._ready.get(name) is not ready:
            self._ready[name] = ready
            self._changed()

    async def _restart(self, run: _Run, probe: Probe) -> bool:
        """End the run; the supervisor restarts the container as the restart policy says."""
        grace = probe.terminationGracePeriodSeconds
        if grace is None and run.pod.spec is not None:
            grace = run.pod.spec.terminationGracePeriodSeconds
        name = run.container.name
        script = _remote.restart_container_script(
            self._root, self._uid, name, 30 if grace is None else grace
        )
        try:
            (await self._link.run(script)).check(f"restarting container {name}")
        except (Unreachable, RuntimeError) as e:  # it fails again on the next failure
            log.warning("pod %s: container %s not restarted: %s", _name(run.pod), name, e)
            return False
        return True

    # -- handlers -----------------------------------------------------------------------------
    def _action(self, probe: Probe, container: Container) -> Action:
        """The probe's handler, ready to call; ValueError for one that cannot run at all."""
        if probe.exec is not None:
            argv = list(probe.exec.command or [])
            line = _remote.exec_command(self._root, self._uid, container.name, argv)
            return lambda limit: self._exec(line, limit)
        if probe.httpGet is not None:
            get = probe.httpGet
            port = _port(get.port, container)
            return lambda _: _http_get(self._link, get, get.host or _DEFAULT_HOST, port)
        if probe.tcpSocket is not None:
            host = probe.tcpSocket.host or _DEFAULT_HOST
            port = _port(probe.tcpSocket.port, container)
            return lambda _: _tcp(self._link, host, port)
        raise ValueError("only exec, httpGet and tcpSocket probes run on SSH devices")

    async def _exec(self, line: str, limit: float) -> tuple[bool, str]:
        """The command, killed on the device if it outlasts the timeout: the local timeout
        only gives up on it, and a probe that hangs every period would pile up processes.
        (No `timeout` command: busybox's took other options before 1.30.)"""
        seconds = max(1, math.ceil(limit))
        script = (
            f"{line} </dev/null &\n"
            "p=$!\n"
            f"(sleep {seconds}; kill -KILL $p) >/dev/null 2>&1 &\n"
            "k=$!\n"
            "wait $p\n"
            "c=$?\n"
            "kill $k 2>/dev/null\n"
            "exit $c\n"
        )
        result = await self._link.run(script, deadline=limit + 5)
        output = (result.stdout + result.stderr).decode(errors="replace").strip()
        return result.exit_status == 0, output[-300:] or f"exit code {result.exit_status}"


async def _tcp(link: Link, host: str, port: int) -> tuple[bool, str]:
    _, writer = await link.open_connection(host, port)
    writer.close()
    return True, ""


async def _http_get(link: Link, get: HTTPGetAction, host: str, port: int) -> tuple[bool, str]:
    """GET with the kubelet's default headers; 200 to 399 is a success. Redirects are not
    followed, so a 3xx is a success where the kubelet, following one to the same host, would
    judge the final answer."""
    scheme = (get.scheme or "HTTP").upper()
    if scheme != "HTTP":
        return False, f"{scheme} probes are not supported on SSH devices, only HTTP"
    path = get.path or "/"
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    headers = [(h.name, h.value) for h in get.httpHeaders or []]
    given = {name.lower() for name, _ in headers}
    defaults = [("Host", authority), ("User-Agent", "kube-probe/vkubelet"), ("Accept", "*/*")]
    headers += [(name, value) for name, value in defaults if name.lower() not in given]
    headers.append(("Connection", "close"))
    http = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_RESPONSE)
    request = h11.Request(
        method="GET", target=path if path.startswith("/") else f"/{path}", headers=headers
    )
    reader, writer = await link.open_connection(host, port)
    try:
        writer.write(http.send(request) + http.send(h11.EndOfMessage()))
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                ok = 200 <= event.status_code < 400
                return ok, f"HTTP {event.status_code} {event.reason.decode(errors='replace')}"
            elif not isinstance(event, h11.InformationalResponse):  # 1xx: the answer follows
                return False, f"no HTTP response: {event!r}"
    finally:
        writer.close()


def _port(port: int | str, container: Container) -> int:
    """A port number, or the number of the container's port of that name."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for named in container.ports or []:
        if named.name == port:
            return named.containerPort
    raise ValueError(f"container {container.name} has no port named {port!r}")


def _run_key(status: _remote.ContainerStatus) -> tuple[int, datetime | None]:
    return status.restart_count, status.started_at


def _name(pod: Pod) -> str:
    meta = pod.metadata
    return f"{meta.namespace}/{meta.name}" if meta is not None else "?"
