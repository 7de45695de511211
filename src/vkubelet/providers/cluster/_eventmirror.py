"""The lower cluster's Events about our lower pods, mirrored onto the upper pods."""

from __future__ import annotations

from collections.abc import Callable

from lightkube.resources.core_v1 import Pod

from ...kube import Handler, KubeClient, Reflector
from ...sdk.provider import EventSink, EventType
from ._convert import JSON

__all__ = ["EventMirror"]

# Lower events not mirrored: the lower kubelet's Created and Started say what the agent's own
# events on the upper pod say (and cost a mirrored event each, two per pod).
_NOT_MIRRORED = ("Created", "Started")


class EventMirror:
    """Only new Events (a restart does not replay history); the agent's event sink aggregates
    and rate-limits them. `upper_pod(lower namespace, name, lower UID)`: the upper pod a lower
    pod of ours stands for, if any."""

    def __init__(
        self,
        client: KubeClient,
        upper_pod: Callable[[str, str, str | None], Pod | None],
        events: EventSink,
    ) -> None:
        self._upper_pod, self._events = upper_pod, events
        skipped = "".join(f",reason!={r}" for r in _NOT_MIRRORED)
        self.reflector: Reflector[JSON] = Reflector(
            client,
            "/api/v1/events",
            dict,
            Handler(self._mirror, lambda _old, new: self._mirror(new), lambda _gone: None),
            params={"fieldSelector": "involvedObject.kind=Pod" + skipped},
            watch_timeout=(300, 300),
            from_now=True,
        )

    def _mirror(self, event: JSON) -> None:
        involved = event.get("involvedObject") or {}
        pod = self._upper_pod(
            str(involved.get("namespace")), str(involved.get("name")), involved.get("uid")
        )
        if pod is not None:
            kind: EventType = "Warning" if event.get("type") == "Warning" else "Normal"
            message = f"lower cluster: {event.get('message') or ''}".strip()
            self._events.pod_event(pod, kind, str(event.get("reason") or "Lower"), message)
