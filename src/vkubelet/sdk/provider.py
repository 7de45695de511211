"""The provider API: what a backend implements to run pods for a virtual node.

It mirrors Go virtual-kubelet's `PodLifecycleHandler`, `PodNotifier` and `NodeProvider` so that
their users feel at home, as async Python protocols over lightkube's typed models. Only the pod
lifecycle is required; everything else is an optional capability that the agent detects with
`isinstance` and falls back from (polling instead of push, a naive ping, 501 for a missing
kubectl verb).

The pod a provider receives is already *resolved*: every container's `env` holds literal values
(ConfigMap/Secret references, the downward API, `$(VAR)` expansion and service links done), and
the pod's volumes are available as file contents through `ResolvedPod.volumes`. A provider never
talks to the apiserver for that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from lightkube.models.core_v1 import PodStatus
from lightkube.resources.core_v1 import Node, Pod

from .volumes import FileContent, ResolvedVolume

__all__ = [
    "Closeable",
    "ConditionStatus",
    "ContainerLogOptions",
    "ContainerLogs",
    "EphemeralContainers",
    "EventSink",
    "EventType",
    "FleetNode",
    "Node",
    "NodeCondition",
    "NodeConditions",
    "NodeConfigurer",
    "NodeFleet",
    "NodeProvider",
    "NodeStatusNotifier",
    "PassThroughPods",
    "Pod",
    "PodLifecycleHandler",
    "PodNotifier",
    "PodStatus",
    "PodTokens",
    "ProviderContext",
    "ProviderError",
    "ResolvedPod",
    "TokensOnDemand",
    "UpperAPI",
    "UsesUpperAPI",
]


class ProviderError(Exception):
    """A provider cannot run a pod as asked. `reason` becomes the pod's status reason.

    Raise it for permanent problems (an unsupported field, a rejected image); the agent marks the
    pod with the reason and message and emits a Warning event. Any other exception is treated as
    transient and retried with back-off.
    """

    def __init__(self, reason: str, message: str, *, permanent: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.permanent = permanent


@dataclass(frozen=True)
class ResolvedPod:
    """A pod ready to run: `pod` with literal env values, plus its volumes' contents.

    For a `PassThroughPods` provider, `pod` is the API's pod as written, `volumes` is empty and
    `references` maps `(kind, namespace, name)` of each object the pod references (ConfigMap,
    Secret, ServiceAccount, PersistentVolumeClaim) to the API's current JSON of it, or None while
    it does not exist.
    """

    pod: Pod
    volumes: Mapping[str, ResolvedVolume] = field(default_factory=dict)
    references: Mapping[tuple[str, str, str], Mapping[str, Any] | None] = field(
        default_factory=dict
    )

    @property
    def namespace(self) -> str:
        return str(self.pod.metadata.namespace)  # type: ignore[union-attr]

    @property
    def name(self) -> str:
        return str(self.pod.metadata.name)  # type: ignore[union-attr]

    @property
    def uid(self) -> str:
        return str(self.pod.metadata.uid)  # type: ignore[union-attr]


@runtime_checkable
class PodLifecycleHandler(Protocol):
    """Required. Calls for one pod never overlap; calls for different pods do."""

    async def create_pod(self, pod: ResolvedPod) -> None:
        """Start the pod. Return once it is accepted; report progress through its status."""

    async def update_pod(self, pod: ResolvedPod) -> None:
        """The pod's mutable fields, env sources or volume contents changed."""

    async def delete_pod(self, pod: Pod, grace_period_seconds: int) -> None:
        """Stop the pod's containers (SIGTERM, then SIGKILL after the grace period).

        May be called more than once. The agent removes the API object as soon as the pod's
        status shows every container terminated, so report that as soon as it is true.
        """

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        """The pod as the provider runs it (status included), or None if it does not."""

    async def get_pod_status(self, namespace: str, name: str) -> PodStatus | None:
        """Current status, or None if the provider does not run the pod."""

    async def list_pods(self) -> list[Pod]:
        """Every pod the provider runs for this node (used to adopt and clean up on start)."""


@runtime_checkable
class PodNotifier(Protocol):
    """Optional: push status changes instead of being polled."""

    def notify_pods(self, callback: Callable[[Pod], None]) -> None:
        """Register `callback`; call it (without blocking) with the pod whenever status changes.

        Called before the node registers; reports made before the agent knows the pod are kept.
        An address learnt after `create_pod` (a VM's, a lower cluster's pod) goes in a later
        report as `podIP` or `podIPs`; `status.podIP` in the env keeps the address known at the
        start (the node's, unless the provider implements `pod_ips`).
        """


@runtime_checkable
class NodeProvider(Protocol):
    """Optional: the backend's health."""

    async def ping(self) -> None:
        """Raise if the backend is unhealthy; the node then goes NotReady."""


@runtime_checkable
class NodeConfigurer(Protocol):
    """Optional: the node the backend presents."""

    def configure_node(self, node: Node) -> None:
        """Set capacity, allocatable, labels, taints, addresses, nodeInfo before registration."""


@runtime_checkable
class NodeStatusNotifier(Protocol):
    """Optional: push node changes (capacity, conditions) instead of waiting for the next update."""

    def notify_node_status(self, callback: Callable[[Node], None]) -> None: ...


ConditionStatus = Literal["True", "False", "Unknown"]


@dataclass(frozen=True)
class NodeCondition:
    """A node condition as the provider sees it; the agent keeps the transition times.

    Standard types (`Ready`, `MemoryPressure`, `DiskPressure`, `PIDPressure`,
    `NetworkUnavailable`) are merged with the agent's own view: any problem wins, so a provider's
    `Ready=False` makes the node NotReady with the provider's reason (unless the agent has a
    problem of its own to report first, such as a failing `ping`). Any other type is
    published as the provider states it (say `Accelerator` with reason `TCGFallback`).
    """

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""


@runtime_checkable
class NodeConditions(Protocol):
    """Optional: conditions the backend reports about itself ("lower cluster unreachable",
    "KVM unusable, running under TCG"). Read at every node status update; call the
    `notify_node_status` callback (if implemented) to have a change published at once."""

    def node_conditions(self) -> Sequence[NodeCondition]: ...


@runtime_checkable
class PassThroughPods(Protocol):
    """Optional: the provider forwards pods to another Kubernetes API and wants them as written.

    With `pass_through = True` the agent does not resolve env, envFrom or volumes: `ResolvedPod.pod`
    is the API's pod unchanged (references, imagePullSecrets and all) and `ResolvedPod.references`
    holds the current copies of exactly the objects it references (ConfigMaps and Secrets are
    watched; ServiceAccounts and PVCs, which the Node authorizer lets a node get but not watch,
    are re-read every 30 s); `update_pod` is called when one of them changes. No secret value is
    ever copied into a pod spec by the agent, so none can leak into another system's pod spec.
    """

    pass_through: bool


class UpperAPI(Protocol):
    """The agent's own client of the cluster its nodes belong to, as far as a provider may use
    it: plain JSON requests with the agent's credentials (a `system:node` identity may read
    Services and mint tokens for its pods, little more). Raises the agent's `ApiError`."""

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]: ...

    async def create(self, path: str, body: Any) -> dict[str, Any]: ...

    def watch(
        self, path: str, params: Mapping[str, str], *, timeout_seconds: int
    ) -> AsyncIterator[tuple[str, bytes]]:
        """(event type, raw object JSON) until the server ends the watch."""
        ...


@runtime_checkable
class UsesUpperAPI(Protocol):
    """Optional: the provider reads the node's own cluster itself (a provider that forwards pods
    to another cluster reflects Services, mints ServiceAccount tokens, names the cluster). The
    agent calls `use_upper_api` once, before any other call, with the client it uses itself."""

    def use_upper_api(self, api: UpperAPI) -> None: ...


class PodTokens(Protocol):
    """The service-account token files of a `TokensOnDemand` provider's pods, on request."""

    async def token_files(
        self, namespace: str, name: str, uid: str
    ) -> Mapping[str, Mapping[str, FileContent]]:
        """`{volume: {path: content}}`: the token files the pod's projected volumes lack, each
        with the path, mode and owner the kubelet would give it. A token is requested (bound
        to the pod) on first use and again once 80 % of its lifetime has passed; between
        those, the same one is returned. Empty for a pod the node does not know (or of
        another UID). `ProviderError("FailedMount", ...)` when no token can be had."""
        ...


@runtime_checkable
class TokensOnDemand(Protocol):
    """Optional: the provider reads service-account tokens only when something needs them.

    A kubelet requests every projected token before the pod starts, and again at 80 % of its
    lifetime, whether anything reads it or not: one TokenRequest per pod, about as costly to
    the apiserver as the pod's status write. A provider whose containers are not real
    processes (the mock, whose files live in memory until someone execs) need not pay that.
    With this capability its `ResolvedPod.volumes` lack the token files, their contents do
    not count as a change (no `update_pod` when a token is renewed), and it asks the
    `PodTokens` given once, before the first pod, when it needs them.
    """

    def use_tokens(self, tokens: PodTokens) -> None: ...


@runtime_checkable
class AdoptsPods(Protocol):
    """Optional: told of each pod it already runs that the agent adopted at start-up and
    gives it no `create_pod` or `update_pod` for (its copy is up to date), with the pod as
    resolved now. A provider that keeps per-pod state in memory (which objects a pod needs,
    tokens to renew) rebuilds it here: after a restart `list_pods` tells it only what runs.
    Raise like `create_pod`: a `ProviderError` is an event and a retry (none if permanent)."""

    async def adopt_pod(self, pod: ResolvedPod) -> None: ...


@runtime_checkable
class EphemeralContainers(Protocol):
    """Optional: `kubectl debug` (an ephemeral container added to a running pod).

    The pods/ephemeralcontainers subresource adds to `pod.spec.ephemeralContainers`; the agent
    hands each new one to the provider once, by name, with the pod as resolved now (its env
    resolved like the others'). Return once it is accepted; report its state in the pod's
    status as `ephemeralContainerStatuses` (the `build_pod_status` of `sdk.status` does, from
    the containers' reports), waiting → running → terminated: `kubectl debug` waits for
    running, then attaches through `ContainerAttach` with the ephemeral container's name.
    After an agent restart a container the provider already runs may be handed again: ignore
    it. Raise `ProviderError` as in `create_pod`: a permanent one is shown as the container's
    waiting reason. Ephemeral containers are never part of `update_pod` (nor of its digest).
    Without this capability the agent reports each one waiting with reason
    `EphemeralContainersNotSupported`.
    """

    async def start_ephemeral_container(self, pod: ResolvedPod, name: str) -> None: ...


@runtime_checkable
class Closeable(Protocol):
    """Optional: release what the provider holds when the agent stops (SIGTERM/SIGINT).

    Called once, after the node's controllers have stopped, with the provider's pods left
    running: a restarted agent adopts them through `list_pods`. So a provider must keep, outside
    the process, whatever lets it find its pods again, and must make `create_pod` idempotent for a
    pod it already runs (same UID).
    """

    async def aclose(self) -> None: ...


EventType = Literal["Normal", "Warning"]


class EventSink(Protocol):
    """Where a provider records Kubernetes Events about its pods and its node.

    Non-blocking; events are aggregated and rate-limited with the agent's own, so a provider may
    report freely. Never put a secret value in a message.
    """

    def pod_event(self, pod: Pod, type: EventType, reason: str, message: str) -> None: ...

    def node_event(self, node_name: str, type: EventType, reason: str, message: str) -> None: ...


class _NoEvents:
    def pod_event(self, pod: Pod, type: EventType, reason: str, message: str) -> None:
        pass

    def node_event(self, node_name: str, type: EventType, reason: str, message: str) -> None:
        pass


@dataclass(frozen=True)
class ProviderContext:
    """What a provider factory gets: enough to find its config, describe its node, report."""

    node_name: str
    config_path: Path | None
    internal_ip: str
    kubelet_port: int
    events: EventSink = field(default_factory=_NoEvents)


@dataclass(frozen=True)
class ContainerLogOptions:
    tail_lines: int | None = None
    limit_bytes: int | None = None
    since_seconds: int | None = None
    since_time: datetime | None = None
    timestamps: bool = False
    follow: bool = False
    previous: bool = False

    def earliest(self) -> datetime | None:
        """The oldest log time asked for (`sinceTime`, or now minus `sinceSeconds`), in UTC."""
        if self.since_time is not None:
            since = self.since_time
            return since if since.tzinfo is not None else since.replace(tzinfo=UTC)
        if self.since_seconds is not None:
            return datetime.now(UTC) - timedelta(seconds=self.since_seconds)
        return None


@runtime_checkable
class ContainerLogs(Protocol):
    """Optional capability behind `kubectl logs`."""

    def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]: ...


@dataclass(frozen=True, eq=False)
class FleetNode:
    """One node of a fleet: its name, its own labels and taints, and the provider that runs it.

    The agent's node settings (kubelet port, address, provider taint) apply to every member;
    `labels` are added to them and `taints`, when given, replace them.
    """

    name: str
    provider: PodLifecycleHandler
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] | None = None


@runtime_checkable
class NodeFleet(Protocol):
    """Optional, instead of a single provider: a provider config that stands for a changing set
    of nodes, such as one node per device in an inventory file that is edited at run time.

    A provider factory may return a `NodeFleet`. The agent then runs one node per member: a new
    member is registered as soon as it appears; a member that disappears is cordoned, its pods
    are evicted (respecting disruption budgets) and, once none is left, its Node is deleted.
    """

    def watch_nodes(self) -> AsyncIterator[Sequence[FleetNode]]:
        """Yield the whole current set of members at once, then again after every change.

        A member is identified by its name: yield the same `FleetNode` (or one with the same
        name) to keep a node as it is.
        """
        ...
