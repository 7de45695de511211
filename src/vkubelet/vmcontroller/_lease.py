"""Leader election through a coordination.k8s.io Lease, as client-go's leaderelection does.

Candidates read the Lease; one takes it when it is free, expired, or already its own, by a
`replace` carrying the resourceVersion read, so two candidates racing for it cannot both win
(the loser gets 409 Conflict). Expiry is judged on the local clock from when this candidate
last saw the record change (holder, renewTime, resourceVersion), never from the timestamps
written by another host, so clock skew between hosts does not matter.

Fencing: the leader's work runs only while renewals succeed. When the Lease cannot be renewed
for `renew_deadline` (shorter than the lease duration), or another holder appears, the work is
cancelled before any other candidate may take over, and this candidate campaigns again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

__all__ = ["LEASE_NAME", "LeaderElector", "LeaseTiming"]

LEASE_NAME: Final = "vkubelet-vm-controller"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseTiming:
    duration: float = 15.0  # a Lease unrenewed this long is free to take
    renew_deadline: float = 10.0  # the leader stops acting when it could not renew this long
    retry: float = 2.0  # between attempts (and renewals)

    @classmethod
    def for_duration(cls, duration: float) -> LeaseTiming:
        """client-go's proportions (15 s / 10 s / 2 s) for another lease duration."""
        return cls(duration, duration * 2 / 3, max(duration * 2 / 15, 0.2))


class _Held(Exception):
    """Another candidate holds a live Lease."""


class LeaderElector:
    def __init__(
        self,
        client: AsyncClient,
        *,
        namespace: str,
        identity: str,
        name: str = LEASE_NAME,
        timing: LeaseTiming | None = None,
    ) -> None:
        self._client, self.namespace, self.identity, self.name = client, namespace, identity, name
        self.timing = timing or LeaseTiming()
        self.is_leader = False
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0

    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """For ever: campaign, then run `lead()` while leading; returns only if `lead` does."""
        while True:
            await self._campaign()
            if await self._lead(lead):
                return

    async def _campaign(self) -> None:
        while True:
            with contextlib.suppress(_Held):
                if await self._attempt():
                    log.info(
                        "leader election: %s now leads (Lease %s/%s)",
                        self.identity,
                        self.namespace,
                        self.name,
                    )
                    return
            await asyncio.sleep(self.timing.retry)

    async def _lead(self, lead: Callable[[], Awaitable[None]]) -> bool:
        """Run `lead` while renewing; True when it returned by itself, False when leadership
        was lost (it was cancelled first)."""
        self.is_leader = True
        work = asyncio.ensure_future(lead())
        renewed = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=self.timing.retry)
                if done:
                    work.result()
                    return True
                try:
                    if await self._attempt():
                        renewed = time.monotonic()
                except _Held:
                    log.warning("leader election: another candidate took the Lease; stopping")
                    return False
                if time.monotonic() - renewed > self.timing.renew_deadline:
                    log.warning(
                        "leader election: Lease not renewed for %.0fs; stopping (fencing)",
                        time.monotonic() - renewed,
                    )
                    return False
        finally:
            self.is_leader = False
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work

    async def _attempt(self) -> bool:
        """One try to take or renew the Lease: True on success, False on an error or a lost
        race (try again), `_Held` when another candidate holds a live Lease."""
        try:
            return await asyncio.wait_for(self._try(), self.timing.renew_deadline / 2)
        except _Held:
            raise
        except (ApiError, TimeoutError, OSError, Exception) as e:  # the apiserver away
            log.debug("leader election: attempt failed: %s", e)
            return False

    async def _try(self) -> bool:
        now = datetime.now(UTC)
        duration = max(1, round(self.timing.duration))
        try:
            lease = await self._client.get(Lease, self.name, namespace=self.namespace)
        except ApiError as e:
            if e.status.code != 404:
                raise
            fresh = Lease(
                metadata=ObjectMeta(name=self.name, namespace=self.namespace),
                spec=LeaseSpec(
                    holderIdentity=self.identity,
                    leaseDurationSeconds=duration,
                    acquireTime=now,
                    renewTime=now,
                    leaseTransitions=0,
                ),
            )
            await self._client.create(fresh)
            return True
        spec = lease.spec or LeaseSpec()
        assert lease.metadata is not None
        record = (spec.holderIdentity, spec.renewTime, lease.metadata.resourceVersion)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        holder = spec.holderIdentity
        if holder and holder != self.identity:
            held_for = spec.leaseDurationSeconds or duration
            if time.monotonic() - self._observed_at < held_for:
                raise _Held(holder)
        if holder != self.identity:
            spec.acquireTime = now
            spec.leaseTransitions = (spec.leaseTransitions or 0) + (1 if holder else 0)
            spec.holderIdentity = self.identity
        spec.renewTime = now
        spec.leaseDurationSeconds = duration
        lease.spec = spec
        try:
            await self._client.replace(lease)  # carries the resourceVersion read: no lost race
        except ApiError as e:
            if e.status.code == 409:
                return False
            raise
        return True

    async def release(self) -> None:
        """Give the Lease up at a clean stop, so that another candidate need not wait for it
        to expire (best effort)."""
        with contextlib.suppress(Exception):
            lease = await self._client.get(Lease, self.name, namespace=self.namespace)
            if lease.spec is not None and lease.spec.holderIdentity == self.identity:
                lease.spec.holderIdentity = None
                lease.spec.renewTime = None
                await self._client.replace(lease)
