"""The lower cluster's API, through the agent's own `KubeClient`, with errors a user can act on.

Two mistakes are common when pointing a provider at another cluster, and both used to show up
only as pods Pending forever (Admiralty #52, tensile-kube #56): a kubeconfig path that does not
resolve, and credentials that lack a permission. `open_lower` names the file and the field for
the first; `check_permissions` asks the lower apiserver (SelfSubjectAccessReview, which every
authorizer answers precisely) about each verb the provider uses and names the missing ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml
from lightkube.core.exceptions import ConfigError as KubeConfigError

from ...kube import ApiError, ClientOptions, KubeClient, Resource, load_kubeconfig
from ...sdk import ConfigError
from ...sdk.provider import ProviderError
from ._config import LowerConfig
from ._deps import DependencyPlan
from ._stamps import Owner, describe_owner, is_ours, stamp

__all__ = [
    "REQUIRED_PERMISSIONS",
    "Applied",
    "LowerCluster",
    "MissingPermissions",
    "Permission",
    "open_lower",
    "resource_path",
]

JSON = dict[str, Any]


@dataclass(frozen=True)
class Permission:
    verb: str
    resource: str  # "pods" or "pods/exec"
    group: str = ""

    def __str__(self) -> str:
        group = f".{self.group}" if self.group else ""
        return f"{self.verb} {self.resource}{group}"


def _all(resource: str, verbs: str, group: str = "") -> list[Permission]:
    return [Permission(verb, resource, group) for verb in verbs.split()]


# Cluster-wide: the provider lists and watches its pods across namespaces by owner label.
REQUIRED_PERMISSIONS: tuple[Permission, ...] = (
    *_all("pods", "get list watch create update patch delete"),
    *_all("pods/log", "get"),
    *_all("pods/resize", "patch"),
    *_all("pods/exec", "create"),
    *_all("pods/attach", "create"),
    *_all("pods/portforward", "create"),
    *_all("configmaps", "get list watch create update delete"),
    *_all("secrets", "get list watch create update delete"),
    *_all("serviceaccounts", "get list watch create update delete"),
    *_all("persistentvolumeclaims", "get list watch create delete"),
    *_all("namespaces", "get create"),
    *_all("nodes", "get list watch"),
    *_all("nodes/proxy", "get"),
    *_all("events", "list watch"),
    *_all("services", "get list watch create update delete"),
    *_all("endpointslices", "get list watch create update delete", "discovery.k8s.io"),
)


@dataclass
class Applied:
    """What applying a dependency plan did: the lower objects as now written (None: deleted),
    names found held by someone else, and errors to retry."""

    written: dict[tuple[str, str, str], JSON | None] = field(default_factory=dict)
    conflicts: dict[tuple[str, str, str], str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


class MissingPermissions(Exception):
    """The lower credentials lack permissions the provider needs."""

    def __init__(self, where: str, missing: Sequence[Permission]) -> None:
        self.missing = tuple(missing)
        listing = ", ".join(str(p) for p in missing)
        super().__init__(
            f"{where}: the lower cluster denies {listing} (cluster-wide); grant them, "
            "see the ClusterRole in docs/cluster-provider.md"
        )


def resource_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The API path of a kind the provider uses (namespaced, or across namespaces when
    `namespace` is None): each has its name in lower case plus "s" as its plural, and all but
    EndpointSlice are core kinds."""
    version = "discovery.k8s.io/v1" if kind == "EndpointSlice" else "v1"
    resource = Resource(version, kind, f"{kind.lower()}s", kind not in ("Namespace", "Node"))
    return resource.path(namespace, name or "")


class LowerCluster:
    """Plain API I/O against the lower cluster; every write path is a stamped object's."""

    def __init__(self, client: KubeClient, config: LowerConfig) -> None:
        self.client = client
        self.config = config
        self._namespaces: set[str] = set()  # known to exist below
        self._namespace_locks: dict[str, asyncio.Lock] = {}  # see ensure_namespace

    @property
    def where(self) -> str:
        user = self.client.config.context.user if self.client.config.context else "?"
        return f"{self.config.source}: lower cluster {self.client.server} (kubeconfig " + (
            f"{self.config.kubeconfig}, user {user})"
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def check_permissions(self, needed: Sequence[Permission] = REQUIRED_PERMISSIONS) -> None:
        """Raise MissingPermissions naming every permission the lower apiserver denies."""
        answers = await asyncio.gather(*(self._allowed(p) for p in needed))
        missing = [p for p, allowed in zip(needed, answers, strict=True) if not allowed]
        if missing:
            raise MissingPermissions(self.where, missing)

    async def _allowed(self, permission: Permission) -> bool:
        resource, _, subresource = permission.resource.partition("/")
        attributes = {"verb": permission.verb, "group": permission.group, "resource": resource}
        if subresource:
            attributes["subresource"] = subresource
        review = await self.client.create(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attributes},
            },
        )
        return bool((review.get("status") or {}).get("allowed"))

    async def call(self, action: Any, *, what: str = "") -> Any:
        """Await a lower API call; the lower API's refusals become the pod's reason."""
        try:
            return await action
        except ApiError as e:
            if e.status == 403 and "service account" in e.message and "not found" in e.message:
                # A namespace just created below gets its `default` account a moment later.
                raise ProviderError(
                    "LowerServiceAccountPending",
                    f"lower cluster: {what or 'request'}: {e.message}",
                    permanent=False,
                ) from None
            if e.status == 404 and "namespaces" in e.message:
                raise ProviderError(
                    "LowerNamespaceMissing",
                    f"lower cluster: {what or 'request'}: {e.message}",
                    permanent=not self.config.namespaces.create,  # else: re-created, retried
                ) from None
            if e.status in (400, 403, 422) or (e.status == 404 and what):
                raise ProviderError(
                    "LowerRejected" if e.status != 403 else "LowerForbidden",
                    f"lower cluster: {what or 'request'}: {e.message or e.reason}",
                ) from None
            raise

    async def server_version(self) -> JSON:
        """The cheapest request that proves the lower apiserver answers (the ping)."""
        return await self.client.get("/version")

    async def get(self, kind: str, namespace: str | None, name: str) -> JSON | None:
        try:
            return await self.client.get(resource_path(kind, namespace, name))
        except ApiError as e:
            if e.not_found:
                return None
            raise

    async def list_objects(
        self, kind: str, *, selector: str | None = None, namespace: str | None = None
    ) -> list[JSON]:
        params = {"labelSelector": selector} if selector else None
        answer = await self.client.get(resource_path(kind, namespace), params)
        items: list[JSON] = answer.get("items") or []
        return items

    async def create(self, body: Mapping[str, Any]) -> JSON:
        metadata = body["metadata"]
        path = resource_path(str(body["kind"]), metadata.get("namespace"))
        try:
            return await self.client.create(path, body)
        except ApiError as e:
            if e.not_found:  # the namespace was deleted below: create it again next time
                self._namespaces.discard(str(metadata.get("namespace")))
            raise

    async def replace(self, body: Mapping[str, Any]) -> JSON:
        metadata = body["metadata"]
        path = resource_path(str(body["kind"]), metadata.get("namespace"), metadata["name"])
        return await self.client.replace(path, body)

    async def delete(
        self,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        grace_period: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete; False if it was already gone, or (with `uid`) replaced by another object.

        Callers pass only objects `is_ours` approved, with their UID, so that an object someone
        else created at the same name since is never removed (a precondition the API checks).
        """
        body: JSON | None = None
        if grace_period is not None or uid:
            body = {"apiVersion": "v1", "kind": "DeleteOptions"}
            if grace_period is not None:
                body["gracePeriodSeconds"] = max(0, grace_period)
            if uid:
                body["preconditions"] = {"uid": uid}
        try:
            await self.client.delete(resource_path(kind, namespace, name), body)
        except ApiError as e:
            if e.not_found or (uid and e.conflict):
                return False
            raise
        return True

    async def apply_dependencies(self, plan: DependencyPlan, owner: Owner) -> Applied:
        """Carry out a dependency plan (namespaces first, then copies), without stopping at the
        first problem (the next pass retries). A name found taken on create (someone else's
        object, not in our owner-label listing) is a conflict, never used or touched."""
        done = Applied()

        async def attempt(what: str, action: Awaitable[object]) -> object:
            try:
                return await action
            except ApiError as e:
                done.problems.append(f"{what}: {e.message or e.reason}")
                return None

        async def create(obj: JSON) -> None:
            key = _key(obj)
            try:
                done.written[key] = await self.create(obj)
            except ApiError as e:
                if not e.conflict:
                    done.problems.append(f"create {_describe(obj)}: {e.message or e.reason}")
                    return
                found = await attempt(f"read {_describe(obj)}", self.get(*key))
                if isinstance(found, dict) and is_ours(found, owner):
                    done.written[key] = found
                elif isinstance(found, dict):
                    done.conflicts[key] = (
                        f"lower {key[0]} {key[1]}/{key[2]} already exists and is "
                        f"{describe_owner(found)}; it is left alone"
                    )

        for namespace in sorted(plan.namespaces):
            await attempt(f"namespace {namespace}", self.ensure_namespace(namespace, owner))
        for obj in plan.create:
            await create(obj)
        for obj in plan.update:
            written = await attempt(f"update {_describe(obj)}", self.replace(obj))
            if isinstance(written, dict):
                done.written[_key(obj)] = written
        for obj in plan.replace:
            key = _key(obj)
            await attempt(f"replace {_describe(obj)}", self.delete(*key, uid=plan.uids.get(key)))
            done.written[key] = None
            await create(obj)
        for key in plan.delete:
            deleted = await attempt(
                f"delete {key[0]} {key[1]}/{key[2]}", self.delete(*key, uid=plan.uids[key])
            )
            if deleted is not None:
                done.written[key] = None
        return done

    async def ensure_namespace(self, name: str, owner: Owner) -> None:
        """Create the lower namespace when missing (stamped, never deleted: other owners and
        the user may put objects there too).

        One look per namespace at a time: the first pods of a burst all start at once, and
        each asked on its own (up to 0.7 GETs per pod of a 1,000-pod burst on a loaded
        machine, where the answers were slow to come)."""
        if not self.config.namespaces.create or name in self._namespaces:
            return
        async with self._namespace_locks.setdefault(name, asyncio.Lock()):
            if name not in self._namespaces:
                await self._ensure_namespace(name, owner)

    async def _ensure_namespace(self, name: str, owner: Owner) -> None:
        if await self.get("Namespace", None, name) is not None:
            self._namespaces.add(name)
            return
        body = stamp(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            owner,
            namespace="",
            name=name,
            uid="",
        )
        try:
            await self.client.create("/api/v1/namespaces", body)
        except ApiError as e:
            if not e.conflict:
                raise
        self._namespaces.add(name)


def open_lower(config: LowerConfig) -> LowerCluster:
    """Load the lower kubeconfig; a ConfigError names lower.yaml, the field and the file."""
    at = f"{config.source}: kubeconfig: {config.kubeconfig}"
    if not config.kubeconfig.is_file():
        raise ConfigError(f"{at}: no such file")
    try:
        kubeconfig = load_kubeconfig(config.kubeconfig)
    except (KubeConfigError, OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise ConfigError(f"{at}: not a usable kubeconfig: {e}") from None
    try:
        loaded = kubeconfig.get(config.context)
    except KubeConfigError:
        loaded = None
    if loaded is None:
        raise ConfigError(
            f"{config.source}: context: {config.context!r} is not in {config.kubeconfig}"
        )
    options = ClientOptions(qps=config.kube_api_qps, burst=config.kube_api_burst)
    return LowerCluster(KubeClient(loaded, options), config)


def _describe(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    return f"{obj.get('kind')} {metadata.get('namespace')}/{metadata.get('name')}"


def _key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(metadata.get("namespace")), str(metadata.get("name")))
