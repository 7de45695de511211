"""Shared test configuration: vkubelet's own pytest plugin (`vkubelet.testing`) provides
`kube_cluster` and `kubectl`, the opt-in SSH lab plugin `ssh_devices`; integration tests are
marked automatically by folder. `tests/parallel.py` shares the suite out to parallel workers."""

from pathlib import Path

import pytest
from hypothesis import settings

# Property tests check what holds, not how fast: on a shared 2-core CI machine hypothesis's
# default 200 ms deadline per example fails them at random.
settings.register_profile("vkubelet", deadline=None)
settings.load_profile("vkubelet")

pytest_plugins = ["vkubelet.testing.sshlab", "tests.parallel"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)
