"""Serving and client certificates: reuse only what this cluster signed, renew without ever
giving up, and say plainly what a pending CSR needs."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from lightkube.config.kubeconfig import KubeConfig

from vkubelet._files import write_kubeconfig
from vkubelet.kube import ClientOptions, KubeClient
from vkubelet.node import _certs
from vkubelet.node._certs import (
    ClientIdentity,
    ServingCertificate,
    cluster_cert_dir,
    stored_certificate_problem,
)
from vkubelet.testing.fakeapi import FakeApiServer

from ..agent.pki import TestCA, approved, pending_csrs, sign_pending, signer
from .helpers import cancel_and_wait, eventually

ADDRESSES = ["10.0.0.7", "vk-a"]


@pytest.fixture
def api() -> FakeApiServer:
    return FakeApiServer()


def serving(
    api: FakeApiServer, directory: Path, ca: TestCA, **kwargs: object
) -> ServingCertificate:
    return ServingCertificate(
        api.client(),
        node_name="vk-a",
        addresses=ADDRESSES,
        cert_dir=directory,
        cluster_ca=[ca.cert],
        **kwargs,  # type: ignore[arg-type]
    )


def test_a_stored_certificate_signed_by_another_clusters_ca_is_not_reused(tmp_path: Path) -> None:
    old, new = TestCA("old cluster"), TestCA("new cluster")
    cert, key = tmp_path / "vk-a-serving.crt", tmp_path / "vk-a-serving.key"
    old.issue(cert, key, name="vk-a", addresses=ADDRESSES)
    assert stored_certificate_problem(cert, key, ADDRESSES, [old.cert]) is None
    assert (
        stored_certificate_problem(cert, key, ADDRESSES, [new.cert])
        == "not signed by the current cluster's CA"
    )


def test_a_stored_certificate_whose_key_does_not_match_is_not_reused(tmp_path: Path) -> None:
    ca = TestCA("cluster")
    cert, key = tmp_path / "a.crt", tmp_path / "a.key"
    ca.issue(cert, key, name="vk-a", addresses=ADDRESSES)
    ca.issue(tmp_path / "b.crt", tmp_path / "b.key", name="vk-a", addresses=ADDRESSES)
    assert stored_certificate_problem(cert, tmp_path / "b.key", ADDRESSES, [ca.cert]) == (
        "its key is missing or does not match"
    )
    assert stored_certificate_problem(cert, tmp_path / "none.key", ADDRESSES, [ca.cert]) == (
        "its key is missing or does not match"
    )


def test_each_cluster_keeps_its_certificates_in_a_directory_of_its_own(tmp_path: Path) -> None:
    one, other = TestCA("one"), TestCA("other")
    server = "https://127.0.0.1:6443"
    assert cluster_cert_dir(tmp_path, one.pem, server) == cluster_cert_dir(
        tmp_path, one.pem, server
    )
    assert cluster_cert_dir(tmp_path, one.pem, server) != cluster_cert_dir(
        tmp_path, other.pem, server
    )
    assert cluster_cert_dir(tmp_path, one.pem, server).parent == tmp_path
    # Without a CA in the kubeconfig, the server's URL tells clusters apart.
    assert cluster_cert_dir(tmp_path, None, server) != cluster_cert_dir(
        tmp_path, None, "https://127.0.0.1:7443"
    )


async def test_a_certificate_from_another_cluster_is_replaced_by_one_from_this_cluster(
    api: FakeApiServer, tmp_path: Path
) -> None:
    old, new = TestCA("old cluster"), TestCA("new cluster")
    certificate = serving(api, tmp_path, new)
    old.issue(certificate.cert_path, certificate.key_path, name="vk-a", addresses=ADDRESSES)
    async with signer(api, new, only_approved=False):
        cert = await asyncio.wait_for(certificate.ensure(), 5)
    cert.verify_directly_issued_by(new.cert)
    assert len(api.objects("certificatesigningrequests")) == 1
    again = await certificate.ensure()  # now reused: no second CSR
    assert again == cert
    assert len(api.objects("certificatesigningrequests")) == 1


async def test_a_failed_serving_certificate_renewal_is_retried_while_the_current_one_serves(
    api: FakeApiServer, tmp_path: Path
) -> None:
    ca = TestCA("cluster")
    renewed: list[x509.Certificate] = []
    certificate = serving(
        api,
        tmp_path,
        ca,
        on_renewed=lambda cert, key: renewed.append(
            x509.load_pem_x509_certificate(cert.read_bytes())
        ),
    )
    certificate.retry_seconds = 0.05
    # Due for renewal within a second or so.
    ca.issue(
        certificate.cert_path, certificate.key_path, name="vk-a", addresses=ADDRESSES, seconds=6
    )
    api.fail("POST", "certificatesigningrequests$", status=500, times=2)
    async with signer(api, ca, only_approved=False):
        task = asyncio.create_task(certificate.renew_forever())
        try:
            await eventually(lambda: renewed, within=10, what="a renewal after two failures")
            assert not task.done()
            assert len([c for c in api.calls if c.method == "POST"]) >= 3
        finally:
            await cancel_and_wait(task)


def _client_with_ca(api: FakeApiServer, ca: TestCA) -> KubeClient:
    config = KubeConfig.from_dict(
        {
            "clusters": [
                {
                    "name": "fake",
                    "cluster": {
                        "server": api.server,
                        "certificate-authority-data": base64.b64encode(ca.pem).decode(),
                    },
                }
            ],
            "users": [{"name": "agent", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
            "current-context": "fake",
        }
    ).get()
    assert config is not None
    return KubeClient(config, ClientOptions(), transport=api.transport)


async def test_a_failed_client_certificate_renewal_is_retried_and_never_ends_the_process(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = TestCA("cluster")
    monkeypatch.setattr(_certs, "RENEW_RETRY_SECONDS", 0.05)
    ca.issue(tmp_path / "c.crt", tmp_path / "c.key", name="vk-a", addresses=[], seconds=6)
    kubeconfig = tmp_path / "node.kubeconfig"
    write_kubeconfig(
        kubeconfig,
        cluster="default",
        server=api.server,
        ca_pem=ca.pem,
        user="system:node:vk-a",
        cert_pem=(tmp_path / "c.crt").read_bytes(),
        key_pem=(tmp_path / "c.key").read_bytes(),
    )
    before = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["client-certificate-data"]
    identity = ClientIdentity(kubeconfig=kubeconfig, bootstrap=None, node_name="vk-a")
    client = _client_with_ca(api, ca)
    api.fail("POST", "certificatesigningrequests$", status=503, times=2)
    async with signer(api, ca, only_approved=False):
        task = asyncio.create_task(identity.renew_forever(client))
        try:

            def renewed() -> bool:
                user = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]
                return bool(user["client-certificate-data"] != before)

            await eventually(renewed, within=10, what="the client certificate renewed")
            assert not task.done()
        finally:
            await cancel_and_wait(task)
            await client.aclose()


async def test_a_pending_serving_csr_is_logged_as_a_warning_with_the_approve_command_every_minute(
    api: FakeApiServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(_certs, "PENDING_REMINDER_SECONDS", 0.2)
    caplog.set_level(logging.WARNING, logger="vkubelet.node._certs")
    seen: list[str | None] = []
    certificate = serving(api, tmp_path, TestCA("cluster"), on_csr=seen.append)
    task = asyncio.create_task(certificate.ensure())
    try:
        [name] = await eventually(lambda: pending_csrs(api), what="a CSR sent")
        assert seen == [name]
        command = f"kubectl certificate approve {name}"

        def reminders() -> int:
            return len([r for r in caplog.records if command in r.getMessage()])

        await eventually(lambda: reminders() >= 1, within=1, what="a warning at once")
        assert all(r.levelno == logging.WARNING for r in caplog.records)
        await eventually(lambda: reminders() >= 3, within=3, what="repeated while pending")
        assert not approved(api.get("certificatesigningrequests", name) or {})
    finally:
        await cancel_and_wait(task)


async def test_a_csr_we_may_approve_is_approved_by_us(api: FakeApiServer, tmp_path: Path) -> None:
    ca = TestCA("cluster")
    seen: list[str | None] = []
    certificate = serving(api, tmp_path, ca, approve=True, on_csr=seen.append)
    async with signer(api, ca, only_approved=True):
        await asyncio.wait_for(certificate.ensure(), 5)
    [csr] = api.objects("certificatesigningrequests")
    assert approved(csr)
    assert seen == [csr["metadata"]["name"], None]  # waiting, then signed


async def test_a_csr_we_may_not_approve_waits_for_an_admin_and_says_how(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vkubelet.node._certs")
    ca = TestCA("cluster")
    api.fail("PUT", "/approval$", status=403, times=None)
    certificate = serving(api, tmp_path, ca, approve=True)
    task = asyncio.create_task(certificate.ensure())
    try:
        [name] = await eventually(lambda: pending_csrs(api))
        await eventually(
            lambda: any(
                f"kubectl certificate approve {name}" in r.getMessage() for r in caplog.records
            )
        )
        assert any("cannot approve" in r.getMessage() for r in caplog.records)
        sign_pending(api, ca, only_approved=False, seconds=3600)  # the admin approved it
        await asyncio.wait_for(task, 5)
    finally:
        await cancel_and_wait(task)


def test_a_stored_client_identity_for_another_cluster_is_not_reused(tmp_path: Path) -> None:
    old, new = TestCA("old cluster"), TestCA("new cluster")
    old.issue(tmp_path / "c.crt", tmp_path / "c.key", name="vk-a", addresses=[])
    kubeconfig, bootstrap = tmp_path / "node.kubeconfig", tmp_path / "bootstrap.kubeconfig"
    write_kubeconfig(
        kubeconfig,
        cluster="default",
        server="https://127.0.0.1:6443",
        ca_pem=old.pem,
        user="system:node:vk-a",
        cert_pem=(tmp_path / "c.crt").read_bytes(),
        key_pem=(tmp_path / "c.key").read_bytes(),
    )
    identity = ClientIdentity(kubeconfig=kubeconfig, bootstrap=bootstrap, node_name="vk-a")
    for ca, reused in ((old, True), (new, False)):
        write_kubeconfig(
            bootstrap,
            cluster="default",
            server="https://127.0.0.1:6443",
            ca_pem=ca.pem,
            user="kubelet-bootstrap",
            token="abcdef.0123456789abcdef",
        )
        assert (identity.current() is not None) == reused


def test_a_node_identity_bootstrapped_in_cluster_is_reused_only_for_the_pods_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--bootstrap-in-cluster` (the chart's `identity: node`): the pod's service account is
    the bootstrap identity, so its cluster (server, CA) is the one a stored certificate must
    be for."""
    old, new = TestCA("old cluster"), TestCA("new cluster")
    old.issue(tmp_path / "c.crt", tmp_path / "c.key", name="vk-a", addresses=[])
    kubeconfig, account = tmp_path / "node.kubeconfig", tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("a-token")
    (account / "namespace").write_text("vkubelet-system")
    monkeypatch.setenv("VKUBELET_SERVICEACCOUNT_DIR", str(account))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "not-this-one"))  # the account, not this
    write_kubeconfig(
        kubeconfig,
        cluster="default",
        server="https://127.0.0.1:6443",
        ca_pem=old.pem,
        user="system:node:vk-a",
        cert_pem=(tmp_path / "c.crt").read_bytes(),
        key_pem=(tmp_path / "c.key").read_bytes(),
    )
    identity = ClientIdentity(
        kubeconfig=kubeconfig, bootstrap=None, bootstrap_in_cluster=True, node_name="vk-a"
    )
    for ca, reused in ((old, True), (new, False)):
        (account / "ca.crt").write_bytes(ca.pem)
        assert (identity.current() is not None) == reused
