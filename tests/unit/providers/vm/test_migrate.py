"""The migration endpoint and progress the provider publishes (the seam with the controller)."""

from __future__ import annotations

import json

import pytest

from vkubelet.providers.vm._migrate import Endpoint, MigrationError, Progress


def test_the_endpoint_round_trips_through_its_json_and_the_controller_may_add_a_bandwidth() -> None:
    endpoint = Endpoint("10.0.0.2", 4000, 4001, 4002, ("disk0", "disk1"))
    data = json.loads(endpoint.to_json())
    assert data == {
        "host": "10.0.0.2",
        "migrationPort": 4000,
        "nbdPort": 4001,
        "consolePort": 4002,
        "disks": ["disk0", "disk1"],
    }
    limited = Endpoint.from_json(json.dumps({**data, "maxBandwidth": 1_000_000}))
    assert limited.max_bandwidth == 1_000_000 and limited.disks == ("disk0", "disk1")
    assert limited.target == "10.0.0.2:4000"


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "{}",
        '{"host": "h", "migrationPort": 0, "nbdPort": 1, "consolePort": 2, "disks": []}',
    ],
)
def test_a_broken_endpoint_is_refused_naming_the_annotation(text: str) -> None:
    with pytest.raises(MigrationError, match=r"vm\.vkubelet\.io/migrate-to"):
        Endpoint.from_json(text)


def test_progress_counts_disks_and_memory_and_stays_below_100_until_done() -> None:
    progress = Progress(disk_done=50, disk_total=100, ram_done=0, ram_total=100)
    assert progress.percent == 25
    progress.ram_done = 100
    progress.disk_done = 100
    assert progress.percent == 99
    assert json.loads(progress.message()) == {"phase": "mirroring", "progress": 99}
