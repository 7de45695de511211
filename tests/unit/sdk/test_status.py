"""The pod-status builder follows the kubelet's rules for phase, container flags and conditions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from lightkube.models.core_v1 import PodSpec, PodStatus
from lightkube.resources.core_v1 import Pod

from vkubelet.sdk.status import (
    ContainerReport,
    Running,
    Terminated,
    Waiting,
    build_pod_status,
    ephemeral_run_before,
)

T0 = datetime(2024, 5, 1, 10, 0, 0, tzinfo=UTC)


def spec(policy: str = "Always", inits: int = 0, mains: int = 1, **extra: Any) -> PodSpec:
    raw = {
        "restartPolicy": policy,
        "initContainers": [{"name": f"init{i}", "image": "busybox"} for i in range(inits)],
        "containers": [{"name": f"c{i}", "image": "busybox"} for i in range(mains)],
        **extra,
    }
    return msgspec.convert(raw, PodSpec)


def running(**kw: Any) -> ContainerReport:
    return ContainerReport(state=Running(T0), **kw)


def exited(code: int, **kw: Any) -> ContainerReport:
    return ContainerReport(state=Terminated(code, T0, T0 + timedelta(seconds=5)), **kw)


def build(s: PodSpec, reports: dict[str, ContainerReport], **kw: Any) -> PodStatus:
    kw.setdefault("now", T0)
    return build_pod_status(s, reports, host_ip="10.0.0.1", **kw)


def conditions(status: PodStatus) -> dict[str, str]:
    return {c.type: c.status for c in status.conditions or []}


def test_a_pod_whose_containers_are_not_created_is_pending_with_container_creating() -> None:
    status = build(spec(), {})
    assert status.phase == "Pending"
    [c] = status.containerStatuses or []
    assert c.state and c.state.waiting and c.state.waiting.reason == "ContainerCreating"
    assert not c.ready and not c.started and c.restartCount == 0
    assert conditions(status)["Ready"] == "False"


def test_a_running_pod_is_ready_with_all_conditions_true() -> None:
    status = build(spec(), {"c0": running()})
    assert status.phase == "Running"
    assert conditions(status) == {
        "PodScheduled": "True",
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    assert status.podIP == "10.0.0.1" and status.hostIP == "10.0.0.1"


def test_readiness_and_startup_probe_verdicts_make_a_container_unready() -> None:
    status = build(spec(mains=2), {"c0": running(ready=False), "c1": running(started=False)})
    c0, c1 = status.containerStatuses or []
    assert c0.started and not c0.ready
    assert not c1.started and not c1.ready  # not started means not ready, whatever readiness says
    ready = next(c for c in status.conditions or [] if c.type == "Ready")
    assert ready.status == "False" and ready.reason == "ContainersNotReady"
    assert ready.message == "containers with unready status: [c0 c1]"


def test_init_containers_keep_the_pod_pending_and_main_containers_initializing() -> None:
    status = build(spec(inits=2), {"init0": exited(0), "init1": running()})
    assert status.phase == "Pending"
    init0, init1 = status.initContainerStatuses or []
    assert init0.ready and not init1.ready  # a completed init container is ready
    [main] = status.containerStatuses or []
    assert main.state and main.state.waiting and main.state.waiting.reason == "PodInitializing"
    initialized = next(c for c in status.conditions or [] if c.type == "Initialized")
    assert initialized.status == "False" and initialized.reason == "ContainersNotInitialized"
    assert initialized.message == "containers with incomplete status: [init1]"


@pytest.mark.parametrize(
    ("policy", "phase"), [("Never", "Failed"), ("OnFailure", "Pending"), ("Always", "Pending")]
)
def test_a_failed_init_container_fails_the_pod_only_when_it_never_restarts(
    policy: str, phase: str
) -> None:
    assert build(spec(policy, inits=1), {"init0": exited(1)}).phase == phase


@pytest.mark.parametrize(
    ("policy", "codes", "phase"),
    [
        ("Always", [0], "Running"),  # restarting
        ("Always", [1], "Running"),
        ("OnFailure", [0, 0], "Succeeded"),
        ("OnFailure", [0, 1], "Running"),  # the failed one restarts
        ("Never", [0, 0], "Succeeded"),
        ("Never", [0, 2], "Failed"),
    ],
)
def test_exited_containers_give_the_phase_the_restart_policy_says(
    policy: str, codes: list[int], phase: str
) -> None:
    reports = {f"c{i}": exited(code) for i, code in enumerate(codes)}
    assert build(spec(policy, mains=len(codes)), reports).phase == phase


def test_a_pod_being_stopped_ends_succeeded_or_failed_whatever_its_policy() -> None:
    ok = build(spec("Always"), {"c0": exited(0)}, terminating=True)
    assert ok.phase == "Succeeded"
    killed = build(spec("Always"), {"c0": exited(137)}, terminating=True)
    assert killed.phase == "Failed"


def test_a_stopping_pod_reports_a_container_in_back_off_with_its_last_run() -> None:
    last = Terminated(0, T0, T0 + timedelta(seconds=1))
    report = ContainerReport(
        state=Waiting("CrashLoopBackOff"), restart_count=1, last_terminated=last
    )
    status = build(spec("Always"), {"c0": report}, terminating=True)
    [c] = status.containerStatuses or []
    assert c.state and c.state.terminated and c.state.terminated.exitCode == 0
    assert status.phase == "Succeeded"


def test_a_pod_stopped_during_its_init_containers_fails() -> None:
    assert build(spec("Always", inits=1), {"init0": running()}).phase == "Pending"
    stopped = build(spec("Always", inits=1), {"init0": exited(143)}, terminating=True)
    assert stopped.phase == "Failed"


def test_a_stopping_pod_reports_a_container_that_never_ran_as_the_kubelet_does() -> None:
    status = build(spec(mains=2), {"c0": exited(0)}, terminating=True)
    never = (status.containerStatuses or [])[1].state
    assert never and never.terminated
    assert (never.terminated.exitCode, never.terminated.reason) == (137, "ContainerStatusUnknown")
    assert status.phase == "Failed"


def test_a_container_waiting_to_restart_keeps_the_pod_running_and_shows_its_last_state() -> None:
    last = Terminated(3, T0, T0 + timedelta(seconds=1))
    waiting = Waiting("CrashLoopBackOff", "back-off 10s restarting failed container=c0 pod=p")
    report = ContainerReport(state=waiting, restart_count=2, last_terminated=last)
    status = build(spec("Always"), {"c0": report})
    assert status.phase == "Running"
    [c] = status.containerStatuses or []
    assert c.restartCount == 2
    assert c.state and c.state.waiting and c.state.waiting.reason == "CrashLoopBackOff"
    assert c.lastState and c.lastState.terminated
    assert c.lastState.terminated.exitCode == 3 and c.lastState.terminated.reason == "Error"


def test_terminated_reasons_default_to_the_runtime_s() -> None:
    status = build(spec("Never", mains=2), {"c0": exited(0), "c1": exited(1)})
    reasons = [c.state.terminated.reason for c in status.containerStatuses or []]  # type: ignore[union-attr]
    assert reasons == ["Completed", "Error"]


def test_a_succeeded_pod_is_not_ready_because_it_completed() -> None:
    status = build(spec("Never"), {"c0": exited(0)})
    ready = next(c for c in status.conditions or [] if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", "PodCompleted")


def test_a_terminal_phase_never_changes_back() -> None:
    done = build(spec("OnFailure"), {"c0": exited(0)})
    assert done.phase == "Succeeded"
    again = build(spec("OnFailure"), {"c0": running()}, previous=done)
    assert again.phase == "Succeeded"


def test_transition_times_move_only_when_a_condition_changes() -> None:
    later = T0 + timedelta(minutes=1)
    first = build(spec(), {"c0": running(ready=False)}, now=T0)
    second = build(spec(), {"c0": running()}, previous=first, now=later)
    times = {c.type: c.lastTransitionTime for c in second.conditions or []}
    assert times["PodScheduled"] == T0 and times["Initialized"] == T0
    assert times["Ready"] == later and times["ContainersReady"] == later
    third = build(spec(), {"c0": running()}, previous=second, now=later + timedelta(minutes=1))
    assert third.conditions == second.conditions


def test_pod_scheduled_dates_from_the_start_when_nothing_older_is_known() -> None:
    status = build(spec(), {}, start_time=T0, now=T0 + timedelta(minutes=5))
    times = {c.type: c.lastTransitionTime for c in status.conditions or []}
    assert times["PodScheduled"] == T0 and times["Ready"] == T0 + timedelta(minutes=5)


def test_times_are_whole_seconds_as_the_api_stores_them() -> None:
    moment = T0 + timedelta(microseconds=123456)
    status = build(spec(), {"c0": ContainerReport(state=Running(moment))}, now=moment)
    [c] = status.containerStatuses or []
    assert c.state and c.state.running and c.state.running.startedAt == T0
    assert all(cond.lastTransitionTime == T0 for cond in status.conditions or [])


def test_readiness_gates_hold_ready_until_their_condition_is_true() -> None:
    gated = spec(readinessGates=[{"conditionType": "example.com/lb"}])
    status = build(gated, {"c0": running()})
    assert conditions(status)["ContainersReady"] == "True"
    assert conditions(status)["Ready"] == "False"
    api = msgspec.convert({"conditions": [{"type": "example.com/lb", "status": "True"}]}, PodStatus)
    assert conditions(build(gated, {"c0": running()}, previous=api))["Ready"] == "True"


def test_a_sidecar_counts_as_initialized_once_started_and_its_readiness_counts() -> None:
    s = msgspec.convert(
        {
            "initContainers": [{"name": "side", "image": "x", "restartPolicy": "Always"}],
            "containers": [{"name": "c0", "image": "x"}],
        },
        PodSpec,
    )
    assert build(s, {"side": running(started=False)}).phase == "Pending"
    status = build(s, {"side": running(ready=False), "c0": running()})
    assert status.phase == "Running"
    assert conditions(status)["Initialized"] == "True"
    assert conditions(status)["Ready"] == "False"


def test_pod_ips_default_to_the_host_ip_and_the_pod_reason_is_passed_on() -> None:
    status = build(spec(), {}, pod_ips=["10.244.0.5", "fd00::5"], reason="X", message="why")
    assert status.podIP == "10.244.0.5"
    assert [ip.ip for ip in status.podIPs or []] == ["10.244.0.5", "fd00::5"]
    assert (status.reason, status.message) == ("X", "why")
    assert build(spec(), {}).podIPs[0].ip == "10.0.0.1"  # type: ignore[index]


def test_ephemeral_containers_are_reported_never_ready_and_leave_the_pod_alone() -> None:
    debugged = spec(ephemeralContainers=[{"name": "dbg", "image": "busybox"}, {"name": "new"}])
    status = build_pod_status(
        debugged, {"c0": running(), "dbg": exited(3)}, host_ip="10.0.0.1", now=T0
    )
    assert status.phase == "Running"
    assert {c.type: c.status for c in status.conditions or []}["Ready"] == "True"
    ephemeral = {s.name: s for s in status.ephemeralContainerStatuses or []}
    assert ephemeral["dbg"].state.terminated.exitCode == 3  # type: ignore[union-attr]
    assert ephemeral["new"].state.waiting.reason == "ContainerCreating"  # type: ignore[union-attr]
    assert not any(s.ready for s in ephemeral.values())
    stopping = build_pod_status(
        debugged, {"c0": exited(0), "dbg": exited(3)}, host_ip="10.0.0.1", terminating=True
    )
    assert stopping.ephemeralContainerStatuses[0].state.terminated is not None  # type: ignore[index,union-attr]


def test_an_ephemeral_container_shown_started_is_reported_as_shown_or_lost_never_run_again() -> (
    None
):
    def shown(state: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": "dbg",
            "image": "busybox",
            "ready": False,
            "restartCount": 0,
            "imageID": "",
            "containerID": "ssh://u/dbg",
            "state": state,
        }

    def pod(*statuses: dict[str, Any]) -> Pod:
        return msgspec.convert({"status": {"ephemeralContainerStatuses": list(statuses)}}, Pod)

    ended = {
        "terminated": {
            "exitCode": 3,
            "startedAt": "2024-05-01T10:00:00Z",
            "finishedAt": "2024-05-01T10:00:05Z",
            "reason": "Error",
        }
    }
    report = ephemeral_run_before(pod(shown(ended)), "dbg")
    assert report == ContainerReport(
        state=Terminated(3, T0, T0 + timedelta(seconds=5), reason="Error"),
        container_id="ssh://u/dbg",
    )
    report = ephemeral_run_before(
        pod(shown({"running": {"startedAt": "2024-05-01T10:00:00Z"}})), "dbg"
    )
    assert report is not None and isinstance(report.state, Terminated)
    assert (report.state.exit_code, report.state.reason) == (137, "ContainerStatusUnknown")
    refused = shown({"waiting": {"reason": "ImageNotSupported"}})
    assert ephemeral_run_before(pod(refused), "dbg") is None
    assert ephemeral_run_before(pod(), "dbg") is None
    assert ephemeral_run_before(Pod(), "dbg") is None
