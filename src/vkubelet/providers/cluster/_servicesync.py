"""Reflecting upper Services below: the upper watch and the sync loop around `_services`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import msgspec

from ...kube import Handler, Reflector
from ...sdk.provider import EventSink, UpperAPI
from ._config import LowerConfig
from ._convert import JSON, name_key
from ._deps import DependencyPlan
from ._lower import LowerCluster
from ._services import plan_services, selects_anything
from ._stamps import is_ours
from ._translate import PodTranslation

__all__ = ["ServiceReflection"]

log = logging.getLogger(__name__)


class ServiceReflection:
    """Upper Services of our pods kept below (`_services` plans, this follows and applies).
    `pods_in(namespaces)`: the provider's running pods there, as JSON."""

    def __init__(
        self,
        config: LowerConfig,
        lower: LowerCluster,
        how: Callable[[], PodTranslation],
        pods_in: Callable[[set[str]], list[JSON]],
        still_adopting: Callable[[], bool],
        events: EventSink,
        node_name: str,
    ) -> None:
        self.config, self.lower, self._how, self._pods_in = config, lower, how, pods_in
        self._still_adopting, self._events, self._node_name = still_adopting, events, node_name
        self.upper: UpperAPI | None = None
        self.upper_services: dict[tuple[str, str], JSON] = {}  # upper (namespace, name)
        self._lower_services: dict[tuple[str, str], JSON] | None = None  # ours, lower key
        self._dirty = asyncio.Event()
        self._listed = asyncio.Event()  # the upper Services, once listed
        self._conflicts: set[tuple[str, str]] = set()  # reported once each

    def changed(self) -> None:
        """The pods changed: so may the Services they need below."""
        self._dirty.set()

    async def follow(self) -> None:
        """List, then watch, the upper Services (every namespace: a `system:node` may)."""
        assert self.upper is not None
        handler = Handler(
            self._put, lambda _old, new: self._put(new), self._drop, on_listed=self._listed.set
        )
        await Reflector(_Raw(self.upper), "/api/v1/services", dict, handler).run()

    async def run(self) -> None:
        """Keep the lower Services (`_services`) matching the upper ones and our pods: at every
        change of either, and every `resync.dependencies` seconds from a fresh lower list."""
        await self._listed.wait()  # never plan from an empty upper view
        relist = True
        while True:
            self._dirty.clear()
            await self.sync(relist=relist)
            relist = False
            try:
                async with asyncio.timeout(self.config.resync.dependencies):
                    await self._dirty.wait()
            except TimeoutError:
                relist = True
            await asyncio.sleep(0.2)  # gather a burst of changes (a Deployment scaling)

    def _put(self, service: JSON) -> None:
        self.upper_services[name_key(service)] = service
        self._dirty.set()

    def _drop(self, service: JSON) -> None:
        self.upper_services.pop(name_key(service), None)
        self._dirty.set()

    async def sync(self, *, relist: bool) -> None:
        owner = self._how().owner
        if self._lower_services is None or relist:
            found = await self.lower.list_objects("Service", selector=owner.selector)
            self._lower_services = {name_key(s): s for s in found if is_ours(s, owner)}
        # Only pods in a namespace where some upper Service selects pods can be selected: in a
        # burst this runs every 0.2 s, and going over every pod each time cost ~1 % of the
        # agent's CPU when no Service selects any of them.
        selecting = {name_key(s)[0] for s in self.upper_services.values() if selects_anything(s)}
        plan = plan_services(
            self.upper_services.values(),
            self._pods_in(selecting),
            self._lower_services,
            owner,
            self._how().lower_namespace,
        )
        if self._still_adopting():
            plan.delete.clear()
            plan.replace.clear()  # a replacement deletes first
        replaced = {name_key(s) for s in plan.replace}
        applied = await self.lower.apply_dependencies(
            DependencyPlan(
                namespaces={name_key(s)[0] for s in plan.create + plan.replace},
                create=plan.create,
                update=plan.update,
                replace=plan.replace,  # deleted first, by UID
                delete=[("Service", *key) for key, _ in plan.delete if key not in replaced],
                uids={("Service", *key): uid for key, uid in plan.delete},
            ),
            owner,
        )
        for (_, namespace, name), obj in applied.written.items():
            if obj is None:
                self._lower_services.pop((namespace, name), None)
            else:
                self._lower_services[(namespace, name)] = obj
        for (_, namespace, name), message in applied.conflicts.items():
            if (namespace, name) not in self._conflicts:
                self._conflicts.add((namespace, name))
                log.warning("%s", message)
                self._events.node_event(self._node_name, "Warning", "LowerServiceConflict", message)
        if applied.problems:
            log.warning("services below: %s", "; ".join(applied.problems))
            self._dirty.set()  # retried after the pause
            await asyncio.sleep(2.0)


class _Raw:
    """The agent's client (`UpperAPI`, plain JSON) as a reflector lists through it."""

    def __init__(self, api: UpperAPI) -> None:
        self._api = api

    async def request_raw(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None
    ) -> bytes:
        assert method == "GET"
        return msgspec.json.encode(await self._api.get(path, params))

    def watch(
        self, path: str, params: Mapping[str, str], *, timeout_seconds: int
    ) -> AsyncIterator[tuple[str, bytes]]:
        return self._api.watch(path, params, timeout_seconds=timeout_seconds)
