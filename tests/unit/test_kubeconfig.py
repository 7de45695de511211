"""Where the agent's credentials come from: client-go's order, and the in-cluster account at a
directory tests can move (VKUBELET_SERVICEACCOUNT_DIR)."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest
from lightkube.config.client_adapter import user_auth
from lightkube.config.kubeconfig import SingleConfig
from lightkube.core.exceptions import ConfigError

from vkubelet._kubeconfig import load_kubeconfig

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://from-file:6443"}}]
users: [{name: u, user: {token: file-token}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


@pytest.fixture
def account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "sa"
    directory.mkdir()
    (directory / "token").write_text("sa-token")
    (directory / "ca.crt").write_text("not read here")
    (directory / "namespace").write_text("vkubelet-system")
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VKUBELET_SERVICEACCOUNT_DIR", str(directory))
    return directory


def current() -> SingleConfig:
    config = load_kubeconfig().get()
    assert config is not None
    return config


def in_pod(monkeypatch: pytest.MonkeyPatch, host: str = "10.0.0.1") -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")


def test_in_a_pod_the_service_account_of_the_named_directory_is_used(
    account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_pod(monkeypatch)
    config = current()
    assert config.cluster.server == "https://10.0.0.1:443"
    assert config.cluster.certificate_auth == str(account / "ca.crt")
    assert config.namespace == "vkubelet-system"
    assert config.user is not None
    assert config.user.token_file == str(account / "token")  # re-read when rotated


def test_an_ipv6_service_host_is_bracketed(account: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    in_pod(monkeypatch, "fd00::1")
    assert current().cluster.server == "https://[fd00::1]:443"


def test_the_token_file_is_sent_and_re_read_after_a_401(
    account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_pod(monkeypatch)
    auth = user_auth(current().user)
    assert auth is not None
    flow = auth.auth_flow(httpx.Request("GET", "https://x/"))
    assert next(flow).headers["Authorization"] == "Bearer sa-token"
    (account / "token").write_text("rotated")  # as the kubelet rotates a projected token
    retried = flow.send(httpx.Response(401))
    assert retried.headers["Authorization"] == "Bearer rotated"


def test_a_kubeconfig_named_by_the_environment_wins_over_the_pod_account(
    account: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    in_pod(monkeypatch)
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert current().cluster.server == "https://from-file:6443"


def test_outside_a_pod_the_account_files_are_ignored(account: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_kubeconfig()


def test_a_pod_without_a_token_says_where_it_looked(
    account: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_pod(monkeypatch)
    (account / "token").unlink()
    with pytest.raises(ConfigError, match=r"sa/token does not exist.*VKUBELET_SERVICEACCOUNT_DIR"):
        load_kubeconfig()
