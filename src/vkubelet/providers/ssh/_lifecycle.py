"""A device container's life as a kubelet tells it, sans I/O: waiting messages and Events.

The device's supervisor (`_remote`) keeps each container's state in a file; the agent reads
them in sweeps. What a kubelet adds on top is said here, from two consecutive readings of a
container: the message of a waiting state (`ImagePullBackOff` names the image and carries the
last pull's error, `CrashLoopBackOff` the back-off), and the Events a kubelet records when a
container enters a state (`Failed` "Failed to pull image ...", `BackOff` "Back-off pulling
image ...", `Failed` "Error: ..." for a container that could not be created or started,
`BackOff` "Back-off restarting failed container ..."). A state the agent did not see (it
lasted less than a sweep, or the agent was down) has no Event; the status tells the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...sdk.backoff import crash_loop_message
from ...sdk.provider import EventType
from ._remote import ContainerStatus

__all__ = ["PodNames", "Record", "events", "waiting_message"]


@dataclass(frozen=True)
class PodNames:
    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class Record:
    """An Event to record for the pod."""

    type: EventType
    reason: str
    message: str


def waiting_message(state: ContainerStatus, image: str, pod: PodNames) -> str | None:
    """The message a kubelet gives a waiting container in this state, or None."""
    if state.reason == "ImagePullBackOff":
        back_off = f'Back-off pulling image "{image}"'
        return f"{back_off}: ErrImagePull: {state.message}" if state.message else back_off
    if state.message is not None:
        return state.message  # the runtime's words
    if state.backoff_seconds is not None:
        return crash_loop_message(state.backoff_seconds, state.name, *_names(pod))
    return None


def events(
    before: ContainerStatus | None, after: ContainerStatus, image: str, pod: PodNames
) -> list[Record]:
    """What a kubelet records as the container goes from `before` (None: not seen yet) to
    `after`: an Event for each state it enters, none while it stays in one."""
    if before is not None and _key(before) == _key(after):
        return []
    error = f"Error: {after.reason}"
    if after.state == "terminated":
        if after.reason != "StartError":
            return []
        return [Record("Warning", "Failed", f"Error: {after.message or 'the runtime failed'}")]
    if after.state != "waiting":
        return []
    match after.reason:
        case "ErrImagePull":
            pulled = f'Failed to pull image "{image}": {after.message or "unknown error"}'
            return [Record("Warning", "Failed", pulled), Record("Warning", "Failed", error)]
        case "ImagePullBackOff":
            back_off = f'Back-off pulling image "{image}"'
            return [Record("Normal", "BackOff", back_off), Record("Warning", "Failed", error)]
        case "ErrImageNeverPull":
            never = after.message or f'Container image "{image}" is not present'
            return [
                Record("Warning", "ErrImageNeverPull", never),
                Record("Warning", "Failed", error),
            ]
        case "CreateContainerError":
            return [Record("Warning", "Failed", f"Error: {after.message or 'the runtime failed'}")]
        case "CrashLoopBackOff":
            restarting = (
                f"Back-off restarting failed container {after.name} in pod "
                f"{pod.name}_{pod.namespace}({pod.uid})"
            )
            return [Record("Warning", "BackOff", restarting)]
    return []


def _key(state: ContainerStatus) -> tuple[object, ...]:
    """What makes a new state: another reason, a waiting of another run, another termination
    (its times: the run count of a termination grows when the next run begins)."""
    if state.state == "terminated":
        return (state.state, state.reason, state.started_at, state.finished_at)
    return (state.state, state.reason, state.restart_count, state.started_at)


def _names(pod: PodNames) -> tuple[str, str, str]:
    return pod.name, pod.namespace, pod.uid
