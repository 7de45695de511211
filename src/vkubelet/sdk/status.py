"""A pod's status as the kubelet reports it, built from what a provider knows of its containers.

Every provider knows its containers' states (waiting, running, terminated), their restart counts
and their probe results; none should have to re-derive from them the kubelet's rules for the
rest: the phase by restart policy, ready/started flags, the four pod conditions and when they
last changed. `build_pod_status` is that derivation, pure and deterministic (the time is an
input), so a provider calls it whenever something changed and reports the result.

The rules follow the kubelet (pkg/kubelet/kubelet_pods.go `getPhase`, pkg/kubelet/status
`Generate*Condition`):

- Phase: `Failed` when an init container failed and the pod never restarts; `Pending` while init
  containers have not all completed or any container waits for its first start; `Running` while a
  container runs; once none runs, `Always` stays `Running` (they restart), all exit codes 0 is
  `Succeeded`, `Never` is `Failed` and `OnFailure` is `Running` (a failed one restarts). A pod
  being stopped (`terminating`) restarts nothing: a container waiting to restart is reported
  with its last run, and all-zero is `Succeeded`, anything else `Failed`. A terminal phase
  never changes back (the apiserver would refuse it).
- A container is `started` once running and past its startup probe, `ready` once started and
  passing its readiness probe; a completed init container is ready.
- Conditions: `PodScheduled`, `PodReadyToStartContainers`, `Initialized`, `ContainersReady` and
  `Ready` (which also needs the pod's readiness gates), with the kubelet's reasons and messages;
  `lastTransitionTime` moves only when a condition's status changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from lightkube.models.core_v1 import (
    ContainerState,
    ContainerStateRunning,
    ContainerStateTerminated,
    ContainerStateWaiting,
    ContainerStatus,
    HostIP,
    PodCondition,
    PodIP,
    PodSpec,
    PodStatus,
)
from lightkube.resources.core_v1 import Pod

__all__ = [
    "ContainerReport",
    "Running",
    "Terminated",
    "Waiting",
    "build_pod_status",
    "ephemeral_run_before",
    "phase_of",
]

TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Waiting:
    """Not running: not started yet (`ContainerCreating`), or between runs (`CrashLoopBackOff`)."""

    reason: str = "ContainerCreating"
    message: str = ""


@dataclass(frozen=True)
class Running:
    started_at: datetime


@dataclass(frozen=True)
class Terminated:
    """A run that ended. `reason` defaults to the runtime's: `Completed` for 0, `Error` else."""

    exit_code: int
    started_at: datetime | None = None
    finished_at: datetime | None = None
    reason: str = ""
    message: str = ""

    @property
    def succeeded(self) -> bool:
        return self.exit_code == 0


State = Waiting | Running | Terminated

_NEVER_RAN = Terminated(
    137,
    reason="ContainerStatusUnknown",
    message="The container could not be located when the pod was terminated",
)


@dataclass(frozen=True)
class ContainerReport:
    """What a provider knows of one container (init containers included).

    `ready` and `started` are the probe engine's verdicts for the current run (True when the
    container has no readiness or startup probe); they count only while the container runs.
    """

    state: State = Waiting()
    restart_count: int = 0
    last_terminated: Terminated | None = None
    ready: bool = True
    started: bool = True
    container_id: str | None = None
    image_id: str = ""


def _second(moment: datetime | None) -> datetime | None:
    """The API keeps whole seconds: report what it will store, so equal statuses compare equal."""
    if moment is None:
        return None
    moment = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).replace(microsecond=0)


def _api_state(state: State | None) -> ContainerState:
    match state:
        case Running(started_at):
            return ContainerState(running=ContainerStateRunning(startedAt=_second(started_at)))
        case Terminated() as t:
            return ContainerState(
                terminated=ContainerStateTerminated(
                    exitCode=t.exit_code,
                    reason=t.reason or ("Completed" if t.succeeded else "Error"),
                    message=t.message or None,
                    startedAt=_second(t.started_at),
                    finishedAt=_second(t.finished_at),
                )
            )
        case Waiting(reason, message):
            return ContainerState(
                waiting=ContainerStateWaiting(reason=reason, message=message or None)
            )
    return ContainerState()


def ephemeral_run_before(
    pod: Pod,
    name: str,
    *,
    lost: str = "the agent that ran it restarted, and it was not found again",
) -> ContainerReport | None:
    """Ephemeral container `name` (`kubectl debug`) as the pod's status shows it started, by an
    agent that has restarted since (it is handed again): what to report instead of running it a
    second time. Its termination as the API has it; one shown running is lost to this agent:
    terminated, `ContainerStatusUnknown` (137), as a kubelet reports a container it lost, with
    the message `lost`. None if it never started (a new one, or one that was refused)."""
    statuses = (pod.status.ephemeralContainerStatuses if pod.status else None) or []
    found = [status for status in statuses if status.name == name]
    state = found[0].state if found else None
    if state is None or (state.running is None and state.terminated is None):
        return None
    if state.terminated is not None:
        ended = state.terminated
        return ContainerReport(
            state=Terminated(
                ended.exitCode,
                ended.startedAt,
                ended.finishedAt,
                reason=ended.reason or "",
                message=ended.message or "",
            ),
            container_id=found[0].containerID,
        )
    started = state.running.startedAt if state.running is not None else None
    gone = Terminated(
        137, started, datetime.now(UTC), reason="ContainerStatusUnknown", message=lost
    )
    return ContainerReport(state=gone, container_id=found[0].containerID)


def _is_sidecar(container: object) -> bool:
    """An init container with `restartPolicy: Always` runs beside the main containers."""
    return getattr(container, "restartPolicy", None) == "Always"


def phase_of(
    spec: PodSpec, reports: Mapping[str, ContainerReport], *, terminating: bool = False
) -> str:
    """The pod's phase from its containers' states, as the kubelet's `getPhase` decides it."""
    policy = spec.restartPolicy or "Always"
    pending_init = failed_init = 0
    for container in spec.initContainers or []:
        report = reports.get(container.name)
        state = report.state if report else None
        if _is_sidecar(container):
            if not (isinstance(state, Running) and report and report.started):
                pending_init += 1
        elif isinstance(state, Terminated):
            if state.succeeded:
                continue
            failed_init += 1
        elif (
            isinstance(state, Waiting)
            and report
            and report.last_terminated
            and not report.last_terminated.succeeded
        ):
            failed_init += 1
        else:
            pending_init += 1
    if failed_init and (policy == "Never" or terminating):
        return "Failed"
    if pending_init or failed_init:
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for container in spec.containers:
        report = reports.get(container.name)
        state = report.state if report else Waiting()
        if isinstance(state, Running):
            running += 1
        elif isinstance(state, Terminated):
            stopped += 1
            succeeded += state.succeeded
        elif report and report.last_terminated is not None:
            stopped += 1  # waiting to restart
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if not stopped:
        return "Pending"
    if terminating:  # nothing restarts any more
        return "Succeeded" if stopped == succeeded else "Failed"
    if policy == "Always":
        return "Running"
    if stopped == succeeded:
        return "Succeeded"
    return "Failed" if policy == "Never" else "Running"


def _container_status(
    container: object,
    report: ContainerReport | None,
    default_wait: str,
    *,
    init: bool,
) -> ContainerStatus:
    name: str = getattr(container, "name")  # noqa: B009 - Container and the spec's types alike
    image: str = getattr(container, "image", None) or ""
    if report is None:
        report = ContainerReport(state=Waiting(default_wait))
    state = report.state
    running = isinstance(state, Running)
    started = running and report.started
    if init and not _is_sidecar(container):
        ready = isinstance(state, Terminated) and state.succeeded
    else:
        ready = started and report.ready
    return ContainerStatus(
        name=name,
        image=image,
        imageID=report.image_id,
        containerID=report.container_id,
        ready=ready,
        started=started,
        restartCount=report.restart_count,
        state=_api_state(state),
        lastState=_api_state(report.last_terminated),
    )


def _final(report: ContainerReport) -> ContainerReport:
    """A stopping pod starts nothing: a container waiting to restart ends with its last run, one
    that never ran as the kubelet reports it (137, `ContainerStatusUnknown`)."""
    if not isinstance(report.state, Waiting):
        return report
    if report.last_terminated is None:
        return replace(report, state=_NEVER_RAN)
    return replace(report, state=report.last_terminated, last_terminated=None)


def _names(statuses: Sequence[str]) -> str:
    return "[" + " ".join(statuses) + "]"


def build_pod_status(
    spec: PodSpec,
    reports: Mapping[str, ContainerReport],
    *,
    host_ip: str,
    pod_ips: Sequence[str] = (),
    start_time: datetime | None = None,
    previous: PodStatus | None = None,
    now: datetime | None = None,
    terminating: bool = False,
    sandbox_ready: bool = True,
    reason: str | None = None,
    message: str | None = None,
    extra_conditions: Sequence[PodCondition] = (),
) -> PodStatus:
    """The status the kubelet would report for a pod with `spec` whose containers (init and main,
    by name) are as `reports` says; a container without a report has not been created yet.
    Ephemeral containers of `spec` (reported by name too) get `ephemeralContainerStatuses`.

    `previous` is the status built last time (or the API's): its conditions' transition times
    are kept where their status did not change, and a terminal phase is kept. `pod_ips` defaults
    to `[host_ip]` (as for `hostNetwork`). `terminating`: the pod is being stopped, so exited
    containers will not restart. `reason`/`message` set the pod's own (say `DeadlineExceeded`).
    `extra_conditions`: the provider's own pod conditions (custom types, say a VM migration's
    progress), appended; their transition time is kept while their status does not change.
    """
    now = _second(now or datetime.now(UTC))
    inits = spec.initContainers or []
    if terminating:
        names = [c.name for c in [*inits, *spec.containers]]
        ended = {name: _final(reports.get(name) or ContainerReport()) for name in names}
        reports = {**reports, **ended}  # ephemeral containers' as reported
    phase = phase_of(spec, reports, terminating=terminating)
    if previous is not None and previous.phase in TERMINAL_PHASES:
        phase = previous.phase

    init_statuses = [
        _container_status(c, reports.get(c.name), "PodInitializing", init=True) for c in inits
    ]
    incomplete = [
        s.name
        for c, s in zip(inits, init_statuses, strict=True)
        if not (s.ready if not _is_sidecar(c) else s.started)
    ]
    main_wait = "PodInitializing" if incomplete else "ContainerCreating"
    statuses = [
        _container_status(c, reports.get(c.name), main_wait, init=False) for c in spec.containers
    ]
    sidecars = [s for c, s in zip(inits, init_statuses, strict=True) if _is_sidecar(c)]
    unready = [s.name for s in [*sidecars, *statuses] if not s.ready]

    old = {c.type: c for c in (previous.conditions or [])} if previous else {}

    def condition(kind: str, ok: bool, why: str | None = None, text: str | None = None) -> None:
        status = "True" if ok else "False"
        before = old.get(kind)
        since = before.lastTransitionTime if before and before.status == status else None
        if before is None and kind == "PodScheduled":  # it was scheduled before it started
            since = _second(start_time)
        conditions.append(
            PodCondition(
                type=kind,
                status=status,
                lastTransitionTime=since or now,
                reason=None if ok else why,
                message=None if ok or not text else text,
            )
        )

    conditions: list[PodCondition] = []
    condition("PodScheduled", True)
    condition("PodReadyToStartContainers", sandbox_ready)
    condition(
        "Initialized",
        not incomplete,
        "ContainersNotInitialized",
        f"containers with incomplete status: {_names(incomplete)}",
    )
    if phase == "Succeeded":
        not_ready = ("PodCompleted", "")
    else:
        not_ready = ("ContainersNotReady", f"containers with unready status: {_names(unready)}")
    containers_ready = not unready and phase != "Succeeded"
    condition("ContainersReady", containers_ready, *not_ready)
    gates = [g.conditionType for g in spec.readinessGates or []]
    missing = [g for g in gates if not (g in old and old[g].status == "True")]
    if containers_ready and missing:
        text = f'corresponding condition of pod readiness gate "{missing[0]}" is not True'
        condition("Ready", False, "ReadinessGatesNotReady", text)
    else:
        condition("Ready", containers_ready, *not_ready)
    for extra in extra_conditions:
        before = old.get(extra.type)
        kept = before.lastTransitionTime if before and before.status == extra.status else None
        conditions.append(
            PodCondition(
                type=extra.type,
                status=extra.status,
                lastTransitionTime=kept or extra.lastTransitionTime or now,
                reason=extra.reason,
                message=extra.message,
            )
        )

    ips = list(pod_ips) or [host_ip]
    status = PodStatus(
        phase=phase,
        reason=reason,
        message=message,
        hostIP=host_ip,
        hostIPs=[HostIP(ip=host_ip)],
        podIP=ips[0],
        podIPs=[PodIP(ip=ip) for ip in ips],
        startTime=_second(start_time),
        conditions=conditions,
        containerStatuses=statuses,
    )
    if init_statuses:
        status.initContainerStatuses = init_statuses
    if spec.ephemeralContainers:
        # `kubectl debug` waits for its container to run; ephemeral containers count for
        # neither the phase nor readiness, and are never ready (as the kubelet reports them).
        status.ephemeralContainerStatuses = [
            _never_ready(_container_status(c, reports.get(c.name), "ContainerCreating", init=False))
            for c in spec.ephemeralContainers
        ]
    return status


def _never_ready(status: ContainerStatus) -> ContainerStatus:
    status.ready = False
    return status
