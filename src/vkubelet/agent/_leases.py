"""What replicas of the agent share to coordinate through Leases: their options, the names and
labels of their Leases, the fenced client of work done under a Lease, and the event loop in a
thread of its own that renews Leases whatever the nodes' loop is doing.

Fencing: losing a Lease, or failing to renew it for the renew deadline, stops the work under it
before any other replica may take over, and `FencedClient` refuses every write of that work
meanwhile, so that a partitioned or paused replica stops writing on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import re
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..kube import ClientOptions, KubeClient, LeaseTiming, Unreachable

GROUP_LABEL = "vkubelet.io/replica-group"
ROLE_LABEL = "vkubelet.io/replica-role"
# Nodes are claimed in buckets: a Lease write per bucket and renewal period, not per node (at a
# thousand nodes per-node claims were 250 writes/s besides the nodes' own heartbeats).
SHARD_BUCKETS = 64

# The fence of the work under way in this task: set in a bucket's task, inherited by every task
# its nodes start (asyncio copies the context), read by `FencedClient` as each request leaves.
FENCE: ContextVar[Callable[[], bool] | None] = ContextVar("vkubelet_fence", default=None)


@dataclasses.dataclass(frozen=True)
class ReplicaOptions:
    namespace: str
    identity: str
    timing: LeaseTiming
    shard: bool = False
    health_port: int = 0  # the standby's /healthz (0: none)
    buckets: int = SHARD_BUCKETS  # the same for every replica of a group


def group_of(names: list[str]) -> str:
    """Replicas configured with the same nodes form one group (a label value: short)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:16]


def lease_name(*parts: str) -> str:
    """A Lease name (a DNS subdomain) from parts that may not be one (a hostname, say)."""
    raw = "-".join(("vkubelet", *parts)).lower()
    name = re.sub(r"[^a-z0-9.-]+", "-", raw).strip("-.")
    if len(name) > 200 or name != raw:
        name = f"{name[:180]}-{hashlib.sha256(raw.encode()).hexdigest()[:10]}"
    return name


class FencedClient(KubeClient):
    """The client of work done under a Lease: it sends no write once `may_write()` says no
    (the Lease's renew deadline passed), whatever task asks. The elector cancels that work too,
    but after a pause (SIGSTOP, a frozen VM) queued callbacks run in timer order as the process
    resumes, some before the elector's own: this check, made as each request leaves, catches
    those. Reads stay allowed: they change nothing."""

    may_write: Callable[[], bool] = staticmethod(lambda: True)  # set by `fenced_client`

    def _before_send(self, method: str) -> None:
        fence = FENCE.get() or self.may_write
        if method != "GET" and not fence():
            raise Unreachable(f"{self.server}: fenced: this replica's Lease expired")


def fenced_client(
    kubeconfig: Path | None, options: ClientOptions, may_write: Callable[[], bool]
) -> FencedClient:
    """Made as the agent makes its client (the same kubeconfig, in-cluster rules and options)."""
    client = FencedClient.from_kubeconfig(kubeconfig, options=options)
    assert isinstance(client, FencedClient)
    client.may_write = may_write
    return client


@contextlib.asynccontextmanager
async def lease_loop() -> AsyncIterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, for as long as the context lasts."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vkubelet leases", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()


async def run_on(
    loop: asyncio.AbstractEventLoop | None, work: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Run `work()` as a task on `loop` (another thread's, or this one) until it ends; its error
    is raised here. Cancelled, it cancels that task and waits for its end: work under a Lease
    has stopped when this returns."""
    here = asyncio.get_running_loop()
    there = loop or here
    ended: asyncio.Future[None] = here.create_future()
    started: list[asyncio.Task[None]] = []

    def settle(task: asyncio.Task[None]) -> None:
        if ended.done():
            return
        if task.cancelled():
            ended.cancel()
        elif (error := task.exception()) is not None:
            ended.set_exception(error)
        else:
            ended.set_result(None)

    def start() -> None:
        task = there.create_task(work())
        task.add_done_callback(lambda t: here.call_soon_threadsafe(settle, t))
        started.append(task)

    there.call_soon_threadsafe(start)
    try:
        await asyncio.shield(ended)
    except asyncio.CancelledError:
        if not ended.done():  # cancelled here: stop it there (after `start`: FIFO), await it
            there.call_soon_threadsafe(lambda: started[0].cancel())
            while not ended.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(ended)
        raise
