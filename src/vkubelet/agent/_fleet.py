"""Fleets: one node agent per member of a provider's changing set of nodes.

The fleet loop only decides; it never waits for a member's work. Members start at once (their
kubelet API follows when the fleet's serving certificate is there) and a member that left is
drained in a task of its own: cordoned, its pods evicted (respecting disruption budgets, leaving
DaemonSet pods as `kubectl drain --ignore-daemonsets` does), then its Node deleted. A member
that comes back while its old node drains is started again once that drain has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from ..kube import ApiError, Unreachable
from ..node import FleetNode, NodeFleet, NodeSpec, PodRecord, ServingCertificate
from ..sdk.tasks import TaskSet, run_supervised
from ._runner import NodeHost, NodeRunner, OnCsr

log = logging.getLogger(__name__)

# How often a drain looks again at the pods it waits for.
DRAIN_POLL_SECONDS = 2.0
# How long a failed API call of a drain waits before it is tried again.
RETRY_SECONDS = 5.0


@dataclasses.dataclass(eq=False)
class Member:
    member: FleetNode
    runner: NodeRunner
    task: asyncio.Task[None] | None = None


class FleetRunner:
    def __init__(self, host: NodeHost, spec: NodeSpec, fleet: NodeFleet) -> None:
        self._host = host
        self.spec = spec
        self.fleet = fleet
        self.name = spec.settings.name
        self.members: dict[str, Member] = {}
        self.draining: dict[str, Member] = {}
        self._wanted: dict[str, FleetNode] | None = None
        self._wake = asyncio.Event()
        self._skipped: set[str] = set()
        self._drains = TaskSet(f"fleet {self.name}", logger=log)
        self._running = TaskSet(f"fleet {self.name}", logger=log)
        self._tls: ssl.SSLContext | None = None
        self._tls_ready = asyncio.Event()
        self._csr: str | None = None

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(
                run_supervised(self._watch, name=f"fleet {self.name}: watch", logger=log)
            )
            if self._host.config.kubelet_api:
                group.create_task(
                    run_supervised(self._serve_tls, name=f"fleet {self.name}: TLS", logger=log)
                )
            while True:
                await self._wake.wait()
                self._wake.clear()
                await self.reconcile()

    async def _watch(self) -> None:
        async for members in self.fleet.watch_nodes():
            self._wanted = {m.name: m for m in members}
            self._wake.set()

    async def _serve_tls(self) -> None:
        """Every member is served at the fleet's address, each on a port of its own (so
        node-level requests such as /stats/summary reach the right member): one certificate for
        the address serves them all."""
        context, certificate = await self._host.tls_context(
            self.name, self.spec.settings.address_list(), self._on_csr
        )
        self._tls = context
        self._tls_ready.set()
        if certificate is not None:
            await certificate.renew_forever()

    def _on_csr(self, csr: str | None) -> None:
        self._csr = csr
        if not self._tls_ready.is_set():
            for member in self.members.values():
                if member.runner.readiness is not None:
                    member.runner.readiness.waiting_for(csr)

    async def reconcile(self) -> None:
        wanted = self._wanted
        if wanted is None:
            return
        for name in sorted(set(self.members) - set(wanted)):
            member = self.members.pop(name)
            self.draining[name] = member
            self._drains.spawn(self._drain(name, member), name=f"drain {name}")
        for name, fleet_node in wanted.items():
            running = self.members.get(name)
            if running is not None:
                if running.member is not fleet_node:
                    # Changed: restart its agent, keep its node and pods (no drain).
                    keep = running.member.provider is fleet_node.provider
                    await self._stop(running, close_provider=not keep)
                    self._start(fleet_node)
                continue
            if name in self.draining:
                continue  # gone and back: started once the old node has drained
            if self._host.node_exists(name):
                if name not in self._skipped:
                    log.error("fleet %s: node %s exists already; skipped", self.name, name)
                    self._skipped.add(name)
                continue
            self._start(fleet_node)

    def _start(self, fleet_node: FleetNode) -> None:
        host = self._host
        base = self.spec.settings
        settings = dataclasses.replace(
            base,
            name=fleet_node.name,
            labels={**base.labels, **fleet_node.labels},
            taints=[dict(t) for t in fleet_node.taints]
            if fleet_node.taints is not None
            else base.taints,
            addresses=[dict(a) for a in base.addresses],
            kubelet_port=host.free_port() if host.config.kubelet_api else 0,
        )
        runner = NodeRunner(host, [(settings, fleet_node.provider)], tls=self._member_tls)
        if runner.readiness is not None and self._csr is not None and not self._tls_ready.is_set():
            runner.readiness.csr = self._csr
        member = Member(fleet_node, runner)
        name = fleet_node.name
        member.task = self._running.spawn(runner.run(), name=f"node {name}")
        self.members[fleet_node.name] = member
        log.info("fleet %s: node %s started", self.name, fleet_node.name)

    async def _member_tls(self, _: OnCsr) -> tuple[ssl.SSLContext, ServingCertificate | None]:
        """The fleet's own context (its CSR shows on every member, see `_on_csr`); the fleet
        renews its certificate."""
        await self._tls_ready.wait()
        assert self._tls is not None
        return self._tls, None

    async def _stop(self, member: Member, *, close_provider: bool = True) -> None:
        """Stop a member's agent and servers; close its provider (once) unless it stays."""
        member.runner.close_providers = close_provider
        if member.task is not None:
            member.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await member.task
            member.task = None
        await member.runner.stop()  # in case its task was cancelled before it started

    async def _drain(self, name: str, member: Member) -> None:
        """Cordon the node, evict its pods, then delete it. Its agent keeps running meanwhile,
        so the evicted pods stop gracefully on the member's backend; disruption budgets are
        respected (an eviction they refuse is retried). DaemonSet pods are left alone: they
        neither block the drain nor would stay away (their controller tolerates cordons)."""
        client = self._host.client
        path = f"/api/v1/nodes/{name}"
        try:
            log.info("node %s left its fleet: draining it", name)
            await until_done(
                f"node {name}: cordon",
                lambda: client.patch(path, {"spec": {"unschedulable": True}}),
            )
            while pods := [
                r
                for r in member.runner.nodes[0].pods.reflector.items.values()
                if not daemonset_pod(r)
            ]:
                for record in pods:
                    if not record.deleting:
                        await self._evict(name, record)
                await asyncio.sleep(DRAIN_POLL_SECONDS)
            await self._stop(member)
            await until_done(f"node {name}: delete", lambda: client.delete(path))
            log.info("node %s drained and deleted", name)
        finally:
            if member.task is not None:  # the drain failed or was cancelled: stop it anyway
                await self._stop(member)
            self.draining.pop(name, None)
            self._wake.set()

    async def _evict(self, name: str, record: PodRecord) -> None:
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": record.name, "namespace": record.namespace},
        }
        where = f"{record.namespace}/{record.name}"
        try:
            await self._host.client.create(
                f"/api/v1/namespaces/{record.namespace}/pods/{record.name}/eviction", eviction
            )
        except Unreachable:
            pass
        except ApiError as e:
            if e.status == 429:
                log.info("node %s: eviction of %s refused for now: %s", name, where, e)
            elif not e.not_found:
                log.warning("node %s: cannot evict %s: %s", name, where, e)

    async def aclose(self) -> None:
        """Stop everything: drains, members (closing their providers), then the fleet itself."""
        await self._drains.aclose()
        for member in [*self.members.values(), *self.draining.values()]:
            await self._stop(member)
        self.members.clear()
        self.draining.clear()
        await self._running.aclose()
        await self._host.close_provider(self.fleet)


def daemonset_pod(record: PodRecord) -> bool:
    """Whether a DaemonSet owns the pod (its controller would recreate it on the node anyway)."""
    try:
        pod: dict[str, Any] = json.loads(record.raw)
    except ValueError:
        return False
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("kind") == "DaemonSet" and o.get("controller") for o in owners)


async def until_done(what: str, call: Callable[[], Awaitable[object]]) -> None:
    """Retry an API call until it succeeds or its object is gone (both mean: done)."""
    while True:
        try:
            await call()
            return
        except ApiError as e:
            if e.not_found:
                return
            log.warning("%s failed (%s); retrying", what, e)
        except Unreachable:
            pass
        await asyncio.sleep(RETRY_SECONDS)
