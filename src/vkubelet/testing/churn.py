"""Pod churn against a real control plane, and the check that nothing was lost on the way.

Shared by the resilience tests (`tests/integration/test_resilience.py`, small) and the benchmark
(`bench/resilience.py`, full size), so that both prove the same invariants:

- every pod still in the API runs exactly once in the provider (one entry with its UID in the
  mock's state files, created once: `creates == 1`), with the latest update it was given;
- no deleted pod runs in the provider, and no API pod is left Terminating;
- every surviving pod is Running in the API.

The plan: pods are created at a fixed rate, bound by `spec.nodeName` to the nodes round-robin;
a quarter are kept, a quarter kept and updated (an annotation the pod's downwardAPI volume
shows, so that the mock's state file proves `update_pod` carried it), a quarter deleted
gracefully and an eighth force-deleted (the API object gone at once), an eighth updated twice.
Every request is retried until the API answers, so an apiserver outage delays the plan but
changes none of its outcomes. What a disruption must not break is then checked with `report`,
either for everything or for the pods whose last operation the API acknowledged before a given
moment (how long the agent takes to reconcile what it missed while it was down).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import msgspec

from ..kube import httpx_params, load_context

GENERATION = "churn.vkubelet.io/generation"
_GEN_FILE = "meta/generation"  # volume/path in the mock's record of the pod's files


@dataclass
class Intent:
    """What the churn did to one pod, as far as the API acknowledged it."""

    name: str
    node: str
    fate: str  # keep, update, update2, delete, force
    generation: int = 0
    created: bool = False
    deleted: bool = False
    last_ack: float = 0.0  # monotonic time of the API's answer to its latest operation


def fate_of(index: int) -> str:
    return ("update", "keep", "delete", "force", "update", "keep", "delete", "update2")[index % 8]


@dataclass
class Report:
    """What differs between the API, the provider and the churn's intents (all zero: fine)."""

    missing_in_provider: list[str] = field(default_factory=list)  # kept pods it does not run
    duplicated: list[str] = field(default_factory=list)  # several entries, or created again
    not_deleted: list[str] = field(default_factory=list)  # runs, but the API has no such pod
    stale: list[str] = field(default_factory=list)  # runs an older update than the API's
    terminating: list[str] = field(default_factory=list)  # API pods with a deletionTimestamp
    not_running: list[str] = field(default_factory=list)  # kept API pods not Running
    missing_in_api: list[str] = field(default_factory=list)  # kept pods the API lost
    checked: int = 0

    @property
    def clean(self) -> bool:
        return not any(self.counts().values())

    def counts(self) -> dict[str, int]:
        return {
            "missing in provider": len(self.missing_in_provider),
            "duplicated": len(self.duplicated),
            "deleted but running": len(self.not_deleted),
            "missed updates": len(self.stale),
            "stuck Terminating": len(self.terminating),
            "not Running": len(self.not_running),
            "lost by the API": len(self.missing_in_api),
        }

    def __str__(self) -> str:
        parts = [f"{k}: {v}" for k, v in self.counts().items() if v]
        examples = [
            f"{k} e.g. {v[:3]}"
            for k, v in (
                ("missing", self.missing_in_provider),
                ("duplicated", self.duplicated),
                ("not deleted", self.not_deleted),
                ("stale", self.stale),
                ("terminating", self.terminating),
                ("not running", self.not_running),
            )
            if v
        ]
        return f"{self.checked} pods checked; " + ("; ".join(parts + examples) or "all consistent")


class _Meta(msgspec.Struct):
    name: str = ""
    uid: str = ""
    deletionTimestamp: str | None = None
    annotations: dict[str, str] | None = None


class _Status(msgspec.Struct):
    phase: str | None = None


class _Pod(msgspec.Struct):
    metadata: _Meta
    status: _Status | None = None


class _PodList(msgspec.Struct):
    items: list[_Pod]


class _MockPod(msgspec.Struct):
    namespace: str
    name: str
    uid: str
    node: str = ""
    files: dict[str, str] = {}
    creates: int = 1


class _MockState(msgspec.Struct):
    pods: list[_MockPod] = []


def http_client(kubeconfig: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        **httpx_params(load_context(kubeconfig), timeout=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=128),
    )


def pod_body(name: str, node: str) -> dict[str, Any]:
    """Bound to its node, no token to request, a downwardAPI volume showing the generation."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {GENERATION: "0"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "c",
                    "image": "churn/app:1",
                    "volumeMounts": [{"name": "meta", "mountPath": "/meta"}],
                }
            ],
            "volumes": [
                {
                    "name": "meta",
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "generation",
                                "fieldRef": {"fieldPath": f"metadata.annotations['{GENERATION}']"},
                            }
                        ]
                    },
                }
            ],
        },
    }


class Churn:
    """Creates, updates and deletes pods in one namespace on a schedule; retries every request
    until the API answers, however long it is away."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        namespace: str,
        nodes: list[str],
        state_files: list[Path],
        *,
        pods: int,
        rate: float,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.nodes = nodes
        self.state_files = state_files
        self.rate = rate
        prefix = uuid.uuid4().hex[:4]
        self.intents = [
            Intent(f"c{prefix}-{i:05d}", nodes[i % len(nodes)], fate_of(i)) for i in range(pods)
        ]
        self.retries = 0
        self.done = asyncio.Event()
        # (seconds into a wait, what differed) each time it changed: what a slow
        # reconciliation was waiting for.
        self.trace: list[tuple[float, str]] = []

    # -- the plan ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run the whole plan; returns when every operation has been acknowledged."""
        start = time.monotonic()
        async with asyncio.TaskGroup() as group:
            for i, intent in enumerate(self.intents):
                at = start + i / self.rate
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                group.create_task(self._life(intent))
        self.done.set()

    async def _life(self, intent: Intent) -> None:
        await self._create(intent)
        if intent.fate in ("update", "update2"):
            await asyncio.sleep(1.5)
            await self._update(intent)
        if intent.fate == "update2":
            await asyncio.sleep(1.5)
            await self._update(intent)
        if intent.fate in ("delete", "force"):
            await asyncio.sleep(2.0)
            await self._delete(intent, force=intent.fate == "force")

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The API's answer, other than a connection failure, a 5xx or a 429 (retried)."""
        while True:
            try:
                response = await self.client.request(method, path, **kwargs)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code < 500 and response.status_code != 429:
                return response
            self.retries += 1
            await asyncio.sleep(0.2)

    def _path(self, name: str = "") -> str:
        base = f"/api/v1/namespaces/{self.namespace}/pods"
        return f"{base}/{name}" if name else base

    async def _create(self, intent: Intent) -> None:
        response = await self._request(
            "POST", self._path(), json=pod_body(intent.name, intent.node)
        )
        # 409: a retried create whose first attempt got through.
        if response.status_code not in (201, 409):
            raise RuntimeError(f"create {intent.name}: {response.status_code} {response.text}")
        intent.created = True
        intent.last_ack = time.monotonic()

    async def _update(self, intent: Intent) -> None:
        generation = intent.generation + 1
        patch = {"metadata": {"annotations": {GENERATION: str(generation)}}}
        response = await self._request(
            "PATCH",
            self._path(intent.name),
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        if response.status_code != 200:
            raise RuntimeError(f"update {intent.name}: {response.status_code} {response.text}")
        intent.generation = generation
        intent.last_ack = time.monotonic()

    async def _delete(self, intent: Intent, *, force: bool) -> None:
        body = {"gracePeriodSeconds": 0} if force else None
        response = await self._request("DELETE", self._path(intent.name), json=body)
        if response.status_code not in (200, 202, 404):
            raise RuntimeError(f"delete {intent.name}: {response.status_code} {response.text}")
        intent.deleted = True
        intent.last_ack = time.monotonic()

    # -- what is where ----------------------------------------------------------------------------
    async def api_pods(self) -> dict[str, _Pod]:
        response = await self._request("GET", self._path())
        response.raise_for_status()
        listed = msgspec.json.decode(response.content, type=_PodList)
        return {p.metadata.name: p for p in listed.items}

    def provider_pods(self) -> list[_MockPod]:
        """Every pod of this namespace in the mock's state files (one per node)."""
        found = []
        for path in self.state_files:
            try:
                state = msgspec.json.decode(path.read_bytes(), type=_MockState)
            except FileNotFoundError:
                continue
            found += [p for p in state.pods if p.namespace == self.namespace]
        return found

    async def report(self, before: float | None = None) -> Report:
        """Compare the API, the provider and the intents; with `before`, only the pods whose
        latest operation the API acknowledged before that moment (monotonic time)."""
        api = await self.api_pods()
        provider = self.provider_pods()
        return compare(self.intents, api, provider, before)

    async def wait_consistent(
        self, before: float | None = None, *, limit: float = 60.0, interval: float = 0.25
    ) -> tuple[Report, float]:
        """Poll `report` until it is clean or `limit` seconds pass: (the last report, seconds)."""
        started = time.monotonic()
        last = ""
        while True:
            report = await self.report(before)
            elapsed = time.monotonic() - started
            if str(report) != last:
                last = str(report)
                self.trace.append((elapsed, f"[{time.strftime('%H:%M:%S')}] {last}"))
            if report.clean or elapsed > limit:
                return report, elapsed
            await asyncio.sleep(interval)


def compare(
    intents: list[Intent], api: dict[str, _Pod], provider: list[_MockPod], before: float | None
) -> Report:
    report = Report()
    runs: dict[str, list[_MockPod]] = {}
    for entry in provider:
        runs.setdefault(entry.name, []).append(entry)
    for intent in intents:
        if not intent.created or (before is not None and intent.last_ack > before):
            continue
        report.checked += 1
        name = intent.name
        pod = api.get(name)
        running = runs.get(name, [])
        if pod is not None and pod.metadata.deletionTimestamp:
            report.terminating.append(name)
        if intent.deleted:
            if running:
                report.not_deleted.append(name)
            continue
        if pod is None:
            report.missing_in_api.append(name)
            continue
        mine = [r for r in running if r.uid == pod.metadata.uid]
        if not mine:
            report.missing_in_provider.append(name)
        elif len(mine) > 1 or mine[0].creates > 1 or mine[0].node != intent.node:
            report.duplicated.append(name)
        elif mine[0].files.get(_GEN_FILE) != str(intent.generation):
            report.stale.append(name)
        if len(running) > len(mine):
            report.not_deleted.append(name)  # an earlier pod of the name still runs
        if (pod.status.phase if pod.status else None) != "Running":
            report.not_running.append(name)
    known = {i.name for i in intents}
    strangers = Counter(e.name for e in provider if e.name not in known)
    report.not_deleted += sorted(strangers)
    return report


@dataclass
class Disruption:
    """One kill or restart during the churn, and how long reconciling after it took."""

    what: str
    at: float  # seconds since the churn started
    down: float  # seconds the component was away
    reconciled: float | None = None  # seconds from its return until consistent (None: never)
    report: Report | None = None
    trace: list[tuple[float, str]] = field(default_factory=list)


async def disrupt_during(
    churn: Churn,
    times: list[float],
    disrupt: Callable[[], Awaitable[tuple[str, float]]],
    *,
    limit: float = 60.0,
) -> list[Disruption]:
    """At each of `times` (seconds after now, and not before the previous disruption was
    reconciled) run `disrupt` (returns what it did and the seconds the component was away),
    then measure the reconciliation: until the pods acknowledged before the component came
    back are all consistent again."""
    start = time.monotonic()
    done: list[Disruption] = []
    for at in times:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        began = time.monotonic() - start
        what, down = await disrupt()
        back = time.monotonic()
        churn.trace = []
        report, _ = await churn.wait_consistent(back, limit=limit)
        reconciled = time.monotonic() - back if report.clean else None
        done.append(Disruption(what, began, down, reconciled, report, churn.trace))
    return done


@dataclass
class Outcome:
    """A churn with its disruptions: how each was reconciled, and the final comparison."""

    disruptions: list[Disruption]
    final: Report
    duration: float  # seconds the plan took (every operation acknowledged)
    settle: float  # seconds from then until consistent
    retries: int  # requests the API did not answer (outages)


async def churn_with(
    churn: Churn,
    times: list[float],
    disrupt: Callable[[], Awaitable[tuple[str, float]]],
    *,
    limit: float = 60.0,
) -> Outcome:
    """Run the churn's plan with the disruptions, then wait for the whole to be consistent."""
    start = time.monotonic()
    plan = asyncio.create_task(churn.run())
    try:
        disruptions = await disrupt_during(churn, times, disrupt, limit=limit)
        await plan
    finally:
        plan.cancel()
    duration = time.monotonic() - start
    final, settle = await churn.wait_consistent(limit=limit)
    return Outcome(disruptions, final, duration, settle, churn.retries)


def agent_config(
    workdir: Path, nodes: list[str], *, extra: dict[str, Any] | None = None
) -> tuple[Path, list[Path]]:
    """An agent config serving `nodes` with the mock provider, each with its state file, so that
    the fake backend outlives the agent as a real one would: (config path, state files)."""
    workdir.mkdir(parents=True, exist_ok=True)
    states = [workdir / f"state-{name}.json" for name in nodes]
    mock = {
        name: {"pods": "2000", "stateFile": str(state)}
        for name, state in zip(nodes, states, strict=True)
    }
    (workdir / "mock.json").write_text(json.dumps(mock))
    config = {
        "certDir": str(workdir / "pki"),
        "nodes": [
            {
                "name": name,
                "provider": "mock",
                "providerConfig": "mock.json",
                "internalIP": "127.0.0.1",
                "kubeletPort": 0,
                "taints": [],
            }
            for name in nodes
        ],
        **(extra or {}),
    }
    path = workdir / "agent.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path, states


__all__ = [
    "Churn",
    "Disruption",
    "Intent",
    "Outcome",
    "Report",
    "agent_config",
    "churn_with",
    "compare",
    "disrupt_during",
    "fate_of",
    "http_client",
    "pod_body",
]
