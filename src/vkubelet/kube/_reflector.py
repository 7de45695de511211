"""List+watch of one kind of object into a local store, like client-go's reflector.

Why our own: lightkube's watch has no bookmarks and silently resets on 410, and an agent that
must never miss a delete needs to know when it relisted. This one lists in pages, watches from the
list's resourceVersion with bookmarks, resumes from the last version after a dropped connection,
relists on 410 Gone (diffing against the store so the handler still sees every change), and waits
with capped back-off while the apiserver is unreachable — it never gives up.

Objects are typed (decoded into `cls`, keyed "namespace/name") or plain JSON (`cls=dict`, for
callers whose logic works on JSON; keyed by UID, so an object deleted and re-created under its
name is two objects, as a watch reports it).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from ..sdk.retry import Backoff
from ._errors import ApiError, Unreachable, status_error

log = logging.getLogger(__name__)
# The longest wait between attempts while the apiserver cannot be reached.
UNREACHABLE_MAX_BACKOFF = 4.0


class HasMeta(Protocol):
    @property
    def metadata(self) -> Any: ...


T = TypeVar("T", bound=HasMeta | dict[str, Any])


class ListWatch(Protocol):
    """What a reflector asks of a client (`KubeClient` is one)."""

    async def request_raw(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None
    ) -> bytes: ...

    def watch(
        self, path: str, params: Mapping[str, str], *, timeout_seconds: int
    ) -> AsyncIterator[tuple[str, bytes]]: ...


@dataclass
class Handler(Generic[T]):
    """Callbacks for store changes. They run on the event loop and must not block."""

    on_add: Callable[[T], None]
    on_update: Callable[[T, T], None]
    on_delete: Callable[[T], None]
    # After every (re)list, the store being that listing: for state kept beside the store.
    on_listed: Callable[[], None] | None = None
    # A failed list or watch (tried again after the back-off): for a caller whose waiters must
    # hear that the objects could not be read, rather than wait for them.
    on_error: Callable[[ApiError | Unreachable], None] | None = None


def key_of(obj: HasMeta | dict[str, Any]) -> str:
    if isinstance(obj, dict):
        meta = obj.get("metadata") or {}
        return str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
    meta = obj.metadata
    return f"{meta.namespace}/{meta.name}" if meta.namespace else str(meta.name)


def _version_of(obj: HasMeta | dict[str, Any]) -> str | None:
    if isinstance(obj, dict):
        version = (obj.get("metadata") or {}).get("resourceVersion")
        return None if version is None else str(version)
    version = obj.metadata.resourceVersion
    return None if version is None else str(version)


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str | None = None


class _Bookmark(msgspec.Struct):
    metadata: _BookmarkMeta


class _ListMeta(msgspec.Struct):
    resourceVersion: str | None = None
    continue_: str | None = msgspec.field(name="continue", default=None)


class _List(msgspec.Struct):
    metadata: _ListMeta
    items: list[msgspec.Raw]


_list_decoder = msgspec.json.Decoder(_List)


#: Refusals (403) in a row logged at INFO before they become warnings (0.2+0.4+0.8+1.6 s).
_QUIET_FORBIDDEN = 4


class Reflector(Generic[T]):
    def __init__(
        self,
        client: ListWatch,
        path: str,
        cls: type[T],
        handler: Handler[T],
        *,
        params: Mapping[str, str] | None = None,
        page_size: int = 500,
        watch_timeout: tuple[int, int] = (300, 600),
        name: str = "",
        decode: Callable[[bytes], T] | None = None,
        relist_every: int | None = None,
        from_now: bool = False,
    ) -> None:
        """`decode` turns one object's JSON into T (default: msgspec into `cls`).
        `relist_every`: each watch lasts that long and is followed by a relist, for a store
        that must notice objects gone without a DELETED event (missed by a watch that was
        down). `from_now`: a stream of changes, not a state (Events): no listing (one item is
        read for the version), no store, no history replayed, and after 410 Gone the watch
        starts from now again."""
        self._client = client
        self._path = path
        self._handler = handler
        self._params = dict(params or {})
        self._page_size = page_size
        self._watch_timeout = (relist_every, relist_every) if relist_every else watch_timeout
        self._relist_each = relist_every is not None
        self._from_now = from_now
        self.name = name or path
        self.items: dict[str, T] = {}
        self.resource_version: str | None = None
        self.synced = asyncio.Event()
        self.relists = 0  # observable in tests and metrics
        self._backoff = Backoff(initial=0.2, cap=30.0)
        self._decode: Callable[[bytes], T] = decode or msgspec.json.Decoder(cls).decode

    async def run(self) -> None:
        """Run until cancelled."""
        while True:
            try:
                if self.resource_version is None:
                    await self._relist()
                await self._watch()
                if self._relist_each:
                    self.resource_version = None
                self._backoff.reset()
                delay = self._backoff.delay(1)  # a watch that ended: again soon, not at once
            except ApiError as e:
                if e.gone:
                    log.info("%s: resourceVersion too old (410 Gone); relisting", self.name)
                    self.resource_version = None
                    continue
                if self._handler.on_error is not None:
                    self._handler.on_error(e)
                overloaded = e.status >= 500 or e.status == 429  # an apiserver starting or busy
                delay = self._backoff.next_delay(
                    cap=UNREACHABLE_MAX_BACKOFF if overloaded else None
                )
                # A node identity's first 403s are often the Node authorizer not yet knowing
                # of the pod that references the object (it learns a moment after the pod
                # appears): a warning only once the refusal lasts (~3 s).
                quiet = e.status == 403 and self._backoff.failures <= _QUIET_FORBIDDEN
                level = logging.INFO if quiet else logging.WARNING
                log.log(level, "%s: %s; retrying in %.1fs", self.name, e, delay)
            except Unreachable as e:
                if self._handler.on_error is not None:
                    self._handler.on_error(e)
                # Cheap to try (a refused connection) and what everything waits for: an apiserver
                # back from a restart is noticed within seconds, not up to 30 s later.
                delay = self._backoff.next_delay(cap=UNREACHABLE_MAX_BACKOFF)
                log.warning(
                    "%s: apiserver unreachable (%s); retrying in %.1fs", self.name, e, delay
                )
            await asyncio.sleep(delay)

    def _prepare(self, obj: T) -> T:
        # managedFields are a large share of every object and of no use to an agent.
        if isinstance(obj, dict):
            (obj.get("metadata") or {}).pop("managedFields", None)
        else:
            obj.metadata.managedFields = None
        return obj

    async def _relist(self) -> None:
        if self._from_now:
            params = {**self._params, "limit": "1"}
            page = await self._client.request_raw("GET", self._path, params=params)
            self.resource_version = _list_decoder.decode(page).metadata.resourceVersion
            self.synced.set()
            return
        seen: dict[str, T] = {}
        params = {**self._params, "limit": str(self._page_size)}
        version: str | None = None
        while True:
            page = await self._client.request_raw("GET", self._path, params=params)
            decoded = _list_decoder.decode(page)
            for item in decoded.items:
                try:
                    obj = self._prepare(self._decode(item))
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    log.error("%s: skipping an object that cannot be decoded: %s", self.name, e)
                    continue
                seen[key_of(obj)] = obj
            version = decoded.metadata.resourceVersion
            if not decoded.metadata.continue_:
                break
            params["continue"] = decoded.metadata.continue_
        self.relists += 1
        old = self.items
        self.items = seen
        for key, obj in seen.items():
            before = old.get(key)
            if before is None:
                self._handler.on_add(obj)
            elif _version_of(before) != _version_of(obj):
                self._handler.on_update(before, obj)
        for key, obj in old.items():
            if key not in seen:
                self._handler.on_delete(obj)
        self.resource_version = version
        if self._handler.on_listed is not None:
            self._handler.on_listed()
        self.synced.set()

    async def _watch(self) -> None:
        low, high = self._watch_timeout
        params = {
            **self._params,
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version or "",
        }
        timeout = random.randint(low, high)  # noqa: S311 - spreads reconnects of many watchers
        async for kind, raw in self._client.watch(self._path, params, timeout_seconds=timeout):
            if kind == "BOOKMARK":
                bookmark = msgspec.json.decode(raw, type=_Bookmark)
                self.resource_version = bookmark.metadata.resourceVersion
                continue
            if kind == "ERROR":
                raise status_error(raw)
            try:
                obj = self._prepare(self._decode(raw))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # Never crash on one bad object; relist so that nothing after it is missed.
                log.error("%s: undecodable watch event (%s); relisting", self.name, e)
                self.resource_version = None
                return
            key = key_of(obj)
            if kind == "DELETED":
                self.items.pop(key, None)
                self._handler.on_delete(obj)
            elif self._from_now and kind == "ADDED":
                self._handler.on_add(obj)
            elif self._from_now:
                self._handler.on_update(obj, obj)
            else:
                before = self.items.get(key)
                self.items[key] = obj
                if before is None:
                    self._handler.on_add(obj)
                else:
                    self._handler.on_update(before, obj)
            self.resource_version = _version_of(obj)
