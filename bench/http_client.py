"""Benchmark: CPU per Kubernetes API request, httpx2 path vs the lean HTTP/1.1 path. Prints figures.

    .venv/bin/python bench/http_client.py [--requests 2000] [--rounds 3] [--cluster NAME]

Clients, in one process, taking turns (the order alternates from round to round) against a dev
cluster's kube-apiserver over TLS with the admin client certificate:

- `httpx2`: KubeClient on httpx2/httpcore2/anyio (ClientOptions(lean=False), the former path);
- `lean`: KubeClient on its lean client (asyncio protocols, httptools, keep-alive pool);
- `aiohttp`: an aiohttp ClientSession (C parser, its own keep-alive pool) with the same TLS
  context and headers, when aiohttp is installed: the alternative to h11 the lean client was
  measured against (the raw session, without KubeClient around it, so it is a lower bound).

Two workloads, `--concurrency` (32) requests in flight: a small GET (a namespace) and a node
status PATCH (merge patch, a changing condition, as a heartbeat or pod status write). Figure:
CPU milliseconds of this process (user + system) per request, median over rounds, and the
ratio to httpx2. The apiserver runs in other processes, so only the client's CPU is counted.
`uptime` is printed with the figures: on a loaded machine trust the ratios.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from _common import cluster_for, log, print_table

from vkubelet.kube import ClientOptions, KubeClient
from vkubelet.kube._http11 import Endpoint

Send = Callable[[str, str, bytes | None], Awaitable[bytes]]
NODE = "bench-http-client"


def kube_send(client: KubeClient) -> Send:
    async def send(method: str, path: str, body: bytes | None) -> bytes:
        if method == "PATCH":
            return await client.request_raw(
                method, path, body=body, content_type="application/merge-patch+json"
            )
        return await client.request_raw(method, path, body=body)

    return send


def aiohttp_send(kubeconfig: Path) -> tuple[Send, Callable[[], Awaitable[None]]] | None:
    try:
        import aiohttp  # type: ignore[import-not-found, unused-ignore]  # optional
    except ImportError:
        return None
    config = KubeClient.from_kubeconfig(kubeconfig).config
    endpoint = Endpoint.from_config(config)
    connector = aiohttp.TCPConnector(limit=32, ssl=endpoint.tls or False, keepalive_timeout=30)
    session = aiohttp.ClientSession(
        base_url=str(config.cluster.server),
        connector=connector,
        headers={"Accept": "application/json, */*", "User-Agent": "vkubelet"},
        auto_decompress=True,
    )

    async def send(method: str, path: str, body: bytes | None) -> bytes:
        headers = {"Content-Type": "application/merge-patch+json"} if body is not None else None
        async with session.request(method, path, data=body, headers=headers) as response:
            content: bytes = await response.read()
            if response.status >= 300:
                raise RuntimeError(f"{response.status}: {content[:200]!r}")
            return content

    return send, session.close


async def run(send: Send, workload: str, requests: int, concurrency: int) -> float:
    """CPU ms per request for `requests` requests, `concurrency` in flight."""
    counter = iter(range(requests))
    patch_path = f"/api/v1/nodes/{NODE}/status"

    def body(i: int) -> bytes:
        condition = {"type": "BenchHttp", "status": "True", "reason": f"R{i % 7}", "message": ""}
        return msgspec.json.encode({"status": {"conditions": [condition]}})

    async def worker() -> None:
        for i in counter:
            if workload == "get":
                await send("GET", "/api/v1/namespaces/default", None)
            else:
                await send("PATCH", patch_path, body(i))

    await asyncio.gather(*(worker() for _ in range(3)))  # warm: connections, TLS
    counter = iter(range(requests))
    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - start) * 1000 / requests


async def main(args: argparse.Namespace) -> None:
    cluster, owned = cluster_for(args.cluster, "bench-http")
    try:
        await measure(cluster.kubeconfig, args)
    finally:
        if owned:
            cluster.down()


async def measure(kubeconfig: Path, args: argparse.Namespace) -> None:
    old = KubeClient.from_kubeconfig(kubeconfig, options=ClientOptions(lean=False))
    lean = KubeClient.from_kubeconfig(kubeconfig, options=ClientOptions(lean=True))
    assert lean.lean and not old.lean
    clients: dict[str, Send] = {"httpx2": kube_send(old), "lean": kube_send(lean)}
    closers: list[Callable[[], Awaitable[Any]]] = [old.aclose, lean.aclose]
    if (aio := aiohttp_send(kubeconfig)) is not None:
        clients["aiohttp"] = aio[0]
        closers.append(aio[1])
    await lean.request("POST", "/api/v1/nodes", body={"metadata": {"name": NODE}})
    figures: dict[tuple[str, str], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            order = list(clients) if round_ % 2 == 0 else list(reversed(clients))
            for workload in ("get", "patch"):
                for name in order:
                    ms = await run(clients[name], workload, args.requests, args.concurrency)
                    figures.setdefault((workload, name), []).append(ms)
                    log(f"round {round_ + 1} {workload} {name}: {ms:.3f} ms CPU/request")
    finally:
        await lean.request("DELETE", f"/api/v1/nodes/{NODE}")
        for close in closers:
            await close()
    rows: list[tuple[str, ...]] = [("workload", "client", "CPU ms/request (median)", "vs httpx2")]
    for workload in ("get", "patch"):
        base = statistics.median(figures[(workload, "httpx2")])
        for name in clients:
            ms = statistics.median(figures[(workload, name)])
            rows.append((workload, name, f"{ms:.3f}", f"{ms / base:.2f}x"))
    print(f"{args.requests} requests x {args.rounds} rounds, {args.concurrency} in flight")
    print_table(rows)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cluster", help="an existing dev cluster (else a temporary one)")
    asyncio.run(main(parser.parse_args()))
