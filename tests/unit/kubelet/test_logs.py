"""`/containerLogs`: options reach the provider, follow flushes every chunk, errors map."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import h11
import pytest

from vkubelet.kubelet import KubeletNode
from vkubelet.sdk.capabilities import ContainerLogOptions
from vkubelet.sdk.provider import ProviderError

from .harness import FakeProvider, HttpClient, Kubelet, StartKubelet, make_pod

LOGS = "/containerLogs/default/web/app"


class FailingLogs(FakeProvider):
    """Logs that fail with `error`: at once (`eager`: when called, as a provider that is not a
    generator would), or after `lines` chunks."""

    def __init__(self, error: Exception, *, eager: bool = False, lines: int = 0) -> None:
        super().__init__()
        self.error = error
        self.eager = eager
        self.lines = lines

    def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        if self.eager:
            raise self.error
        return self._fail_after_lines()

    async def _fail_after_lines(self) -> AsyncIterator[bytes]:
        for n in range(self.lines):
            yield f"line {n + 1}\n".encode()
        raise self.error


async def test_logs_are_returned_as_text(kubelet: Kubelet) -> None:
    reply = await kubelet.get(LOGS)
    assert (reply.status, reply.text) == (200, "line 1\nline 2\n")
    assert reply.headers["content-type"].startswith("text/plain")


async def test_query_becomes_container_log_options(kubelet: Kubelet) -> None:
    await kubelet.get(
        LOGS
        + "?tailLines=5&timestamps=true&limitBytes=100&previous=1&sinceTime=2024-05-01T10:00:00Z"
    )
    options = kubelet.provider.log_options[-1]
    assert options.tail_lines == 5
    assert options.timestamps and options.previous and not options.follow
    assert options.limit_bytes == 100
    assert options.since_time == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    await kubelet.get(LOGS + "?sinceSeconds=30")
    assert kubelet.provider.log_options[-1].since_seconds == 30


@pytest.mark.parametrize(
    "query",
    [
        "tailLines=-1",
        "sinceSeconds=abc",
        "follow=maybe",
        "sinceSeconds=5&sinceTime=2024-05-01T10:00:00Z",
    ],
)
async def test_invalid_log_query_is_400(kubelet: Kubelet, query: str) -> None:
    assert (await kubelet.get(f"{LOGS}?{query}")).status == 400


async def test_limit_bytes_is_enforced_even_if_the_provider_ignores_it(kubelet: Kubelet) -> None:
    reply = await kubelet.get(LOGS + "?limitBytes=9")
    assert reply.body == b"line 1\nli"


async def test_unknown_container_is_400_with_the_providers_message(kubelet: Kubelet) -> None:
    """As the kubelet answers: the apiserver shows a 400's message to kubectl, not a 404's."""
    reply = await kubelet.get("/containerLogs/default/web/nope")
    assert (reply.status, reply.text) == (400, "no container nope in default/web")
    assert reply.headers["content-type"].startswith("text/plain")


PREVIOUS = 'previous terminated container "app" in pod "web" not found'


@pytest.mark.parametrize(
    ("error", "eager"),
    [
        (ProviderError("NotFound", PREVIOUS), False),
        (ProviderError("NotFound", PREVIOUS), True),
        (ProviderError("BadRequest", "container app is waiting to start"), False),
        (RuntimeError("the backend lost its log store"), False),
    ],
)
async def test_any_error_before_the_first_chunk_is_400_with_its_message(
    start_kubelet: StartKubelet, error: Exception, eager: bool
) -> None:
    kubelet = await start_kubelet(provider=FailingLogs(error, eager=eager))
    reply = await kubelet.get(LOGS + "?previous=true")
    assert (reply.status, reply.text) == (400, str(error))
    assert reply.headers["content-type"].startswith("text/plain")


async def test_an_error_that_is_not_a_provider_error_is_logged_as_a_likely_bug(
    start_kubelet: StartKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    kubelet = await start_kubelet(provider=FailingLogs(KeyError("cursor")))
    with caplog.at_level(logging.WARNING, logger="vkubelet.kubelet"):
        reply = await kubelet.get(LOGS)
    assert (reply.status, reply.text) == (400, "'cursor'")
    assert any(r.exc_info and isinstance(r.exc_info[1], KeyError) for r in caplog.records)
    caplog.clear()
    kubelet = await start_kubelet(provider=FailingLogs(ProviderError("NotFound", PREVIOUS)))
    with caplog.at_level(logging.WARNING, logger="vkubelet.kubelet"):
        assert (await kubelet.get(LOGS)).status == 400
    assert not caplog.records  # a provider's verdict is no bug


async def test_an_error_after_the_first_chunk_cuts_the_stream(
    start_kubelet: StartKubelet,
) -> None:
    """The status is out with the first chunk: the client can only see a broken body."""
    kubelet = await start_kubelet(provider=FailingLogs(RuntimeError("gone"), lines=1))
    client = await HttpClient.connect(kubelet.port, kubelet.context())
    try:
        await client.request("GET", LOGS)
        assert (await client.response()).status_code == 200
        received = b""
        with pytest.raises(ConnectionError):
            async for chunk in client.chunks():
                received += chunk
        assert received == b"line 1\n"
    finally:
        await client.close()


async def test_a_pod_bound_to_no_node_of_the_port_is_still_404(
    start_kubelet: StartKubelet,
) -> None:
    """The server decides that one itself, before any provider is asked."""
    one, two = FakeProvider([make_pod("a", node="n1")]), FakeProvider([make_pod("b", node="n2")])
    kubelet = await start_kubelet(
        nodes=[
            KubeletNode("n1", one, pods=lambda: list(one.pods.values())),
            KubeletNode("n2", two, pods=lambda: list(two.pods.values())),
        ]
    )
    reply = await kubelet.get("/containerLogs/default/web/app", headers=[("Host", "elsewhere")])
    assert reply.status == 404
    assert "not bound" in reply.text


async def test_follow_flushes_each_chunk_as_it_comes(kubelet: Kubelet) -> None:
    provider = kubelet.provider
    client = await HttpClient.connect(kubelet.port, kubelet.context())
    try:
        await client.request("GET", LOGS + "?follow=true")
        response = await client.response()
        assert response.status_code == 200
        assert (b"transfer-encoding", b"chunked") in response.headers
        chunks = client.chunks()
        received = b""
        while received != b"line 1\nline 2\n":
            received += await anext(chunks)
        # Each later line arrives on its own, while the stream stays open.
        for n in (3, 4):
            await provider.more_logs.put(f"line {n}\n".encode())
            async with asyncio.timeout(2):
                assert await anext(chunks) == f"line {n}\n".encode()
        await provider.more_logs.put(None)  # the container exits
        assert [c async for c in chunks] == []
        assert client.conn.their_state is h11.DONE
    finally:
        await client.close()


async def test_follow_ends_the_provider_stream_when_the_client_hangs_up(kubelet: Kubelet) -> None:
    client = await HttpClient.connect(kubelet.port, kubelet.context())
    await client.request("GET", LOGS + "?follow=1")
    assert (await client.response()).status_code == 200
    await client.close()
    async with asyncio.timeout(2):
        await kubelet.provider.log_stream_closed.wait()
