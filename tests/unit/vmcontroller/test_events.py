"""The controller's Events: about the right object, and a repeat bumps the count of the Event
already written instead of writing another (a reconcile loop finding the same problem)."""

from __future__ import annotations

import asyncio

from vkubelet.kube import EventRecorder, ObjectRef
from vkubelet.testing.fakeapi import FakeApiServer
from vkubelet.testing.harness import cancel_and_wait, eventually
from vkubelet.vmcontroller._controller import COMPONENT


async def test_an_event_names_the_virtual_machine_and_a_repeat_bumps_its_count() -> None:
    api = FakeApiServer()
    client = api.client()
    events = EventRecorder(client, component=COMPONENT, host="controller-1")
    task = asyncio.create_task(events.run())
    try:
        vm = api.create(
            "virtualmachines",
            {"metadata": {"name": "db", "namespace": "ns"}, "spec": {"replicas": 1}},
        )
        events.emit(ObjectRef.of(vm), "Warning", "FailedCreate", "refused")
        await eventually(lambda: events.sent == 1)
        events.emit(ObjectRef.of(vm), "Warning", "FailedCreate", "refused")
        await eventually(lambda: events.sent == 2)
    finally:
        await cancel_and_wait(task)
        await client.aclose()
    (event,) = api.objects("events", "ns")
    ref = event["involvedObject"]
    assert (ref["apiVersion"], ref["kind"], ref["name"], ref["namespace"], ref["uid"]) == (
        "vkubelet.io/v1alpha1",
        "VirtualMachine",
        "db",
        "ns",
        vm["metadata"]["uid"],
    )
    assert (event["type"], event["reason"], event["message"]) == (
        "Warning",
        "FailedCreate",
        "refused",
    )
    assert event["source"]["component"] == COMPONENT
    writes = [(c.method, (c.body or {}).get("count")) for c in api.calls if "/events" in c.path]
    assert writes == [("POST", 1), ("PATCH", 2)]
