"""Leader election on an in-memory Lease with the apiserver's optimistic concurrency: one leader
among candidates, takeover of an expired Lease, and fencing (a leader that cannot renew stops
acting before its Lease may be taken)."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from vkubelet.kube import LeaderElector, LeaseConflict, LeaseTiming
from vkubelet.testing.harness import eventually

TIMING = LeaseTiming(duration=2.0, renew_deadline=1.0, retry=0.1)  # whole seconds: the field


class FakeLeases:
    """What the apiserver does with one Lease: none before it exists, 409 on a stale write."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.version = 0
        self.broken = False  # the apiserver unreachable for everyone
        self.requests = 0

    def _check(self) -> None:
        self.requests += 1
        if self.broken:
            raise ConnectionRefusedError("apiserver away")

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.stored)

    async def create(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._check()
        if self.stored is not None:
            raise LeaseConflict("exists")
        return self._store(lease)

    async def replace(self, lease: dict[str, Any]) -> dict[str, Any]:
        self._check()
        assert self.stored is not None
        if lease["metadata"]["resourceVersion"] != self.stored["metadata"]["resourceVersion"]:
            raise LeaseConflict("stale")
        return self._store(lease)

    def _store(self, lease: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.stored = lease
        return copy.deepcopy(lease)


def elector(leases: FakeLeases, identity: str) -> LeaderElector:
    return LeaderElector(leases, namespace="ns", identity=identity, name="l", timing=TIMING)


class Work:
    """A leader's work: running from start to cancellation."""

    def __init__(self) -> None:
        self.running = False
        self.started = 0
        self.cancelled_at: float | None = None

    async def __call__(self) -> None:
        self.running, self.started = True, self.started + 1
        try:
            await asyncio.Future()
        finally:
            self.running, self.cancelled_at = False, time.monotonic()


async def test_of_two_candidates_exactly_one_leads_at_any_time() -> None:
    leases = FakeLeases()
    works = {name: Work() for name in ("a", "b")}
    electors = {name: elector(leases, name) for name in works}
    tasks = [asyncio.create_task(electors[n].run(works[n])) for n in works]
    try:
        await eventually(lambda: any(w.running for w in works.values()))
        deadline = time.monotonic() + 3 * TIMING.duration
        while time.monotonic() < deadline:  # several lease durations: no second leader
            assert sum(w.running for w in works.values()) == 1
            await asyncio.sleep(0.01)
        holder = next(n for n, w in works.items() if w.running)
        assert leases.stored is not None
        assert leases.stored["spec"]["holderIdentity"] == holder
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_lease_left_by_a_dead_leader_is_taken_once_it_expires() -> None:
    leases = FakeLeases()
    dead = elector(leases, "dead")
    assert await dead._attempt()  # it took the Lease, then died without releasing it
    work = Work()
    started = time.monotonic()
    task = asyncio.create_task(elector(leases, "heir").run(work))
    try:
        await eventually(lambda: work.running)
        assert time.monotonic() - started >= TIMING.duration * 0.9  # not before it expired
        assert leases.stored is not None
        assert leases.stored["spec"]["holderIdentity"] == "heir"
        assert leases.stored["spec"]["leaseTransitions"] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_leader_that_cannot_renew_stops_acting_before_its_lease_expires() -> None:
    leases = FakeLeases()
    work = Work()
    task = asyncio.create_task(elector(leases, "a").run(work))
    try:
        await eventually(lambda: work.running)
        await asyncio.sleep(0.2)
        leases.broken = True
        broken_at = time.monotonic()
        await eventually(lambda: not work.running)
        assert work.cancelled_at is not None
        # The last renewal was before the break; another candidate may take over one lease
        # duration after it: the work stopped earlier than that.
        assert work.cancelled_at - broken_at < TIMING.duration
        leases.broken = False
        await eventually(lambda: work.started == 2)  # campaigns again, leads again
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_released_lease_is_taken_at_once() -> None:
    leases = FakeLeases()
    first = elector(leases, "first")
    assert await first._attempt()
    second = elector(leases, "second")
    with pytest.raises(Exception, match="first"):  # held: not to be taken
        await second._try()
    await first.release()
    assert await second._attempt()  # no waiting for an expiry
    assert leases.stored is not None
    assert leases.stored["spec"]["holderIdentity"] == "second"


async def test_a_leader_renews_with_one_write_and_reads_again_after_a_conflict() -> None:
    leases = FakeLeases()
    a = elector(leases, "a")
    assert await a._attempt()
    before = leases.requests
    assert await a._attempt()
    assert leases.requests == before + 1  # the renewal: one replace, no read
    assert leases.stored is not None
    leases.stored["metadata"]["resourceVersion"] = "other"  # someone else wrote it
    assert not await a._attempt()  # the stale write fails...
    before = leases.requests
    assert await a._attempt()  # ...the next one reads the Lease first (still its own)
    assert leases.requests == before + 2


async def test_a_stopped_leader_stops_no_later_than_the_renew_deadline_when_writes_hang() -> None:
    leases = FakeLeases()
    work = Work()
    a = elector(leases, "a")
    task = asyncio.create_task(a.run(work))
    try:
        await eventually(lambda: work.running)
        hang: asyncio.Future[None] = asyncio.Future()

        async def hanging(lease: dict[str, Any]) -> dict[str, Any]:
            await hang
            raise AssertionError

        leases.replace = hanging  # type: ignore[method-assign]
        last_ok = a._renewed_at
        await eventually(lambda: not work.running)
        assert work.cancelled_at is not None
        assert work.cancelled_at - last_ok <= TIMING.renew_deadline + 0.1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_renewal_lost_to_a_stalled_request_is_retried_within_the_deadline() -> None:
    """With a renewal period long next to the deadline (sharding's 4 s of 16), the retry of a
    renewal cut at half the deadline must come soon, not a whole period later."""
    leases = FakeLeases()
    work = Work()
    timing = LeaseTiming(duration=2.0, renew_deadline=1.0, retry=0.4)
    a = LeaderElector(leases, namespace="ns", identity="a", name="l", timing=timing)
    task = asyncio.create_task(a.run(work))
    try:
        await eventually(lambda: work.running)
        fast = leases.replace
        stalled: list[float] = []

        async def stall_once(lease: dict[str, Any]) -> dict[str, Any]:
            if not stalled:
                stalled.append(time.monotonic())
                await asyncio.Future()  # never answers
            return await fast(lease)

        leases.replace = stall_once  # type: ignore[method-assign]
        await eventually(lambda: bool(stalled))
        await asyncio.sleep(2 * timing.duration)
        assert work.running and work.started == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
