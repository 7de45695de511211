"""Upper service-account tokens minted, refreshed and removed for the lower pods (`_tokens`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from ...kube import ApiError, Unreachable
from ...sdk.provider import ProviderError, ResolvedPod, UpperAPI
from ...sdk.tasks import TaskSet
from ._config import LowerConfig
from ._convert import epoch, to_json
from ._lower import LowerCluster
from ._stamps import describe_owner, is_ours, upper_identity
from ._tokens import (
    ROLE_LABEL,
    ROLE_TOKEN,
    refresh_at,
    token_request,
    token_secret,
    token_secret_name,
    token_sources,
)
from ._translate import PodTranslation

__all__ = ["UpperTokens"]

log = logging.getLogger(__name__)


class UpperTokens:
    """serviceAccountTokens: upper -- minting, refreshing and removing the pods' token Secrets.
    It reads the provider's pods (`given`, `deleting`: upper "namespace/name" -> pod, UID) and
    writes only its own state: when each pod's tokens are due again."""

    def __init__(
        self,
        config: LowerConfig,
        lower: LowerCluster,
        how: Callable[[], PodTranslation],
        given: Mapping[str, ResolvedPod],
        deleting: Mapping[str, str],
        still_adopting: Callable[[], bool],
        spawned: TaskSet,
    ) -> None:
        self.config, self.lower, self._how = config, lower, how
        self._given, self._deleting, self._still_adopting = given, deleting, still_adopting
        self._spawned = spawned
        self.upper: UpperAPI | None = None
        self.due: dict[str, tuple[str, float]] = {}  # "namespace/name" -> (UID, when to mint)
        self.check_every = 5.0  # seconds between looks for tokens due

    async def deliver(self, pod: ResolvedPod) -> None:
        """Mint the pod's upper tokens (TokenRequest, bound to the pod) and write them to its
        stamped token Secret below. No token value is ever logged or put in a message."""
        if self.config.service_account_tokens != "upper":
            return
        upper = to_json(pod.pod)
        spec = upper.get("spec") or {}
        sources = token_sources(spec)
        if not sources:
            return
        if self.upper is None:
            raise ProviderError(
                "UpperTokenUnavailable",
                "serviceAccountTokens: upper needs the agent's client of the upper cluster",
            )
        account = str(spec.get("serviceAccountName") or "default")
        path = f"/api/v1/namespaces/{pod.namespace}/serviceaccounts/{account}/token"
        tokens: dict[str, str] = {}
        due = float("inf")
        for source in sources:
            issued = time.time()
            try:
                answer = await self.upper.create(path, token_request(source, pod.name, pod.uid))
            except ApiError as e:
                raise ProviderError(
                    "UpperTokenFailed",
                    f"upper cluster: TokenRequest for service account {pod.namespace}/{account}: "
                    f"{e.message or e.reason}",
                    permanent=False,
                ) from None
            status = answer.get("status") or {}
            tokens[source.key] = str(status.get("token") or "")
            expires = epoch(status.get("expirationTimestamp"), issued + source.seconds)
            due = min(due, refresh_at(issued, expires))
        how = self._how()
        body = token_secret(how.owner, how.lower_namespace(pod.namespace), upper, tokens)
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        existing = await self.lower.call(self.lower.get("Secret", namespace, name))
        if existing is None:
            await self.lower.call(self.lower.create(body), what="create the token Secret")
        elif is_ours(existing, how.owner):
            body["metadata"]["resourceVersion"] = existing["metadata"].get("resourceVersion")
            await self.lower.call(self.lower.replace(body), what="refresh the token Secret")
        else:
            raise ProviderError(
                "LowerNameConflict",
                f"lower Secret {namespace}/{name} already exists and is "
                f"{describe_owner(existing)}; it is left alone",
            )
        self.due[f"{pod.namespace}/{pod.name}"] = (pod.uid, due)

    async def run(self) -> None:
        """Mint again the tokens past 80 % of their life; now and then remove token Secrets
        of pods gone while the agent was down."""
        swept = 0.0
        while True:
            await self.refresh_due()
            if time.monotonic() - swept >= self.config.resync.dependencies:
                swept = time.monotonic()
                await self._sweep()
            await asyncio.sleep(self.check_every)

    async def refresh_due(self) -> None:
        now = time.time()
        for key, (uid, due) in list(self.due.items()):
            given = self._given.get(key)
            if given is None or given.uid != uid:
                self.due.pop(key, None)
                continue
            if due > now or self._deleting.get(key) == uid:
                continue
            try:
                await self.deliver(given)
            except (ProviderError, ApiError, Unreachable) as e:
                log.warning("pod %s: refreshing its upper tokens failed: %s", key, e)

    async def _sweep(self) -> None:
        if self._still_adopting():
            return  # the next sweep: the pods not handed back yet are not given yet
        owner = self._how().owner
        selector = f"{owner.selector},{ROLE_LABEL}={ROLE_TOKEN}"
        live = {p.uid for p in self._given.values()}
        for secret in await self.lower.list_objects("Secret", selector=selector):
            identity = upper_identity(secret)
            if not is_ours(secret, owner) or identity is None or identity[2] in live:
                continue
            meta = secret["metadata"]
            await self.lower.delete("Secret", meta["namespace"], meta["name"], uid=meta["uid"])

    def drop(self, key: str, uid: str) -> None:
        """The pod is gone: so is its token Secret (deleted only if ours, by UID)."""
        if self.config.service_account_tokens != "upper":
            return
        due = self.due.get(key)
        if due is not None and due[0] == uid:
            del self.due[key]
        namespace = self._how().lower_namespace(key.partition("/")[0])
        self._spawned.spawn(
            self._delete_secret(namespace, token_secret_name(uid)), name=f"tokens {key}"
        )

    async def _delete_secret(self, namespace: str, name: str) -> None:
        existing = await self.lower.get("Secret", namespace, name)
        if existing is not None and is_ours(existing, self._how().owner):
            uid = str(existing["metadata"].get("uid", ""))
            await self.lower.delete("Secret", namespace, name, uid=uid)
