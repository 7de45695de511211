"""The controller's Events: about the right object, and a repeat bumps the count of the Event
already written instead of writing another (a reconcile loop finding the same problem)."""

from __future__ import annotations

from typing import Any

from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event

from vkubelet.vmcontroller import EventRecorder, VirtualMachine


class FakeClient:
    def __init__(self) -> None:
        self.created: list[Event] = []
        self.patched: list[tuple[str, dict[str, Any]]] = []

    async def create(self, event: Event) -> Event:
        assert event.metadata is not None
        event.metadata.name = f"db.{len(self.created)}"
        self.created.append(event)
        return event

    async def patch(self, res: type, name: str, body: dict[str, Any], **_: Any) -> None:
        self.patched.append((name, body))


async def test_an_event_names_the_virtual_machine_and_a_repeat_bumps_its_count() -> None:
    client = FakeClient()
    events = EventRecorder(client)  # type: ignore[arg-type]
    vm = VirtualMachine(metadata=ObjectMeta(name="db", namespace="ns", uid="u1"))
    events.emit(vm, "Warning", "FailedCreate", "refused")
    await events.aclose()
    events.emit(vm, "Warning", "FailedCreate", "refused")
    await events.aclose()
    (event,) = client.created
    ref = event.involvedObject
    assert (ref.apiVersion, ref.kind, ref.name, ref.namespace, ref.uid) == (
        "vkubelet.io/v1alpha1",
        "VirtualMachine",
        "db",
        "ns",
        "u1",
    )
    assert (event.type, event.reason, event.message, event.count) == (
        "Warning",
        "FailedCreate",
        "refused",
        1,
    )
    assert [(name, body["count"]) for name, body in client.patched] == [("db.0", 2)]
