"""Powering a VM on again after its pod failed: the kubelet's CrashLoopBackOff numbers.

Without a pause a pod that fails for good (a wrong image, a spec the provider refuses) is
replaced as fast as the apiserver allows: hundreds of pods a minute. So a failed pod is kept (it
shows why) until a back-off has passed: 10 s after the first failure, doubling up to 5 minutes,
from the bottom again once a pod ran 10 minutes (the kubelet's numbers, `sdk.backoff`).

The state lives in the VM's status (`restarts`, `lastFailure`, `nextStartAfter`), not in the
controller's memory: a controller restarted while a VM waits goes on waiting. Times are
arguments, so the rules are tested without waiting.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from ..sdk.backoff import INITIAL_SECONDS, MAX_SECONDS, RESET_SECONDS
from ..sdk.logs import parse_rfc3339

__all__ = ["delay_for", "failure_of", "parse_time", "ran_long_enough", "stamp"]


def stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time as the apiserver writes it (None if absent or unreadable)."""
    return parse_rfc3339(value) if isinstance(value, str) else None


def delay_for(restarts: int) -> timedelta:
    """The wait before power-on number `restarts` (1 = after the first failure) of a streak."""
    seconds = INITIAL_SECONDS * 2 ** max(0, min(restarts - 1, 16))  # 16: no float overflow
    return timedelta(seconds=min(seconds, MAX_SECONDS))


def ran_long_enough(pod: Mapping[str, Any], now: datetime) -> bool:
    """Whether the failed pod had been up as long as the kubelet's reset time (2 x the maximum
    back-off): its failure starts a new streak, as a container's does."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    started = parse_time(status.get("startTime")) or parse_time(meta.get("creationTimestamp"))
    return started is not None and (now - started).total_seconds() >= RESET_SECONDS


def failure_of(pod: Mapping[str, Any]) -> tuple[str, str]:
    """The reason and message a failed pod gives: the pod's own (a provider that refused it,
    e.g. UnsupportedImage), else its container's termination (e.g. QEMU's exit)."""
    status = pod.get("status") or {}
    if status.get("reason"):
        return str(status["reason"]), str(status.get("message") or "")[:512]
    for container in status.get("containerStatuses") or []:
        ended = (container.get("state") or {}).get("terminated")
        if ended:
            reason = str(ended.get("reason") or "Error")
            message = str(ended.get("message") or f"exit code {ended.get('exitCode')}")
            return reason, message[:512]
    phase = str(status.get("phase") or "Failed")
    return ("Completed", "the pod ended") if phase == "Succeeded" else ("Failed", "the pod failed")
