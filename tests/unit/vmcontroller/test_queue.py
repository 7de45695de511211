"""The controller's work queue: a key is queued once however often it changes, handled by one
worker at a time, and a change during its handling queues it once more afterwards."""

from __future__ import annotations

import asyncio

from vkubelet.vmcontroller._controller import _Queue


async def test_a_key_changed_many_times_is_queued_once() -> None:
    queue = _Queue()
    for _ in range(3):
        queue.add((0, "ns", "db"))
    queue.add((0, "ns", "web"))
    assert [await queue.get(), await queue.get()] == [(0, "ns", "db"), (0, "ns", "web")]
    assert queue._queue.empty()


async def test_a_change_while_a_key_is_handled_queues_it_after_not_beside() -> None:
    queue = _Queue()
    key = (0, "ns", "db")
    queue.add(key)
    assert await queue.get() == key
    queue.add(key)  # changed while a worker has it: no second worker may take it now
    queue.add(key)
    assert queue._queue.empty()
    queue.done(key)
    assert await asyncio.wait_for(queue.get(), 1) == key
    queue.done(key)
    assert queue._queue.empty()


async def test_add_after_queues_the_key_later() -> None:
    queue = _Queue()
    queue.add_after((0, "ns", "db"), 0.05)
    assert queue._queue.empty()
    assert await asyncio.wait_for(queue.get(), 1) == (0, "ns", "db")
    queue.close()
