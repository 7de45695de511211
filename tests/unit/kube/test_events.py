"""The node's event recorder as the provider's event sink: provider events share the agent's
queues, aggregation and rate limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.kube import EventRecorder
from vkubelet.sdk import EventSink
from vkubelet.testing.fakeapi import FakeApiServer

from ..node.helpers import NODE, NS, cancel_and_wait, eventually, pod


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


@pytest.fixture
async def recorder(api: FakeApiServer) -> AsyncIterator[EventRecorder]:
    client = api.client()
    events = EventRecorder(client, component="vkubelet", host=NODE, qps=5, burst=2)
    task = asyncio.create_task(events.run())
    yield events
    await cancel_and_wait(task)
    await client.aclose()


def a_pod(api: FakeApiServer) -> Pod:
    return msgspec.convert(api.create("pods", pod("vm")), Pod)


async def test_a_burst_of_identical_provider_events_costs_one_write(
    api: FakeApiServer, recorder: EventRecorder
) -> None:
    sink: EventSink = recorder
    target = a_pod(api)
    for _ in range(500):
        sink.pod_event(target, "Warning", "TCGFallback", "KVM unusable, running under TCG")
    [event] = await eventually(lambda: api.objects("events", NS), what="the event")
    await eventually(lambda: recorder.pending == 0)
    [event] = api.objects("events", NS)
    assert event["count"] == 500
    assert event["involvedObject"]["uid"] == target.metadata.uid  # type: ignore[union-attr]
    writes = api.calls_to("POST", "/events$") + api.calls_to("PATCH", "/events/")
    assert len(writes) == 1
    assert recorder.dropped == 0


async def test_provider_events_are_rate_limited_with_the_agents(
    api: FakeApiServer, recorder: EventRecorder
) -> None:
    target = a_pod(api)
    for i in range(6):
        recorder.pod_event(target, "Normal", "Step", f"step {i}")
    await eventually(lambda: len(api.objects("events", NS)) >= 2, what="the burst")
    # 5 per second after a burst of 2: the other four take most of a second.
    assert len(api.objects("events", NS)) < 6
    await eventually(lambda: len(api.objects("events", NS)) == 6, within=3)


async def test_a_node_event_is_recorded_like_the_kubelets(
    api: FakeApiServer, recorder: EventRecorder
) -> None:
    recorder.node_event(NODE, "Warning", "LowerClusterUnreachable", "lower cluster unreachable")
    [event] = await eventually(lambda: api.objects("events", "default"), what="a node event")
    involved = event["involvedObject"]
    assert (involved["kind"], involved["name"], involved["uid"]) == ("Node", NODE, NODE)
    assert event["source"] == {"component": "vkubelet", "host": NODE}
