"""lower.yaml: what it accepts, its defaults, and errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.node import ConfigError
from vkubelet.providers.cluster import load_lower_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lower.yaml"
    path.write_text(text)
    return path


def test_only_a_kubeconfig_is_required_and_it_is_relative_to_the_file(tmp_path: Path) -> None:
    config = load_lower_config(write(tmp_path, "kubeconfig: lower/kubeconfig\n"))
    assert config.kubeconfig == tmp_path / "lower" / "kubeconfig"
    assert config.namespaces.lower("team-a") == "team-a"  # same name by default
    assert config.namespaces.create
    assert (config.dependency_names, config.service_accounts) == ("suffixed", "lower")
    assert config.upper_cluster_id is None and config.context is None
    assert config.publish_common_labels and config.resync.pods == 60
    assert config.shared_service_grace == 30


def test_every_option_is_read(tmp_path: Path) -> None:
    config = load_lower_config(
        write(
            tmp_path,
            """
kubeconfig: /abs/kubeconfig
context: lower-admin
upperClusterID: prod-eu
namespaces: {prefix: up-, map: {default: team-a}, create: false}
dependencyNames: same
serviceAccounts: none
pvcStorageClass: ""
publishCommonLabels: false
excludeLabels: ["example.com/*"]
resync: {pods: 10, nodes: 5, dependencies: 120}
kubeApiQps: 20
kubeApiBurst: 40
sharedServiceGrace: 5
""",
        )
    )
    assert config.kubeconfig == Path("/abs/kubeconfig")
    assert (config.context, config.upper_cluster_id) == ("lower-admin", "prod-eu")
    assert config.namespaces.lower("default") == "team-a"
    assert config.namespaces.lower("web") == "up-web"
    assert config.namespaces.upper("up-web") == "web"
    assert config.namespaces.upper("team-a") == "default"
    assert not config.namespaces.create
    assert (config.dependency_names, config.service_accounts) == ("same", "none")
    assert config.pvc_storage_class == ""
    assert not config.publish_common_labels
    assert config.label_excluded("example.com/rack") and not config.label_excluded("zone")
    assert (config.resync.pods, config.resync.nodes, config.resync.dependencies) == (10, 5, 120)
    assert (config.kube_api_qps, config.kube_api_burst) == (20.0, 40)
    assert config.shared_service_grace == 5


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("context: x\n", "lower.yaml: kubeconfig: required"),
        ("kubeconfig: k\nnamespace: x\n", "lower.yaml: namespace: unknown field"),
        ("kubeconfig: k\nnamespaces: {prefix: Up_}\n", "lower.yaml: namespaces.prefix:"),
        ("kubeconfig: k\nnamespaces: {prefixx: a}\n", "lower.yaml: namespaces.prefixx: unknown"),
        ("kubeconfig: k\nnamespaces: {map: {a: B}}\n", "lower.yaml: namespaces.map.a: lower"),
        (
            "kubeconfig: k\nnamespaces: {map: {a: x, b: x}}\n",
            "lower.yaml: namespaces.map: two upper namespaces map to 'x'",
        ),
        ("kubeconfig: k\nnamespaces: {create: yes-please}\n", "namespaces.create: expected"),
        ("kubeconfig: k\nupperClusterID: 'a b'\n", "lower.yaml: upperClusterID: 'a b' is not"),
        ("kubeconfig: k\nupperClusterID: " + "a" * 64 + "\n", "upperClusterID: expected"),
        ("kubeconfig: k\ndependencyNames: hashed\n", "dependencyNames: expected one of"),
        ("kubeconfig: k\nserviceAccounts: upper\n", "serviceAccounts: expected one of"),
        ("kubeconfig: k\nresync: {pods: 0}\n", "lower.yaml: resync.pods: expected seconds"),
        ("kubeconfig: k\nresync: {pod: 3}\n", "lower.yaml: resync.pod: unknown field"),
        ("kubeconfig: k\nkubeApiQps: -1\n", "lower.yaml: kubeApiQps: expected a positive"),
        ("kubeconfig: k\nkubeApiBurst: 1.5\n", "lower.yaml: kubeApiBurst: expected a positive"),
        ("kubeconfig: k\nsharedServiceGrace: -1\n", "lower.yaml: sharedServiceGrace: expected"),
        ("kubeconfig: k\nexcludeLabels: zone\n", "lower.yaml: excludeLabels: expected a list"),
        ("kubeconfig: k\npvcStorageClass: 3\n", "lower.yaml: pvcStorageClass: expected"),
        ("- kubeconfig: k\n", "expected a mapping with at least `kubeconfig: PATH`"),
        ("kubeconfig: [\n", "lower.yaml: not valid YAML"),
    ],
)
def test_errors_name_the_file_and_the_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_lower_config(write(tmp_path, text))
    assert error in str(raised.value)
    assert str(tmp_path / "lower.yaml") in str(raised.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lower\.yaml: no such file"):
        load_lower_config(tmp_path / "lower.yaml")


def test_a_namespace_mapping_that_sends_two_upper_namespaces_to_one_is_detected() -> None:
    from vkubelet.providers.cluster._config import NamespaceMapping

    mapping = NamespaceMapping(prefix="", explicit=(("default", "team-a"),))
    assert mapping.upper(mapping.lower("default")) == "default"  # runs
    assert mapping.upper(mapping.lower("team-a")) != "team-a"  # refused: it would share team-a
    assert mapping.upper(mapping.lower("shop")) == "shop"
