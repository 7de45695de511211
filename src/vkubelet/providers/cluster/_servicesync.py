"""Reflecting upper Services below: the upper watches (Services, EndpointSlices) and the sync
loop around `_services`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass

import msgspec

from ...kube import ApiError, Handler, Reflector, Unreachable
from ...sdk.provider import EventSink, UpperAPI
from ._config import LowerConfig
from ._convert import JSON, name_key
from ._deps import DependencyPlan
from ._lower import LowerCluster
from ._services import SERVICE_NAME, held_deletes, plan_services, selects_anything
from ._stamps import Owner, is_ours
from ._translate import PodTranslation

__all__ = ["ServiceReflection", "SharedServices"]

_SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
_KINDS = ("Service", "EndpointSlice")


@dataclass(frozen=True)
class SharedServices:
    """Mirror mode: the members of a fleet share one lower copy of each upper Service, owned
    by the fleet (`name`), so that it is reflected once, by whichever member needs it, and
    stays while any member (`members()`, their node names) has an endpoint of it."""

    name: str
    members: Callable[[], Collection[str]]


log = logging.getLogger(__name__)


class ServiceReflection:
    """Upper Services of our pods kept below (`_services` plans, this follows and applies).
    `pods_in(namespaces)`: the provider's running pods there, as JSON; `shared`: mirror mode."""

    def __init__(
        self,
        config: LowerConfig,
        lower: LowerCluster,
        how: Callable[[], PodTranslation],
        pods_in: Callable[[set[str]], list[JSON]],
        still_adopting: Callable[[], bool],
        events: EventSink,
        node_name: str,
        shared: SharedServices | None = None,
    ) -> None:
        self.config, self.lower, self._how, self._pods_in = config, lower, how, pods_in
        self._still_adopting, self._events, self._node_name = still_adopting, events, node_name
        self._shared = shared
        self.upper: UpperAPI | None = None
        self.upper_services: dict[tuple[str, str], JSON] = {}  # upper (namespace, name)
        # Upper EndpointSlices by their Service's (namespace, name), then by slice name; None
        # until listed (they may not be readable: see `_slices_failed`).
        self.upper_slices: dict[tuple[str, str], dict[str, JSON]] | None = None
        self._slice_store: dict[tuple[str, str], dict[str, JSON]] = {}
        self._lower: dict[tuple[str, str, str], JSON] | None = None  # ours, (kind, ns, name)
        self._dirty = asyncio.Event()
        self._listed = asyncio.Event()  # the upper Services, once listed
        self._slices_tried = asyncio.Event()  # the upper EndpointSlices listed, or refused
        self._slices_refused = False  # reported once
        self._conflicts: set[tuple[str, str]] = set()  # reported once each
        self._unneeded: dict[tuple[str, str, str], float] = {}  # see `held_deletes`

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

    async def follow_slices(self) -> None:
        """List, then watch, the upper EndpointSlices (every namespace), kept by Service."""
        assert self.upper is not None
        handler = Handler(
            self._put_slice,
            lambda _old, new: self._put_slice(new),
            self._drop_slice,
            on_listed=self._slices_listed,
            on_error=self._slices_failed,
        )
        await Reflector(_Raw(self.upper), _SLICES, dict, handler).run()

    @property
    def owner(self) -> Owner:
        """Who owns the lower copies: this node, or in mirror mode its fleet."""
        owner = self._how().owner
        return owner if self._shared is None else Owner(owner.cluster_id, self._shared.name)

    async def run(self) -> None:
        """Keep the lower Services and EndpointSlices (`_services`) matching the upper ones and
        our pods: at every change of either, and every `resync.dependencies` seconds from a
        fresh lower list."""
        await self._listed.wait()  # never plan from an empty upper view
        await self._slices_tried.wait()  # nor delete every slice below for want of a listing
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

    def _service_of(self, endpoint_slice: JSON) -> tuple[str, str]:
        metadata = endpoint_slice.get("metadata") or {}
        service = (metadata.get("labels") or {}).get(SERVICE_NAME, "")
        return (str(metadata.get("namespace")), str(service))

    def _put_slice(self, endpoint_slice: JSON) -> None:
        by_name = self._slice_store.setdefault(self._service_of(endpoint_slice), {})
        by_name[name_key(endpoint_slice)[1]] = endpoint_slice
        self._dirty.set()

    def _drop_slice(self, endpoint_slice: JSON) -> None:
        service = self._service_of(endpoint_slice)
        self._slice_store.get(service, {}).pop(name_key(endpoint_slice)[1], None)
        if not self._slice_store.get(service, True):
            del self._slice_store[service]
        self._dirty.set()

    def _slices_listed(self) -> None:
        if self._slices_refused:
            log.info("upper EndpointSlices: readable now")
        self.upper_slices, self._slices_refused = self._slice_store, False
        self._slices_tried.set()
        self._dirty.set()

    def _slices_failed(self, error: ApiError | Unreachable) -> None:
        """Refused (a `system:node` identity may not read them): the Services are reflected
        without endpoints from elsewhere, said once, until the listing succeeds."""
        if isinstance(error, ApiError) and error.status == 403 and not self._slices_refused:
            self._slices_refused = True
            message = (
                "the upper cluster denies list/watch endpointslices.discovery.k8s.io to this "
                "agent: Services reflected below get no endpoints until it is granted "
                f"(docs/cluster-provider.md, Services): {error.message or error.reason}"
            )
            log.warning("%s", message)
            self._events.node_event(
                self._node_name, "Warning", "UpperEndpointSlicesForbidden", message
            )
            self._slices_tried.set()

    async def _drop_members_copies(self) -> None:
        """Mirror mode: Services an earlier version reflected per member (owned by the member,
        not the fleet, and selecting its lower pods) make way for the fleet's copy."""
        member = self._how().owner
        for found in await self.lower.list_objects("Service", selector=member.selector):
            if is_ours(found, member):
                namespace, name = name_key(found)
                uid = str(found["metadata"].get("uid", ""))
                await self.lower.delete("Service", namespace, name, uid=uid)

    async def sync(self, *, relist: bool) -> None:
        owner = self.owner
        if self._lower is None or relist:
            self._lower = {}
            for kind in _KINDS:
                found = await self.lower.list_objects(kind, selector=owner.selector)
                self._lower |= {(kind, *name_key(o)): o for o in found if is_ours(o, owner)}
            if self._shared is not None:
                await self._drop_members_copies()
        # Only pods in a namespace where some upper Service selects pods can be selected: in a
        # burst this runs every 0.2 s, and going over every pod each time cost ~1 % of the
        # agent's CPU when no Service selects any of them.
        selecting = {name_key(s)[0] for s in self.upper_services.values() if selects_anything(s)}
        slices = self.upper_slices
        plan = plan_services(
            self.upper_services.values(),
            self._pods_in(selecting),
            None if slices is None else {k: list(v.values()) for k, v in slices.items()},
            self._lower,
            owner,
            self._how().lower_namespace,
            {self._node_name} if self._shared is None else self._shared.members(),
        )
        if self._still_adopting():
            plan.delete.clear()
            plan.replace.clear()  # a replacement deletes first
        if self._shared is not None:
            known = self.upper_services.keys()
            before = self._unneeded
            grace = self.config.shared_service_grace
            plan.delete, self._unneeded = held_deletes(
                plan.delete, self._lower, known, before, time.monotonic(), grace
            )
            if self._unneeded.keys() - before.keys():  # another pass once the grace is over
                asyncio.get_running_loop().call_later(grace, self._dirty.set)
        replaced = {("Service", *name_key(s)) for s in plan.replace}
        applied = await self.lower.apply_dependencies(
            DependencyPlan(
                namespaces={name_key(s)[0] for s in plan.create + plan.replace},
                create=plan.create,
                update=plan.update,
                replace=plan.replace,  # deleted first, by UID
                delete=[key for key, _ in plan.delete if key not in replaced],
                uids=dict(plan.delete),
            ),
            owner,
        )
        for key, obj in applied.written.items():
            if obj is None:
                self._lower.pop(key, None)
            else:
                self._lower[key] = obj
        if any(obj["kind"] == "Service" for obj in plan.create + plan.replace):
            self._dirty.set()  # their EndpointSlices, now that they are ours (`plan_services`)
        for (kind, namespace, name), message in applied.conflicts.items():
            if kind == "Service" and (namespace, name) not in self._conflicts:
                self._conflicts.add((namespace, name))
                log.warning("%s", message)
                self._events.node_event(self._node_name, "Warning", "LowerServiceConflict", message)
        if applied.problems:
            log.warning("services below: %s", "; ".join(applied.problems))
            # Another member of a mirror fleet may have written a shared copy meanwhile (a
            # conflict on update): the next pass starts from a fresh listing.
            self._lower = None
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
