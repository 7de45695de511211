"""The reflector: paged list, then watch with bookmarks; resume after a dropped connection from
the last resourceVersion; relist on 410 Gone with a diff that reports what happened meanwhile;
patience while the apiserver is unreachable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.kube import Handler, KubeClient, Reflector, key_of
from vkubelet.testing.fakeapi import FakeApiServer

from ..node.helpers import NODE, NS, eventually, pod


@dataclass
class Seen:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    def handler(self) -> Handler[Pod]:
        return Handler(
            lambda p: self.added.append(key_of(p)),
            lambda _old, new: self.updated.append(key_of(new)),
            lambda p: self.deleted.append(key_of(p)),
        )


@dataclass
class Running:
    api: FakeApiServer
    client: KubeClient
    reflector: Reflector[Pod]
    seen: Seen
    task: asyncio.Task[None]


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


@pytest.fixture
async def running(api: FakeApiServer) -> AsyncIterator[Running]:
    api.create("pods", pod("a"))
    api.create("pods", pod("b"))
    api.create("pods", pod("elsewhere", node="other-node"))
    client = api.client()
    seen = Seen()
    reflector = Reflector(
        client,
        "/api/v1/pods",
        Pod,
        seen.handler(),
        params={"fieldSelector": f"spec.nodeName={NODE}"},
        page_size=1,
    )
    task = asyncio.create_task(reflector.run())
    await asyncio.wait_for(reflector.synced.wait(), 5)
    await eventually(lambda: api.watch_count("pods") == 1, what="the watch to open")
    yield Running(api, client, reflector, seen, task)
    assert not task.done(), "the reflector must run until cancelled"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await client.aclose()


async def test_lists_in_pages_then_watches_only_this_nodes_pods(running: Running) -> None:
    api, reflector, seen = running.api, running.reflector, running.seen
    assert sorted(reflector.items) == [f"{NS}/a", f"{NS}/b"]
    assert sorted(seen.added) == [f"{NS}/a", f"{NS}/b"]
    lists = api.calls_to("GET", "^/api/v1/pods$")
    assert [c.params.get("limit") for c in lists] == ["1", "1"]
    assert "continue" in lists[1].params
    assert all(c.params["fieldSelector"] == f"spec.nodeName={NODE}" for c in lists)
    watch = api.calls_to("GET", "^/api/v1/pods$", watch=True)[0]
    assert watch.params["allowWatchBookmarks"] == "true"
    assert watch.params["resourceVersion"] == reflector.resource_version

    api.create("pods", pod("c"))
    api.create("pods", pod("not-ours", node="other-node"))
    api.patch("pods", "a", {"metadata": {"labels": {"x": "1"}}}, NS)
    api.delete("pods", "b", NS, grace=0)
    await eventually(lambda: seen.deleted == [f"{NS}/b"])
    assert seen.added[-1] == f"{NS}/c"
    assert seen.updated == [f"{NS}/a"]
    assert sorted(reflector.items) == [f"{NS}/a", f"{NS}/c"]
    assert reflector.resource_version == str(api.resource_version)
    assert reflector.relists == 1


async def test_managed_fields_are_dropped_from_stored_objects(running: Running) -> None:
    raw = pod("heavy")
    raw["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Update"}]
    running.api.create("pods", raw)
    await eventually(lambda: f"{NS}/heavy" in running.reflector.items)
    meta = running.reflector.items[f"{NS}/heavy"].metadata
    assert meta is not None and meta.managedFields is None


async def test_a_bookmark_moves_the_resource_version_forward(running: Running) -> None:
    api, reflector = running.api, running.reflector
    for i in range(3):  # changes the node's watch does not see
        api.create("pods", pod(f"other-{i}", node="other-node"))
    before = reflector.resource_version
    api.bookmark()
    await eventually(lambda: reflector.resource_version == str(api.resource_version))
    assert before != reflector.resource_version
    assert running.seen.added == [f"{NS}/a", f"{NS}/b"]


async def test_a_dropped_watch_resumes_from_the_last_version_without_relisting(
    running: Running,
) -> None:
    api, reflector, seen = running.api, running.reflector, running.seen
    api.bookmark()
    await eventually(lambda: reflector.resource_version == str(api.resource_version))
    last = reflector.resource_version
    api.close_watches()
    api.create("pods", pod("during-gap"))  # happens while no watch is open
    await eventually(lambda: f"{NS}/during-gap" in reflector.items)
    watches = api.calls_to("GET", "^/api/v1/pods$", watch=True)
    assert watches[-1].params["resourceVersion"] == last
    assert reflector.relists == 1
    assert seen.added.count(f"{NS}/during-gap") == 1


async def test_410_gone_relists_and_reports_what_changed_while_disconnected(
    running: Running,
) -> None:
    api, reflector, seen = running.api, running.reflector, running.seen
    with api.down():
        api.delete("pods", "a", NS, grace=0)
        api.patch("pods", "b", {"metadata": {"labels": {"changed": "yes"}}}, NS)
        api.create("pods", pod("c"))
        api.compact()  # the agent's resourceVersion is now too old
        await asyncio.sleep(0.05)
    await eventually(lambda: reflector.relists == 2, what="a relist")
    assert seen.deleted == [f"{NS}/a"]
    assert seen.updated == [f"{NS}/b"]
    assert seen.added[-1] == f"{NS}/c"
    assert sorted(reflector.items) == [f"{NS}/b", f"{NS}/c"]
    # ...and watching carries on from the new list
    api.create("pods", pod("d"))
    await eventually(lambda: f"{NS}/d" in reflector.items)


async def test_a_410_error_event_on_an_open_watch_relists(running: Running) -> None:
    api, reflector, seen = running.api, running.reflector, running.seen
    api.watch_error(410)
    await eventually(lambda: reflector.relists == 2)
    assert seen.deleted == [] and seen.updated == []  # nothing changed: a relist is silent
    api.create("pods", pod("after"))
    await eventually(lambda: f"{NS}/after" in reflector.items)


async def test_other_watch_errors_retry_the_watch_from_the_same_version(running: Running) -> None:
    api, reflector = running.api, running.reflector
    api.watch_error(500)
    api.create("pods", pod("after-error"))
    await eventually(lambda: f"{NS}/after-error" in reflector.items)
    assert reflector.relists == 1


async def test_failures_are_told_to_the_handler_and_410_gone_is_not_one(
    api: FakeApiServer,
) -> None:
    api.create("pods", pod("a"))
    api.fail("GET", "^/api/v1/pods$", status=403)
    client = api.client()
    failures: list[int] = []
    handler: Handler[Pod] = Seen().handler()
    handler.on_error = lambda e: failures.append(getattr(e, "status", 0))
    reflector = Reflector(client, "/api/v1/pods", Pod, handler)
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 5)
        await eventually(lambda: api.watch_count("pods") == 1, what="the watch to open")
        api.watch_error(410)
        await eventually(lambda: reflector.relists == 2)
        assert failures == [403]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_an_unreachable_apiserver_is_retried_until_it_is_back(api: FakeApiServer) -> None:
    api.create("pods", pod("a"))
    client = api.client()
    seen = Seen()
    reflector = Reflector(
        client,
        "/api/v1/pods",
        Pod,
        seen.handler(),
        params={"fieldSelector": f"spec.nodeName={NODE}"},
    )
    with api.down():
        task = asyncio.create_task(reflector.run())
        await asyncio.sleep(0.5)  # a few attempts fail
        assert not task.done()
        assert not reflector.synced.is_set()
    try:
        await asyncio.wait_for(reflector.synced.wait(), 5)
        assert seen.added == [f"{NS}/a"]
        # An outage of an established watch: no crash, no relist, nothing lost.
        await eventually(lambda: api.watch_count("pods") == 1)
        with api.down():
            await asyncio.sleep(0.3)
            assert not task.done()
        api.create("pods", pod("b"))
        await eventually(lambda: f"{NS}/b" in reflector.items, within=5)
        assert reflector.relists == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


@dataclass
class SeenJSON:
    changes: list[tuple[str, str]] = field(default_factory=list)
    listed: int = 0

    def handler(self) -> Handler[dict[str, Any]]:
        def note(what: str) -> Callable[[dict[str, Any]], None]:
            return lambda obj: self.changes.append((what, obj["metadata"]["name"]))

        def listed() -> None:
            self.listed += 1

        return Handler(note("add"), lambda _old, new: note("update")(new), note("delete"), listed)


async def test_json_objects_are_keyed_by_uid_and_relisted_after_each_watch_of_relist_every(
    api: FakeApiServer,
) -> None:
    raw = pod("a")
    raw["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    api.create("pods", raw)
    client = api.client()
    seen = SeenJSON()
    reflector: Reflector[dict[str, Any]] = Reflector(
        client, "/api/v1/pods", dict, seen.handler(), relist_every=1
    )
    task = asyncio.create_task(reflector.run())
    try:
        await eventually(lambda: reflector.relists >= 2, within=5, what="a relist after 1 s")
        stored = api.get("pods", "a", NS)
        assert stored is not None
        assert list(reflector.items) == [stored["metadata"]["uid"]]
        assert "managedFields" not in reflector.items[stored["metadata"]["uid"]]["metadata"]
        assert seen.changes == [("add", "a")], "a relist that finds nothing new is silent"
        assert seen.listed == reflector.relists
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


async def test_from_now_replays_no_history_not_even_after_410_gone(api: FakeApiServer) -> None:
    api.create("pods", pod("old"))
    client = api.client()
    seen = SeenJSON()
    reflector: Reflector[dict[str, Any]] = Reflector(
        client, "/api/v1/pods", dict, seen.handler(), from_now=True
    )
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 5)
        assert [c.params.get("limit") for c in api.calls_to("GET", "^/api/v1/pods$")] == ["1"]
        await eventually(lambda: api.watch_count("pods") == 1, what="the watch to open")
        api.create("pods", pod("new"))
        await eventually(lambda: seen.changes == [("add", "new")])
        api.watch_error(410)
        await eventually(lambda: len(api.calls_to("GET", "^/api/v1/pods$")) == 2)
        await eventually(lambda: api.watch_count("pods") == 1, what="watching again")
        api.create("pods", pod("newer"))
        await eventually(lambda: seen.changes == [("add", "new"), ("add", "newer")])
        assert reflector.items == {}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


@pytest.mark.parametrize(("refusals", "warned"), [(2, False), (5, True)])
async def test_a_brief_refusal_is_no_warning_and_a_lasting_one_is(
    api: FakeApiServer, caplog: pytest.LogCaptureFixture, refusals: int, warned: bool
) -> None:
    """A node identity's first 403s are the Node authorizer catching up with a new pod."""
    caplog.set_level(logging.INFO, logger="vkubelet.kube._reflector")
    api.create("pods", pod("a"))
    api.fail("GET", "^/api/v1/pods$", status=403, times=refusals)
    client = api.client()
    reflector = Reflector(client, "/api/v1/pods", Pod, Seen().handler())
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 10)
        refused = [r for r in caplog.records if "403" in r.getMessage()]
        assert len(refused) == refusals
        assert any(r.levelname == "WARNING" for r in refused) is warned
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
