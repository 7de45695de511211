"""Serving a provider's mutating admission webhook: HTTPS, the configuration, the audit.

A provider that wants one (the cluster provider's constraint webhook, `ServesAdmission`)
decides what it answers and what it installs, sans I/O; the agent does the I/O:

- TLS: the provider's given files, or else the node's kubelet serving certificate (the same
  context object, so renewals reach both). That certificate comes from a CSR to the upper
  cluster for signer `kubernetes.io/kubelet-serving`, which the kube-controller-manager signs with
  the cluster CA; its SANs are the node's addresses, so the webhook URL uses the node's internal
  IP, and the caBundle is the CA of the agent's kubeconfig. No second CSR, no second approval:
  whoever approves the kubelet API's certificate (an admin, `--approve-own-csrs`, or the agent
  itself on a dev cluster) has approved the webhook's.
- HTTP: h11 through the kubelet API's own connection loop (`kubelet._http`), a dependency we
  have: one small POST route needs no framework.
- The MutatingWebhookConfiguration, server-side applied (field manager `vkubelet`, forced:
  the agent owns it) once the port listens. It is left in place when the agent stops:
  `failurePolicy: Ignore` lets pods through meanwhile, and the audit finds them afterwards.
- The audit: at start and every `audit_seconds`, opted-in pods the webhook never saw get one
  Warning Event each (reason from the provider), and a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..kube import APPLY_PATCH, ApiError, KubeClient, ObjectRef, Unreachable
from ..kubelet import Exchange, HttpLimits, serve_connection, server_ssl_context
from ..node import NodeAgent
from ._serving import cluster_ca

log = logging.getLogger(__name__)

_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
# A pod in an AdmissionReview can be as large as the object limit of etcd (1.5 MiB), twice over
# on updates; we only see creates.
_LIMITS = HttpLimits(max_body_bytes=4 << 20, header_timeout=10.0)


class AdmissionWebhook(Protocol):
    """One node's webhook, as a provider describes it (see the cluster provider's `_admission`)."""

    name: str  # of the MutatingWebhookConfiguration
    node_name: str
    port: int
    host: str  # what the apiserver dials
    path: str
    cert_file: Path | None
    key_file: Path | None
    ca_file: Path | None
    audit_seconds: float
    skipped_reason: str  # of the Warning Event about a pod admitted without the webhook

    def review(self, body: bytes) -> bytes:
        """AdmissionReview in, AdmissionReview out; ValueError for a body that is not one."""
        ...

    def configuration(self, url: str, ca_bundle: bytes) -> dict[str, Any]: ...

    def audit_lists(
        self, namespaces: Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, dict[str, str]]]: ...

    def skipped(
        self, pod: Mapping[str, Any], namespaces: Mapping[str, Mapping[str, Any]]
    ) -> str | None: ...


@runtime_checkable
class ServesAdmission(Protocol):
    """Optional provider protocol: a webhook for the agent to serve (None: not enabled)."""

    def admission_webhook(self) -> AdmissionWebhook | None: ...


KubeletContext = Callable[[], Awaitable[ssl.SSLContext]]


async def serve_webhook(
    client: KubeClient,
    node: NodeAgent,
    webhook: AdmissionWebhook,
    kubelet_context: KubeletContext | None,
) -> None:
    """Listen, install, audit; until cancelled (run under a supervisor: a failure restarts it)."""
    context, ca_bundle = await _tls(client, webhook, kubelet_context)

    connections: set[asyncio.Task[Any]] = set()

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.add(task)
        try:
            await serve_connection(reader, writer, functools.partial(_handle, webhook), _LIMITS)
        except asyncio.CancelledError:
            # Closing ends the apiserver's kept-alive connections this way; asyncio's own
            # connection task would otherwise report the cancellation as an error.
            pass
        finally:
            connections.discard(task)

    server = await asyncio.start_server(
        on_connection, port=webhook.port, ssl=context, ssl_handshake_timeout=10.0
    )
    try:
        url = f"https://{_url_host(webhook.host)}:{webhook.port}{webhook.path}"
        log.info("node %s: admission webhook listening, served as %s", webhook.node_name, url)
        await install(client, webhook.configuration(url, ca_bundle))
        log.info(
            "node %s: MutatingWebhookConfiguration %s applied", webhook.node_name, webhook.name
        )
        await audit_forever(client, node, webhook)
    finally:
        server.close()
        for task in list(connections):
            task.cancel()
        with contextlib.suppress(Exception):
            await server.wait_closed()


async def _handle(webhook: AdmissionWebhook, exchange: Exchange) -> None:
    request = exchange.request
    if request.path != webhook.path:
        await exchange.respond(404, "not found")
        return
    if request.method != "POST":
        await exchange.respond(405, "POST an AdmissionReview", headers=[("Allow", "POST")])
        return
    try:
        answer = webhook.review(request.body)
    except ValueError as e:
        await exchange.respond(400, str(e))
        return
    await exchange.respond(200, answer, content_type="application/json")


async def _tls(
    client: KubeClient, webhook: AdmissionWebhook, kubelet_context: KubeletContext | None
) -> tuple[ssl.SSLContext, bytes]:
    """The server context and the caBundle that verifies it."""
    ca_pem, _ = cluster_ca(client)
    if webhook.ca_file is not None:
        ca_pem = webhook.ca_file.read_bytes()
    if webhook.cert_file is not None and webhook.key_file is not None:
        context = server_ssl_context(webhook.cert_file, webhook.key_file)
    elif kubelet_context is not None:
        context = await kubelet_context()
    else:
        raise RuntimeError(
            f"node {webhook.node_name}: the admission webhook needs certFile and keyFile when "
            "the kubelet API (whose serving certificate it shares) is off"
        )
    if not ca_pem:
        raise RuntimeError(
            f"node {webhook.node_name}: no CA bundle for the admission webhook: the kubeconfig "
            "names no CA; set caFile"
        )
    return context, ca_pem


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def install(client: KubeClient, configuration: dict[str, Any]) -> None:
    """Server-side apply: the agent's fields are exactly these, whatever was there."""
    name = configuration["metadata"]["name"]
    try:
        await client.patch(
            f"{_CONFIGURATIONS}/{name}?fieldManager=vkubelet&force=true",
            configuration,
            content_type=APPLY_PATCH,
        )
    except ApiError as e:
        if e.status == 403:
            log.error(
                "cannot install MutatingWebhookConfiguration %s: %s. The agent's identity needs "
                "`patch` on admissionregistration.k8s.io mutatingwebhookconfigurations (see "
                "docs/cluster-provider.md, Constraint webhook)",
                name,
                e.message,
            )
        raise


async def audit_forever(client: KubeClient, node: NodeAgent, webhook: AdmissionWebhook) -> None:
    warned: set[str] = set()
    while True:
        try:
            await audit_once(client, node, webhook, warned)
        except (ApiError, Unreachable) as e:
            log.warning("node %s: webhook audit failed (%s); retrying later", node.settings.name, e)
        await asyncio.sleep(webhook.audit_seconds)


async def audit_once(
    client: KubeClient, node: NodeAgent, webhook: AdmissionWebhook, warned: set[str]
) -> int:
    """Warn about each opted-in pod admitted without the webhook, once per pod and process.
    Returns how many were found this time."""
    namespaces = (await client.get("/api/v1/namespaces")).get("items") or []
    by_name = {str((n.get("metadata") or {}).get("name")): n for n in namespaces}
    found = 0
    for path, params in webhook.audit_lists(namespaces):
        for pod in (await client.get(path, params)).get("items") or []:
            metadata = pod.get("metadata") or {}
            uid = str(metadata.get("uid", ""))
            if uid in warned:
                continue
            message = webhook.skipped(pod, by_name)
            if message is None:
                continue
            found += 1
            warned.add(uid)
            namespace, name = str(metadata.get("namespace")), str(metadata.get("name"))
            log.warning("pod %s/%s %s", namespace, name, message)
            node.events.emit(
                ObjectRef("Pod", namespace, name, uid), "Warning", webhook.skipped_reason, message
            )
    return found


def webhooks(nodes: Sequence[NodeAgent]) -> list[tuple[NodeAgent, AdmissionWebhook]]:
    """The nodes whose provider serves a webhook, with it."""
    found = []
    for node in nodes:
        if isinstance(node.provider, ServesAdmission):
            webhook = node.provider.admission_webhook()
            if webhook is not None:
                found.append((node, webhook))
    return found
