"""Where the agent's API credentials come from when no kubeconfig is named.

In a pod, as client-go does: the service account's token, CA and namespace files plus the
`KUBERNETES_SERVICE_HOST`/`_PORT` the kubelet sets. lightkube knows this layout, but tries it
before `$KUBECONFIG` (client-go prefers a kubeconfig it was pointed at) and only at the fixed
path; tests (and unusual mounts) need another directory, so `VKUBELET_SERVICEACCOUNT_DIR` names
one. The token file is re-read by lightkube on a 401, so the kubelet's token rotation needs
nothing more.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig
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
        if not os.environ.get("KUBERNETES_SERVICE_PORT"):
            raise ConfigError("KUBERNETES_SERVICE_HOST is set but KUBERNETES_SERVICE_PORT is not")
        return KubeConfig.from_service_account(account)
    if default.is_file():
        return KubeConfig.from_file(default)
    raise ConfigError(
        f"in a pod (KUBERNETES_SERVICE_HOST is set) but {account}/token does not exist "
        f"(automountServiceAccountToken: false? ${SERVICE_ACCOUNT_DIR_ENV} names another "
        f"directory) and there is no kubeconfig ({default}, $KUBECONFIG or --kubeconfig)"
    )
