"""The cluster provider's kubectl verbs: the same verb on the lower pod, through the lower API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ...kube import ApiError
from ...sdk.capabilities import AttachIO, ByteStream
from ...sdk.provider import ContainerLogOptions, ProviderError
from ...streaming import Endpoint, UpgradeFailed, attach, exec_command
from ...streaming import port_forward as streaming_port_forward
from ._convert import JSON
from ._lower import LowerCluster
from ._stamps import is_ours, upper_identity
from ._stats import merge_resource_metrics, merge_summaries
from ._translate import PodTranslation

__all__ = ["LowerVerbs"]

log = logging.getLogger(__name__)


class LowerVerbs:
    """kubectl logs, exec, attach, port-forward and top on upper pods, served by the lower
    apiserver and kubelets. It reads the provider's lower pods (upper "namespace/name" ->
    lower pod) and keeps only its connection details and the scrape errors it reported."""

    def __init__(
        self,
        lower: LowerCluster,
        node_name: str,
        lower_pods: Mapping[str, JSON],
        how: Callable[[], PodTranslation],
    ) -> None:
        self.lower, self._node_name, self._lower_pods, self._how = lower, node_name, lower_pods, how
        self._stream_endpoint: Endpoint | None = None
        self._scrape_errors: dict[str, str] = {}  # lower node -> its last stats error

    async def container_logs(
        self, namespace: str, pod: str, container: str, options: ContainerLogOptions
    ) -> AsyncIterator[bytes]:
        """`kubectl logs` upstairs is the lower apiserver's pod log, options passed through."""
        since = options.earliest() if options.since_seconds is None else None
        given = {
            "container": container,
            "tailLines": options.tail_lines,
            "limitBytes": options.limit_bytes,
            "sinceSeconds": options.since_seconds,
            "sinceTime": since.strftime("%Y-%m-%dT%H:%M:%SZ") if since is not None else None,
            "timestamps": "true" if options.timestamps else None,
            "follow": "true" if options.follow else None,
            "previous": "true" if options.previous else None,
        }
        params = {key: str(value) for key, value in given.items() if value is not None}
        lower_ns, name = self._lower_ref(namespace, pod)
        path = f"/api/v1/namespaces/{lower_ns}/pods/{name}/log"
        try:
            async for chunk in self.lower.client.stream(path, params):
                yield chunk
        except ApiError as e:
            raise ProviderError(
                e.reason or "LowerLogsFailed", f"lower cluster: {e.message}"
            ) from None

    async def exec_in_container(
        self, namespace: str, pod: str, container: str, command: list[str], io: AttachIO
    ) -> int:
        """`kubectl exec` (and `cp`) upstairs: the same exec on the lower pod, through the lower
        apiserver (WebSocket v5, or SPDY)."""
        lower_ns, name = self._lower_ref(namespace, pod)
        try:
            return await exec_command(self._endpoint(), lower_ns, name, container, command, io)
        except UpgradeFailed as e:
            raise ProviderError("LowerExecFailed", f"lower cluster: {e}") from None

    async def attach_to_container(
        self, namespace: str, pod: str, container: str, io: AttachIO
    ) -> None:
        lower_ns, name = self._lower_ref(namespace, pod)
        try:
            await attach(self._endpoint(), lower_ns, name, container, io)
        except UpgradeFailed as e:
            raise ProviderError("LowerAttachFailed", f"lower cluster: {e}") from None

    async def port_forward(self, namespace: str, pod: str, port: int, stream: ByteStream) -> None:
        lower_ns, name = self._lower_ref(namespace, pod)
        await streaming_port_forward(self._endpoint(), lower_ns, name, port, stream)

    def _lower_ref(self, namespace: str, pod: str) -> tuple[str, str]:
        """Where the upper pod runs below; only our own pods are reachable this way."""
        current = self._lower_pods.get(f"{namespace}/{pod}")
        if current is None or not is_ours(current, self._how().owner):
            raise ProviderError("NotFound", f"pod {namespace}/{pod} does not run here")
        metadata = current.get("metadata") or {}
        return str(metadata.get("namespace")), str(metadata.get("name"))

    def _endpoint(self) -> Endpoint:
        if self._stream_endpoint is None:
            self._stream_endpoint = Endpoint.from_config(self.lower.client.config)
        return self._stream_endpoint

    async def stats_summary(self) -> dict[str, Any]:
        """`kubectl top pod/node`: our pods' numbers from the lower kubelets (see `_stats`)."""
        nodes, renames = self._placement()
        answers = await asyncio.gather(
            *(self.lower.client.get(f"/api/v1/nodes/{n}/proxy/stats/summary") for n in nodes),
            return_exceptions=True,
        )
        self._note_scrapes("stats/summary", nodes, answers)
        summaries = [a for a in answers if isinstance(a, dict)]
        return merge_summaries(self._node_name, summaries, renames)

    async def metrics_resource(self) -> str:
        """The metrics-server's scrape: the lower kubelets' `/metrics/resource`, our pods only."""
        nodes, renames = self._placement()
        answers = await asyncio.gather(
            *(
                self.lower.client.request_raw("GET", f"/api/v1/nodes/{n}/proxy/metrics/resource")
                for n in nodes
            ),
            return_exceptions=True,
        )
        self._note_scrapes("metrics/resource", nodes, answers)
        texts = [a.decode(errors="replace") for a in answers if isinstance(a, bytes)]
        return merge_resource_metrics(texts, renames)

    def _note_scrapes(self, what: str, nodes: set[str], answers: list[Any]) -> None:
        """A lower node whose figures cannot be read leaves its pods out of `kubectl top`; say
        why once per node and message (metrics-server scrapes every 15 s), and when it heals.
        The usual cause: the lower apiserver proxies to no loopback or link-local node address
        ("address not allowed")."""
        for node, answer in zip(nodes, answers, strict=True):
            before = self._scrape_errors.get(node)
            if isinstance(answer, BaseException):
                message = str(answer) or type(answer).__name__
                if "address not allowed" in message:
                    message += (
                        " (the lower apiserver proxies to no loopback or link-local node"
                        " address: give the lower nodes another InternalIP)"
                    )
                if message != before:
                    self._scrape_errors[node] = message
                    log.warning(
                        "kubectl top: lower node %s: %s through the lower apiserver: %s",
                        node,
                        what,
                        message,
                    )
            elif before is not None:
                del self._scrape_errors[node]
                log.info("kubectl top: lower node %s: %s readable again", node, what)

    def _placement(self) -> tuple[set[str], dict[tuple[str, str], tuple[str, str, str]]]:
        """The lower nodes running our pods, and lower (namespace, name) -> upper pod."""
        nodes: set[str] = set()
        renames: dict[tuple[str, str], tuple[str, str, str]] = {}
        for lower in self._lower_pods.values():
            identity = upper_identity(lower)
            metadata = lower.get("metadata") or {}
            if identity is None:
                continue
            renames[(str(metadata.get("namespace")), str(metadata.get("name")))] = identity
            node = (lower.get("spec") or {}).get("nodeName")
            if node:
                nodes.add(str(node))
        return nodes, renames
