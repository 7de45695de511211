"""Endpoints from kubeconfigs, credentials on the upgrade request, and refusals as errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from vkubelet._files import write_kubeconfig
from vkubelet.sdk.capabilities import AttachIO
from vkubelet.sdk.pipe import InboundPipe
from vkubelet.streaming import Endpoint, StreamingError, UpgradeFailed, exec_command
from vkubelet.streaming._exec import _target

from ..kubelet.harness import CONTAINER, NAMESPACE, POD, Kubelet, Pki, StartKubelet
from .stdio import Collected, Feed


def kubeconfig(
    kubelet: Kubelet, pki: Pki, path: Path, *, cert: bool = False, token: str | None = None
) -> Path:
    write_kubeconfig(
        path,
        cluster="kubelet",
        server=f"https://127.0.0.1:{kubelet.port}",
        ca_pem=pki.ca.read_bytes(),
        user="relay",
        cert_pem=pki.apiserver_cert.read_bytes() if cert else None,
        key_pem=pki.apiserver_key.read_bytes() if cert else None,
        token=token,
    )
    return path


async def echo(endpoint: Endpoint) -> bytes:
    stdout = Collected()
    io = AttachIO(stdin=None, stdout=stdout, stderr=None)
    assert await exec_command(endpoint, NAMESPACE, POD, CONTAINER, ["echo", "hi"], io) == 0
    return bytes(stdout.data)


def as_kubelet(endpoint: Endpoint) -> Endpoint:
    return Endpoint(endpoint.server, endpoint.ssl_context, endpoint.auth, kubelet=True)


async def test_a_kubeconfig_with_a_client_certificate_logs_in(
    kubelet: Kubelet, pki: Pki, tmp_path: Path
) -> None:
    path = kubeconfig(kubelet, pki, tmp_path / "kubeconfig", cert=True)
    assert await echo(as_kubelet(Endpoint.from_kubeconfig(path))) == b"hi\n"


async def test_a_kubeconfig_with_a_bearer_token_logs_in(
    kubelet: Kubelet, pki: Pki, tmp_path: Path
) -> None:
    path = kubeconfig(kubelet, pki, tmp_path / "kubeconfig", token="good-token")
    assert await echo(as_kubelet(Endpoint.from_kubeconfig(path))) == b"hi\n"
    assert kubelet.authorizer.asked[-1][0] == "alice"


@pytest.mark.parametrize(("token", "status"), [("wrong", 401), (None, 401), ("bob-token", 403)])
async def test_refused_credentials_are_an_upgrade_failure_with_the_status(
    start_kubelet: StartKubelet, pki: Pki, tmp_path: Path, token: str | None, status: int
) -> None:
    kubelet = await start_kubelet()
    kubelet.authorizer.deny.add("bob")
    path = kubeconfig(kubelet, pki, tmp_path / "kubeconfig", token=token)
    with pytest.raises(UpgradeFailed) as failure:
        await echo(as_kubelet(Endpoint.from_kubeconfig(path)))
    assert failure.value.status == status


async def test_an_unreachable_server_is_a_streaming_error(tmp_path: Path) -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(StreamingError, match="cannot connect"):
        await echo(Endpoint(f"http://127.0.0.1:{port}", kubelet=True))


def test_apiserver_targets_use_pod_exec_options_and_kubelet_targets_its_own_query() -> None:
    io = AttachIO(stdin=Feed(), stdout=Collected(), stderr=Collected(), tty=True)
    api = Endpoint("https://api.example:6443/prefix/")
    assert _target(api, "exec", "ns", "p", "c", ["sh", "-c", "a b"], io) == (
        "/prefix/api/v1/namespaces/ns/pods/p/exec"
        "?container=c&command=sh&command=-c&command=a+b&stdin=true&stdout=true&tty=true"
    )
    kubelet = Endpoint("https://node:10250", kubelet=True)
    assert _target(kubelet, "attach", "ns", "p", "c", [], io) == (
        "/attach/ns/p/c?input=1&output=1&tty=1"
    )


def test_endpoints_refuse_urls_that_are_not_http() -> None:
    with pytest.raises(ValueError):
        Endpoint("ftp://example")


async def test_an_inbox_holds_no_more_than_its_high_water_mark() -> None:
    """The brake behind bounded memory: a writer waits while the reader lags."""
    inbox = InboundPipe(high_water=1000)
    await inbox.put(b"x" * 1001)
    blocked = asyncio.create_task(inbox.put(b"y" * 10))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    assert await inbox.read(2000) == b"x" * 1001
    async with asyncio.timeout(5):
        await blocked
    assert await inbox.read() == b"y" * 10
