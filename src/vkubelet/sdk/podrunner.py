"""The kubelet's pod worker, for providers that run a pod's containers themselves.

A provider that starts processes (locally, in a VM, on a board) needs the same loop for every
pod: init containers one after the other, each until it succeeds; then the containers side by
side, each restarted as the pod's restart policy says with the kubelet's back-off; the pod's
status rebuilt at every change; and, on deletion, a signal to each running container, a grace
period, then a kill. `PodRunner` is that loop. The provider supplies two things: how to run one
container to its exit code, and how to signal a running one.

A container whose run takes a while to be really up (a VM booting, an image unpacked on a
device) can be reported `Waiting: ContainerCreating` until then: with `confirms_start`, a run
shows as running, and its probes start, only once the provider calls `confirm_start` (with the
moment it started, which a provider keeps across an agent restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from lightkube.models.core_v1 import (
    Container,
    EphemeralContainer,
    PodCondition,
    PodSpec,
    PodStatus,
)
from lightkube.resources.core_v1 import Pod

from .backoff import supervise_container
from .logs import previous_not_found, read_log, run_log_path
from .probes import PodProbes, ProbeEvent, ProbeTransport
from .provider import ContainerLogOptions, EventSink, ProviderError, ResolvedPod
from .status import ContainerReport, Running, Terminated, Waiting, build_pod_status
from .tasks import TaskSet

__all__ = ["PodRunner", "RunContainer", "RunnerProvider", "SignalContainer"]

log = logging.getLogger(__name__)

# Runs container `c` (its run number `n`, i.e. its restart count) to the end: the exit code, or
# -N for a signal N, or a `Terminated` when the provider names its own reason (say `Migrated`).
# An exception means the run could not start (the kubelet's StartError).
RunContainer = Callable[[Container, int], Awaitable[int | Terminated]]
# Sends a signal to container `name`'s current process; raises ProcessLookupError when there is
# none (not started yet, or already exited): the runner then tries again.
SignalContainer = Callable[[str, int], None]

_START_ERROR = 128  # what the kubelet reports for a container that could not start


class PodRunner:
    """One pod's containers, run and restarted as the kubelet would, and its status."""

    def __init__(
        self,
        pod: Pod,
        run: RunContainer,
        signal_container: SignalContainer,
        *,
        host_ip: str,
        pod_ips: Sequence[str] = (),
        on_change: Callable[[], None] = lambda: None,
        probe_transport: ProbeTransport | None = None,
        on_event: Callable[[ProbeEvent], None] | None = None,
        restart_counts: Mapping[str, int] | None = None,
        start_time: datetime | None = None,
        confirms_start: bool = False,
    ) -> None:
        """`probe_transport`: how the probe engine reaches the containers; with it, the pod's
        liveness, readiness and startup probes run (a liveness failure ends the run: SIGTERM,
        SIGKILL after the grace period, and the restart policy decides) and `on_event` gets
        their Events. `restart_counts`: where each container's runs start counting (a pod
        adopted after an agent restart keeps its restart counts). `start_time`: the pod's
        `status.startTime` (default: now; an adopted pod keeps its own). `confirms_start`: each
        run is `Waiting: ContainerCreating` until the provider calls `confirm_start`."""
        assert pod.metadata is not None and pod.spec is not None
        self.pod = pod
        self.reports: dict[str, ContainerReport] = {}
        self.probes: PodProbes | None = None
        if probe_transport is not None:
            self.probes = PodProbes(
                pod,
                probe_transport,
                self._end_run,
                host=(list(pod_ips) or [host_ip])[0],
                on_change=on_change,
                on_event=on_event,
            )
        self._run, self._signal = run, signal_container
        self._first_runs = dict(restart_counts or {})
        self._host_ip, self._pod_ips = host_ip, list(pod_ips)
        self._on_change = on_change
        self._stop = asyncio.Event()
        self._changed = asyncio.Event()  # set at every container state change
        self._signalled: set[tuple[str, int, int]] = set()  # (container, run, signal) sent
        self._started = start_time or datetime.now(UTC)
        self._confirms_start = confirms_start
        self._up: dict[str, tuple[int, datetime]] = {}  # container -> (run, started_at) confirmed
        self._status: PodStatus | None = None
        self._conditions: dict[str, PodCondition] = {}  # the provider's own, by type
        # Ephemeral containers (`kubectl debug`) as the provider reports them, by name.
        self._ephemeral: dict[str, tuple[EphemeralContainer, ContainerReport]] = {}
        self._tasks = TaskSet(f"pod {pod.metadata.namespace}/{pod.metadata.name}")
        self._life: asyncio.Task[None] | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Start the containers; the Pending status (containers being created) is pushed now."""
        self._on_change()
        self._life = self._tasks.spawn(self._pod_life(), name="containers")

    def restart_count(self, container: str) -> int:
        report = self.reports.get(container)
        return report.restart_count if report is not None else 0

    def running(self, container: str, run: int | None = None) -> bool:
        """Whether `container` runs (its run number `run`, if given)."""
        report = self.reports.get(container)
        if report is None or not isinstance(report.state, Running):
            return False
        return run is None or report.restart_count == run

    def up(self, container: str) -> bool:
        """Whether `container` runs and, with `confirms_start`, its current run was confirmed."""
        if not self.running(container):
            return False
        if not self._confirms_start:
            return True
        confirmed = self._up.get(container)
        return confirmed is not None and confirmed[0] == self.restart_count(container)

    def confirm_start(self, container: str, run: int, started_at: datetime | None = None) -> None:
        """Run `run` of `container` is really up (since `started_at`, default now): it is
        reported running and its probes start. A run that is no longer current is ignored."""
        if not self.running(container, run) or self.up(container):
            return
        self._up[container] = (run, started_at or datetime.now(UTC))
        self._sync_probes()
        self._changed.set()
        self._on_change()

    def set_condition(
        self, kind: str, status: str, reason: str | None = None, message: str | None = None
    ) -> None:
        """Report a pod condition of the provider's own (a custom type: a VM migration's
        progress, say) in the pod's status from now on; the status is pushed."""
        self._conditions[kind] = PodCondition(
            type=kind, status=status, reason=reason, message=message
        )
        self._on_change()

    def report_ephemeral(self, container: EphemeralContainer, report: ContainerReport) -> None:
        """The state of an ephemeral container the provider runs for this pod (`kubectl
        debug`): in the pod's spec and `ephemeralContainerStatuses` from now on; pushed."""
        self._ephemeral[container.name] = (container, report)
        self._on_change()

    def ephemeral(self, name: str) -> ContainerReport | None:
        """The last report of ephemeral container `name`, None if there is none."""
        found = self._ephemeral.get(name)
        return None if found is None else found[1]

    def _spec(self) -> PodSpec:
        spec = self.pod.spec
        assert spec is not None
        if not self._ephemeral:
            return spec
        debug = [container for container, _ in self._ephemeral.values()]
        return msgspec.structs.replace(spec, ephemeralContainers=debug)

    def finish(self) -> None:
        """No further runs: the current run's end is the pod's end, whatever the restart policy
        (its workload went elsewhere, say a VM migrated away). Nothing is signalled."""
        if not self._stop.is_set():
            self._stop.set()
            self._changed.set()
            self._on_change()

    def status(self) -> PodStatus:
        reports = {name: self._shown(name, report) for name, report in self.reports.items()}
        reports.update((name, report) for name, (_, report) in self._ephemeral.items())
        self._status = build_pod_status(
            self._spec(),
            reports,
            host_ip=self._host_ip,
            pod_ips=self._pod_ips,
            start_time=self._started,
            previous=self._status,
            terminating=self.stopping,
            extra_conditions=list(self._conditions.values()),
        )
        return self._status

    def _shown(self, name: str, report: ContainerReport) -> ContainerReport:
        if not self.running(name):
            return report
        if self._confirms_start:
            if not self.up(name):
                return replace(report, state=Waiting("ContainerCreating"))
            report = replace(report, state=Running(self._up[name][1]))
        if self.probes is not None:
            report = _with_probes(report, self.probes, name)
        return report

    def as_pod(self) -> Pod:
        """The pod with its current status, as `get_pod`/`list_pods`/`notify_pods` report it."""
        return Pod(metadata=self.pod.metadata, spec=self._spec(), status=self.status())

    async def stop(self, grace_period_seconds: int) -> None:
        """SIGTERM every running container, SIGKILL what is left after the grace period, and
        return once every container has exited. Calling it again just waits."""
        first = not self._stop.is_set()
        self._stop.set()
        self._changed.set()
        if first:
            self._signal_running(signal.SIGTERM)
            self._sync_probes()
            self._on_change()
        if self._life is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_period_seconds
        signum = signal.SIGTERM
        while not self._life.done():
            # Again and again: a run that was starting when the pod was stopped has its process
            # only now (each run is signalled once with each signal).
            left = deadline - loop.time()
            if left <= 0:
                signum = signal.SIGKILL
            await asyncio.wait({self._life}, timeout=min(max(left, 0.0), 0.5) or 0.5)
            self._signal_running(signum)
        if self.probes is not None:
            await self.probes.aclose()
        self._on_change()

    async def _end_run(self, container: str, grace_seconds: int, kind: str) -> None:
        """A failed liveness or startup probe: end the container's run as the kubelet kills a
        container (SIGTERM, SIGKILL after the grace period)."""
        run = self.restart_count(container)
        with contextlib.suppress(ProcessLookupError):
            self._signal(container, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_seconds
        while self.running(container, run) and (left := deadline - loop.time()) > 0:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        if self.running(container, run):
            with contextlib.suppress(ProcessLookupError):
                self._signal(container, signal.SIGKILL)

    def _sync_probes(self) -> None:
        """Probe workers follow the runs: a new run (restart count) gets fresh ones."""
        if self.probes is not None:
            running = {n: r.restart_count for n, r in self.reports.items() if self.up(n)}
            self.probes.sync(running, terminating=self.stopping)

    def _signal_running(self, signum: int) -> None:
        for name, report in list(self.reports.items()):
            sent = (name, report.restart_count, signum)
            if self.running(name) and sent not in self._signalled:
                with contextlib.suppress(ProcessLookupError):
                    self._signal(name, signum)
                    self._signalled.add(sent)

    async def _pod_life(self) -> None:
        spec = self.pod.spec
        assert spec is not None
        sidecars: list[asyncio.Task[bool]] = []
        try:
            for init in spec.initContainers or []:
                if init.restartPolicy == "Always":
                    # A sidecar: started in order, then it runs (and restarts) beside the
                    # containers; the next init container waits only for it to be running.
                    sidecar = self._container(init, init=False, policy="Always")
                    sidecars.append(asyncio.create_task(sidecar, name=f"sidecar {init.name}"))
                    await self._until(functools.partial(self._up_or_stopping, init.name))
                elif not await self._container(init, init=True):
                    return
            await asyncio.gather(
                *sidecars, *(self._container(c, init=False) for c in spec.containers)
            )
        finally:
            for task in sidecars:
                task.cancel()
            await asyncio.gather(*sidecars, return_exceptions=True)

    def _up_or_stopping(self, container: str) -> bool:
        return self.up(container) or self.stopping

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    async def _container(
        self, container: Container, *, init: bool, policy: str | None = None
    ) -> bool:
        meta, spec = self.pod.metadata, self.pod.spec
        assert meta is not None and spec is not None

        async def once(count: int) -> int | Terminated:
            if self._stop.is_set():  # deleted while waiting to start: this run never happens
                return -int(signal.SIGTERM)
            try:
                return await self._run(container, count)
            except Exception as e:  # the provider should also say why in the container's log
                log.warning(
                    "%s/%s: container %s did not start: %s",
                    meta.namespace,
                    meta.name,
                    container.name,
                    e,
                )
                return _START_ERROR

        def report(state: ContainerReport) -> None:
            self.reports[container.name] = state
            self._sync_probes()
            self._changed.set()
            self._on_change()

        names = (container.name, str(meta.name), str(meta.namespace), str(meta.uid))
        return await supervise_container(
            once,
            report,
            restart_policy=policy or spec.restartPolicy,
            stop=self._stop,
            names=names,
            init=init,
            first_run=self._first_runs.get(container.name, 0),
        )


def _with_probes(report: ContainerReport, probes: PodProbes, name: str) -> ContainerReport:
    return replace(report, ready=probes.ready(name), started=probes.started(name))


class RunnerProvider:
    """The provider API but `create_pod`, for a provider whose pods are `PodRunner`s.

    Bookkeeping every such provider would write again: the pods by key, status push
    (`notify_pods`), `get_pod`/`get_pod_status`/`list_pods` from the runners, graceful
    `delete_pod`, and `kubectl logs` (follow, tail, since, previous) from the CRI log files the
    provider writes at `log_path(...)`. A subclass implements `create_pod` with `start_runner`,
    and overrides `update_pod` if its pods can take changes in place.
    """

    def __init__(self, *, host_ip: str, log_dir: Path, events: EventSink | None = None) -> None:
        self.host_ip, self.log_dir, self.events = host_ip, log_dir, events
        self.runners: dict[str, PodRunner] = {}  # "namespace/name"
        self._notify: Callable[[Pod], None] = lambda pod: None
        self._stopping = TaskSet("stopping pods")

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        self._notify = callback

    def log_path(self, uid: str, container: str, run: int) -> Path:
        """Where run `run` of `container` of the pod with `uid` writes its CRI log."""
        return run_log_path(self.log_dir / uid, container, run)

    def start_runner(
        self,
        resolved: ResolvedPod,
        run: RunContainer,
        signal_container: SignalContainer,
        *,
        pod_ips: Sequence[str] = (),
        probe_transport: ProbeTransport | None = None,
        restart_counts: Mapping[str, int] | None = None,
        start_time: datetime | None = None,
        confirms_start: bool = False,
    ) -> PodRunner:
        key, pod, events = f"{resolved.namespace}/{resolved.name}", resolved.pod, self.events

        def on_event(e: ProbeEvent) -> None:
            if events is not None:
                events.pod_event(pod, e.type, e.reason, e.message)

        runner = PodRunner(
            pod,
            run,
            signal_container,
            host_ip=self.host_ip,
            pod_ips=pod_ips,
            on_change=lambda: self._notify(runner.as_pod()),
            probe_transport=probe_transport,
            on_event=on_event,
            restart_counts=restart_counts,
            start_time=start_time,
            confirms_start=confirms_start,
        )
        self.runners[key] = runner
        runner.start()
        return runner

    async def update_pod(self, pod: ResolvedPod) -> None:
        """Processes cannot take new env or files in place: the default keeps them as they are."""

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        meta = pod.metadata
        assert meta is not None
        key = f"{meta.namespace}/{meta.name}"
        runner = self.runners.get(key)
        if runner is None or runner.pod.metadata.uid != meta.uid:  # type: ignore[union-attr]
            return
        if not runner.stopping:  # stopping takes up to the grace period: not in the agent's worker
            self._stopping.spawn(self._stop(key, runner, grace_period_seconds), name=key)

    async def _stop(self, key: str, runner: PodRunner, grace_period_seconds: int) -> None:
        await runner.stop(grace_period_seconds)  # its last status: every container terminated
        if self.runners.get(key) is runner:
            del self.runners[key]
        shutil.rmtree(self.log_dir / str(runner.pod.metadata.uid), ignore_errors=True)  # type: ignore[union-attr]

    async def aclose(self) -> None:
        """The agent stops: these pods are processes of the agent's machine that a restarted
        agent could not adopt, so they are stopped (each with its grace period) rather than
        orphaned and started twice."""
        stops = []
        for key, runner in list(self.runners.items()):
            spec = runner.pod.spec
            grace = spec.terminationGracePeriodSeconds if spec else None
            stops.append(self._stop(key, runner, 30 if grace is None else grace))
        await asyncio.gather(*stops, return_exceptions=True)  # stopping ones: stop() just waits
        await self._stopping.aclose()

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        runner = self.runners.get(f"{namespace}/{name}")
        return runner.as_pod() if runner is not None else None

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        pod = await self.get_pod(namespace, name)
        return pod.status if pod is not None else None

    async def list_pods(self) -> list[Pod]:
        return [runner.as_pod() for runner in self.runners.values()]

    def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        runner = self.runners.get(f"{namespace}/{pod}")
        spec = runner.pod.spec if runner is not None else None
        names = [c.name for c in [*(spec.initContainers or []), *spec.containers]] if spec else []
        if runner is None or container not in names:
            raise ProviderError("NotFound", f"container {container} is not valid for pod {pod}")
        run = runner.restart_count(container) - options.previous
        if run < 0:
            raise previous_not_found(container, pod)
        path = self.log_path(str(runner.pod.metadata.uid), container, run)  # type: ignore[union-attr]
        return read_log(path, options, running=lambda: runner.running(container, run))
