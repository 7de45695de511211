"""Leader election through a coordination.k8s.io Lease, as client-go's leaderelection does.

Candidates read the Lease; one takes it when it is free, expired, or already its own, by a
`replace` carrying the resourceVersion read, so two candidates racing for it cannot both win
(the loser gets 409 Conflict). Expiry is judged on the local clock from when this candidate
last saw the record change (holder, renewTime, resourceVersion), never from the timestamps
written by another host, so clock skew between hosts does not matter.

Fencing: the leader's work runs only while renewals succeed. When the Lease cannot be renewed
for `renew_deadline` (shorter than the lease duration), or another holder appears, the work is
cancelled before any other candidate may take over, and this candidate campaigns again.

The elector talks to the apiserver through a `LeaseStore` of plain JSON objects, so that both
the node agent (its own `KubeClient`) and the VM controller (lightkube) use this one elector.
A leader renews with the object it last wrote (one request, as client-go does since 1.27);
only a conflict makes it read the Lease again.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..sdk.clock import now_micro
from ._client import KubeClient
from ._errors import ApiError
from ._resources import LEASES

log = logging.getLogger(__name__)

JSON = dict[str, Any]


@dataclass(frozen=True)
class LeaseTiming:
    duration: float = 15.0  # a Lease unrenewed this long is free to take
    renew_deadline: float = 10.0  # the leader stops acting when it could not renew this long
    retry: float = 2.0  # between attempts (and renewals)

    @classmethod
    def for_duration(cls, duration: float) -> LeaseTiming:
        """client-go's proportions (15 s / 10 s / 2 s) for another lease duration."""
        return cls(duration, duration * 2 / 3, max(duration * 2 / 15, 0.2))


class LeaseConflict(Exception):
    """409: the Lease changed since it was read, or was created by someone else first."""


class LeaseStore(Protocol):
    """The Lease API, with objects as JSON dicts."""

    async def get(self, namespace: str, name: str) -> JSON | None:
        """The Lease, or None when there is none."""

    async def create(self, lease: JSON) -> JSON:
        """The stored Lease (with its resourceVersion); `LeaseConflict` if it exists."""

    async def replace(self, lease: JSON) -> JSON:
        """The stored Lease; `LeaseConflict` on a stale resourceVersion."""


class KubeLeases:
    """`LeaseStore` over the agent's `KubeClient`."""

    def __init__(self, client: KubeClient) -> None:
        self._client = client

    async def get(self, namespace: str, name: str) -> JSON | None:
        try:
            return await self._client.get(LEASES.path(namespace, name))
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def create(self, lease: JSON) -> JSON:
        return await _unless_conflict(
            self._client.create(LEASES.path(lease["metadata"]["namespace"]), lease)
        )

    async def replace(self, lease: JSON) -> JSON:
        meta = lease["metadata"]
        path = LEASES.path(meta["namespace"], meta["name"])
        return await _unless_conflict(self._client.replace(path, lease))

    async def list(self, namespace: str, selector: str) -> list[JSON]:
        answer = await self._client.get(LEASES.path(namespace), {"labelSelector": selector})
        items: list[JSON] = answer.get("items") or []
        return items

    async def delete(self, namespace: str, name: str) -> None:
        try:
            await self._client.delete(LEASES.path(namespace, name))
        except ApiError as e:
            if not e.not_found:
                raise


async def _unless_conflict(write: Awaitable[JSON]) -> JSON:
    """The stored Lease; a 409 is `LeaseConflict`."""
    try:
        return await write
    except ApiError as e:
        if e.conflict:
            raise LeaseConflict(str(e)) from e
        raise


def default_identity() -> str:
    """A candidate's identity: the pod's name in a cluster, else host, pid and a nonce (a
    restarted process is a new candidate: it must not resume a Lease as if it had kept it)."""
    pod = os.environ.get("POD_NAME")
    if pod:
        return pod
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _Held(Exception):
    """Another candidate holds a live Lease."""


class LeaderElector:
    def __init__(
        self,
        store: LeaseStore,
        *,
        namespace: str,
        identity: str,
        name: str,
        timing: LeaseTiming | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._store, self.namespace, self.identity, self.name = store, namespace, identity, name
        self.timing = timing or LeaseTiming()
        self.labels = dict(labels or {})
        self.is_leader = False
        self.holder: str | None = None  # as last observed
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._mine: JSON | None = None  # the Lease as this candidate last wrote it
        self._duration = self.timing.duration  # of the Lease as last observed
        self._renewed_at = 0.0  # when the last successful write of ours started (monotonic)

    # -- observing ------------------------------------------------------------------------------
    def observe(self, lease: JSON | None) -> None:
        """Note the Lease as seen now (by a read of its own or by a list of many)."""
        if lease is None:
            self._observed, self.holder = None, None
            return
        spec = lease.get("spec") or {}
        record = (
            spec.get("holderIdentity"),
            spec.get("renewTime"),
            (lease.get("metadata") or {}).get("resourceVersion"),
        )
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        self.holder = spec.get("holderIdentity") or None
        self._duration = float(spec.get("leaseDurationSeconds") or self.timing.duration)

    @property
    def observed_at(self) -> float:
        """When (monotonic) the Lease's record was last seen to change."""
        return self._observed_at

    def held_by_other(self) -> bool:
        """Whether, as last observed, another candidate holds the Lease and it has not expired."""
        if not self.holder or self.holder == self.identity:
            return False
        return time.monotonic() - self._observed_at < self._duration

    def holds(self) -> bool:
        """Whether this candidate may act now: it leads and its last renewal started less than
        the renew deadline ago. Monotonic time: a process paused past the deadline sees it
        expired the moment it resumes, before any of its queued work runs."""
        return self.is_leader and time.monotonic() - self._renewed_at < self.timing.renew_deadline

    # -- campaigning and leading ----------------------------------------------------------------
    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """For ever: campaign, then run `lead()` while leading; returns only if `lead` does."""
        while True:
            await self._campaign()
            if await self.hold(lead):
                return

    async def _campaign(self) -> None:
        while not await self.acquire():  # noqa: ASYNC110 - polling the apiserver, not a flag
            await asyncio.sleep(self.timing.retry)

    async def acquire(self) -> bool:
        """One try to take (or renew) the Lease; never raises."""
        with contextlib.suppress(_Held):
            renewal = self._mine is not None
            if await self._attempt():
                if not renewal:
                    log.info(
                        "leader election: %s now leads (Lease %s/%s)",
                        self.identity,
                        self.namespace,
                        self.name,
                    )
                return True
        return False

    async def hold(self, lead: Callable[[], Awaitable[None]]) -> bool:
        """Run `lead` while renewing a Lease just acquired; True when it returned by itself,
        False when leadership was lost (it was cancelled first)."""
        self.is_leader = True
        work = asyncio.ensure_future(lead())
        deadline = self.timing.renew_deadline
        pause, renewed = self.timing.retry, True
        try:
            while True:
                # The renewal in flight never outlasts the deadline: the work stops no later
                # than `renew_deadline` after the start of the last successful renewal.
                remaining = self._renewed_at + deadline - time.monotonic()
                if remaining > 0:
                    wait = min(pause, remaining if renewed else remaining / 2)
                    done, _ = await asyncio.wait({work}, timeout=wait)
                    if done:
                        work.result()
                        return True
                    remaining = self._renewed_at + deadline - time.monotonic()
                if remaining > 0:
                    try:
                        # A renewal that failed (cut at half the deadline, or refused) is
                        # tried again soon, not a whole period later: with a period of 4 s and
                        # a deadline of 16, one renewal lost to a stalled connection would
                        # otherwise leave no time for the next.
                        renewed = await self._attempt(min(deadline / 2, remaining))
                        pause = self.timing.retry if renewed else self.timing.retry / 4
                    except _Held:
                        log.warning(
                            "leader election: another candidate took Lease %s; stopping",
                            self.name,
                        )
                        return False
                    continue
                log.warning(
                    "leader election: Lease %s not renewed for %.0fs; stopping (fencing)",
                    self.name,
                    time.monotonic() - self._renewed_at,
                )
                return False
        finally:
            self.is_leader = False
            if not work.done():
                work.cancel()
                await asyncio.wait({work})  # its end, without taking its CancelledError as ours

    async def _attempt(self, within: float | None = None) -> bool:
        """One try to take or renew the Lease: True on success, False on an error or a lost
        race (try again), `_Held` when another candidate holds a live Lease."""
        started = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for may swallow a cancellation
            # that arrives as the request completes, and a cancelled leader would keep leading.
            async with asyncio.timeout(within or self.timing.renew_deadline / 2):
                await self._try()
        except _Held:
            raise
        except LeaseConflict:
            self._mine = None  # someone else wrote it: read it again next time
            return False
        except Exception as e:  # the apiserver away, a timeout: said by leader and standby
            log.info("leader election: attempt on Lease %s failed: %r", self.name, e)
            return False
        self._renewed_at = started  # the write came later: others' expiry counts from after it
        return True

    async def _try(self) -> None:
        now = now_micro()
        # Up, never down: a Lease written shorter than the fence would free it while we act.
        duration = max(1, math.ceil(self.timing.duration))
        if time.monotonic() - self._renewed_at >= self.timing.renew_deadline:
            self._mine = None  # possibly taken meanwhile (a pause, a partition): read it first
        lease = copy.deepcopy(self._mine) if self._mine is not None else None
        if lease is None:
            lease = await self._store.get(self.namespace, self.name)
            if lease is None:
                fresh: JSON = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {
                        "holderIdentity": self.identity,
                        "leaseDurationSeconds": duration,
                        "acquireTime": now,
                        "renewTime": now,
                        "leaseTransitions": 0,
                    },
                }
                if self.labels:
                    fresh["metadata"]["labels"] = dict(self.labels)
                self._wrote(await self._store.create(fresh))
                return
            self.observe(lease)
            if self.held_by_other():
                raise _Held(self.holder)
        spec = lease.setdefault("spec", {})
        holder = spec.get("holderIdentity")
        if holder != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + (1 if holder else 0)
            spec["holderIdentity"] = self.identity
        spec["renewTime"] = now
        spec["leaseDurationSeconds"] = duration
        if self.labels:
            lease["metadata"].setdefault("labels", {}).update(self.labels)
        # Carries the resourceVersion read (or last written): no lost race.
        self._wrote(await self._store.replace(lease))

    def _wrote(self, stored: JSON) -> None:
        self._mine = stored
        self.observe(stored)

    async def release(self) -> None:
        """Give the Lease up at a clean stop, so that another candidate need not wait for it
        to expire (best effort)."""
        self._mine = None
        with contextlib.suppress(Exception):
            lease = await self._store.get(self.namespace, self.name)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == (
                self.identity
            ):
                lease["spec"]["holderIdentity"] = None
                lease["spec"]["renewTime"] = None
                self.observe(await self._store.replace(lease))
