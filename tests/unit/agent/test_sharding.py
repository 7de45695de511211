"""Sharding on an in-memory Lease API with the apiserver's optimistic concurrency: nodes dealt
into buckets alike by every replica, buckets shared fairly with each node run exactly once, a
cut-off replica's buckets stopped before the others take them, every write of a node fenced by
its own bucket's Lease only, and renewals that keep their deadline while the nodes' event loop
is blocked."""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import httpx2 as httpx
import pytest

from vkubelet.agent import ReplicaOptions, _leases, _sharding
from vkubelet.agent._leases import FencedClient
from vkubelet.agent._sharding import ShardRunner, buckets_of
from vkubelet.kube import LeaseConflict, LeaseTiming, Unreachable
from vkubelet.node import NodeSettings, NodeSpec
from vkubelet.testing.fakeapi import kubeconfig
from vkubelet.testing.harness import eventually

JSON = dict[str, Any]
TIMING = LeaseTiming(duration=1.0, renew_deadline=0.7, retry=0.2)


class FakeApi:
    """Leases of one namespace as the apiserver keeps them: 409 on a stale write."""

    def __init__(self) -> None:
        self.leases: dict[str, JSON] = {}
        self.version = 0

    def store(self, lease: JSON) -> JSON:
        self.version += 1
        lease = copy.deepcopy(lease)
        lease["metadata"]["resourceVersion"] = str(self.version)
        self.leases[lease["metadata"]["name"]] = lease
        return copy.deepcopy(lease)


class Store:
    """One replica's view of the API; `cut` makes every request fail (a partition)."""

    def __init__(self, api: FakeApi) -> None:
        self.api = api
        self.cut = False

    def _check(self) -> None:
        if self.cut:
            raise ConnectionRefusedError("partitioned")

    async def get(self, namespace: str, name: str) -> JSON | None:
        self._check()
        return copy.deepcopy(self.api.leases.get(name))

    async def create(self, lease: JSON) -> JSON:
        self._check()
        if lease["metadata"]["name"] in self.api.leases:
            raise LeaseConflict("exists")
        return self.api.store(lease)

    async def replace(self, lease: JSON) -> JSON:
        self._check()
        stored = self.api.leases[lease["metadata"]["name"]]
        if lease["metadata"]["resourceVersion"] != stored["metadata"]["resourceVersion"]:
            raise LeaseConflict("stale")
        return self.api.store(lease)

    async def list(self, namespace: str, selector: str) -> list[JSON]:
        self._check()
        key, value = selector.split("=")
        return [
            copy.deepcopy(lease)
            for lease in self.api.leases.values()
            if lease["metadata"].get("labels", {}).get(key) == value
        ]

    async def delete(self, namespace: str, name: str) -> None:
        self._check()
        self.api.leases.pop(name, None)


class Runs:
    """Which replica runs which node, and when nodes started and stopped."""

    def __init__(self) -> None:
        self.now: dict[str, list[str]] = {}  # node -> replicas running it now
        self.started: list[tuple[float, str, str]] = []
        self.stopped: list[tuple[float, str, str]] = []
        self.fences: dict[str, Any] = {}  # node -> the fence its writes answer to


class Replica(ShardRunner):
    def __init__(self, identity: str, names: list[str], runs: Runs, store: Store) -> None:
        specs = [NodeSpec(NodeSettings(name=n, provider="mock"), Path("m.json")) for n in names]
        options = ReplicaOptions("ns", identity, TIMING, shard=True, buckets=8)
        super().__init__(cast(Any, None), specs, options)
        self.runs, self.store = runs, store
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """As the agent runs it: claims in a thread of their own, nodes on this loop."""
        self.task = asyncio.create_task(self.run())

    async def _run_with_own_client(self) -> None:
        await self._run(self.store)

    async def _run_node(self, name: str) -> None:
        identity = self.options.identity
        self.runs.now.setdefault(name, []).append(identity)
        self.runs.started.append((time.monotonic(), identity, name))
        self.runs.fences[name] = _leases.FENCE.get()
        try:
            await asyncio.Future()
        finally:
            self.runs.now[name].remove(identity)
            self.runs.stopped.append((time.monotonic(), identity, name))


async def stop(replicas: list[Replica]) -> None:
    for r in replicas:
        assert r.task is not None
        r.task.cancel()
    await asyncio.gather(*(r.task for r in replicas if r.task), return_exceptions=True)


@pytest.fixture(autouse=True)
def no_start_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sharding, "START_SPREAD_SECONDS", 0.0)


NAMES = [f"node-{i:02d}" for i in range(20)]


def test_every_replica_deals_the_nodes_into_the_same_even_buckets() -> None:
    buckets = buckets_of(NAMES, 8)
    assert buckets == buckets_of(list(reversed(NAMES)), 8)
    assert sorted(n for b in buckets for n in b) == sorted(NAMES)
    assert {len(b) for b in buckets} == {2, 3}  # 20 in 8: sizes differ by one at most
    assert buckets_of(NAMES[:5], 8) == [[n] for n in NAMES[:5]]  # fewer nodes: one each
    assert len(buckets_of([f"n{i}" for i in range(1000)])) == 64  # the default


def started(count: int, api: FakeApi, runs: Runs) -> list[Replica]:
    """`count` replicas of one group, running, each with its own view of the shared API."""
    replicas = [Replica(f"r{i}", NAMES, runs, Store(api)) for i in range(count)]
    for r in replicas:
        r.start()
    return replicas


def settled(replicas: list[Replica], runs: Runs) -> bool:
    """Each node run exactly once, by a live replica, none above its fair share of buckets."""
    live = {r.options.identity for r in replicas}
    if sorted(runs.now) != sorted(NAMES) or any(
        len(ids) != 1 or ids[0] not in live for ids in runs.now.values()
    ):
        return False
    fair = -(-8 // len(replicas))
    return all(len(r.running) <= fair for r in replicas)


async def test_replicas_share_the_buckets_fairly_and_run_each_node_exactly_once() -> None:
    api, runs = FakeApi(), Runs()
    replicas = started(3, api, runs)
    try:
        await eventually(lambda: settled(replicas, runs), within=10)
        # ...and stays so: no node stopped or started twice over a few lease durations.
        starts = len(runs.started)
        end = time.monotonic() + 3 * TIMING.duration
        while time.monotonic() < end:
            assert all(len(ids) <= 1 for ids in runs.now.values())
            await asyncio.sleep(0.05)
        assert settled(replicas, runs) and len(runs.started) == starts
        assert Counter(len(r.running) for r in replicas) == Counter({3: 2, 2: 1})
        # One Lease per bucket and one per replica, none per node.
        assert len(api.leases) == 8 + 3
    finally:
        await stop(replicas)


async def test_a_cut_off_replicas_nodes_stop_before_the_others_start_them() -> None:
    api, runs = FakeApi(), Runs()
    replicas = started(3, api, runs)
    try:
        await eventually(lambda: settled(replicas, runs), within=10)
        victim = replicas[2]
        its_nodes = {n for n, ids in runs.now.items() if ids == ["r2"]}
        cut_at = time.monotonic()
        victim.store.cut = True
        await eventually(lambda: settled(replicas[:2], runs), within=10)
        took = time.monotonic() - cut_at
        # Taken over after one lease duration, plus a round or two: not before, not much after.
        assert TIMING.duration <= took < TIMING.duration + 4 * TIMING.retry
        for node in its_nodes:
            stopped = max(t for t, who, n in runs.stopped if n == node and who == "r2")
            restarted = max(t for t, who, n in runs.started if n == node and who != "r2")
            assert stopped < restarted
            assert stopped - cut_at <= TIMING.renew_deadline + 0.1  # by its own deadline
    finally:
        await stop(replicas)


async def test_a_replica_joining_later_gets_buckets_handed_back_to_it() -> None:
    api, runs = FakeApi(), Runs()
    replicas = started(2, api, runs)
    try:
        await eventually(lambda: settled(replicas, runs), within=10)
        late = Replica("r2", NAMES, runs, Store(api))
        replicas.append(late)
        late.start()
        await eventually(lambda: settled(replicas, runs) and len(late.running) >= 2, within=10)
    finally:
        await stop(replicas)


async def test_a_nodes_writes_answer_to_its_own_buckets_lease_only() -> None:
    api, runs = FakeApi(), Runs()
    replica = Replica("r0", NAMES, runs, Store(api))
    replica.start()
    try:
        await eventually(lambda: sorted(runs.now) == NAMES, within=10)
        for index, bucket in enumerate(replica.buckets):
            for node in bucket:
                assert runs.fences[node] == replica.electors[index].holds
    finally:
        await stop([replica])

    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.method)
        return httpx.Response(200, json={})

    client = FencedClient(kubeconfig(), transport=httpx.MockTransport(handler))
    client.may_write = lambda: True  # every other bucket holds

    async def in_a_lapsed_bucket() -> None:
        _leases.FENCE.set(lambda: False)
        with pytest.raises(Unreachable, match="fenced"):
            await client.patch("/api/v1/nodes/n", {"metadata": {}})
        await client.get("/api/v1/nodes/n")

    await asyncio.create_task(in_a_lapsed_bucket())
    await client.patch("/api/v1/nodes/other", {"metadata": {}})  # another bucket's node
    assert sent == ["GET", "PATCH"]
    await client.aclose()


async def test_renewals_keep_their_deadline_while_the_nodes_loop_is_blocked() -> None:
    """The claims run on a loop of their own: a node start-up holding the nodes' loop for
    longer than the renew deadline (here by blocking it outright) stops no bucket."""
    api, runs = FakeApi(), Runs()
    replica = Replica("r0", NAMES, runs, Store(api))
    replica.start()
    try:
        await eventually(lambda: sorted(runs.now) == NAMES, within=10)
        renewals = api.version
        time.sleep(3 * TIMING.renew_deadline)  # noqa: ASYNC251 - the point: a blocked loop
        assert api.version > renewals  # renewed meanwhile, from the claims' thread
        await asyncio.sleep(0.1)
        assert sorted(runs.now) == NAMES and len(runs.stopped) == 0
    finally:
        await stop([replica])
