"""Mirror mode: one virtual node per lower node, as a fleet (`NodeFleet`) the agent runs.

The fleet only follows which lower nodes exist (list, then watch; re-listed every
`resync.nodes` seconds) and gives each a `ClusterProvider` pinned to it (`lower_node`): that
provider follows its node's capacity, labels, cordon and readiness itself, so a change to a lower
node never restarts its member. A lower node that appears is registered upstairs at once; one
that vanishes leaves the fleet, and the agent drains its virtual node (cordon, evictions that
respect disruption budgets, then the Node is deleted), as for any fleet.

Each member is its own owner below (`<upperClusterID>/<member name>`): its pods, adoption after a
restart and its dependency copies are its own, exactly as for an aggregate node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import AsyncGenerator, Sequence

import msgspec

from ...kube import ApiError, Unreachable
from ...node import FleetNode
from ...sdk.provider import ProviderContext
from ._config import LowerConfig
from ._lower import LowerCluster, open_lower
from ._provider import ClusterProvider

__all__ = ["ClusterFleet", "member_name"]

log = logging.getLogger(__name__)

RETRY_SECONDS = 2.0
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

    def _member(self, lower_node: str) -> FleetNode:
        found = self._members.get(lower_node)
        if found is None:
            name = member_name(self.context.node_name, lower_node)
            provider = ClusterProvider(
                self.config,
                dataclasses.replace(self.context, node_name=name),
                open_lower(self.config),
                lower_node=lower_node,
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
        known: set[str] | None = None
        while True:
            try:
                answer = await self.lower.client.get("/api/v1/nodes")
            except (ApiError, Unreachable) as e:
                log.warning("mirror %s: cannot list the lower nodes: %s", self.context.node_name, e)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            names = {str(n["metadata"]["name"]) for n in answer.get("items") or []}
            if names != known:
                known = names
                yield self._current(names)
            version = str((answer.get("metadata") or {}).get("resourceVersion", ""))
            params = {"resourceVersion": version, "allowWatchBookmarks": "true"}
            try:
                async for kind, raw in self.lower.client.watch(
                    "/api/v1/nodes", params, timeout_seconds=max(1, int(self.config.resync.nodes))
                ):
                    if kind == "ERROR":
                        break
                    if kind not in ("ADDED", "DELETED"):
                        continue
                    name = str(msgspec.json.decode(raw)["metadata"]["name"])
                    changed = (known | {name}) if kind == "ADDED" else (known - {name})
                    if changed != known:
                        known = changed
                        yield self._current(known)
            except (ApiError, Unreachable) as e:
                log.warning("mirror %s: lower node watch ended: %s", self.context.node_name, e)
                await asyncio.sleep(RETRY_SECONDS)

    async def aclose(self) -> None:
        await self.lower.aclose()
