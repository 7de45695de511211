"""The CA that signs the apiserver's kubelet client certificate, which the kubelet API trusts.

It is written to one file per process (the TLS library reads CAs from files), rewritten in place
on every retry, and removed when the agent stops. Callers that ask at the same time (every
kubelet port of a starting agent) share one read.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import tempfile
from pathlib import Path

from ..kube import ApiError, KubeClient

log = logging.getLogger(__name__)

_AUTHENTICATION_CONFIGMAP = (
    "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication"
)


class ClientCA:
    def __init__(self, configured: Path | None) -> None:
        self._configured = configured
        self._directory: Path | None = None
        self._reading: asyncio.Task[Path | None] | None = None

    async def file(self, client: KubeClient) -> Path | None:
        """In order: `clientCAFile` from the config; the cluster's own statement of it
        (ConfigMap kube-system/extension-apiserver-authentication, readable with the right
        RBAC); the kubeconfig's CA, which is the same CA in kubeadm-style and vkubelet dev
        clusters. None: no client certificate is trusted, only bearer tokens."""
        if self._configured is not None:
            return self._configured
        if self._reading is None:
            self._reading = asyncio.create_task(self._read(client))
            self._reading.add_done_callback(self._read_done)
        return await asyncio.shield(self._reading)

    def _read_done(self, task: asyncio.Task[Path | None]) -> None:
        if self._reading is task:
            self._reading = None  # a later call (a retry) reads again

    async def _read(self, client: KubeClient) -> Path | None:
        pem: bytes | None = None
        try:
            cm = await client.get(_AUTHENTICATION_CONFIGMAP)
            text = (cm.get("data") or {}).get("client-ca-file")
            pem = text.encode() if text else None
        except ApiError as e:
            log.info("cannot read the cluster's client CA (%s); using the kubeconfig's CA", e)
        if pem is None:
            cluster = client.config.cluster
            if cluster.certificate_auth_data:
                pem = base64.b64decode(cluster.certificate_auth_data)
            elif cluster.certificate_auth:
                return Path(cluster.certificate_auth)
        if pem is None:
            log.warning("no client CA: the kubelet API accepts only bearer tokens")
            return None
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="vkubelet-ca-"))
        path = self._directory / "client-ca.crt"
        path.write_bytes(pem)
        return path

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
