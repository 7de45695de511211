"""KubeClient's lean HTTP/1.1 client against a scripted local HTTP server.

The server speaks raw HTTP/1.1 over asyncio streams so each test can send exactly the framing it
is about (Content-Length, chunked, gzip), close a kept-alive connection without answering (what a
server that dropped an idle connection looks like to the client), or refuse a token.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lightkube.config.kubeconfig import KubeConfig, SingleConfig

from vkubelet.kube import ApiError, ClientOptions, KubeClient, Unreachable
from vkubelet.kube._http11 import Pool
from vkubelet.testing.harness import eventually


@dataclass
class Seen:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    connection: int


# An answer: the raw bytes to write, or None to close the connection without answering.
Answer = Callable[[Seen], Awaitable[bytes | None]]


def response(status: int, body: bytes, *, headers: dict[str, str] | None = None) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def chunked(parts: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body


def ok(obj: Any) -> bytes:
    return response(200, json.dumps(obj).encode(), headers={"Content-Type": "application/json"})


class Server:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.seen: list[Seen] = []
        self.connections = 0
        self.closed = 0
        self.close_after_answer = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._handlers.values():
            writer.close()
        await asyncio.gather(*self._handlers)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        index = self.connections
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = writer
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                line, *fields = head.decode().split("\r\n")[:-2]
                method, target, _ = line.split(" ")
                headers = {k.lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                seen = Seen(method, target, headers, body, index)
                self.seen.append(seen)
                answer = await self.answer(seen)
                if answer is None:
                    return
                writer.write(answer)
                try:
                    await writer.drain()
                except ConnectionError:
                    return  # the client gave up first
                if self.close_after_answer:
                    return
        finally:
            writer.close()
            self.closed += 1


def config(server: str, **user: Any) -> SingleConfig:
    single = KubeConfig.from_dict(
        {
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
    ).get()
    assert single is not None
    return single


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., KubeClient]]:
    clients: list[KubeClient] = []

    def make(server: Server, options: ClientOptions | None = None, **user: Any) -> KubeClient:
        client = KubeClient(config(server.url, **user), options or ClientOptions())
        assert client.lean
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


async def always(answer: bytes) -> Answer:
    async def reply(_: Seen) -> bytes:
        return answer

    return reply


async def test_a_content_length_answer_is_decoded_and_the_connection_reused(
    make: Callable[..., KubeClient],
) -> None:
    async with Server(await always(ok({"kind": "Namespace"}))) as server:
        client = make(server, token="t0k")
        for _ in range(5):
            assert await client.get("/api/v1/namespaces/default") == {"kind": "Namespace"}
        assert server.connections == 1
        assert [s.headers["authorization"] for s in server.seen] == ["Bearer t0k"] * 5


async def test_requests_in_flight_together_each_get_their_own_kept_alive_connection(
    make: Callable[..., KubeClient],
) -> None:
    release = asyncio.Event()

    async def slow(_: Seen) -> bytes:
        await release.wait()
        return ok({})

    async with Server(slow) as server:
        client = make(server)
        calls = [asyncio.ensure_future(client.get(f"/p/{i}")) for i in range(4)]
        await eventually(lambda: len(server.seen) == 4)
        release.set()
        await asyncio.gather(*calls)
        await asyncio.gather(*(client.get(f"/q/{i}") for i in range(4)))
        assert server.connections == 4


async def test_a_chunked_answer_is_reassembled(make: Callable[..., KubeClient]) -> None:
    parts = [b'{"items": [', b"1, 2", b", 3]}"]
    async with Server(await always(chunked(parts))) as server:
        client = make(server)
        assert await client.get("/x") == {"items": [1, 2, 3]}
        assert await client.get("/x") == {"items": [1, 2, 3]}
        assert server.connections == 1


async def test_a_gzipped_answer_is_decompressed(make: Callable[..., KubeClient]) -> None:
    body = gzip.compress(json.dumps({"big": "x" * 1000}).encode())
    answer = response(200, body, headers={"Content-Encoding": "gzip"})
    async with Server(await always(answer)) as server:
        client = make(server)
        assert await client.get("/x") == {"big": "x" * 1000}
        assert server.seen[0].headers["accept-encoding"] == "gzip"


async def test_a_watch_yields_events_split_across_chunks_with_query_parameters(
    make: Callable[..., KubeClient],
) -> None:
    events = b'{"type":"ADDED","object":{"a":1}}\n{"type":"MODIFIED","object":{"a":2}}\n'
    parts = [events[:10], events[10:40], events[40:]]
    async with Server(await always(chunked(parts))) as server:
        client = make(server)
        seen = [
            (kind, json.loads(bytes(raw)))
            async for kind, raw in client.watch(
                "/api/v1/pods", {"labelSelector": "a in (b,c)"}, timeout_seconds=5
            )
        ]
        assert seen == [("ADDED", {"a": 1}), ("MODIFIED", {"a": 2})]
        target = server.seen[0].target
        assert target.startswith("/api/v1/pods?labelSelector=a+in+%28b%2Cc%29")
        assert "watch=true" in target and "timeoutSeconds=5" in target


async def test_a_streamed_body_arrives_as_it_is_sent(make: Callable[..., KubeClient]) -> None:
    async with Server(await always(chunked([b"line 1\n", b"line 2\n"]))) as server:
        client = make(server)
        assert b"".join([c async for c in client.stream("/log", {"follow": "true"})]) == (
            b"line 1\nline 2\n"
        )


def drops_second_request(answer: bytes) -> Answer:
    """Answer the first request of each connection, then close without answering the next:
    to the client, a kept-alive connection the server had dropped while it sat idle."""
    counts: dict[int, int] = {}

    async def reply(seen: Seen) -> bytes | None:
        counts[seen.connection] = counts.get(seen.connection, 0) + 1
        return answer if counts[seen.connection] == 1 else None

    return reply


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_an_idempotent_request_on_a_dead_kept_alive_connection_is_sent_once_more(
    make: Callable[..., KubeClient], method: str
) -> None:
    async with Server(drops_second_request(ok({"n": 1}))) as server:
        client = make(server)
        await client.get("/warm")
        assert await client.request(method, "/x", body={} if method == "PUT" else None) == {"n": 1}
        assert [(s.method, s.connection) for s in server.seen] == [
            ("GET", 1),
            (method, 1),
            (method, 2),
        ]


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_a_post_or_patch_that_may_have_reached_the_server_is_never_sent_twice(
    make: Callable[..., KubeClient], method: str
) -> None:
    async with Server(drops_second_request(ok({}))) as server:
        client = make(server)
        await client.get("/warm")
        with pytest.raises(Unreachable, match="connection lost"):
            await client.request(method, "/x", body={"a": 1})
        assert [s.method for s in server.seen] == ["GET", method]
        assert await client.request(method, "/x", body={"a": 1}) == {}  # a fresh connection


async def test_a_connection_the_server_closed_while_idle_is_not_used_again(
    make: Callable[..., KubeClient],
) -> None:
    async with Server(await always(response(200, b"{}"))) as server:
        server.close_after_answer = True  # no "Connection: close": it just drops the connection
        client = make(server)
        await client.create("/x", {})
        await eventually(lambda: server.closed == 1)
        pool = client._http
        assert isinstance(pool, Pool)
        idle = pool._idle
        await eventually(lambda: all(conn.closed() for conn in idle))
        # A POST is never re-sent, so it only succeeds if the dead connection was left alone.
        await client.create("/y", {})
        assert [s.connection for s in server.seen] == [1, 2]


async def test_a_401_rereads_the_token_file_and_sends_again(
    make: Callable[..., KubeClient], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("old\n")

    async def check(seen: Seen) -> bytes:
        return ok({}) if seen.headers.get("authorization") == "Bearer new" else response(401, b"")

    async with Server(check) as server:
        client = make(server, tokenFile=str(token))
        with pytest.raises(ApiError) as error:
            await client.get("/x")
        assert error.value.status == 401
        token.write_text("new\n")  # the kubelet rotated it
        assert await client.create("/x", {"a": 1}) == {}
        assert await client.get("/y") == {}
        auths = [(s.method, s.headers["authorization"]) for s in server.seen]
        assert auths == [
            ("GET", "Bearer old"),
            ("GET", "Bearer old"),
            ("POST", "Bearer old"),
            ("POST", "Bearer new"),
            ("GET", "Bearer new"),
        ]


async def test_reload_switches_to_the_new_credentials(make: Callable[..., KubeClient]) -> None:
    async with Server(await always(ok({}))) as server:
        client = make(server, token="first")
        await client.get("/x")
        client.reload(config(server.url, token="second"))
        await client.get("/x")
        await client.heartbeat("/lease", {"spec": {}})
        assert [s.headers["authorization"] for s in server.seen] == [
            "Bearer first",
            "Bearer second",
            "Bearer second",
        ]


async def test_an_error_status_becomes_an_api_error_with_its_reason(
    make: Callable[..., KubeClient],
) -> None:
    status = {"kind": "Status", "reason": "NotFound", "message": 'pods "p" not found'}
    async with Server(await always(response(404, json.dumps(status).encode()))) as server:
        client = make(server)
        with pytest.raises(ApiError) as error:
            await client.get("/api/v1/namespaces/d/pods/p")
        assert error.value.not_found and error.value.reason == "NotFound"
        with pytest.raises(ApiError, match="NotFound"):
            async for _ in client.watch("/api/v1/pods", {}, timeout_seconds=5):
                pass


async def test_a_refused_connection_is_unreachable(make: Callable[..., KubeClient]) -> None:
    async with Server(await always(ok({}))) as server:
        pass  # closed: nothing listens on its port any more
    client = make(server)
    with pytest.raises(Unreachable, match=r"127\.0\.0\.1"):
        await client.get("/x")
    with pytest.raises(Unreachable):
        async for _ in client.watch("/api/v1/pods", {}, timeout_seconds=5):
            pass


async def test_a_garbled_or_cut_answer_is_unreachable(make: Callable[..., KubeClient]) -> None:
    async with Server(await always(b"NOT HTTP AT ALL\r\n\r\n")) as server:
        with pytest.raises(Unreachable, match="bad answer"):
            await make(server).get("/x")
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}"
    async with Server(await always(cut)) as server:
        server.close_after_answer = True
        with pytest.raises(Unreachable):
            await make(server).get("/x")


async def test_an_answer_that_never_comes_times_out_as_unreachable(
    make: Callable[..., KubeClient],
) -> None:
    done = asyncio.Event()

    async def late(_: Seen) -> bytes:
        await done.wait()  # until the test is over
        return ok({})

    async with Server(late) as server:
        client = make(server, options=ClientOptions(timeout=0.3))
        with pytest.raises(Unreachable, match="timed out"):
            await client.get("/x")
        done.set()


def test_credentials_the_lean_client_cannot_use_keep_the_httpx_path() -> None:
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true"}}
    assert not KubeClient(config("https://127.0.0.1:1", **exec_user)).lean
    assert not KubeClient(config("https://127.0.0.1:1"), ClientOptions(lean=False)).lean
    assert KubeClient(config("https://127.0.0.1:1", token="t")).lean


class FencedAfter(KubeClient):
    """Allows its first `allowed` checks of a write, refuses the ones after (a Lease that lapses
    while the write waits for a connection, or between a 401 and the re-send)."""

    allowed = 1
    checks = 0

    def _before_send(self, method: str) -> None:
        if method == "GET":
            return
        self.checks += 1
        if self.checks > self.allowed:
            raise Unreachable("fenced: this replica's Lease expired")


async def test_a_write_fenced_after_it_was_queued_never_reaches_the_server() -> None:
    async with Server(await always(ok({}))) as server:
        client = FencedAfter(config(server.url))
        try:
            with pytest.raises(Unreachable, match="fenced"):
                await client.patch("/api/v1/nodes/n/status", {"status": {}})
            await client.get("/after")  # the same connection: nothing of the PATCH precedes it
        finally:
            await client.aclose()
        assert [s.method for s in server.seen] == ["GET"]


async def test_a_write_fenced_between_a_401_and_its_resend_is_not_sent_again(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")

    async def refuse_writes(seen: Seen) -> bytes:
        return ok({}) if seen.method == "GET" else response(401, b"")

    async with Server(refuse_writes) as server:
        client = FencedAfter(config(server.url, tokenFile=str(token)))
        client.allowed = 2  # the early check and the first attempt
        try:
            with pytest.raises(Unreachable, match="fenced"):
                await client.delete("/api/v1/namespaces/d/pods/p")
            await client.get("/after")
        finally:
            await client.aclose()
        assert [s.method for s in server.seen] == ["DELETE", "GET"]


async def test_closing_the_client_ends_an_open_watch(make: Callable[..., KubeClient]) -> None:
    first = b'{"type":"ADDED","object":{"a":1}}\n'
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    hold = asyncio.Event()

    async def open_watch(_: Seen) -> bytes:
        return head + b"%x\r\n%s\r\n" % (len(first), first)  # and never the last chunk

    async with Server(open_watch) as server:
        client = make(server)
        seen: list[str] = []

        async def follow() -> None:
            async for kind, _ in client.watch("/api/v1/pods", {}, timeout_seconds=300):
                seen.append(kind)
                hold.set()

        watching = asyncio.ensure_future(follow())
        await hold.wait()
        await client.aclose()
        with pytest.raises(Unreachable):
            await asyncio.wait_for(watching, 5)
        assert seen == ["ADDED"]
        await eventually(lambda: server.closed == 1)


async def test_a_token_that_would_split_the_request_head_is_never_sent(
    make: Callable[..., KubeClient], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("abc\r\nX-Injected: 1\n")
    async with Server(await always(ok({}))) as server:
        client = make(server, tokenFile=str(token))
        with pytest.raises(Unreachable, match="not allowed in an HTTP header"):
            await client.get("/x")
        token.unlink()
        with pytest.raises(Unreachable, match="token file"):
            await client.get("/x")
        token.write_text("good\n")
        assert await client.get("/x") == {}
        assert [s.headers["authorization"] for s in server.seen] == ["Bearer good"]


async def test_a_path_with_a_space_or_line_break_is_refused_before_anything_is_sent(
    make: Callable[..., KubeClient],
) -> None:
    async with Server(await always(ok({}))) as server:
        client = make(server)
        for path in ("/api/v1/namespaces/a b", "/x\r\nHost: evil"):
            with pytest.raises(Unreachable, match="bad target"):
                await client.get(path)
        assert server.seen == []


async def test_a_watch_line_cut_into_many_chunks_is_joined_once(
    make: Callable[..., KubeClient],
) -> None:
    big = json.dumps({"type": "ADDED", "object": {"data": "x" * 5000}}).encode()
    tail = b'\n{"type":"DELETED","object":{}}\n'
    parts = [big[i : i + 100] for i in range(0, len(big), 100)] + [tail]
    async with Server(await always(chunked(parts))) as server:
        client = make(server)
        watch = client.watch("/w", {}, timeout_seconds=5)
        seen = [(kind, json.loads(bytes(raw))) async for kind, raw in watch]
        assert seen == [("ADDED", {"data": "x" * 5000}), ("DELETED", {})]


async def test_answers_larger_than_a_read_arrive_whole_streamed_or_not(
    make: Callable[..., KubeClient],
) -> None:
    big = json.dumps({"items": ["x" * 1000] * 2000}).encode()  # ~2 MB: many reads
    async with Server(await always(response(200, big))) as server:
        client = make(server)
        assert await client.get("/list") == json.loads(big)
        received = bytearray()
        async for chunk in client.stream("/log"):
            received += chunk
        assert bytes(received) == big
