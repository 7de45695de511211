"""The object cache: each ConfigMap or Secret a pod uses is followed by name; what a pod cannot
read fails its read (rather than reading as absent), and the pods hear of every change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from vkubelet.node._objects import ObjectCache, ReadFailed, Ref
from vkubelet.testing.fakeapi import FakeApiServer

from .helpers import NS, configmap, eventually

CONF: Ref = ("ConfigMap", NS, "conf")


@dataclass
class Told:
    changes: list[tuple[Ref, set[str]]] = field(default_factory=list)

    def __call__(self, ref: Ref, users: set[str]) -> None:
        self.changes.append((ref, users))


@dataclass
class Cache:
    api: FakeApiServer
    objects: ObjectCache
    told: Told


@pytest.fixture
async def cache() -> AsyncIterator[Cache]:
    api = FakeApiServer()
    client = api.client()
    told = Told()
    objects = ObjectCache(client, told)
    yield Cache(api, objects, told)
    await objects.aclose()
    await client.aclose()


def data_of(objects: ObjectCache, ref: Ref) -> object:
    found = objects.get(ref)
    return None if found is None else found.get("data")


async def test_an_object_that_cannot_be_read_fails_the_read_until_it_can(cache: Cache) -> None:
    cache.api.create("configmaps", configmap("conf", {"level": "info"}))
    cache.api.fail("GET", f"^/api/v1/namespaces/{NS}/configmaps$", status=403)
    await cache.objects.use("web", {CONF})
    with pytest.raises(ReadFailed, match="ConfigMap shop/conf"):
        cache.objects.get(CONF)
    await eventually(lambda: cache.told.changes == [(CONF, {"web"})], what="the recovery told")
    assert data_of(cache.objects, CONF) == {"level": "info"}


async def test_a_missing_object_reads_as_none_and_its_creation_is_told(cache: Cache) -> None:
    await cache.objects.use("web", {CONF})
    assert cache.objects.get(CONF) is None
    cache.api.create("configmaps", configmap("conf", {"level": "info"}))
    await eventually(lambda: cache.told.changes == [(CONF, {"web"})], what="the creation told")
    assert data_of(cache.objects, CONF) == {"level": "info"}


async def test_a_deleted_then_recreated_object_reads_as_the_new_one(cache: Cache) -> None:
    cache.api.create("configmaps", configmap("conf", {"level": "info"}))
    await cache.objects.use("web", {CONF})
    cache.api.delete("configmaps", "conf", NS)
    await eventually(lambda: cache.objects.get(CONF) is None, what="the deletion seen")
    cache.api.create("configmaps", configmap("conf", {"level": "debug"}))
    await eventually(lambda: data_of(cache.objects, CONF) == {"level": "debug"})
    assert [users for _, users in cache.told.changes] == [{"web"}, {"web"}]


async def test_the_watch_stops_when_its_last_user_releases_it(cache: Cache) -> None:
    cache.api.create("configmaps", configmap("conf", {"level": "info"}))
    await cache.objects.use("web", {CONF})
    await cache.objects.use("api", {CONF})
    cache.objects.release("web")
    assert len(cache.objects) == 1
    cache.objects.release("api")
    assert len(cache.objects) == 0
    await eventually(lambda: cache.api.watch_count("configmaps") == 0, what="the watch closed")
