"""Who is calling the kubelet port, and may they? The kubelet's webhook mode, in small pieces.

Authentication tries, in order: the TLS client certificate (already verified against the client
CA by the TLS layer; CN is the user, O the groups), then a bearer token checked with a
TokenReview. Credentials that fail are a 401 even when anonymous access is on: a bad token must
never quietly become "anonymous". Authorization asks a SubjectAccessReview whether the user may
`<verb>` `nodes/<subresource>` on this node, with the subresource taken from the path exactly as
the kubelet does, so RBAC written for real kubelets applies unchanged.

Both halves are protocols so that tests (and unusual deployments) can plug in their own, and
both cache their answers because every `kubectl exec` would otherwise cost two API calls.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from ..kube import ApiError, Unreachable

log = logging.getLogger(__name__)

ANONYMOUS = "system:anonymous"
UNAUTHENTICATED = "system:unauthenticated"
AUTHENTICATED = "system:authenticated"

TOKEN_REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"  # noqa: S105 - a path
SUBJECT_ACCESS_REVIEW_PATH = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


@dataclass(frozen=True)
class UserInfo:
    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def cache_key(self) -> tuple[Any, ...]:
        return (self.name, self.uid, self.groups, tuple(sorted(self.extra.items())))


@dataclass(frozen=True)
class Credentials:
    """What a request presents. `peer_certificate` is `SSLSocket.getpeercert()`: only set when
    the TLS layer verified the chain against the client CA."""

    peer_certificate: Mapping[str, Any] | None = None
    bearer_token: str | None = None

    @property
    def present(self) -> bool:
        return bool(self.peer_certificate) or self.bearer_token is not None


@dataclass(frozen=True)
class Attributes:
    """What a request does, in the terms a SubjectAccessReview uses."""

    verb: str
    node: str
    subresource: str
    path: str
    resource: str = "nodes"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


class AuthenticationError(Exception):
    """Credentials were presented but could not be checked or were rejected."""


class ReviewClient(Protocol):
    """What the webhooks need of an API client; `KubeClient` is one."""

    async def create(self, path: str, body: Any) -> dict[str, Any]: ...


class Authenticator(Protocol):
    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        """The user, None if this authenticator has nothing to say about these credentials,
        or AuthenticationError if it recognised them as its kind and rejected them."""
        ...


class Authorizer(Protocol):
    async def authorize(self, user: UserInfo, attributes: Attributes) -> Decision: ...


# --- request → attributes -------------------------------------------------------------------

_VERBS = {
    "GET": "get",
    "HEAD": "get",
    "POST": "create",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def request_attributes(method: str, path: str, node: str) -> Attributes:
    """The kubelet's mapping: `/stats*` → stats, `/metrics*` → metrics (the agent's own
    `/metrics` included, as the kubelet's own `/metrics` is), `/logs*` → log, all else → proxy
    (notably exec, attach, port-forward, `/pods` and `/containerLogs`)."""
    if _under(path, "/stats"):
        subresource = "stats"
    elif _under(path, "/metrics"):
        subresource = "metrics"
    elif _under(path, "/logs"):
        subresource = "log"
    else:
        subresource = "proxy"
    # Like the kubelet, an unknown method maps to no verb, which no RBAC rule but "*" grants.
    return Attributes(_VERBS.get(method.upper(), ""), node, subresource, path)


# --- caches ---------------------------------------------------------------------------------

K = TypeVar("K")
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """A bounded map whose entries expire; the oldest go first when it is full, so that a
    stream of random tokens cannot grow it without limit."""

    def __init__(self, max_entries: int = 4096) -> None:
        self._max = max_entries
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        expires, value = item
        if time.monotonic() >= expires:
            del self._items[key]
            return None
        return value

    def put(self, key: K, value: V, ttl: float) -> None:
        if ttl <= 0:
            return
        self._items[key] = (time.monotonic() + ttl, value)
        self._items.move_to_end(key)
        while len(self._items) > self._max:
            self._items.popitem(last=False)


# --- authenticators -------------------------------------------------------------------------


def _with_authenticated(groups: tuple[str, ...]) -> tuple[str, ...]:
    return groups if AUTHENTICATED in groups else (*groups, AUTHENTICATED)


class X509Authenticator:
    """The TLS layer has verified the chain; this only reads the subject."""

    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        cert = credentials.peer_certificate
        if not cert:
            return None
        names: list[str] = []
        orgs: list[str] = []
        for rdn in cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    names.append(value)
                elif key == "organizationName":
                    orgs.append(value)
        if not names or not names[0]:
            raise AuthenticationError("client certificate has no common name")
        return UserInfo(names[0], groups=_with_authenticated(tuple(orgs)))


class TokenReviewAuthenticator:
    """Bearer tokens checked by the apiserver. Accepted tokens are cached for `ttl` (the
    kubelet's default 2 min), rejected ones briefly, errors not at all."""

    def __init__(
        self,
        client: ReviewClient,
        *,
        audiences: tuple[str, ...] = (),
        ttl: float = 120.0,
        failure_ttl: float = 10.0,
        max_entries: int = 4096,
    ) -> None:
        self._client = client
        self._audiences = audiences
        self._ttl = ttl
        self._failure_ttl = failure_ttl
        self._cache: TtlCache[str, UserInfo | str] = TtlCache(max_entries)

    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        token = credentials.bearer_token
        if token is None:
            return None
        key = hashlib.sha256(token.encode()).hexdigest()  # never keep the token itself
        cached = self._cache.get(key)
        if cached is None:
            cached = await self._review(token)
            self._cache.put(
                key, cached, self._ttl if isinstance(cached, UserInfo) else self._failure_ttl
            )
        if isinstance(cached, str):
            raise AuthenticationError(cached)
        return cached

    async def _review(self, token: str) -> UserInfo | str:
        spec: dict[str, Any] = {"token": token}
        if self._audiences:
            spec["audiences"] = list(self._audiences)
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        try:
            review = await self._client.create(TOKEN_REVIEW_PATH, body)
        except (ApiError, Unreachable) as exc:
            raise AuthenticationError(f"token review failed: {exc}") from exc
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return str(status.get("error") or "token not authenticated")
        user = status.get("user") or {}
        extra = {k: tuple(v) for k, v in (user.get("extra") or {}).items()}
        return UserInfo(
            name=str(user.get("username", "")),
            uid=str(user.get("uid", "")),
            groups=_with_authenticated(tuple(user.get("groups") or ())),
            extra=extra,
        )


class UnionAuthenticator:
    """The first authenticator that knows the caller wins. Without credentials the caller is
    anonymous, which is allowed only if asked for (the kubelet's `--anonymous-auth=false`
    is our default)."""

    def __init__(self, *authenticators: Authenticator, allow_anonymous: bool = False) -> None:
        self._authenticators = authenticators
        self.allow_anonymous = allow_anonymous

    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        for authenticator in self._authenticators:
            user = await authenticator.authenticate(credentials)
            if user is not None:
                return user
        if credentials.present:
            raise AuthenticationError("credentials not recognised")
        if self.allow_anonymous:
            return UserInfo(ANONYMOUS, groups=(UNAUTHENTICATED,))
        return None


# --- authorizers ----------------------------------------------------------------------------


class SubjectAccessReviewAuthorizer:
    """Asks the apiserver, caching "allowed" for 5 min and "denied" for 30 s as the kubelet's
    webhook authorizer does by default."""

    def __init__(
        self,
        client: ReviewClient,
        *,
        allowed_ttl: float = 300.0,
        denied_ttl: float = 30.0,
        max_entries: int = 4096,
    ) -> None:
        self._client = client
        self._allowed_ttl = allowed_ttl
        self._denied_ttl = denied_ttl
        self._cache: TtlCache[tuple[Any, ...], Decision] = TtlCache(max_entries)

    async def authorize(self, user: UserInfo, attributes: Attributes) -> Decision:
        key = (
            user.cache_key(),
            attributes.verb,
            attributes.resource,
            attributes.subresource,
            attributes.node,
        )
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        decision = await self._review(user, attributes)
        self._cache.put(key, decision, self._allowed_ttl if decision.allowed else self._denied_ttl)
        return decision

    async def _review(self, user: UserInfo, attributes: Attributes) -> Decision:
        spec: dict[str, Any] = {
            "user": user.name,
            "groups": list(user.groups),
            "resourceAttributes": {
                "verb": attributes.verb,
                "group": "",
                "version": "v1",
                "resource": attributes.resource,
                "subresource": attributes.subresource,
                "name": attributes.node,
            },
        }
        if user.uid:
            spec["uid"] = user.uid
        if user.extra:
            spec["extra"] = {k: list(v) for k, v in user.extra.items()}
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": spec,
        }
        review = await self._client.create(SUBJECT_ACCESS_REVIEW_PATH, body)
        status = review.get("status") or {}
        allowed = bool(status.get("allowed")) and not status.get("denied")
        reason = str(status.get("reason") or status.get("evaluationError") or "")
        return Decision(allowed, reason)


class AlwaysAllow:
    async def authorize(self, user: UserInfo, attributes: Attributes) -> Decision:
        return Decision(True, "authorization disabled")


class AllowAnyone:
    """Authentication that lets everyone in as anonymous (or as their certificate says)."""

    async def authenticate(self, credentials: Credentials) -> UserInfo | None:
        user = await X509Authenticator().authenticate(credentials)
        return user or UserInfo(ANONYMOUS, groups=(UNAUTHENTICATED,))


@dataclass(frozen=True)
class KubeletAuth:
    """The pair the server consults on every request except `/healthz`."""

    authenticator: Authenticator
    authorizer: Authorizer

    @classmethod
    def webhook(
        cls,
        client: ReviewClient,
        *,
        allow_anonymous: bool = False,
        audiences: tuple[str, ...] = (),
        token_ttl: float = 120.0,
        allowed_ttl: float = 300.0,
        denied_ttl: float = 30.0,
    ) -> KubeletAuth:
        """Client certificates (verified by the TLS context's client CA) and TokenReview, then
        SubjectAccessReview: what a kubelet with `authentication.webhook` and
        `authorization.mode: Webhook` does."""
        authenticator = UnionAuthenticator(
            X509Authenticator(),
            TokenReviewAuthenticator(client, audiences=audiences, ttl=token_ttl),
            allow_anonymous=allow_anonymous,
        )
        authorizer = SubjectAccessReviewAuthorizer(
            client, allowed_ttl=allowed_ttl, denied_ttl=denied_ttl
        )
        return cls(authenticator, authorizer)

    @classmethod
    def insecure_allow_all(cls) -> KubeletAuth:
        """Anyone may do anything, exec included. Only for throwaway local experiments."""
        log.warning(
            "KUBELET API AUTHENTICATION AND AUTHORIZATION ARE DISABLED: anyone who can reach "
            "the kubelet port can read logs and run commands in every pod of these nodes"
        )
        return cls(AllowAnyone(), AlwaysAllow())
