"""Mirror mode: one virtual node per lower node, as a fleet (`NodeFleet`) the agent runs.

The fleet only follows which lower nodes exist (a reflector: list, then watch; re-listed every
`resync.nodes` seconds) and gives each a `ClusterProvider` pinned to it (`lower_node`): that
provider follows its node's capacity, labels, cordon and readiness itself, so a change to a lower
node never restarts its member. A lower node that appears is registered upstairs at once; one
that vanishes leaves the fleet, and the agent drains its virtual node (cordon, evictions that
respect disruption budgets, then the Node is deleted), as for any fleet.

Each member is its own owner below (`<upperClusterID>/<member name>`): its pods, adoption after a
restart and its dependency copies are its own, exactly as for an aggregate node. Services below
are the fleet's (`SharedServices`): one copy each, written by whichever member needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncGenerator, Sequence
from functools import partial

from ...kube import Handler, Reflector
from ...sdk import FleetNode
from ...sdk.provider import ProviderContext
from ._config import LowerConfig
from ._convert import JSON
from ._lower import LowerCluster, open_lower
from ._provider import ClusterProvider
from ._servicesync import SharedServices

__all__ = ["ClusterFleet", "member_name"]

log = logging.getLogger(__name__)

_MAX_NAME = 253


def member_name(prefix: str, lower_node: str) -> str:
    """`<virtual node name>-<lower node name>`: readable, and distinct per lower node. A name
    over the API's limit keeps its start and ends with a hash of the whole."""
    name = f"{prefix}-{lower_node}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: _MAX_NAME - 11].rstrip('-.')}-{digest}"


class ClusterFleet:
    """Implements `NodeFleet` for `mode: mirror`."""

    def __init__(self, config: LowerConfig, context: ProviderContext, lower: LowerCluster) -> None:
        self.config = config
        self.context = context
        self.lower = lower
        self._members: dict[str, FleetNode] = {}  # lower node name -> its member
        self._shared = SharedServices(context.node_name, self._member_names)

    def _member_names(self) -> set[str]:
        return {member.name for member in self._members.values()}

    def _member(self, lower_node: str) -> FleetNode:
        found = self._members.get(lower_node)
        if found is None:
            name = member_name(self.context.node_name, lower_node)
            provider = ClusterProvider(
                self.config,
                dataclasses.replace(self.context, node_name=name),
                open_lower(self.config),
                lower_node=lower_node,
                shared_services=self._shared,
            )
            found = FleetNode(name=name, provider=provider)
            self._members[lower_node] = found
        return found

    def _current(self, names: set[str]) -> list[FleetNode]:
        for gone in set(self._members) - names:
            del self._members[gone]  # the agent drains it and closes its provider
        return [self._member(n) for n in sorted(names)]

    async def watch_nodes(self) -> AsyncGenerator[Sequence[FleetNode], None]:
        """The lower nodes, whole, at start and after every node added or deleted. While the
        lower apiserver does not answer, the members stay (their pings make them NotReady)."""
        names: set[str] = set()
        changes: asyncio.Queue[set[str]] = asyncio.Queue()  # the names after each change

        def change(node: JSON, *, gone: bool = False) -> None:
            name = str(node["metadata"]["name"])
            if gone:
                names.discard(name)
            else:
                names.add(name)
            if nodes.synced.is_set():  # the first listing is told whole, once (`listed`)
                changes.put_nowait(set(names))

        def listed() -> None:
            names.clear()
            names.update(str(n["metadata"]["name"]) for n in nodes.items.values())
            changes.put_nowait(set(names))

        nodes: Reflector[JSON] = Reflector(
            self.lower.client,
            "/api/v1/nodes",
            dict,
            Handler(change, lambda _old, _new: None, partial(change, gone=True), listed),
            relist_every=max(1, int(self.config.resync.nodes)),
            name=f"mirror {self.context.node_name}: lower nodes",
        )
        following = asyncio.create_task(nodes.run())
        known: set[str] | None = None
        try:
            while True:
                current = await changes.get()
                if current != known:
                    known = current
                    yield self._current(current)
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following

    async def aclose(self) -> None:
        await self.lower.aclose()
