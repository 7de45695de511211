"""Lower pod status -> upper pod status, and the verdict on a lower pod that vanished.

Pure. The lower kubelet already applies the kubelet's status rules (phase by restart policy,
restart counts, last state), so the upper status mirrors it, with three exceptions:
- `PodScheduled` upstairs belongs to the upper scheduler (the pod *is* bound to the virtual
  node); a lower scheduler's refusal shows as the pod's `reason`/`message` instead, which
  `kubectl get pods` prints in its STATUS column;
- `hostIP` is the virtual node's address, since the upper cluster has no lower node;
- readiness gates live upstairs only (see `_translate`), so `Ready` is the lower Ready AND the
  gates' conditions, as the kubelet computes it.

A lower pod deleted, evicted or lost behind the provider's back makes the upper pod Failed with
a reason saying so, so its controller replaces it; it never stays a zombie Running.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["LOWER_POD_DELETED", "LOWER_PREFIX", "gone_status", "status_up", "vanished_reason"]

JSON = dict[str, Any]

LOWER_POD_DELETED = "LowerPodDeleted"
LOWER_PREFIX = "lower cluster: "
_COPIED = (
    "phase",
    "podIP",
    "podIPs",
    "startTime",
    "initContainerStatuses",
    "containerStatuses",
    "ephemeralContainerStatuses",
    "qosClass",
    "reason",
    "message",
)
_TERMINAL = {"Succeeded", "Failed"}


def status_up(
    lower: Mapping[str, Any], upper: Mapping[str, Any], *, host_ip: str, now: str
) -> JSON:
    """The upper pod's status for the lower pod `lower`; `upper` is the upper pod as it is."""
    lower_status = lower.get("status") or {}
    upper_status = upper.get("status") or {}
    out: JSON = {k: copy_of(lower_status[k]) for k in _COPIED if k in lower_status}
    out.setdefault("phase", "Pending")
    out["hostIP"] = host_ip
    out["hostIPs"] = [{"ip": host_ip}]
    lower_conditions = {c["type"]: c for c in lower_status.get("conditions") or [] if "type" in c}
    upper_conditions = {c["type"]: c for c in upper_status.get("conditions") or [] if "type" in c}
    gates = [g["conditionType"] for g in (upper.get("spec") or {}).get("readinessGates") or []]
    conditions: list[JSON] = []
    conditions.append(
        upper_conditions.get("PodScheduled")
        or {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}
    )
    for kind, condition in lower_conditions.items():
        if kind in ("PodScheduled", "Ready") or kind in gates:
            continue
        conditions.append(dict(condition))
    conditions.append(_ready(lower_conditions.get("Ready"), upper_conditions, gates, now))
    conditions.extend(dict(upper_conditions[g]) for g in gates if g in upper_conditions)
    out["conditions"] = conditions
    scheduled = lower_conditions.get("PodScheduled")
    if (
        out["phase"] == "Pending"
        and scheduled is not None
        and scheduled.get("status") == "False"
        and "reason" not in lower_status
    ):
        out["reason"] = scheduled.get("reason") or "Unschedulable"
        out["message"] = LOWER_PREFIX + str(scheduled.get("message") or "not scheduled yet")
    elif "message" in out and not str(out["message"]).startswith(LOWER_PREFIX):
        out["message"] = LOWER_PREFIX + str(out["message"])
    return out


def _ready(
    lower: Mapping[str, Any] | None,
    upper_conditions: Mapping[str, Mapping[str, Any]],
    gates: list[str],
    now: str,
) -> JSON:
    ready: JSON = (
        dict(lower) if lower else {"type": "Ready", "status": "False", "lastTransitionTime": now}
    )
    if ready.get("status") != "True":
        return ready
    missing = [g for g in gates if (upper_conditions.get(g) or {}).get("status") != "True"]
    if not missing:
        return ready
    previous = upper_conditions.get("Ready") or {}
    return {
        "type": "Ready",
        "status": "False",
        "reason": "ReadinessGatesNotReady",
        "message": f"corresponding condition of pod readiness gate {missing[0]!r} is not True",
        "lastTransitionTime": (
            previous.get("lastTransitionTime", now) if previous.get("status") == "False" else now
        ),
    }


def vanished_reason(last_seen: Mapping[str, Any] | None) -> tuple[str, str]:
    """Why a lower pod is gone, from the last copy of it the provider saw (None: never seen).

    The disruption controller and the eviction API mark a pod with a `DisruptionTarget`
    condition before deleting it; a kubelet eviction leaves `reason: Evicted`.
    """
    if last_seen is not None:
        status = last_seen.get("status") or {}
        metadata = last_seen.get("metadata") or {}
        where = f"{metadata.get('namespace')}/{metadata.get('name')}"
        if status.get("reason") == "Evicted":
            return "Evicted", LOWER_PREFIX + str(status.get("message") or f"{where} was evicted")
        for condition in status.get("conditions") or []:
            if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
                reason = str(condition.get("reason") or "Evicted")
                detail = condition.get("message") or "the lower pod was disrupted"
                return reason, f"{LOWER_PREFIX}{where}: {detail}"
        return LOWER_POD_DELETED, (
            f"{LOWER_PREFIX}the pod {where} was deleted there, not by vkubelet; "
            "it is not re-created (its controller upstairs replaces this pod)"
        )
    return LOWER_POD_DELETED, (
        f"{LOWER_PREFIX}the pod is missing there and was not deleted by vkubelet; "
        "it is not re-created (its controller upstairs replaces this pod)"
    )


def gone_status(upper: Mapping[str, Any], *, reason: str, message: str, now: str) -> JSON:
    """Failed, for an upper pod whose lower pod is gone; a terminal status is left as it is.

    Containers not already terminated end as the kubelet reports containers it lost:
    `ContainerStatusUnknown`, exit code 137.
    """
    status: JSON = copy_of(dict(upper.get("status") or {}))
    if status.get("phase") in _TERMINAL:
        return status
    status["phase"] = "Failed"
    status["reason"] = reason
    status["message"] = message
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for container in status.get(key) or []:
            state = container.get("state") or {}
            if "terminated" in state:
                continue
            container["lastState"] = {}
            container["ready"] = False
            container["started"] = False
            container["state"] = {
                "terminated": {
                    "exitCode": 137,
                    "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the pod was terminated",
                    "finishedAt": now,
                    "startedAt": (state.get("running") or {}).get("startedAt", now),
                }
            }
    conditions = [
        c
        for c in status.get("conditions") or []
        if c.get("type") not in ("Ready", "ContainersReady")
    ]
    for kind in ("ContainersReady", "Ready"):
        conditions.append(
            {"type": kind, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
        )
    status["conditions"] = conditions
    return status


def copy_of(value: Any) -> Any:
    """A deep copy of JSON data (cheaper and stricter than `copy.deepcopy`)."""
    if isinstance(value, dict):
        return {k: copy_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copy_of(v) for v in value]
    return value
