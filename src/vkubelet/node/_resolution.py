"""Turns an API pod into a `ResolvedPod` for the provider, fetching what resolution needs.

`vkubelet.node.resolve` is pure and synchronous; this module does the I/O around it: it makes
sure every referenced ConfigMap and Secret is loaded (and watched), keeps the Services for
service-link variables, asks the provider for the pod's IPs before it starts (so `status.podIP`
can be resolved, which the reference cannot do), and obtains service-account tokens with the
TokenRequest API, bound to the pod and refreshed at 80 % of their lifetime like the kubelet does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import msgspec
from lightkube.resources.core_v1 import Pod, Service

from ..sdk.provider import ResolvedPod
from ._kube import ApiError, KubeClient, Unreachable
from ._objects import ObjectCache, ReadFailed
from ._reflector import Handler, Reflector
from .resolve import (
    EnvResolutionError,
    SourceReadError,
    referenced_objects,
    resolve_env,
    resolve_volumes,
)

JSON = dict[str, Any]


class ResolutionFailed(Exception):
    """The pod cannot start yet; `reason` is the kubelet's (CreateContainerConfigError...)."""

    def __init__(self, reason: str, message: str, events: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.events = list(events)


@dataclass
class Resolution:
    pod: ResolvedPod
    warnings: list[tuple[str, str]] = field(default_factory=list)
    refresh_after: float | None = None  # seconds until tokens must be renewed


@runtime_checkable
class PodNetwork(Protocol):
    """Optional provider capability: the pod's IPs, known before it starts."""

    async def pod_ips(self, pod: Pod) -> list[str]: ...


class ServiceCache:
    """All Services, for service-link env vars; one watch per process, started on first use."""

    def __init__(self, client: KubeClient) -> None:
        noop: Callable[..., None] = lambda *_: None  # noqa: E731
        self._reflector: Reflector[Service] = Reflector(
            client, "/api/v1/services", Service, Handler(noop, noop, noop), name="services"
        )
        self._task: asyncio.Task[None] | None = None

    async def ready(self, wait: float = 2.0) -> None:
        """Wait (a little) for the first list; ResolutionFailed if Services cannot be read."""
        if self._task is None:
            self._task = asyncio.create_task(self._reflector.run(), name="services reflector")
        try:
            async with asyncio.timeout(wait):
                await self._reflector.synced.wait()
        except TimeoutError:
            # What the kubelet says; the pod is retried, and no worker waits forever.
            raise ResolutionFailed(
                "CreateContainerConfigError",
                "services have not yet been read at least once, cannot construct envvars",
            ) from None

    def in_namespace(self, namespace: str) -> list[JSON]:
        prefix = f"{namespace}/"
        return [
            msgspec.to_builtins(s) for k, s in self._reflector.items.items() if k.startswith(prefix)
        ]


class _Sources:
    def __init__(self, objects: ObjectCache, services: ServiceCache) -> None:
        self._objects = objects
        self._services = services

    def _get(self, kind: str, namespace: str, name: str) -> JSON | None:
        try:
            return self._objects.get((kind, namespace, name))
        except ReadFailed as e:
            raise SourceReadError(str(e)) from None

    def get_configmap(self, namespace: str, name: str) -> JSON | None:
        return self._get("ConfigMap", namespace, name)

    def get_secret(self, namespace: str, name: str) -> JSON | None:
        return self._get("Secret", namespace, name)

    def list_services(self, namespace: str) -> list[JSON]:
        return self._services.in_namespace(namespace)


@dataclass
class _Token:
    token: str
    expiry: datetime
    refresh_at: float  # monotonic


class _Tokens:
    """Tokens fetched ahead of the (synchronous) resolution, keyed by what was asked for."""

    def __init__(self, tokens: dict[tuple[str, str | None, int], _Token]) -> None:
        self._tokens = tokens

    def request_token(
        self,
        namespace: str,
        service_account: str,
        audience: str | None,
        expiration_seconds: int,
        pod: Mapping[str, Any],
    ) -> tuple[str, datetime]:
        found = self._tokens.get((service_account, audience, expiration_seconds))
        if found is None:
            raise SourceReadError(f"no token for service account {service_account}")
        return found.token, found.expiry


class Resolver:
    def __init__(
        self,
        client: KubeClient,
        objects: ObjectCache,
        provider: object,
        services: ServiceCache,
        *,
        host_ip: str,
        allocatable: Callable[[], JSON],
    ) -> None:
        self._client = client
        self._objects = objects
        self._provider = provider
        self._services = services
        self._sources = _Sources(objects, services)
        self._host_ip = host_ip
        self._allocatable = allocatable
        self._tokens: dict[str, dict[tuple[str, str | None, int], _Token]] = {}

    def forget(self, key: str) -> None:
        self._tokens.pop(key, None)

    async def resolve(self, key: str, pod: Pod) -> Resolution:
        raw: JSON = msgspec.to_builtins(pod)
        refs = referenced_objects(raw)
        await self._objects.use(key, {(r[0], r[1], r[2]) for r in refs})
        spec = raw["spec"]
        await self._services.ready()  # the `kubernetes` service variables are always set
        pod_ips = [self._host_ip]
        if isinstance(self._provider, PodNetwork):
            pod_ips = await self._provider.pod_ips(pod)
        tokens = await self._fetch_tokens(key, raw)
        allocatable = self._allocatable()
        warnings: list[tuple[str, str]] = []
        containers = [
            *(spec.get("initContainers") or []),
            *(spec.get("containers") or []),
            *(spec.get("ephemeralContainers") or []),
        ]
        for container in containers:
            try:
                result = resolve_env(
                    raw,
                    container,
                    self._sources,
                    node_allocatable=allocatable,
                    pod_ips=pod_ips,
                    host_ips=[self._host_ip],
                )
            except EnvResolutionError as e:
                raise ResolutionFailed(
                    "CreateContainerConfigError",
                    str(e),
                    [(ev.reason, ev.message) for ev in e.events],
                ) from None
            warnings += [(ev.reason, ev.message) for ev in result.events if ev.type == "Warning"]
            container["env"] = result.as_env_list()
            container.pop("envFrom", None)
        volumes = resolve_volumes(
            raw, self._sources, token_source=_Tokens(tokens), node_allocatable=allocatable
        )
        if volumes.errors:
            message = "; ".join(e.message for e in volumes.errors)
            raise ResolutionFailed("FailedMount", message, [("FailedMount", message)])
        refresh = min((t.refresh_at for t in tokens.values()), default=None)
        return Resolution(
            pod=ResolvedPod(
                pod=msgspec.convert(raw, Pod),
                volumes={v.name: v for v in volumes.volumes},
            ),
            warnings=warnings,
            refresh_after=None if refresh is None else max(refresh - time.monotonic(), 1.0),
        )

    async def _fetch_tokens(self, key: str, raw: JSON) -> dict[tuple[str, str | None, int], _Token]:
        wanted: set[tuple[str, str | None, int]] = set()
        account = raw["spec"].get("serviceAccountName") or "default"
        for volume in raw["spec"].get("volumes") or []:
            for source in (volume.get("projected") or {}).get("sources") or []:
                token = source.get("serviceAccountToken")
                if token:
                    wanted.add(
                        (
                            account,
                            token.get("audience") or None,
                            int(token.get("expirationSeconds") or 3600),
                        )
                    )
        if not wanted:
            self._tokens.pop(key, None)
            return {}
        cache = self._tokens.setdefault(key, {})
        for stale in set(cache) - wanted:
            del cache[stale]
        now = time.monotonic()
        for want in wanted:
            current = cache.get(want)
            if current is None or current.refresh_at <= now:
                cache[want] = await self._request_token(raw, *want)
        return cache

    async def _request_token(
        self, raw: JSON, account: str, audience: str | None, seconds: int
    ) -> _Token:
        meta = raw["metadata"]
        body: JSON = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": seconds,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            },
        }
        if audience:
            body["spec"]["audiences"] = [audience]
        path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
        try:
            answer = await self._client.create(path, body)
        except (ApiError, Unreachable) as e:
            raise ResolutionFailed(
                "FailedMount", f"cannot get a token for service account {account}: {e}"
            ) from None
        expiry = datetime.fromisoformat(answer["status"]["expirationTimestamp"])
        lifetime = max((expiry - datetime.now(UTC)).total_seconds(), 1.0)
        # The kubelet renews at 80 % of the lifetime, or after 24 hours at the latest.
        refresh_in = min(lifetime * 0.8, timedelta(hours=24).total_seconds())
        return _Token(answer["status"]["token"], expiry, time.monotonic() + refresh_in)
