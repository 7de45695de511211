"""Configuration files: the agent's YAML and the mock provider's JSON. A bad value is reported
with the file and the field it is in, before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vkubelet.node import ConfigError, load_agent_config, parse_taint
from vkubelet.providers.mock import ConfigError as MockConfigError
from vkubelet.providers.mock import MockConfig

GOOD = """\
kubeconfig: kube/config
kubeApiQps: 500
kubeApiBurst: 800
podSyncWorkers: 16
nodes:
  - name: vk-mock-0
    provider: mock
    providerConfig: mock.json
    kubeletPort: 10260
    internalIP: 10.1.2.3
    labels: {zone: lab-1}
  - name: vk-mock-1
    provider: mock
    taints: []
  - name: vk-mock-2
    provider: mock
    taints: ["example.com/gpu=true:NoExecute", "dedicated:NoSchedule"]
"""


def write(tmp_path: Path, text: str, name: str = "agent.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def node_yaml(**fields: Any) -> str:
    entry = {"name": "vk-0", "provider": "mock", **fields}
    return "nodes:\n  - " + json.dumps(entry) + "\n"  # a JSON flow mapping is YAML


def test_a_good_agent_config_is_loaded(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, GOOD))
    assert config.kubeconfig == tmp_path / "kube" / "config"
    assert config.client.qps == 500 and config.client.burst == 800
    assert config.workers == 16
    first, second, third = config.nodes
    assert first.settings.name == "vk-mock-0"
    assert first.provider_config == tmp_path / "mock.json"
    assert first.settings.kubelet_port == 10260
    assert {"type": "InternalIP", "address": "10.1.2.3"} in first.settings.addresses
    assert first.settings.labels == {"zone": "lab-1"}
    assert first.settings.taints is None  # the default provider taint
    assert first.settings.effective_taints()[0]["key"] == "virtual-kubelet.io/provider"
    assert second.settings.effective_taints() == []
    assert third.settings.effective_taints() == [
        {"key": "example.com/gpu", "value": "true", "effect": "NoExecute"},
        {"key": "dedicated", "effect": "NoSchedule"},
    ]


def test_defaults_leave_the_client_unthrottled(tmp_path: Path) -> None:
    config = load_agent_config(write(tmp_path, node_yaml()))
    assert config.client.qps is None
    assert config.workers == 96
    assert config.kubeconfig is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: [", "not valid YAML"),
        ("- just a list", "expected a mapping at the top level"),
        ("nodes: []", "nodes: expected a non-empty list"),
        ("nodes: [oops]", "nodes[0]: expected a mapping"),
        ("colour: blue\n" + node_yaml(), "colour: unknown field"),
        (node_yaml(kubeletPrt=1), "nodes[0].kubeletPrt: unknown field"),
        ('{"nodes": [{"provider": "mock"}]}', "nodes[0].name: required"),
        ('{"nodes": [{"name": "a"}]}', "nodes[0].provider: required"),
        (node_yaml(kubeletPort="10250"), "nodes[0].kubeletPort: expected an integer"),
        (node_yaml(kubeletPort=70000), "nodes[0].kubeletPort: expected an integer"),
        (node_yaml(labels={"zone": 1}), "nodes[0].labels: expected a mapping of strings"),
        (node_yaml(taints="a:NoSchedule"), "nodes[0].taints: expected a list"),
        (node_yaml(taints=["a:Sometimes"]), "nodes[0].taints: taint 'a:Sometimes'"),
        (node_yaml(taints=["=v:NoSchedule"]), "nodes[0].taints: taint '=v:NoSchedule': empty key"),
        (
            '{"nodes": [{"name": "a", "provider": "m"}, {"name": "a", "provider": "m"}]}',
            "nodes: duplicate name 'a'",
        ),
        ("kubeApiQps: -5\n" + node_yaml(), "kubeApiQps: expected a positive number"),
        ("podSyncWorkers: many\n" + node_yaml(), "podSyncWorkers: expected a positive"),
    ],
)
def test_agent_config_errors_name_the_file_and_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_agent_config(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_a_missing_agent_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent\.yaml: no such file"):
        load_agent_config(tmp_path / "absent.yaml")


def test_taints_parse_like_kubectl_taint() -> None:
    assert parse_taint("k=v:NoSchedule") == {"key": "k", "value": "v", "effect": "NoSchedule"}
    assert parse_taint("k:PreferNoSchedule") == {"key": "k", "effect": "PreferNoSchedule"}
    with pytest.raises(ConfigError, match="Effect one of"):
        parse_taint("k=v")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kubeletPort": True}, "kubeletPort"),
        ({"internalIP": "not-an-ip"}, "internalIP"),
        ({"name": "Not_A_Node_Name"}, "name"),
        ({"providerConfig": 5}, "providerConfig"),
    ],
)
def test_bad_node_values_are_config_errors(
    tmp_path: Path, fields: dict[str, Any], field: str
) -> None:
    path = write(tmp_path, node_yaml(**fields))
    with pytest.raises(ConfigError, match=rf"nodes\[0\]\.{field}"):
        load_agent_config(path)


def test_a_fractional_worker_count_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "podSyncWorkers: 0.5\n" + node_yaml())
    with pytest.raises(ConfigError, match="podSyncWorkers"):
        load_agent_config(path)


def test_a_bad_kubeconfig_value_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "kubeconfig: 5\n" + node_yaml())
    with pytest.raises(ConfigError, match="kubeconfig"):
        load_agent_config(path)


# -- the mock provider's config -------------------------------------------------------------
def mock_file(tmp_path: Path, entries: dict[str, Any]) -> Path:
    path = tmp_path / "mock.json"
    path.write_text(json.dumps(entries))
    return path


def test_the_reference_mock_config_format_is_accepted(tmp_path: Path) -> None:
    path = mock_file(
        tmp_path,
        {
            "vk-0": {
                "cpu": "2",
                "memory": "32Gi",
                "pods": "128",
                "others": {"nvidia.com/gpu": "1"},
                "providerID": "mock://vk-0",
            }
        },
    )
    config = MockConfig.load(path, "vk-0")
    assert (config.cpu, config.memory, config.pods) == ("2", "32Gi", "128")
    assert config.others == {"nvidia.com/gpu": "1"}
    assert config.provider_id == "mock://vk-0"


def test_our_mock_options_are_accepted(tmp_path: Path) -> None:
    path = mock_file(
        tmp_path,
        {"vk-0": {"startDelay": 0.5, "failureRatio": 0.1, "podCIDR": "10.9.0.0/24"}},
    )
    config = MockConfig.load(path, "vk-0")
    assert (config.start_delay, config.failure_ratio, config.pod_cidr) == (0.5, 0.1, "10.9.0.0/24")


def test_without_a_file_the_mock_uses_defaults() -> None:
    config = MockConfig.load(None, "vk-0")
    assert (config.cpu, config.memory) == ("20", "100Gi")


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"other-node": {}}, "no entry for node 'vk-0' (entries: other-node)"),
        ({"vk-0": []}, "vk-0: expected an object"),
        ({"vk-0": {"cpus": "2"}}, "vk-0.cpus: unknown field"),
        ({"vk-0": {"cpu": "lots"}}, "vk-0.cpu: 'lots' is not a Kubernetes quantity"),
        ({"vk-0": {"memory": "12 GB"}}, "vk-0.memory: '12 GB' is not a Kubernetes quantity"),
        ({"vk-0": {"others": {"gpu": "x"}}}, "vk-0.others.gpu: 'x' is not a Kubernetes quantity"),
        ({"vk-0": {"others": ["gpu"]}}, "vk-0.others: expected an object"),
        ({"vk-0": {"failureRatio": 2}}, "vk-0.failureRatio: expected a number in [0, 1]"),
        ({"vk-0": {"startDelay": -1}}, "vk-0.startDelay: expected seconds >= 0"),
        ({"vk-0": {"podCIDR": "10.0.0.0/33"}}, "vk-0.podCIDR:"),
    ],
)
def test_mock_config_errors_name_the_file_and_the_field(
    tmp_path: Path, entries: dict[str, Any], message: str
) -> None:
    path = mock_file(tmp_path, entries)
    with pytest.raises(MockConfigError) as error:
        MockConfig.load(path, "vk-0")
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_a_mock_config_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mock.json"
    path.write_text("{cpu: 2}")
    with pytest.raises(MockConfigError, match=r"mock\.json: not valid JSON"):
        MockConfig.load(path, "vk-0")
    with pytest.raises(MockConfigError, match=r"absent\.json: no such file"):
        MockConfig.load(tmp_path / "absent.json", "vk-0")


@pytest.mark.parametrize("field", ["stateFile", "pingFailFile", "providerID"])
def test_mock_path_and_id_fields_must_be_strings(tmp_path: Path, field: str) -> None:
    path = mock_file(tmp_path, {"vk-0": {field: 5}})
    with pytest.raises(MockConfigError, match=rf"vk-0\.{field}"):
        MockConfig.load(path, "vk-0")
