"""The device inventory: what it accepts, and errors that name the file and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.node import ConfigError
from vkubelet.providers.ssh import load_inventory


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return path


def test_devices_inherit_defaults_and_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
defaults: {user: pi, identityFile: keys/id, knownHosts: kh, labels: {site: lab}}
devices:
  - {name: board-1, address: 10.0.0.5}
  - {name: board-2, address: 10.0.0.6, port: 2222, user: admin,
     taints: ["dev=x:NoSchedule"], capacity: {cpu: "4", memory: 2Gi}}
""",
    )
    one, two = load_inventory(path).devices
    assert (one.user, one.port, one.identity_file) == ("pi", 22, tmp_path / "keys/id")
    assert dict(one.labels) == {"site": "lab"}
    assert one.taints is None
    assert (two.user, two.port) == ("admin", 2222)
    assert two.taint_list() == [{"effect": "NoSchedule", "key": "dev", "value": "x"}]
    assert dict(two.capacity) == {"cpu": "4", "memory": "2Gi"}
    assert one.runs_image("host") and not one.runs_image("busybox")


def test_the_reconnect_back_off_is_1_s_doubling_to_30_s_unless_set(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
defaults: {agent: true, knownHosts: kh}
devices:
  - {name: board-1, address: 10.0.0.5}
  - {name: board-2, address: 10.0.0.6, reconnectBackoff: {initial: 0.5, max: 4}}
""",
    )
    one, two = load_inventory(path).devices
    assert (one.reconnect_initial, one.reconnect_max) == (1.0, 30.0)
    assert (two.reconnect_initial, two.reconnect_max) == (0.5, 4.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("devices: [{address: 1.2.3.4}]", "devices[0].name: required (a non-empty string)"),
        ("devices: [{name: Bad_Name, address: a}]", "devices[0].name: 'Bad_Name' is not a valid"),
        ("devices: [{name: a, address: b, port: 70000}]", "devices[0].port: expected an integer"),
        ("devices: [{name: a, address: b, knownHosts: k}]", "devices[0].identityFile: required"),
        ("devices: [{name: a, address: b, identityFile: k}]", "devices[0].knownHosts: required"),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k, colour: red}]",
            "devices[0].colour: unknown field",
        ),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k, capacity: {cpu: lots}}]",
            "devices[0].capacity.cpu: 'lots' is not a Kubernetes quantity",
        ),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k, taints: [nope]}]",
            "devices[0].taints:",
        ),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k,"
            " reconnectBackoff: {initial: 5, max: 2}}]",
            "devices[0].reconnectBackoff.max: must not be less than initial",
        ),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k, containerRuntime: lxc}]",
            "devices[0].containerRuntime: expected one of",
        ),
        (
            "devices: [{name: a, address: b, agent: true, knownHosts: k, runtimeCommand: []}]",
            "devices[0].runtimeCommand:",
        ),
        ("devices: {a: 1}", "devices: expected a list"),
        ("devices: [", "not valid YAML"),
    ],
)
def test_a_broken_inventory_is_refused_naming_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_inventory(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_duplicate_device_names_are_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "defaults: {agent: true, insecureIgnoreHostKey: true}\n"
        "devices: [{name: a, address: x}, {name: a, address: y}]\n",
    )
    with pytest.raises(ConfigError, match="duplicate name 'a'"):
        load_inventory(path)


def test_an_empty_inventory_has_no_devices(tmp_path: Path) -> None:
    assert load_inventory(write(tmp_path, "")).devices == ()


def test_a_device_runs_no_container_runtime_unless_the_inventory_names_one(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "defaults: {agent: true, insecureIgnoreHostKey: true}\n"
        "devices:\n"
        "  - {name: a, address: x}\n"
        "  - {name: b, address: y, containerRuntime: podman,\n"
        "     runtimeCommand: [podman, --runtime, /usr/sbin/runc], runtimeRunArgs: [--ulimit, x]}\n"
        "  - {name: c, address: z, containerRuntime: auto}\n",
    )
    a, b, c = load_inventory(path).devices
    assert (a.container_runtime, a.runtime_command, a.runtime_run_args) == ("none", (), ())
    assert b.container_runtime == "podman"
    assert b.runtime_command == ("podman", "--runtime", "/usr/sbin/runc")
    assert b.runtime_run_args == ("--ulimit", "x")
    assert c.container_runtime == "auto"
