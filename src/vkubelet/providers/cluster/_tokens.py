"""Upper service-account tokens for lower pods (`serviceAccountTokens: upper`).

A pod that must reach the *upper* API (an operator, a CI runner) needs an upper token, but an
upper token must never go down as a long-lived Secret (tensile-kube copies the account's token
Secret; a leaked copy is valid forever). So each token is minted with the TokenRequest API
exactly as the kubelet would: for the pod's account, bound to the pod (deleting the upper pod
invalidates it), with the audience and lifetime its projected `serviceAccountToken` source asks
for. It goes down in one stamped Secret per pod, which the provider rewrites with fresh tokens
before 80 % of their lifetime has passed (the kubelet's rule) and deletes with the pod.

The lower pod keeps its projected volumes; each `serviceAccountToken` source becomes a `secret`
source reading that Secret, at the same path, so the files look as they do upstairs (a client
library re-reads the token file). The `kube-root-ca.crt` source is copied like any ConfigMap
(it is the upper CA, the one that verifies the upper apiserver). Pure here; the provider mints
and writes.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._stamps import LABEL_OWNER, Owner, stamp, upper_identity

__all__ = [
    "ROLE_LABEL",
    "ROLE_TOKEN",
    "TokenSource",
    "is_token_secret",
    "refresh_at",
    "token_request",
    "token_secret",
    "token_secret_name",
    "token_sources",
    "use_token_secret",
]

JSON = dict[str, Any]
ROLE_LABEL = "vkubelet.io/role"
ROLE_TOKEN = "upper-token"  # noqa: S105  (a label value)
_DEFAULT_SECONDS = 3600
_MIN_SECONDS = 600  # what the TokenRequest API accepts at least


@dataclass(frozen=True)
class TokenSource:
    """One `serviceAccountToken` projected source: where it goes in the Secret and its wishes."""

    key: str  # the Secret key: "<volume>.<index>"
    audience: str | None
    seconds: int


def _tokens_in(spec: Mapping[str, Any]) -> Iterator[tuple[list[JSON], int, str, JSON]]:
    """Each `serviceAccountToken` projected source: its list, its index there, its key in the
    token Secret ("<volume>.<index>") and the source itself."""
    for volume in spec.get("volumes") or []:
        projected = volume.get("projected")
        sources = (projected.get("sources") or []) if isinstance(projected, dict) else []
        for index, source in enumerate(sources):
            token = source.get("serviceAccountToken")
            if token is not None:
                yield sources, index, f"{volume.get('name')}.{index}", token


def token_sources(spec: Mapping[str, Any]) -> list[TokenSource]:
    found = []
    for _, _, key, token in _tokens_in(spec):
        seconds = int(token.get("expirationSeconds") or _DEFAULT_SECONDS)
        found.append(TokenSource(key, token.get("audience") or None, max(seconds, _MIN_SECONDS)))
    return found


def token_secret_name(upper_uid: str) -> str:
    """One Secret per upper pod (by UID, so a re-created pod of that name gets its own)."""
    return "vk-token-" + hashlib.sha256(upper_uid.encode()).hexdigest()[:20]


def use_token_secret(spec: JSON, secret_name: str) -> None:
    """Point every `serviceAccountToken` source of the lower spec at the token Secret (same
    path), and keep the lower ServiceAccount admission from mounting a lower token there."""
    for sources, index, key, token in _tokens_in(spec):
        item = {"key": key, "path": token.get("path") or "token"}
        sources[index] = {"secret": {"name": secret_name, "items": [item]}}
    spec["automountServiceAccountToken"] = False


def token_request(source: TokenSource, pod_name: str, pod_uid: str) -> JSON:
    """The TokenRequest the kubelet would send: bound to the pod, so it dies with it."""
    spec: JSON = {
        "audiences": [source.audience] if source.audience else [],
        "expirationSeconds": source.seconds,
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid},
    }
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}


def refresh_at(issued: float, expires: float) -> float:
    """When to mint again: at 80 % of the lifetime, as the kubelet does."""
    return issued + 0.8 * max(expires - issued, 0.0)


def token_secret(
    owner: Owner,
    lower_namespace: str,
    upper: Mapping[str, Any],
    tokens: Mapping[str, str],
) -> JSON:
    """The stamped Secret holding a pod's tokens (key -> token)."""
    metadata = upper.get("metadata") or {}
    uid = str(metadata.get("uid", ""))
    body: JSON = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "namespace": lower_namespace,
            "name": token_secret_name(uid),
            "labels": {ROLE_LABEL: ROLE_TOKEN},
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(tokens.items())},
    }
    return stamp(
        body, owner, namespace=str(metadata.get("namespace")), name=str(metadata["name"]), uid=uid
    )


def is_token_secret(obj: Mapping[str, Any]) -> bool:
    """One of our pods' token Secrets: its role label, and the name its pod's UID gives (a
    label alone could be an upper object's, copied down: never taken for a token Secret)."""
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    if LABEL_OWNER not in labels or labels.get(ROLE_LABEL) != ROLE_TOKEN:
        return False
    identity = upper_identity(obj)
    return identity is not None and metadata.get("name") == token_secret_name(identity[2])
