"""Liveness, readiness and startup probes with the kubelet's rules, against a provider's transport.

A provider says which containers run (`PodProbes.sync`, a run identity per running container:
a new identity is a new run, as a new container ID is for the kubelet) and supplies a
`ProbeTransport` (run a command in the container, open a TCP connection from the pod's
network). The engine runs one worker per probe and run, and tells the provider what it needs
for the pod's status (`ready`, `started`), when they change (`on_change`), which Events to
record (`on_event`, in the kubelet's wording) and when a container must be restarted
(`restart`, awaited; the restart policy then decides, as for the kubelet).

The rules are pkg/kubelet/prober's: a worker ticks every `periodSeconds` and probes once the run
is `initialDelaySeconds` old; a result counts once `successThreshold` (readiness) or
`failureThreshold` equal results come in a row; liveness and readiness wait until the startup
probe has succeeded (readiness is probed at once then); readiness is false until its first
success, true once started without a readiness probe; a liveness or startup failure restarts the
container with the probe's `terminationGracePeriodSeconds` (else the pod's) and holds the probe
until the next run; while the pod terminates only readiness runs. One difference: a result the
transport cannot vouch for (`ProbeUnknown`, or a failure while `available()` is False) counts
neither way. Initial delays count from when the engine first saw the run, unless the provider
gives a start time on the agent's clock: a device's clock may differ from the agent's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from lightkube.models.core_v1 import Container, Probe
from lightkube.resources.core_v1 import Pod

from ._probe_checks import (
    MAX_OUTPUT,
    ExecResult,
    Outcome,
    ProbeReader,
    ProbeTransport,
    ProbeUnknown,
    ProbeWriter,
    Result,
    grpc_check,
    http_get,
    tcp_check,
)
from .tasks import TaskSet

log = logging.getLogger(__name__)

__all__ = [
    "ExecResult",
    "PodProbes",
    "ProbeEvent",
    "ProbeKind",
    "ProbeReader",
    "ProbeTransport",
    "ProbeUnknown",
    "ProbeWriter",
    "RestartCallback",
]

ProbeKind = Literal["startup", "readiness", "liveness"]
# (container, grace period seconds, probe kind) -> None; raise if the container was not restarted
RestartCallback = Callable[[str, int, ProbeKind], Awaitable[None]]


@dataclass(frozen=True)
class ProbeEvent:
    """An Event the kubelet would record about the container (`type`, `reason`, `message`)."""

    container: str
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


class _ConfigError(Exception):
    """A probe that cannot run as written (an unknown port name): it errors every period."""


@dataclass
class _Run:
    container: Container
    key: Hashable
    began: float  # loop time the run's initial delays count from
    started: asyncio.Event = field(default_factory=asyncio.Event)  # startup probe succeeded
    ready: bool = False
    wake_readiness: asyncio.Event = field(default_factory=asyncio.Event)
    workers: dict[ProbeKind, asyncio.Task[None]] = field(default_factory=dict)

    def stop(self, kinds: tuple[ProbeKind, ...] = ("startup", "readiness", "liveness")) -> None:
        for kind in kinds:
            task = self.workers.pop(kind, None)
            if task is not None:
                task.cancel()


class PodProbes:
    """The probe workers of one pod.

    `second` is how long a second of the probe settings lasts (tests shorten it). `host` is the
    address httpGet, tcpSocket and grpc probes use when the probe names none (the pod IP for a
    kubelet). Call `update` with a new spec of the pod (its probes apply from the next run).
    """

    def __init__(
        self,
        pod: Pod,
        transport: ProbeTransport,
        restart: RestartCallback,
        *,
        host: str = "127.0.0.1",
        on_change: Callable[[], None] | None = None,
        on_event: Callable[[ProbeEvent], None] | None = None,
        second: float = 1.0,
    ) -> None:
        self.pod = pod
        self.host = host
        self._transport = transport
        self._restart = restart
        self._on_change = on_change or (lambda: None)
        self._on_event = on_event or (lambda _: None)
        self._second = second
        self._runs: dict[str, _Run] = {}
        self._terminating = False
        self._tasks = TaskSet(f"probes {_name(pod)}", logger=log)

    # -- the provider's side --------------------------------------------------------------------
    def update(self, pod: Pod) -> None:
        self.pod = pod

    def sync(
        self,
        running: Mapping[str, Hashable],
        *,
        terminating: bool = False,
        started_at: Mapping[str, float] | None = None,
    ) -> None:
        """`running`: a run identity for each running container. Workers of runs that ended
        stop, new runs get workers. `started_at`: optional start times (`time.time()` clock).

        Call it before publishing a status: a new run with a readiness or startup probe is not
        ready here, so no status shows it ready before a probe said so.
        """
        for name, run in list(self._runs.items()):
            if running.get(name, _GONE) != run.key:
                run.stop()
                del self._runs[name]
        if terminating and not self._terminating:
            self._terminating = True
            for run in self._runs.values():  # as the kubelet: only readiness while terminating
                run.stop(("startup", "liveness"))
                run.started.set()
        spec = self.pod.spec
        for container in spec.containers if spec is not None else []:
            key = running.get(container.name, _GONE)
            if key is _GONE or container.name in self._runs:
                continue
            began = asyncio.get_running_loop().time()
            if started_at is not None and container.name in started_at:
                began -= max(0.0, time.time() - started_at[container.name])
            self._runs[container.name] = self._start(container, key, began)

    def ready(self, container: str) -> bool:
        """Whether a running container is ready (False for one not running)."""
        run = self._runs.get(container)
        return run is not None and run.ready

    def started(self, container: str) -> bool:
        """Whether a running container's startup probe (if any) has succeeded."""
        run = self._runs.get(container)
        return run is not None and run.started.is_set()

    def stop(self) -> None:
        for run in self._runs.values():
            run.stop()
        self._runs.clear()

    async def aclose(self) -> None:
        self.stop()
        await self._tasks.aclose()

    @property
    def workers(self) -> int:
        return sum(len(run.workers) for run in self._runs.values())

    # -- runs -----------------------------------------------------------------------------------
    def _start(self, container: Container, key: Hashable, began: float) -> _Run:
        run = _Run(container, key, began)
        probes: dict[ProbeKind, Probe | None] = {
            "startup": container.startupProbe,
            "readiness": container.readinessProbe,
            "liveness": container.livenessProbe,
        }
        if probes["startup"] is None or self._terminating:
            run.started.set()
        run.ready = run.started.is_set() and probes["readiness"] is None
        for kind, probe in probes.items():
            if probe is None or (self._terminating and kind != "readiness"):
                continue
            work = self._work(run, kind, probe)
            run.workers[kind] = self._tasks.spawn(work, name=f"{kind} {container.name}")
        return run

    def _set_ready(self, run: _Run, ready: bool) -> None:
        if run.ready is not ready:
            run.ready = ready
            self._on_change()

    # -- a worker -------------------------------------------------------------------------------
    async def _work(self, run: _Run, kind: ProbeKind, probe: Probe) -> None:
        """Tick every period; probe when the run is old enough and (but for the startup probe)
        has started; act on results that reach their threshold."""
        loop = asyncio.get_running_loop()
        period = max(1, probe.periodSeconds or 10) * self._second
        delay = (probe.initialDelaySeconds or 0) * self._second
        thresholds = {
            True: max(1, probe.successThreshold or 1),
            False: max(1, probe.failureThreshold or 3),
        }
        last: bool | None = None
        count = 0
        tick = loop.time()
        while True:
            gated = kind != "startup" and not run.started.is_set()
            if not gated and loop.time() - run.began >= delay:
                success = await self._probe_once(run, kind, probe)
                if success is not None:
                    count = count + 1 if success == last else 1
                    last = success
                    if count >= thresholds[success]:
                        if await self._settle(run, kind, success):
                            return
                        if kind != "readiness" and not success:
                            count = 0  # not restarted: count the failures again
            tick += period
            while tick <= loop.time():  # a probe that outlasted periods skips their ticks
                tick += period
            wake = run.wake_readiness if kind == "readiness" else None
            await _sleep_until(loop, tick, wake)

    async def _settle(self, run: _Run, kind: ProbeKind, success: bool) -> bool:
        """Act on a result that reached its threshold; True when this worker's job for the run
        is done (the startup probe succeeded, or the container was restarted)."""
        if kind == "readiness":
            self._set_ready(run, success)
            return False
        if success:
            if kind == "startup":
                run.started.set()
                run.wake_readiness.set()
                if run.container.readinessProbe is None:
                    self._set_ready(run, True)
                else:
                    self._on_change()  # `started` changed
            return kind == "startup"
        name = run.container.name
        self._event(
            name, "Normal", "Killing", f"Container {name} failed {kind} probe, will be restarted"
        )
        try:
            await self._restart(name, self._grace(run, kind), kind)
        except Exception as e:  # it fails again after the next failures
            log.warning("pod %s: container %s not restarted: %s", _name(self.pod), name, e)
            return False
        return True

    def _grace(self, run: _Run, kind: ProbeKind) -> int:
        probe = run.container.livenessProbe if kind == "liveness" else run.container.startupProbe
        grace = probe.terminationGracePeriodSeconds if probe is not None else None
        if grace is None and self.pod.spec is not None:
            grace = self.pod.spec.terminationGracePeriodSeconds
        return 30 if grace is None else grace

    async def _probe_once(self, run: _Run, kind: ProbeKind, probe: Probe) -> bool | None:
        """Run the probe: True, False, or None for a result that does not count."""
        label = kind.capitalize()
        name = run.container.name
        timeout = max(1, probe.timeoutSeconds or 1) * self._second
        try:
            async with asyncio.timeout(timeout):
                result = await self._check(run.container, probe, timeout)
        except ProbeUnknown as e:
            log.debug("pod %s: %s %s probe: unknown: %s", _name(self.pod), name, kind, e)
            return None
        except _ConfigError as e:
            message = f"{label} probe errored and resulted in unknown state: {e}"
            self._event(name, "Warning", "Unhealthy", message)
            return None
        except TimeoutError:
            result = Result(Outcome.FAILURE, _timeout_message(probe, timeout / self._second))
        if result.outcome is Outcome.FAILURE and not self._transport.available():
            return None  # the backend's link failed, not the container
        if result.outcome is Outcome.WARNING:
            self._event(name, "Warning", "ProbeWarning", f"{label} probe warning: {result.output}")
        elif result.outcome is Outcome.FAILURE:
            log.debug("pod %s: %s %s probe failed: %s", _name(self.pod), name, kind, result.output)
            self._event(name, "Warning", "Unhealthy", f"{label} probe failed: {result.output}")
        return result.outcome is not Outcome.FAILURE

    async def _check(self, container: Container, probe: Probe, limit: float) -> Result:
        if probe.exec is not None:
            command = list(probe.exec.command or [])
            done = await self._transport.exec(container.name, command, limit)
            output = done.output[-MAX_OUTPUT:].decode(errors="replace")
            return Result(Outcome.SUCCESS if done.exit_code == 0 else Outcome.FAILURE, output)
        if probe.httpGet is not None:
            get = probe.httpGet
            port = _port(get.port, container)
            headers = [(h.name, h.value) for h in get.httpHeaders or []]
            host = get.host or self.host
            return await http_get(
                self._transport, get.scheme or "HTTP", host, port, get.path or "/", headers
            )
        if probe.tcpSocket is not None:
            port = _port(probe.tcpSocket.port, container)
            return await tcp_check(self._transport, probe.tcpSocket.host or self.host, port)
        if probe.grpc is not None:
            grpc = probe.grpc
            return await grpc_check(self._transport, self.host, grpc.port, grpc.service or "")
        raise _ConfigError("the probe has no handler")

    def _event(
        self, container: str, type: Literal["Normal", "Warning"], reason: str, message: str
    ) -> None:
        self._on_event(ProbeEvent(container, type, reason, message))


_GONE = object()


async def _sleep_until(
    loop: asyncio.AbstractEventLoop, when: float, wake: asyncio.Event | None
) -> None:
    delay = max(0.0, when - loop.time())
    if wake is None:
        await asyncio.sleep(delay)
        return
    with contextlib.suppress(TimeoutError):  # not wait_for: it may swallow a cancellation (3.11)
        async with asyncio.timeout(delay):
            await wake.wait()
    wake.clear()


def _timeout_message(probe: Probe, seconds: float) -> str:
    if probe.exec is not None:
        command = " ".join(probe.exec.command or [])
        return f'command "{command}" timed out after {math.ceil(seconds)}s'
    return f"probe timed out after {math.ceil(seconds)}s"


def _port(port: int | str, container: Container) -> int:
    """A port number, or the container's port of that name (as the kubelet's `extractPort`)."""
    number: int | None = None
    if isinstance(port, int):
        number = port
    else:
        for named in container.ports or []:
            if named.name == port:
                number = named.containerPort
        if number is None and port.isdigit():
            number = int(port)
        if number is None:
            raise _ConfigError(f"port {port!r} not found in container {container.name}")
    if not 0 < number < 65536:
        raise _ConfigError(f"invalid port number: {number}")
    return number


def _name(pod: Pod) -> str:
    meta = pod.metadata
    return f"{meta.namespace}/{meta.name}" if meta is not None else "?"
