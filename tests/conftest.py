"""Shared test configuration: vkubelet's own pytest plugin (`vkubelet.testing`) provides
`kube_cluster` and `kubectl`, the opt-in SSH lab plugin `ssh_devices`; integration tests are
marked automatically by folder."""

from pathlib import Path

import pytest

pytest_plugins = ["vkubelet.testing.sshlab"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
