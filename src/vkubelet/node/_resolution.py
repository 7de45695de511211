"""Turns an API pod into a `ResolvedPod` for the provider, fetching what resolution needs.

`vkubelet.node.resolve` is pure and synchronous; this module does the I/O around it: it makes
sure every referenced ConfigMap and Secret is loaded (and watched), keeps the Services for
service-link variables, asks the provider for the pod's IPs before it starts (so `status.podIP`
can be resolved, which the reference cannot do), and obtains service-account tokens with the
TokenRequest API, bound to the pod and refreshed at 80 % of their lifetime like the kubelet does.

A pass-through provider (`PassThroughPods`) gets none of that: the pod as written, plus the
current copies of the objects it references, so that no secret value is ever copied into a spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

import msgspec
from lightkube.resources.core_v1 import Pod, Service

from ..kube import ApiError, Handler, KubeClient, Reflector, Unreachable
from ..sdk.provider import PassThroughPods, ProviderError, ResolvedPod, TokensOnDemand
from ..sdk.volumes import FileContent
from ._objects import ObjectCache, ReadFailed
from .resolve import (
    EnvResolutionError,
    SourceReadError,
    TokenFile,
    expand_command_and_args,
    pass_through_references,
    referenced_objects,
    resolve_env,
    resolve_volumes,
)
from .resolve.servicelinks import pod_service_env

JSON = dict[str, Any]


class ResolutionFailed(Exception):
    """The pod cannot start yet; `reason` is the kubelet's (CreateContainerConfigError...).

    `permanent`: retrying cannot help until a referenced object changes, and its watch re-syncs
    the pod then (a Secret value that cannot be an environment variable).
    """

    def __init__(
        self,
        reason: str,
        message: str,
        events: Sequence[tuple[str, str]] = (),
        *,
        permanent: bool = False,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.events = list(events)
        self.permanent = permanent


@dataclass
class Resolution:
    pod: ResolvedPod
    warnings: list[tuple[str, str]] = field(default_factory=list)
    refresh_after: float | None = None  # seconds until tokens must be renewed
    # Ephemeral containers (`kubectl debug`) whose env cannot be resolved, by name: left out of
    # `pod`. As with the kubelet, that container waits with the reason, the pod runs on.
    ephemeral_failures: dict[str, ResolutionFailed] = field(default_factory=dict)


log = logging.getLogger(__name__)


@runtime_checkable
class PodNetwork(Protocol):
    """Optional provider capability: the pod's IPs, known before it starts.

    `pod_ips` may reserve them (an address, a network namespace); `release_pod_ips` frees
    what it reserved for a pod that did not start here after all: one whose settings could not
    be resolved and that was then deleted, replaced or ended. A pod the provider runs keeps its
    addresses until its `delete_pod`, so `release_pod_ips` leaves those alone."""

    async def pod_ips(self, pod: Pod) -> list[str]: ...

    async def release_pod_ips(self, namespace: str, name: str, uid: str) -> None: ...


class ServiceCache:
    """All Services, for service-link env vars; one watch per process, started on first use.

    Indexed by namespace and converted to JSON once per change, not once per container: a pod
    reads its own namespace's Services and the master `kubernetes` Service only.
    """

    def __init__(self, client: KubeClient) -> None:
        self._by_namespace: dict[str, dict[str, JSON]] = {}
        self.generation = 0  # moves on every change: what was derived from the Services is stale
        self._reflector: Reflector[Service] = Reflector(
            client,
            "/api/v1/services",
            Service,
            Handler(self._put, lambda _old, new: self._put(new), self._drop),
            name="services",
        )
        self._task: asyncio.Task[None] | None = None

    def _put(self, service: Service) -> None:
        meta = service.metadata
        if meta is not None and meta.namespace and meta.name:
            self.generation += 1
            self._by_namespace.setdefault(meta.namespace, {})[meta.name] = msgspec.to_builtins(
                service
            )

    def _drop(self, service: Service) -> None:
        meta = service.metadata
        if meta is None or not meta.namespace:
            return
        self.generation += 1
        services = self._by_namespace.get(meta.namespace, {})
        services.pop(meta.name or "", None)
        if not services:
            self._by_namespace.pop(meta.namespace, None)

    def start(self) -> None:
        """Start the watch now (idempotent). A node calls this as it starts, so that the first
        list runs alongside its registration and pod list: started only at the first pod sync,
        every adopted pod of a restarted agent waited for it, and failed (then backed off)
        when that took longer than `ready`'s wait."""
        if self._task is None:
            self._task = asyncio.create_task(self._reflector.run(), name="services reflector")

    async def ready(self, wait: float = 2.0) -> None:
        """Wait (a little) for the first list; ResolutionFailed if Services cannot be read."""
        if self._reflector.synced.is_set():
            return  # every pod after the first: no timeout to arm and cancel
        self.start()
        try:
            async with asyncio.timeout(wait):
                await self._reflector.synced.wait()
        except TimeoutError:
            # What the kubelet says; the pod is retried, and no worker waits forever.
            raise ResolutionFailed(
                "CreateContainerConfigError",
                "services have not yet been read at least once, cannot construct envvars",
            ) from None

    async def aclose(self) -> None:
        """Stop the watch before its client closes: left running, it saw its connection cut at
        every clean stop and logged the apiserver as unreachable."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def get(self, namespace: str, name: str) -> JSON | None:
        return self._by_namespace.get(namespace, {}).get(name)

    def in_namespace(self, namespace: str) -> list[JSON]:
        return list(self._by_namespace.get(namespace, {}).values())


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

    def get_service(self, namespace: str, name: str) -> JSON | None:
        return self._services.get(namespace, name)

    def list_services(self, namespace: str) -> list[JSON]:
        return self._services.in_namespace(namespace)


_TokenKey = tuple[str, str | None, int]  # service account, audience, expiration seconds


@dataclass(frozen=True)
class _DeferredTokens:
    """What a `TokensOnDemand` provider's pod needs to get its token files later."""

    meta: JSON  # namespace, name and uid: what the token is bound to
    account: str
    files: tuple[TokenFile, ...]


@dataclass
class _Token:
    token: str
    expiry: datetime
    refresh_at: float  # monotonic
    uid: str  # the pod it is bound to: a new pod under the same name needs its own


class _Tokens:
    """Tokens fetched ahead of the (synchronous) resolution, keyed by what was asked for."""

    def __init__(self, tokens: dict[_TokenKey, _Token]) -> None:
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
        self._services = services
        self._sources = _Sources(objects, services)
        self._host_ip = host_ip
        self._allocatable = allocatable
        self._tokens: dict[str, dict[_TokenKey, _Token]] = {}
        self._reserved: dict[str, str] = {}  # key -> the UID the provider reserved IPs for
        self._deferred: dict[str, _DeferredTokens] = {}
        # Service-link variables per (namespace, links enabled), with the Services' generation
        # they were made from: the same for every pod of a namespace until a Service changes.
        self._service_env: dict[tuple[str, bool], tuple[int, dict[str, str]]] = {}
        self._pass_through = isinstance(provider, PassThroughPods) and provider.pass_through is True
        # Checked once: a runtime protocol check per pod costs more than the rest of its setup.
        self._network = provider if isinstance(provider, PodNetwork) else None
        self._tokens_on_demand = isinstance(provider, TokensOnDemand)
        if isinstance(provider, TokensOnDemand):
            provider.use_tokens(self)  # one resolver per node, made before its first pod

    async def forget(self, key: str) -> None:
        """The pod is gone or ended: its tokens are needed no more, nor its reserved IPs."""
        self._tokens.pop(key, None)
        self._deferred.pop(key, None)
        await self._release_ips(key)

    async def _release_ips(self, key: str) -> None:
        uid = self._reserved.pop(key, None)
        if uid is None or self._network is None:
            return
        namespace, name = key.split("/", 1)
        try:
            await self._network.release_pod_ips(namespace, name, uid)
        except ProviderError as e:
            log.warning("pod %s: the provider could not release its IPs: %s", key, e.message)

    async def resolve(self, key: str, pod: Pod) -> Resolution:
        raw: JSON = msgspec.to_builtins(pod)
        if self._pass_through:
            return await self._pass_through_pod(key, raw)
        refs = referenced_objects(raw)
        await self._objects.use(key, {(r[0], r[1], r[2]) for r in refs})
        spec = raw["spec"]
        await self._services.ready()  # the `kubernetes` service variables are always set
        pod_ips = [self._host_ip]
        if self._network is not None:
            uid = raw["metadata"]["uid"]
            if self._reserved.get(key, uid) != uid:
                await self._release_ips(key)  # an earlier pod of this name that never started
            try:
                pod_ips = await self._network.pod_ips(pod)
            except ProviderError as e:  # no address left, say: the pod waits, and says why
                raise ResolutionFailed(e.reason, e.message) from None
            self._reserved[key] = uid
        tokens = {} if self._tokens_on_demand else await self._fetch_tokens(key, raw)
        allocatable = self._allocatable()
        warnings: list[tuple[str, str]] = []
        ephemeral = spec.get("ephemeralContainers") or []
        containers = [
            *(spec.get("initContainers") or []),
            *(spec.get("containers") or []),
            *ephemeral,
        ]
        failed: dict[str, ResolutionFailed] = {}
        try:  # the same for every container: computed once per pod
            service_env = self._pod_service_env(raw)
        except SourceReadError as e:
            raise ResolutionFailed(
                "CreateContainerConfigError",
                f"failed to list services when setting up env vars: {e}",
            ) from None
        for container in containers:
            try:
                result = resolve_env(
                    raw,
                    container,
                    self._sources,
                    node_allocatable=allocatable,
                    pod_ips=pod_ips,
                    host_ips=[self._host_ip],
                    service_env=service_env,
                )
            except EnvResolutionError as e:
                error = ResolutionFailed(
                    "CreateContainerConfigError",
                    str(e),
                    [(ev.reason, ev.message) for ev in e.events],
                    permanent=e.permanent,
                )
                if any(container is c for c in ephemeral):
                    failed[str(container.get("name"))] = error
                    continue
                raise error from None
            warnings += [(ev.reason, ev.message) for ev in result.events if ev.type == "Warning"]
            container["env"] = result.as_env_list()
            container.pop("envFrom", None)
            # As the kubelet does before it starts a container: a provider runs these as given.
            command, args = expand_command_and_args(container, result.env)
            if container.get("command") is not None:
                container["command"] = command
            if container.get("args") is not None:
                container["args"] = args
        if failed:
            spec["ephemeralContainers"] = [c for c in ephemeral if c.get("name") not in failed]
        volumes = resolve_volumes(
            raw,
            self._sources,
            token_source=_Tokens(tokens),
            node_allocatable=allocatable,
            defer_tokens=self._tokens_on_demand,
        )
        if volumes.errors:
            message = "; ".join(e.message for e in volumes.errors)
            raise ResolutionFailed("FailedMount", message, [("FailedMount", message)])
        if volumes.deferred_tokens:
            account = spec.get("serviceAccountName") or "default"
            meta = raw["metadata"]
            bound = {k: meta[k] for k in ("namespace", "name", "uid")}  # not the whole metadata
            self._deferred[key] = _DeferredTokens(bound, account, volumes.deferred_tokens)
        else:
            self._deferred.pop(key, None)
        refresh = min((t.refresh_at for t in tokens.values()), default=None)
        return Resolution(
            pod=ResolvedPod(
                pod=msgspec.convert(raw, Pod),
                volumes={v.name: v for v in volumes.volumes},
            ),
            warnings=warnings,
            refresh_after=None if refresh is None else max(refresh - time.monotonic(), 1.0),
            ephemeral_failures=failed,
        )

    def _pod_service_env(self, raw: JSON) -> dict[str, str]:
        namespace = (raw.get("metadata") or {}).get("namespace") or ""
        links = (raw.get("spec") or {}).get("enableServiceLinks", True) is not False
        key = (str(namespace), links)
        generation = self._services.generation
        cached = self._service_env.get(key)
        if cached is not None and cached[0] == generation:
            return cached[1]
        env = pod_service_env(raw, self._sources)
        self._service_env[key] = (generation, env)
        return env

    async def _pass_through_pod(self, key: str, raw: JSON) -> Resolution:
        """The pod as written, and current copies of what it references (None: missing)."""
        refs = pass_through_references(raw)
        await self._objects.use(key, set(refs))
        references: dict[tuple[str, str, str], JSON | None] = {}
        for ref in sorted(refs):
            try:
                # A copy: the provider may change what it gets, the cache must stay as read.
                references[ref] = copy.deepcopy(self._objects.get(ref))
            except ReadFailed as e:
                raise ResolutionFailed("CreateContainerConfigError", str(e)) from None
        return Resolution(pod=ResolvedPod(pod=msgspec.convert(raw, Pod), references=references))

    async def token_files(
        self, namespace: str, name: str, uid: str
    ) -> dict[str, dict[str, FileContent]]:
        """`PodTokens` for a `TokensOnDemand` provider: the token files resolution left out."""
        key = f"{namespace}/{name}"
        deferred = self._deferred.get(key)
        if deferred is None or deferred.meta.get("uid") != uid:
            return {}
        wanted = {(deferred.account, f.audience, f.expiration_seconds) for f in deferred.files}
        try:
            tokens = await self._current_tokens(key, deferred.meta, wanted)
        except ResolutionFailed as e:
            raise ProviderError(e.reason, e.message, permanent=False) from None
        files: dict[str, dict[str, FileContent]] = {}
        for f in deferred.files:
            token = tokens[(deferred.account, f.audience, f.expiration_seconds)].token
            files.setdefault(f.volume, {})[f.path] = FileContent(
                token.encode(), f.mode, f.owner_uid
            )
        return files

    async def _fetch_tokens(self, key: str, raw: JSON) -> dict[_TokenKey, _Token]:
        wanted: set[_TokenKey] = set()
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
        return await self._current_tokens(key, raw["metadata"], wanted)

    async def _current_tokens(
        self, key: str, meta: JSON, wanted: set[_TokenKey]
    ) -> dict[_TokenKey, _Token]:
        """The pod's cached tokens, with those missing or due for renewal requested now."""
        cache = self._tokens.setdefault(key, {})
        for stale in set(cache) - wanted:
            del cache[stale]
        now = time.monotonic()
        # Built apart from the cache: a concurrent call for another set of tokens (the pod
        # re-created under its name) may drop entries from it while this one waits.
        current: dict[_TokenKey, _Token] = {}
        for want in wanted:
            token = cache.get(want)
            if token is None or token.refresh_at <= now or token.uid != meta["uid"]:
                token = cache[want] = await self._request_token(meta, *want)
            current[want] = token
        return current

    async def _request_token(
        self, meta: JSON, account: str, audience: str | None, seconds: int
    ) -> _Token:
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
        try:
            expiry = datetime.fromisoformat(answer["status"]["expirationTimestamp"])
            token = str(answer["status"]["token"])
            lifetime = max((expiry - datetime.now(UTC)).total_seconds(), 1.0)  # naive: TypeError
        except (KeyError, TypeError, ValueError) as e:
            raise ResolutionFailed(
                "FailedMount",
                f"cannot get a token for service account {account}: "
                f"the apiserver's TokenRequest answer has no valid status ({e!r})",
            ) from None
        # The kubelet renews at 80 % of the lifetime, or after 24 hours at the latest.
        refresh_in = min(lifetime * 0.8, timedelta(hours=24).total_seconds())
        return _Token(token, expiry, time.monotonic() + refresh_in, meta["uid"])
