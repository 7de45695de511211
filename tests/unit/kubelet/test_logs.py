"""`/containerLogs`: options reach the provider, follow flushes every chunk, errors map."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import h11
import pytest

from .conftest import Kubelet
from .harness import HttpClient

LOGS = "/containerLogs/default/web/app"


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


async def test_unknown_container_is_404(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/containerLogs/default/web/nope")
    assert reply.status == 404
    assert "no container nope" in reply.text


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
