"""The chart's example values (deploy/helm/vkubelet/ci/*-values.yaml, rendered into
deploy/manifests) hold provider configs their providers accept, with the secret files they name
beside them as the chart mounts them. Rendering itself is checked by the integration tests; the
values are checked here without helm, against each provider's own config loader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from vkubelet.providers.cluster import load_lower_config
from vkubelet.providers.mock import MockConfig
from vkubelet.providers.ssh import load_inventory

CI = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "vkubelet" / "ci"
KUBECONFIG = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [{"name": "c", "cluster": {"server": "https://lower:6443"}}],
    "users": [{"name": "u", "user": {"token": "t"}}],
    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
    "current-context": "x",
}
# Files the example values expect in their existingSecret, with plausible content.
SECRET_FILES = {
    "id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\n",
    "known_hosts": "10.0.0.5 ssh-ed25519 AAAA\n",
    "lower.kubeconfig": yaml.safe_dump(KUBECONFIG),
}


def values(provider: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CI / f"{provider}-values.yaml").read_text())
    return loaded


def mounted(provider: str, directory: Path) -> Path:
    """The projected /etc/vkubelet: the config file and the secret files next to it."""
    config = values(provider)["providerConfig"]
    for name, content in SECRET_FILES.items():
        (directory / name).write_text(content)
    if provider == "mock":
        path = directory / "provider.json"
        path.write_text(json.dumps(config))
    else:
        path = directory / "provider.yaml"
        path.write_text(yaml.safe_dump(config))
    return path


def test_every_provider_has_example_values() -> None:
    assert sorted(p.name for p in CI.glob("*-values.yaml")) == [
        f"{p}-values.yaml" for p in ("cluster", "mock", "ssh")
    ]  # not vm: the chart refuses it (docs/host-install.md)


def test_the_mock_values_configure_their_node(tmp_path: Path) -> None:
    node = values("mock")["nodeName"]
    assert MockConfig.load(mounted("mock", tmp_path), node).pods == "110"


def test_the_ssh_values_name_the_secrets_files(tmp_path: Path) -> None:
    inventory = load_inventory(mounted("ssh", tmp_path))
    (device,) = inventory.devices
    assert device.identity_file == tmp_path / "id_ed25519"


def test_the_cluster_values_name_the_secrets_kubeconfig(tmp_path: Path) -> None:
    config = load_lower_config(mounted("cluster", tmp_path))
    assert Path(config.kubeconfig) == tmp_path / "lower.kubeconfig"
