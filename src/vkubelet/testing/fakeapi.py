"""An in-memory Kubernetes API server behind `httpx2.MockTransport`, for the node agent's tests.

It serves what the agent uses, with the apiserver's semantics where the agent depends on them:

- GET one object; LIST with `fieldSelector` (`a=b`, `a!=b`, any dotted field path),
  `labelSelector` (`k=v`, `k!=v`, `k`, `!k`) and
  `limit`/`continue` pages served from a snapshot, like etcd-backed lists;
- WATCH as a streamed newline-delimited JSON response: replay from `resourceVersion`, synthetic
  ADDED events when it is empty or "0", BOOKMARKs on request (`bookmark()`), `ERROR` 410 Expired
  for a compacted version (`compact()`), injected ERROR events (`watch_error()`), ended streams
  (`close_watches()`), and `timeoutSeconds`;
- POST (409 AlreadyExists), PUT (resourceVersion precondition), PATCH (JSON merge patch and a
  strategic merge patch that knows the merge keys the agent meets — conditions by `type`,
  addresses by `type`, pod/host IPs by `ip`, owner references by `uid`; other lists, including
  `containerStatuses`, are replaced, as in Kubernetes), `metadata.uid`/`metadata.resourceVersion`
  in a patch act as preconditions (409), the `status` subresource changes only the status and
  the main resource never changes pod or node status;
- `pods/resize` changes only the containers (their resources);
- the VM controller's custom resources (`vkubelet.io/v1alpha1`), with a status subresource;
- DELETE with `gracePeriodSeconds` and `preconditions` (query or DeleteOptions body): pods bound
  to a node and not terminal get `deletionTimestamp`/`deletionGracePeriodSeconds` and stay until
  deleted with grace 0; everything else goes at once;
- `POST .../serviceaccounts/<name>/token` (TokenRequest; the `default` account always exists);
- one monotonically increasing resourceVersion for everything;
- `down()`: the server is unreachable (`httpx2.ConnectError`; open watches break with
  `httpx2.ReadError`) until the context ends; `fail()` answers matching requests with an error.

It is a test fake: it proves that the agent does what it means to against the semantics above,
never that a feature works against Kubernetes (the integration tests do that).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote

import httpx2 as httpx
from lightkube.config.kubeconfig import KubeConfig, SingleConfig

from vkubelet.kube import ClientOptions, KubeClient

JSON = dict[str, Any]

SERVER = "https://fake-apiserver.test:6443"

# resource (plural) -> (apiVersion, namespaced, kind)
RESOURCES: dict[str, tuple[str, bool, str]] = {
    "pods": ("v1", True, "Pod"),
    "nodes": ("v1", False, "Node"),
    "configmaps": ("v1", True, "ConfigMap"),
    "secrets": ("v1", True, "Secret"),
    "services": ("v1", True, "Service"),
    "endpointslices": ("discovery.k8s.io/v1", True, "EndpointSlice"),
    "events": ("v1", True, "Event"),
    "serviceaccounts": ("v1", True, "ServiceAccount"),
    "persistentvolumeclaims": ("v1", True, "PersistentVolumeClaim"),
    "persistentvolumes": ("v1", False, "PersistentVolume"),
    "leases": ("coordination.k8s.io/v1", True, "Lease"),
    "certificatesigningrequests": ("certificates.k8s.io/v1", False, "CertificateSigningRequest"),
    # the VM controller's custom resources
    "virtualmachines": ("vkubelet.io/v1alpha1", True, "VirtualMachine"),
    "virtualmachinebackups": ("vkubelet.io/v1alpha1", True, "VirtualMachineBackup"),
    "virtualmachinemigrations": ("vkubelet.io/v1alpha1", True, "VirtualMachineMigration"),
}
# API path prefix -> apiVersion
_PREFIXES = {("/api/" if v == "v1" else "/apis/") + v: v for v, _, _ in RESOURCES.values()}

# Strategic merge patch: lists merged by key (path of the list -> merge key). Every other list
# is replaced, which is what Kubernetes does for lists without a patch strategy — notably
# `status.containerStatuses`, which is atomic.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("status", "podIPs"): "ip",
    ("status", "hostIPs"): "ip",
    ("metadata", "ownerReferences"): "uid",
    ("spec", "containers"): "name",
    ("spec", "initContainers"): "name",
}

# Resources whose status is a subresource.
_WITH_STATUS = {
    "pods",
    "nodes",
    "certificatesigningrequests",
    "virtualmachines",
    "virtualmachinebackups",
    "virtualmachinemigrations",
}
_REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Expired"}


def now_rfc3339(delta: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=delta)).strftime("%Y-%m-%dT%H:%M:%SZ")


def kubeconfig(server: str = SERVER) -> SingleConfig:
    """A kubeconfig for the fake server (its transport never looks at TLS or credentials)."""
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "fake", "cluster": {"server": server}}],
            "users": [{"name": "agent", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
            "current-context": "fake",
        }
    ).get()
    assert config is not None
    return config


def status_body(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class _Error(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.body = status_body(code, reason, message)
        self.code = code


def _not_found(resource: str, name: str) -> _Error:
    return _Error(404, "NotFound", f'{resource} "{name}" not found')


def _conflict(resource: str, name: str, why: str) -> _Error:
    return _Error(409, "Conflict", f'Operation cannot be fulfilled on {resource} "{name}": {why}')


@dataclass
class Call:
    """A request as the server saw it."""

    method: str
    path: str
    params: dict[str, str]
    body: Any
    content_type: str


@dataclass
class _Change:
    rv: int
    resource: str
    type: str
    obj: JSON


_CLOSE = object()


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str | None
    selector: Callable[[JSON], bool]
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    times: int | None


def _parse(path: str) -> tuple[str, str | None, str | None, str | None]:
    """(resource, namespace, name, subresource) of an API path."""
    prefix = next((p for p in _PREFIXES if path.startswith(p + "/")), None)
    if prefix is None:
        raise _Error(404, "NotFound", f"the server could not find the requested resource {path}")
    parts = [unquote(p) for p in path[len(prefix) + 1 :].split("/") if p]
    namespace = None
    if len(parts) >= 3 and parts[0] == "namespaces":
        namespace, parts = parts[1], parts[2:]
    resource = parts[0]
    if resource not in RESOURCES or RESOURCES[resource][0] != _PREFIXES[prefix]:
        raise _Error(404, "NotFound", f"the server could not find the requested resource {path}")
    if RESOURCES[resource][1] != (namespace is not None) and len(parts) > 1:
        raise _Error(404, "NotFound", f"{resource}: wrong scope in {path}")
    name = parts[1] if len(parts) > 1 else None
    sub = parts[2] if len(parts) > 2 else None
    return resource, namespace, name, sub


def field_value(obj: JSON, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _selector(text: str) -> Callable[[JSON], bool]:
    terms: list[tuple[str, bool, str]] = []
    for term in filter(None, text.split(",")):
        match = re.fullmatch(r"([\w.]+)\s*(!=|==|=)\s*(.*)", term)
        if match is None:
            raise _Error(400, "BadRequest", f"invalid field selector {term!r}")
        terms.append((match[1], match[2] != "!=", match[3]))
    return lambda obj: all((field_value(obj, f) == v) == eq for f, eq, v in terms)


def _label_selector(text: str) -> Callable[[JSON], bool]:
    """`k=v`, `k==v`, `k!=v`, `k` (the label exists) and `!k` (it does not)."""
    # (key, the value wanted or None for presence, whether it must match)
    terms: list[tuple[str, str | None, bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        match = re.fullmatch(r"([\w./-]+)\s*(!=|==|=)\s*(.*)", term)
        if match is not None:
            terms.append((match[1], match[3], match[2] != "!="))
        elif re.fullmatch(r"!?[\w./-]+", term):
            terms.append((term.lstrip("!"), None, not term.startswith("!")))
        else:
            raise _Error(400, "BadRequest", f"invalid label selector {term!r}")

    def matches(obj: JSON) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(
            ((k in labels) if v is None else (labels.get(k) == v)) == eq for k, v, eq in terms
        )

    return matches


def _selectors(params: dict[str, str]) -> Callable[[JSON], bool]:
    fields = _selector(params.get("fieldSelector", ""))
    labels = _label_selector(params.get("labelSelector", ""))
    return lambda obj: fields(obj) and labels(obj)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    return _merge(target, patch, None)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A simplified strategic merge patch: merge-keyed lists from MERGE_KEYS, `null` deletes,
    `{key: ..., "$patch": "delete"}` removes an element of such a list and an element
    `{"$patch": "replace"}` replaces the whole list with the others; other directives
    (`$setElementOrder/...`, `$retainKeys`) are ignored."""
    return _merge(target, patch, ())


def _merge(target: Any, patch: Any, path: tuple[str, ...] | None) -> Any:
    """A merge patch; with `path` (where `patch` is in the object) a strategic one."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        here = None if path is None else (*path, key)
        merge_key = MERGE_KEYS.get(here) if here is not None and isinstance(value, list) else None
        if here is not None and key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif merge_key is not None and {"$patch": "replace"} in value:
            result[key] = [copy.deepcopy(v) for v in value if v != {"$patch": "replace"}]
        elif merge_key is not None and isinstance(result.get(key), list):
            merged = [copy.deepcopy(item) for item in result[key]]
            for item in value:
                if not isinstance(item, dict):
                    continue
                index = next(
                    (
                        i
                        for i, old in enumerate(merged)
                        if isinstance(old, dict) and old.get(merge_key) == item.get(merge_key)
                    ),
                    None,
                )
                if item.get("$patch") == "delete":
                    if index is not None:
                        del merged[index]
                elif index is None:
                    merged.append(_merge({}, item, here))
                else:
                    merged[index] = _merge(merged[index], item, here)
            result[key] = merged
        else:
            result[key] = _merge(result.get(key), value, here)
    return result


class FakeApiServer:
    def __init__(self, server: str = SERVER) -> None:
        self.server = server
        self._rv = 100
        self._objects: dict[str, dict[tuple[str, str], JSON]] = {r: {} for r in RESOURCES}
        self._history: list[_Change] = []
        self._compacted = 0  # watches from a version below this get 410 Expired
        self._watches: set[_Watch] = set()
        self._snapshots: dict[str, tuple[int, list[JSON]]] = {}
        self._faults: list[_Fault] = []
        self.unreachable = False
        self.calls: list[Call] = []
        self.tokens_issued = 0
        self.transport = httpx.MockTransport(self._handle)

    # -- for tests ------------------------------------------------------------------------------
    def client(self, options: ClientOptions | None = None) -> KubeClient:
        return KubeClient(
            kubeconfig(self.server), options or ClientOptions(), transport=self.transport
        )

    @property
    def resource_version(self) -> int:
        return self._rv

    def create(self, resource: str, obj: JSON, namespace: str | None = None) -> JSON:
        """Create like POST does (server-set fields, watch event) and return the stored copy."""
        ns = namespace or (obj.get("metadata") or {}).get("namespace")
        return copy.deepcopy(self._create(resource, ns if RESOURCES[resource][1] else None, obj))

    def get(self, resource: str, name: str, namespace: str | None = None) -> JSON | None:
        found = self._objects[resource].get((namespace or "", name))
        return copy.deepcopy(found) if found is not None else None

    def objects(self, resource: str, namespace: str | None = None) -> list[JSON]:
        return [
            copy.deepcopy(o)
            for (ns, _), o in sorted(self._objects[resource].items())
            if namespace is None or ns == namespace
        ]

    def patch(
        self,
        resource: str,
        name: str,
        patch: JSON,
        namespace: str | None = None,
        *,
        strategic: bool = False,
        subresource: str | None = None,
    ) -> JSON:
        """Change an object as another actor would (bumps the version, sends MODIFIED)."""
        kind = f"application/{'strategic-merge' if strategic else 'merge'}-patch+json"
        return copy.deepcopy(self._patch(resource, namespace, name, subresource, patch, kind))

    def delete(
        self,
        resource: str,
        name: str,
        namespace: str | None = None,
        *,
        grace: int | None = None,
        uid: str | None = None,
    ) -> JSON:
        options: JSON = {}
        if grace is not None:
            options["gracePeriodSeconds"] = grace
        if uid is not None:
            options["preconditions"] = {"uid": uid}
        return copy.deepcopy(self._delete(resource, namespace, name, options))

    def collect_garbage(self) -> None:
        """What the garbage collector does: delete objects whose every owner is gone."""
        uids = {o["metadata"]["uid"] for objs in self._objects.values() for o in objs.values()}
        for resource, objs in self._objects.items():
            for (ns, name), obj in list(objs.items()):
                owners = obj["metadata"].get("ownerReferences") or []
                if owners and not any(o.get("uid") in uids for o in owners):
                    self._delete(resource, ns or None, name, {"gracePeriodSeconds": 0})

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current resourceVersion to every watch that asked for them."""
        for watch in list(self._watches):
            if watch.bookmarks:
                kind = RESOURCES[watch.resource][2]
                obj = {"kind": kind, "metadata": {"resourceVersion": str(self._rv)}}
                watch.queue.put_nowait({"type": "BOOKMARK", "object": obj})

    def compact(self) -> None:
        """Forget history: watches from any version before now get 410 Expired."""
        self._compacted = self._rv
        self._history.clear()

    def watch_error(self, code: int = 410, resource: str | None = None) -> None:
        """Send an ERROR event (a Status) on open watches; the server ends them afterwards."""
        reason = "Expired" if code == 410 else "InternalError"
        for watch in list(self._watches):
            if resource is None or watch.resource == resource:
                error = {"type": "ERROR", "object": status_body(code, reason, "injected")}
                watch.queue.put_nowait(error)
                watch.queue.put_nowait(_CLOSE)

    def close_watches(self, resource: str | None = None) -> None:
        """End open watch streams cleanly, as the apiserver does at `timeoutSeconds`."""
        for watch in list(self._watches):
            if resource is None or watch.resource == resource:
                watch.queue.put_nowait(_CLOSE)

    def watch_count(self, resource: str | None = None) -> int:
        return sum(1 for w in self._watches if resource is None or w.resource == resource)

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The apiserver is unreachable inside the block; open watches break."""
        self.unreachable = True
        for watch in list(self._watches):
            watch.queue.put_nowait(httpx.ReadError("connection reset by fake apiserver"))
        try:
            yield
        finally:
            self.unreachable = False

    def fail(self, method: str, path_regex: str, status: int = 500, times: int | None = 1) -> None:
        """Answer matching requests with `status`, `times` times (None: until the test ends)."""
        self._faults.append(_Fault(method, re.compile(path_regex), status, times))

    def calls_to(
        self, method: str, path_regex: str = "", *, watch: bool | None = False
    ) -> list[Call]:
        pattern = re.compile(path_regex)
        return [
            c
            for c in self.calls
            if c.method == method
            and pattern.search(c.path)
            and (watch is None or (c.params.get("watch") == "true") == watch)
        ]

    # -- HTTP -----------------------------------------------------------------------------------
    async def _handle(self, request: httpx.Request) -> httpx.Response:
        if self.unreachable:
            raise httpx.ConnectError("connection refused (fake apiserver is down)", request=request)
        path = request.url.path
        params = dict(request.url.params)
        content_type = request.headers.get("content-type", "")
        body = json.loads(request.content) if request.content else None
        self.calls.append(Call(request.method, path, params, body, content_type))
        for fault in self._faults:
            if fault.method == request.method and fault.pattern.search(path):
                if fault.times is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                reason = _REASONS.get(fault.status, "InternalError")
                return _json(fault.status, status_body(fault.status, reason, "injected"))
        try:
            return self._route(request.method, path, params, body, content_type)
        except _Error as e:
            return _json(e.code, e.body)

    def _route(
        self, method: str, path: str, params: dict[str, str], body: Any, content_type: str
    ) -> httpx.Response:
        resource, namespace, name, sub = _parse(path)
        if method == "GET" and name is None:
            if params.get("watch") in ("true", "1"):
                return self._watch(resource, namespace, params)
            return _json(200, self._list(resource, namespace, params))
        if name is None:
            if method == "POST":
                return _json(201, self._create(resource, namespace, body))
            raise _Error(405, "MethodNotAllowed", f"{method} on a collection")
        if method == "GET":
            return _json(200, self._existing(resource, (namespace or "", name)))
        if method == "POST" and resource == "serviceaccounts" and sub == "token":
            return _json(201, self._token(namespace or "", name, body))
        if method == "POST" and resource == "pods" and sub == "eviction":
            self._delete(resource, namespace, name, dict((body or {}).get("deleteOptions") or {}))
            return _json(201, {"kind": "Status", "status": "Success"})
        if method == "PATCH":
            return _json(200, self._patch(resource, namespace, name, sub, body, content_type))
        if method == "PUT":
            return _json(200, self._replace(resource, namespace, name, sub, body))
        if method == "DELETE":
            options = dict(body or {})
            if "gracePeriodSeconds" in params:
                options["gracePeriodSeconds"] = int(params["gracePeriodSeconds"])
            return _json(200, self._delete(resource, namespace, name, options))
        raise _Error(405, "MethodNotAllowed", f"{method} {path}")

    # -- verbs ----------------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, resource: str, type_: str, obj: JSON) -> None:
        change = _Change(
            int(obj["metadata"]["resourceVersion"]), resource, type_, copy.deepcopy(obj)
        )
        self._history.append(change)
        for watch in list(self._watches):
            if watch.resource == resource and self._matches(watch, obj):
                watch.queue.put_nowait({"type": type_, "object": change.obj})

    @staticmethod
    def _matches(watch: _Watch, obj: JSON) -> bool:
        if watch.namespace is not None and obj["metadata"].get("namespace") != watch.namespace:
            return False
        return watch.selector(obj)

    def _existing(self, resource: str, key: tuple[str, str]) -> JSON:
        found = self._objects[resource].get(key)
        if found is None:
            raise _not_found(resource, key[1])
        return found

    def _create(self, resource: str, namespace: str | None, body: Any) -> JSON:
        if not isinstance(body, dict):
            raise _Error(400, "BadRequest", "expected an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
        if not name:
            raise _Error(422, "Invalid", "metadata.name: Required value")
        if namespace is not None and meta.get("namespace", namespace) != namespace:
            raise _Error(400, "BadRequest", "the namespace of the object does not match the path")
        key = (namespace or "", name)
        if key in self._objects[resource]:
            raise _Error(409, "AlreadyExists", f'{resource} "{name}" already exists')
        obj["apiVersion"], namespaced, obj["kind"] = RESOURCES[resource]
        meta["name"] = name
        if namespaced:
            meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["resourceVersion"] = self._next_rv()
        for server_set in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(server_set, None)
        if resource == "pods":
            # Pods are created Pending; tests may seed more status (a terminal phase, say).
            seed = obj.get("status")
            obj["status"] = {"phase": "Pending", **(seed if isinstance(seed, dict) else {})}
        self._objects[resource][key] = obj
        self._record(resource, "ADDED", obj)
        return obj

    def _list(self, resource: str, namespace: str | None, params: dict[str, str]) -> JSON:
        token = params.get("continue")
        if token:
            if token not in self._snapshots:
                raise _Error(410, "Expired", "the provided continue parameter is too old")
            rv, items = self._snapshots.pop(token)
        else:
            selector = _selectors(params)
            rv = self._rv
            items = [
                copy.deepcopy(o)
                for (ns, _), o in sorted(self._objects[resource].items())
                if (namespace is None or ns == namespace) and selector(o)
            ]
        limit = int(params.get("limit") or 0)
        meta: JSON = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            page, rest = items[:limit], items[limit:]
            next_token = base64.b64encode(uuid.uuid4().bytes).decode()
            self._snapshots[next_token] = (rv, rest)
            meta["continue"] = next_token
            meta["remainingItemCount"] = len(rest)
            items = page
        version, _, kind = RESOURCES[resource]
        return {
            "kind": f"{kind}List",
            "apiVersion": version,
            "metadata": meta,
            "items": items,
        }

    def _watch(
        self, resource: str, namespace: str | None, params: dict[str, str]
    ) -> httpx.Response:
        selector = _selectors(params)
        watch = _Watch(resource, namespace, selector, params.get("allowWatchBookmarks") == "true")
        since = params.get("resourceVersion", "")
        replay: list[JSON] = []
        if since in ("", "0"):
            replay = [
                {"type": "ADDED", "object": copy.deepcopy(o)}
                for (ns, _), o in sorted(self._objects[resource].items())
                if self._matches(watch, o)
            ]
        elif int(since) < self._compacted:
            error = status_body(410, "Expired", f"too old resource version: {since}")
            replay = [{"type": "ERROR", "object": error}]
            watch.queue.put_nowait(_CLOSE)
        else:
            replay = [
                {"type": c.type, "object": c.obj}
                for c in self._history
                if c.rv > int(since) and c.resource == resource and self._matches(watch, c.obj)
            ]
        self._watches.add(watch)
        timeout = float(params.get("timeoutSeconds") or 1800)
        return httpx.Response(
            200,
            headers={"content-type": "application/json"},
            content=self._stream(watch, replay, timeout),
        )

    async def _stream(
        self, watch: _Watch, replay: list[JSON], seconds: float
    ) -> AsyncIterator[bytes]:
        try:
            for event in replay:
                yield _line(event)
            async with asyncio.timeout(seconds):
                while True:
                    item = await watch.queue.get()
                    if item is _CLOSE:
                        return
                    if isinstance(item, Exception):
                        raise item
                    yield _line(item)
        except TimeoutError:
            return
        finally:
            self._watches.discard(watch)

    def _check_preconditions(self, resource: str, current: JSON, meta: JSON) -> None:
        name = current["metadata"]["name"]
        uid = meta.get("uid")
        if uid and uid != current["metadata"]["uid"]:
            raise _conflict(
                resource,
                name,
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {current['metadata']['uid']}",
            )
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise _conflict(
                resource,
                name,
                "the object has been modified; please apply your changes to the "
                "latest version and try again",
            )

    def _patch(
        self,
        resource: str,
        namespace: str | None,
        name: str,
        sub: str | None,
        patch: Any,
        content_type: str,
    ) -> JSON:
        key = (namespace or "", name)
        current = self._existing(resource, key)
        if not isinstance(patch, dict):
            raise _Error(400, "BadRequest", "patch must be an object")
        self._check_preconditions(resource, current, patch.get("metadata") or {})
        if content_type.startswith("application/merge-patch+json"):
            updated = merge_patch(current, patch)
        elif content_type.startswith("application/strategic-merge-patch+json"):
            updated = strategic_merge_patch(current, patch)
        else:
            raise _Error(415, "UnsupportedMediaType", f"patch type {content_type!r}")
        return self._store(resource, key, current, updated, sub)

    def _replace(
        self, resource: str, namespace: str | None, name: str, sub: str | None, body: Any
    ) -> JSON:
        key = (namespace or "", name)
        current = self._existing(resource, key)
        self._check_preconditions(resource, current, (body or {}).get("metadata") or {})
        return self._store(resource, key, current, copy.deepcopy(body), sub)

    def _store(
        self, resource: str, key: tuple[str, str], current: JSON, updated: JSON, sub: str | None
    ) -> JSON:
        if sub in ("status", "approval"):  # a CSR's approval is a status subresource too
            result = copy.deepcopy(current)
            result["status"] = updated.get("status") or {}
        elif sub == "resize" and resource == "pods":  # in-place resize: the containers only
            result = copy.deepcopy(current)
            result["spec"]["containers"] = updated["spec"]["containers"]
        elif sub is None:
            result = updated
            if resource in _WITH_STATUS:
                result["status"] = copy.deepcopy(current.get("status"))
        else:
            raise _Error(404, "NotFound", f"subresource {sub!r}")
        meta = result.setdefault("metadata", {})
        for fixed in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if fixed in current["metadata"]:
                meta[fixed] = current["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        result["apiVersion"], result["kind"] = current["apiVersion"], current["kind"]
        if result == current:
            return current  # a no-op write changes nothing, not even the resourceVersion
        meta["resourceVersion"] = self._next_rv()
        self._objects[resource][key] = result
        self._record(resource, "MODIFIED", result)
        return result

    def _delete(self, resource: str, namespace: str | None, name: str, options: JSON) -> JSON:
        key = (namespace or "", name)
        current = self._existing(resource, key)
        self._check_preconditions(resource, current, options.get("preconditions") or {})
        grace = 0
        if resource == "pods":
            asked = options.get("gracePeriodSeconds")
            if asked is None:
                asked = (current.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            grace = int(asked)
            phase = (current.get("status") or {}).get("phase")
            if not (current.get("spec") or {}).get("nodeName") or phase in ("Succeeded", "Failed"):
                grace = 0
            meta = current["metadata"]
            if meta.get("deletionTimestamp") is not None and grace >= meta.get(
                "deletionGracePeriodSeconds", 0
            ):
                return current  # already terminating with a shorter grace period
        if grace > 0:
            updated = copy.deepcopy(current)
            updated["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
            updated["metadata"]["deletionGracePeriodSeconds"] = grace
            updated["metadata"]["resourceVersion"] = self._next_rv()
            self._objects[resource][key] = updated
            self._record(resource, "MODIFIED", updated)
            return updated
        del self._objects[resource][key]
        gone = copy.deepcopy(current)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._record(resource, "DELETED", gone)
        return gone

    def _token(self, namespace: str, account: str, body: Any) -> JSON:
        if account != "default" and (namespace, account) not in self._objects["serviceaccounts"]:
            raise _not_found("serviceaccounts", account)
        spec = dict((body or {}).get("spec") or {})
        seconds = int(spec.get("expirationSeconds") or 3600)
        self.tokens_issued += 1
        return {
            "kind": "TokenRequest",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": account, "namespace": namespace},
            "spec": spec,
            "status": {
                "token": f"token-{account}-{self.tokens_issued}",
                "expirationTimestamp": now_rfc3339(seconds),
            },
        }


def _line(event: JSON) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _json(status: int, body: JSON) -> httpx.Response:
    return httpx.Response(status, json=body)
