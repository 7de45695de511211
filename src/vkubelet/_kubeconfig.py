"""Kubeconfigs, read in one place: where the credentials come from when no kubeconfig is named,
and what a loaded context gives a connection (TLS, Authorization, httpx's parameters).

lightkube parses kubeconfigs (client certificates, tokens, exec plugins); every connection of
vkubelet (the client stack, the streaming client, test tools) asks this module rather than
lightkube's adapters, so that a kubeconfig means the same thing to each of them.

When none is named, in a pod, as client-go does: the service account's token, CA and namespace
files plus the `KUBERNETES_SERVICE_HOST`/`_PORT` the kubelet sets. lightkube knows this layout,
but tries it before `$KUBECONFIG` (client-go prefers a kubeconfig it was pointed at) and only at
the fixed path; tests (and unusual mounts) need another directory, so
`VKUBELET_SERVICEACCOUNT_DIR` names one. The token file is re-read by lightkube on a 401, so the
kubelet's token rotation needs nothing more.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import httpx2 as httpx
from lightkube.config.client_adapter import ConnectionParams, user_auth, verify_cluster
from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig, SingleConfig
from lightkube.config.models import User
from lightkube.core.exceptions import ConfigError

SERVICE_ACCOUNT_DIR_ENV = "VKUBELET_SERVICEACCOUNT_DIR"
DEFAULT_KUBECONFIG = "~/.kube/config"


def service_account_dir() -> Path:
    return Path(os.environ.get(SERVICE_ACCOUNT_DIR_ENV) or SERVICE_ACCOUNT)


def in_cluster() -> bool:
    """Running as a pod: the kubelet set the apiserver's service address."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def load_kubeconfig(path: Path | str | None = None) -> KubeConfig:
    """In client-go's order: `path`, else `$KUBECONFIG`, else (in a pod) the service account,
    else ~/.kube/config. Raises lightkube's ConfigError naming what was looked for."""
    path = path or os.environ.get("KUBECONFIG")
    if path:
        return KubeConfig.from_file(path)
    default = Path(DEFAULT_KUBECONFIG).expanduser()
    if not in_cluster():
        return KubeConfig.from_file(default)
    account = service_account_dir()
    if (account / "token").is_file():
        return service_account_kubeconfig()
    if default.is_file():
        return KubeConfig.from_file(default)
    raise ConfigError(
        f"in a pod (KUBERNETES_SERVICE_HOST is set) but {account}/token does not exist "
        f"(automountServiceAccountToken: false? ${SERVICE_ACCOUNT_DIR_ENV} names another "
        f"directory) and there is no kubeconfig ({default}, $KUBECONFIG or --kubeconfig)"
    )


def service_account_kubeconfig() -> KubeConfig:
    """The pod's own service account, whatever `$KUBECONFIG` says: what an agent in a pod
    bootstraps its node identity with (`--bootstrap-in-cluster`)."""
    account = service_account_dir()
    if not in_cluster():
        raise ConfigError("not in a pod: KUBERNETES_SERVICE_HOST is not set")
    if not os.environ.get("KUBERNETES_SERVICE_PORT"):
        raise ConfigError("KUBERNETES_SERVICE_HOST is set but KUBERNETES_SERVICE_PORT is not")
    if not (account / "token").is_file():
        raise ConfigError(
            f"in a pod but {account}/token does not exist (automountServiceAccountToken: false? "
            f"${SERVICE_ACCOUNT_DIR_ENV} names another directory)"
        )
    return KubeConfig.from_service_account(account)


def load_context(path: Path | str | None = None, context: str | None = None) -> SingleConfig:
    """`path`'s `context` (default: the current one), `path` found as `load_kubeconfig` does."""
    config = load_kubeconfig(path).get(context)
    if config is None:
        raise ValueError(f"kubeconfig {path or '(from environment)'}: no context {context!r}")
    return config


def http11_tls(config: SingleConfig) -> ssl.SSLContext:
    """The context's TLS (its cluster's CA, its user's client certificate), HTTP/1.1 only: an
    upgrade exists only there, and the lean client speaks nothing else."""
    tls = verify_cluster(config.cluster, config.user or User(), config.abs_file, trust_env=False)
    tls.set_alpn_protocols(["http/1.1"])
    return tls


def httpx_auth(config: SingleConfig) -> httpx.Auth | None:
    """The Authorization flow of the context's user (token, token file, exec plugin...)."""
    if config.user is None:
        return None
    auth: httpx.Auth | None = user_auth(config.user)
    return auth


def httpx_params(
    config: SingleConfig,
    *,
    timeout: float,
    transport: httpx.AsyncBaseTransport | None = None,
    http2: bool = False,
) -> dict[str, Any]:
    """`httpx.AsyncClient`'s keyword arguments for the context (base URL, TLS, auth)."""
    params = ConnectionParams(
        timeout=httpx.Timeout(timeout),
        trust_env=False,
        transport=transport,  # type: ignore[arg-type]  # lightkube annotates the sync type
        http2=http2,
    )
    found: dict[str, Any] = params.httpx_params(config)
    return found
