"""Leader election on an in-memory Lease with the apiserver's optimistic concurrency: one leader
among candidates, takeover of an expired Lease, and fencing (a leader that cannot renew stops
acting before its Lease may be taken)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status
from lightkube.resources.coordination_v1 import Lease

from vkubelet.vmcontroller._lease import LeaderElector, LeaseTiming

TIMING = LeaseTiming(duration=2.0, renew_deadline=1.0, retry=0.1)  # whole seconds: the field


def _error(code: int) -> ApiError:
    return ApiError(status=Status(code=code, message=f"error {code}"))


class FakeLeases:
    """What the apiserver does with one Lease: 404 before it exists, 409 on a stale write."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.version = 0
        self.broken = False  # the apiserver unreachable for everyone

    def _check(self) -> None:
        if self.broken:
            raise ConnectionRefusedError("apiserver away")

    async def get(self, res: type, name: str, *, namespace: str) -> Lease:
        self._check()
        if self.stored is None:
            raise _error(404)
        return Lease.from_dict(self.stored)  # type: ignore[return-value]

    async def create(self, obj: Lease) -> Lease:
        self._check()
        if self.stored is not None:
            raise _error(409)
        return self._store(obj)

    async def replace(self, obj: Lease) -> Lease:
        self._check()
        assert obj.metadata is not None and self.stored is not None
        if obj.metadata.resourceVersion != self.stored["metadata"]["resourceVersion"]:
            raise _error(409)
        return self._store(obj)

    def _store(self, obj: Lease) -> Lease:
        self.version += 1
        assert obj.metadata is not None
        obj.metadata.resourceVersion = str(self.version)
        self.stored = obj.to_dict()
        return obj


def elector(leases: FakeLeases, identity: str) -> LeaderElector:
    return LeaderElector(
        leases,  # type: ignore[arg-type]
        namespace="ns",
        identity=identity,
        timing=TIMING,
    )


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


async def _until(check: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_of_two_candidates_exactly_one_leads_at_any_time() -> None:
    leases = FakeLeases()
    works = {name: Work() for name in ("a", "b")}
    electors = {name: elector(leases, name) for name in works}
    tasks = [asyncio.create_task(electors[n].run(works[n])) for n in works]
    try:
        await _until(lambda: any(w.running for w in works.values()))
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
        await _until(lambda: work.running)
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
        await _until(lambda: work.running)
        await asyncio.sleep(0.2)
        leases.broken = True
        broken_at = time.monotonic()
        await _until(lambda: not work.running)
        assert work.cancelled_at is not None
        # The last renewal was before the break; another candidate may take over one lease
        # duration after it: the work stopped earlier than that.
        assert work.cancelled_at - broken_at < TIMING.duration
        leases.broken = False
        await _until(lambda: work.started == 2)  # campaigns again, leads again
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
