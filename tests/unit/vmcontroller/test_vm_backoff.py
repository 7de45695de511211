"""A VM whose pod fails is powered on again after the kubelet's back-off, not in a tight loop
(issue 13: 855 pods in 4 minutes for `image: tiny`). Times are arguments: nothing waits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from vkubelet.sdk.backoff import INITIAL_SECONDS, MAX_SECONDS, RESET_SECONDS
from vkubelet.vmcontroller._powerbackoff import delay_for, failure_of
from vkubelet.vmcontroller._vm import Decision, decide

from .fakes import pod, vm

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
MESSAGE = (
    "spec.containers[0].image: 'tiny' is not a VM image (this node runs vm.vkubelet.io/<name>)"
)


def refused(name: str = "db-aaaaa", created: datetime = T0) -> dict[str, Any]:
    """A pod the vm provider refused for good, as the pod controller writes it."""
    p = pod(name, running=False, phase="Failed", created=created.strftime("%Y-%m-%dT%H:%M:%SZ"))
    p["status"] = {"phase": "Failed", "reason": "UnsupportedImage", "message": MESSAGE}
    return p


def after(machine: dict[str, Any], decision: Decision) -> dict[str, Any]:
    """The VM as the next pass reads it: with the status this decision wrote."""
    return {**machine, "status": decision.status}


def ready(decision: Decision) -> dict[str, Any]:
    return next(c for c in decision.status["conditions"] if c["type"] == "Ready")


def test_the_back_off_is_the_kubelet_s_10s_doubling_to_5_minutes() -> None:
    delays = [delay_for(n).total_seconds() for n in range(1, 9)]
    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]
    assert (INITIAL_SECONDS, MAX_SECONDS) == (10, 300)
    assert delay_for(10_000).total_seconds() == MAX_SECONDS


def test_a_failed_pod_is_kept_and_nothing_created_until_the_back_off_passed() -> None:
    first = decide(vm(), [refused()], now=T0)
    assert first.create is None and first.delete == [] and not first.power_off
    assert first.requeue == 10
    status = first.status
    assert status["phase"] == "Failed" and status["restarts"] == 1
    assert status["nextStartAfter"] == "2026-01-01T12:00:10Z"
    assert status["lastFailure"]["podName"] == "db-aaaaa"
    # Level-triggered: every pass inside the window does nothing but wait for the rest.
    for seconds in (1, 5, 9.5):
        waiting = decide(after(vm(), first), [refused()], now=T0 + timedelta(seconds=seconds))
        assert waiting.create is None and waiting.delete == []
        assert waiting.event is None  # one BackOff event per restart, not per pass
        assert waiting.requeue is not None and waiting.requeue <= 10 - seconds + 0.5
        assert waiting.status["restarts"] == 1
    due = decide(after(vm(), first), [refused()], now=T0 + timedelta(seconds=10))
    assert due.delete == ["db-aaaaa"] and due.create is None  # replaced once it is gone
    gone = decide(after(vm(), due), [], now=T0 + timedelta(seconds=11))
    assert gone.create is not None


def test_the_ready_condition_and_the_event_carry_the_failed_pod_s_reason_and_message() -> None:
    decision = decide(vm(), [refused()], now=T0)
    condition = ready(decision)
    assert condition["status"] == "False"
    assert (condition["reason"], condition["message"]) == ("UnsupportedImage", MESSAGE)
    assert decision.event is not None
    kind, reason, message = decision.event
    assert (kind, reason) == ("Warning", "BackOff")
    assert message.startswith("back-off 10s powering on VirtualMachine db")
    # Still said once the pod is gone (deleted by hand while the VM waits).
    later = decide(after(vm(), decision), [], now=T0 + timedelta(seconds=3))
    assert later.create is None
    assert (ready(later)["reason"], ready(later)["message"]) == ("UnsupportedImage", MESSAGE)


def test_each_quick_failure_doubles_the_wait() -> None:
    machine, now, waits = vm(), T0, []
    for n in range(1, 8):
        decision = decide(machine, [refused(f"db-{n}", now)], now=now)
        assert decision.event is not None
        waits.append(decision.event[2].split()[1])
        machine = after(machine, decision)
        now += timedelta(seconds=(decision.requeue or 0) + 1)
    assert waits == ["10s", "20s", "40s", "1m20s", "2m40s", "5m0s", "5m0s"]
    assert machine["status"]["restarts"] == 7


def test_a_pod_that_ran_10_minutes_starts_the_back_off_from_the_bottom() -> None:
    machine = vm()
    machine["status"] = {
        "restarts": 6,
        "lastFailure": {"podName": "db-old", "reason": "Error", "observedGeneration": 3},
    }
    started = T0 - timedelta(seconds=RESET_SECONDS)
    decision = decide(machine, [refused("db-new", started)], now=T0)
    assert decision.status["restarts"] == 1 and decision.requeue == 10
    short = decide(machine, [refused("db-new", T0 - timedelta(seconds=60))], now=T0)
    assert short.status["restarts"] == 7 and short.requeue == MAX_SECONDS


def test_a_restarted_controller_goes_on_waiting_and_does_not_recreate_at_once() -> None:
    """The state is the VM's status: a fresh decide() from it (no memory) still waits."""
    machine = vm()
    machine["status"] = {
        "phase": "Failed",
        "restarts": 3,
        "lastFailure": {
            "podName": "db-aaaaa",
            "reason": "UnsupportedImage",
            "message": MESSAGE,
            "time": "2026-01-01T12:00:00Z",
            "observedGeneration": 3,
        },
        "nextStartAfter": "2026-01-01T12:00:40Z",
    }
    for pods in ([refused()], []):  # the failed pod still there, or already deleted
        decision = decide(machine, pods, now=T0 + timedelta(seconds=15))
        assert decision.create is None and decision.delete == []
        assert decision.requeue == 25 and decision.event is None
        assert decision.status["phase"] == "Failed" and decision.status["restarts"] == 3


def test_a_spec_change_resets_the_back_off_and_powers_on_at_once() -> None:
    waiting = after(vm(), decide(vm(), [refused()], now=T0))
    fixed = {**waiting, "metadata": {**waiting["metadata"], "generation": 4}}
    decision = decide(fixed, [refused()], now=T0 + timedelta(seconds=1))
    assert decision.delete == ["db-aaaaa"] and decision.event is None
    assert decision.status["restarts"] == 0 and decision.status["nextStartAfter"] is None
    gone = decide(after(fixed, decision), [], now=T0 + timedelta(seconds=2))
    assert gone.create is not None and gone.status["phase"] == "Starting"


def test_scale_to_zero_while_backing_off_is_stopped_and_creates_nothing() -> None:
    waiting = after(vm(), decide(vm(), [refused()], now=T0))
    off = {**vm(replicas=0), "status": waiting["status"]}
    decision = decide(off, [refused()], now=T0 + timedelta(seconds=1))
    assert decision.delete == ["db-aaaaa"] and decision.create is None
    stopped = decide(after(off, decision), [], now=T0 + timedelta(seconds=2))
    assert stopped.create is None and stopped.status["phase"] == "Stopped"
    assert stopped.status["nextStartAfter"] is None and stopped.status["restarts"] == 0


def test_a_running_pod_is_not_held_back_by_an_old_failure() -> None:
    waiting = after(vm(), decide(vm(), [refused()], now=T0))
    decision = decide(waiting, [pod("db-bbbbb")], now=T0 + timedelta(seconds=1))
    assert decision.status["phase"] == "Running" and ready(decision)["status"] == "True"
    assert decision.create is None and decision.event is None


def test_a_pod_that_crashed_gives_its_container_s_termination() -> None:
    crashed = pod(running=False, phase="Failed")
    crashed["status"]["containerStatuses"][0]["state"] = {
        "terminated": {"exitCode": 1, "reason": "Error", "message": "qemu: could not open disk"}
    }
    assert failure_of(crashed) == ("Error", "qemu: could not open disk")
    assert failure_of(refused()) == ("UnsupportedImage", MESSAGE)
