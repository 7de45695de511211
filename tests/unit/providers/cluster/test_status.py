"""Status up: the lower kubelet's view mirrored, the lower scheduler's refusal visible, and a
lower pod lost behind our back ending the upper pod as Failed."""

from __future__ import annotations

from typing import Any

from vkubelet.providers.cluster import LOWER_POD_DELETED, gone_status, status_up, vanished_reason

NOW = "2026-11-24T06:00:00Z"
JSON = dict[str, Any]


def lower_running() -> JSON:
    return {
        "metadata": {"name": "web-1", "namespace": "shop"},
        "status": {
            "phase": "Running",
            "podIP": "10.244.1.7",
            "podIPs": [{"ip": "10.244.1.7"}],
            "hostIP": "192.168.5.3",
            "startTime": "2026-11-24T05:59:00Z",
            "qosClass": "Burstable",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
                {"type": "Initialized", "status": "True", "lastTransitionTime": "t1"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "t2"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "t2"},
            ],
            "containerStatuses": [
                {
                    "name": "app",
                    "ready": True,
                    "started": True,
                    "restartCount": 2,
                    "image": "web:1",
                    "imageID": "sha256:abc",
                    "containerID": "containerd://123",
                    "state": {"running": {"startedAt": "2026-11-24T05:59:30Z"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ],
        },
    }


def upper(**spec: Any) -> JSON:
    return {
        "metadata": {"name": "web-1", "namespace": "shop"},
        "spec": spec,
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "t-1"}],
        },
    }


def test_phase_ips_times_and_container_statuses_come_up_as_the_lower_kubelet_reports() -> None:
    lower = lower_running()
    status = status_up(lower, upper(), host_ip="10.0.0.9", now=NOW)
    for key in ("phase", "podIP", "podIPs", "startTime", "qosClass", "containerStatuses"):
        assert status[key] == lower["status"][key], key
    assert status["containerStatuses"][0]["restartCount"] == 2
    assert status["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 1
    assert (status["hostIP"], status["hostIPs"]) == ("10.0.0.9", [{"ip": "10.0.0.9"}])
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["PodScheduled"]["lastTransitionTime"] == "t-1"  # the upper scheduler's
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Initialized"]["lastTransitionTime"] == "t1"


def test_the_lower_schedulers_refusal_is_visible_on_the_upper_pod() -> None:
    lower = {
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient cpu.",
                }
            ],
        }
    }
    status = status_up(lower, upper(), host_ip="10.0.0.9", now=NOW)
    assert status["phase"] == "Pending"
    assert status["reason"] == "Unschedulable"
    assert status["message"] == "lower cluster: 0/3 nodes are available: 3 Insufficient cpu."
    scheduled = [c for c in status["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled == [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "t-1"}]


def test_readiness_gates_upstairs_hold_back_ready() -> None:
    pod = upper(readinessGates=[{"conditionType": "example.com/lb"}])
    status = status_up(lower_running(), pod, host_ip="10.0.0.9", now=NOW)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReadinessGatesNotReady")
    gate = {"type": "example.com/lb", "status": "True", "lastTransitionTime": "t9"}
    pod["status"]["conditions"].append(gate)
    status = status_up(lower_running(), pod, host_ip="10.0.0.9", now=NOW)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["example.com/lb"] == gate  # kept: its owner upstairs set it


def test_a_lower_pod_deleted_behind_our_back_fails_the_upper_pod_with_the_reason() -> None:
    lower = lower_running()
    reason, message = vanished_reason(lower)
    assert reason == LOWER_POD_DELETED
    assert "shop/web-1 was deleted there, not by vkubelet" in message
    running = {**upper(), "status": status_up(lower, upper(), host_ip="10.0.0.9", now=NOW)}
    status = gone_status(running, reason=reason, message=message, now=NOW)
    assert (status["phase"], status["reason"]) == ("Failed", LOWER_POD_DELETED)
    [app] = status["containerStatuses"]
    assert app["state"]["terminated"]["exitCode"] == 137
    assert app["state"]["terminated"]["reason"] == "ContainerStatusUnknown"
    assert app["state"]["terminated"]["startedAt"] == "2026-11-24T05:59:30Z"
    assert app["ready"] is False and app["restartCount"] == 2
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == conditions["ContainersReady"] == "False"


def test_an_eviction_below_is_named_as_such() -> None:
    evicted = lower_running()
    evicted["status"]["conditions"].append(
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting",
        }
    )
    reason, message = vanished_reason(evicted)
    assert reason == "EvictionByEvictionAPI"
    assert message == "lower cluster: shop/web-1: Eviction API: evicting"
    by_kubelet = {"metadata": {}, "status": {"reason": "Evicted", "message": "low on memory"}}
    assert vanished_reason(by_kubelet) == ("Evicted", "lower cluster: low on memory")
    assert vanished_reason(None)[0] == LOWER_POD_DELETED


def test_a_pod_that_already_ended_keeps_its_terminal_status() -> None:
    done = {"status": {"phase": "Succeeded", "reason": "Completed"}}
    assert gone_status(done, reason="x", message="y", now=NOW) == done["status"]
