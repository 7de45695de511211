"""Benchmark: what each kind of request an agent makes per pod costs the apiserver. Prints figures.

    .venv/bin/python bench/apiserver_cost.py [--requests 2000] [--rounds 2] [--cluster NAME]

On this machine the apiserver, etcd and the agent share two cores, so at thousands of pods an
agent's pods/s is bounded by the apiserver's CPU, not its own: every request it makes per pod
is paid for there. This measures that price per request kind, with `--concurrency` (32) in
flight against a dev cluster, `--requests` pods made beforehand (bound to a Node object that no
agent serves, so nothing acts on them):

- `GET pod`: the cheapest request, for scale;
- `TokenRequest`: a service-account token bound to a pod, which a kubelet requests for every
  pod with a projected token volume (the ServiceAccount admission plugin adds one to every pod);
- `event POST`: a new `Started`-style Event;
- a pod status write, one per pod started, the same Running status (four conditions, one
  container status) in the three forms an agent can send it: a strategic merge patch (what
  vkubelet sends), a JSON merge patch, and a PUT of the whole pod (what the Go library sends).

Figure: CPU milliseconds of the kube-apiserver and etcd processes (user + system, from /proc)
per request, median over `--rounds`, each round after the cluster has settled for 2 s.

It is a benchmark, not a test: it asserts nothing and only prints.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2 as httpx
from _common import (
    cluster_for,
    control_plane_cpu,
    http_client,
    log,
    new_namespace,
    print_table,
)

_CONTROL_PLANE = ("kube-apiserver", "etcd")

Request = Callable[[int], Awaitable[None]]


def requests(client: httpx.AsyncClient, ns: str, pods: list[dict[str, Any]]) -> dict[str, Request]:
    uids = [str(pod["metadata"]["uid"]) for pod in pods]

    async def ok(response: Awaitable[httpx.Response]) -> None:
        (await response).raise_for_status()

    async def get(i: int) -> None:
        await ok(client.get(f"/api/v1/namespaces/{ns}/pods/p{i}"))

    async def token(i: int) -> None:
        ref = {"apiVersion": "v1", "kind": "Pod", "name": f"p{i}", "uid": uids[i]}
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3607, "boundObjectRef": ref},
        }
        await ok(client.post(f"/api/v1/namespaces/{ns}/serviceaccounts/default/token", json=body))

    async def event(i: int) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"p{i}.{time.monotonic_ns():x}", "namespace": ns},
            "involvedObject": {"kind": "Pod", "name": f"p{i}", "namespace": ns, "uid": uids[i]},
            "reason": "Started",
            "message": "the pod's containers are running",
            "type": "Normal",
            "source": {"component": "bench", "host": "nowhere"},
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        await ok(client.post(f"/api/v1/namespaces/{ns}/events", json=body))

    def full_status() -> dict[str, Any]:
        """A status as an agent writes when a pod starts, with a change every time."""
        ready = "True" if time.monotonic_ns() % 2 else "False"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {"status": ready, "lastTransitionTime": stamp}
        return {
            "phase": "Running",
            "hostIP": "10.0.0.1",
            "podIP": "10.244.0.7",
            "podIPs": [{"ip": "10.244.0.7"}],
            "startTime": stamp,
            "conditions": [
                {"type": kind, **condition}
                for kind in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
            ],
            "containerStatuses": [
                {
                    "name": "c",
                    "image": "x",
                    "imageID": "",
                    "ready": ready == "True",
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": stamp}},
                }
            ],
        }

    def patcher(content_type: str) -> Request:
        async def patch(i: int) -> None:
            body = {"metadata": {"uid": uids[i]}, "status": full_status()}
            headers = {"Content-Type": content_type}
            path = f"/api/v1/namespaces/{ns}/pods/p{i}/status"
            await ok(client.patch(path, json=body, headers=headers))

        return patch

    async def put(i: int) -> None:
        pod = dict(pods[i])
        pod["metadata"] = {k: v for k, v in pod["metadata"].items() if k != "resourceVersion"}
        pod["status"] = full_status()
        await ok(client.put(f"/api/v1/namespaces/{ns}/pods/p{i}/status", json=pod))

    return {
        "GET pod": get,
        "TokenRequest": token,
        "event POST": event,
        "status PATCH (strategic merge)": patcher("application/strategic-merge-patch+json"),
        "status PATCH (JSON merge)": patcher("application/merge-patch+json"),
        "status PUT (whole pod)": put,
    }


async def run(args: argparse.Namespace) -> None:
    cluster, ours = cluster_for(args.cluster, "apicost")
    try:
        async with http_client(cluster.kubeconfig, args.concurrency) as client:
            ns = await new_namespace(client, "apicost")
            limit = asyncio.Semaphore(args.concurrency)

            async def limited(request: Callable[[int], Awaitable[Any]], i: int) -> Any:
                async with limit:
                    return await request(i)

            # A Node object for the pods, or the pod garbage collector deletes them as orphans
            # (after 40 s) while the rounds run.
            node = f"apicost-{os.getpid()}"
            answer = await client.post("/api/v1/nodes", json={"metadata": {"name": node}})
            answer.raise_for_status()

            async def make_pod(i: int) -> dict[str, Any]:
                body = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"p{i}"},
                    "spec": {
                        "nodeName": node,
                        "containers": [{"name": "c", "image": "x"}],
                        # The node has no agent: it turns NotReady, and its taints would evict.
                        "tolerations": [{"operator": "Exists"}],
                    },
                }
                answer = await client.post(f"/api/v1/namespaces/{ns}/pods", json=body)
                answer.raise_for_status()
                pod: dict[str, Any] = answer.json()
                return pod

            log(f"creating {args.requests} pods")
            pods = list(await asyncio.gather(*(limited(make_pod, i) for i in range(args.requests))))
            kinds = requests(client, ns, pods)
            figures: dict[str, list[float]] = {kind: [] for kind in kinds}
            for round_ in range(args.rounds):
                order = list(kinds) if round_ % 2 == 0 else list(reversed(kinds))
                for kind in order:
                    await asyncio.sleep(2)  # the create burst's (or last kind's) work settles
                    before = control_plane_cpu(cluster, _CONTROL_PLANE)
                    await asyncio.gather(*(limited(kinds[kind], i) for i in range(args.requests)))
                    spent = control_plane_cpu(cluster, _CONTROL_PLANE) - before
                    figures[kind].append(spent / args.requests * 1000)
                    log(f"round {round_ + 1}: {kind}: {figures[kind][-1]:.2f} ms per request")
    finally:
        if ours:
            cluster.down()
    print(
        f"\n## apiserver + etcd CPU per request ({args.requests} requests, "
        f"{args.concurrency} in flight, {args.rounds} rounds)"
    )
    base = statistics.median(figures["GET pod"])
    rows: list[tuple[str, ...]] = [("request", "CPU ms / request", "x a GET")]
    for kind, values in figures.items():
        cost = statistics.median(values)
        rows.append((kind, f"{cost:.2f}", f"{cost / base:.1f}"))
    print_table(rows)
    print(f"load: {os.getloadavg()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--cluster", help="a running dev cluster to use (default: a new one)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
