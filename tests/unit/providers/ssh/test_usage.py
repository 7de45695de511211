"""`kubectl top` on a device, against a local "device" (`LocalLink`): one script per sample
whatever the number of pods and requests, a busy pod's CPU and held memory measured from its
process group, and the node's capacity following the device unless pinned."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from lightkube.models.core_v1 import NodeSpec, NodeStatus
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node

from vkubelet.providers.ssh._inventory import DeviceConfig
from vkubelet.providers.ssh._provider import DeviceProvider
from vkubelet.providers.ssh._usage import ContainerReading, parse_sample, sample_script
from vkubelet.testing.harness import eventually

from .test_provider import Device, make_pod, wait_running

pytestmark = pytest.mark.timeout(60)


def host_figures() -> tuple[int, str]:
    """This machine's online CPUs and MemTotal (KiB): the local device's."""
    stat = Path("/proc/stat").read_text()
    total = re.search(r"^MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M)
    assert total is not None
    return len(re.findall(r"^cpu\d", stat, re.M)), total.group(1)


BURN = "x=$(head -c 20000000 /dev/zero | tr '\\0' a); while :; do :; done"


def samples(device: Device) -> int:
    return sum("usage sample" in script for script in device.link.scripts)


async def test_one_script_samples_every_pod_for_summary_and_metrics_alike(device: Device) -> None:
    provider = device.provider()
    await provider.create_pod(make_pod("busy", "u1", command=["sh", "-c", BURN]))
    await provider.create_pod(make_pod("idle", "u2"))
    await wait_running(provider, "busy")
    await wait_running(provider, "idle")
    await eventually(lambda: provider._facts.get("hz"), within=10, what="discovery")

    before = samples(device)
    summary = await provider.stats_summary()
    text = await provider.metrics_resource()
    assert samples(device) == before + 1  # one sample answers one scrape's requests
    assert {p["podRef"]["name"] for p in summary["pods"]} == {"busy", "idle"}
    assert 'container_cpu_usage_seconds_total{container="main",namespace="ns",pod="busy"}' in text
    assert re.search(r"^node_cpu_usage_seconds_total [0-9.e+]+ \d+$", text, re.M)

    async def burning() -> dict[str, int] | None:
        found = {p["podRef"]["name"]: p for p in (await provider.stats_summary())["pods"]}
        busy, idle = found["busy"], found["idle"]
        rate = busy["cpu"]["usageNanoCores"]
        return {"busy": rate, "idle": idle["cpu"]["usageNanoCores"]} if rate > 2e8 else None

    rates = await eventually(burning, within=20, interval=1.1, what="the busy pod's rate")
    assert rates is not None
    assert rates["idle"] < 5e7
    summary = await provider.stats_summary()
    [busy] = [p for p in summary["pods"] if p["podRef"]["name"] == "busy"]
    assert busy["memory"]["workingSetBytes"] >= 20_000_000  # the 20 MB it holds
    assert busy["containers"][0]["cpu"]["usageCoreNanoSeconds"] > 2e8
    node = summary["node"]
    assert node["cpu"]["usageCoreNanoSeconds"] > busy["cpu"]["usageCoreNanoSeconds"]
    assert node["memory"]["workingSetBytes"] > 0 and node["memory"]["availableBytes"] > 0


def capacity(provider: DeviceProvider) -> dict[str, str]:
    node = Node(metadata=ObjectMeta(labels={}), spec=NodeSpec(), status=NodeStatus())
    provider.configure_node(node)
    assert node.status is not None and node.status.capacity is not None
    return dict(node.status.capacity)


async def test_capacity_follows_the_device_unless_the_inventory_pins_it(device: Device) -> None:
    provider = device.provider()
    await eventually(lambda: provider._facts.get("hz"), within=10, what="discovery")
    told: list[Node] = []
    provider.notify_node_status(told.append)
    await provider.stats_summary()
    cpus, total = host_figures()
    assert capacity(provider)["cpu"] == str(cpus)
    assert capacity(provider)["memory"] == f"{total}Ki"

    provider._facts = {**provider._facts, "cpus": "64", "mem": "1"}  # the device changed...
    provider._sample = None
    await provider.stats_summary()  # ... and the next sample tells
    assert capacity(provider)["cpu"] == str(cpus) and told  # the node was told

    pinned = DeviceConfig(
        name="dev", address="127.0.0.1", capacity=(("cpu", "3"), ("memory", "3Gi"))
    )
    other = DeviceProvider(pinned, link=device.link)  # type: ignore[arg-type]
    other._facts = dict(provider._facts)
    assert {k: capacity(other)[k] for k in ("cpu", "memory")} == {"cpu": "3", "memory": "3Gi"}


# -- the sample, sans I/O -------------------------------------------------------------------------
def test_a_sample_reads_groups_by_pid_and_old_kernels_memory() -> None:
    output = (
        b"vkubelet-usage 1\ncpu 1000\ncpus 4\nbtime 1700000000\n"
        b"mem MemTotal 2048\nmem MemFree 512\nmem Buffers 128\nmem Cached 256\n"
        b"group 42 300 10\ngroup 43 5 1\ngroup 7 1 1\ngarbage line here\ngroup x 1 1\n"
    )
    containers = {42: ("u1", "main"), 43: ("u1", "side")}
    reading = parse_sample(output, containers, ticks_per_second=100, page_size=4096)
    assert reading.cpu_ns == 10 * 10**9 and reading.cpus == 4
    assert reading.memory == 2048 * 1024 and reading.available == 896 * 1024  # no MemAvailable
    assert reading.containers[("u1", "main")].cpu_ns == 3 * 10**9
    assert reading.containers[("u1", "main")].working_set == 10 * 4096
    assert set(reading.containers) == {("u1", "main"), ("u1", "side")}  # pid 7: not asked for
    with pytest.raises(ValueError, match="/proc/stat"):
        parse_sample(b"vkubelet-usage 1\n", {}, ticks_per_second=100, page_size=4096)


def test_the_sample_script_names_only_safe_pids() -> None:
    script = sample_script([12, 1, 0, 345])
    assert "WANT='12 345'" in script
    assert "WANT" not in sample_script([])  # no pods: no pass over the processes


def test_a_sample_reads_runtime_containers_cgroups_in_bytes_and_nanoseconds() -> None:
    output = b"vkubelet-usage 1\ncpu 1000\ncgroup 42 1234567891 20480\ncgroup 9 1 1\n"
    reading = parse_sample(output, {42: ("u1", "main")}, ticks_per_second=100, page_size=4096)
    assert reading.containers == {("u1", "main"): ContainerReading(1234567891, 20480)}


def test_a_cid_file_that_holds_no_runtime_id_never_reaches_grep(tmp_path: Path) -> None:
    hostile = tmp_path / "hostile"
    hostile.write_text(f"-e . -r / ; touch {tmp_path}/pwned\n")
    unknown = tmp_path / "unknown"
    unknown.write_text("0123456789abcdef" * 4 + "\n")  # an id no process's cgroup names
    script = sample_script([], {42: str(hostile), 43: str(unknown), 44: str(tmp_path / "none")})
    done = subprocess.run(["sh", "-c", script], capture_output=True, timeout=30, check=True)
    assert not (tmp_path / "pwned").exists()
    assert b"cgroup" not in done.stdout and b"vkubelet-usage 1" in done.stdout


async def test_a_tty_pod_counts_the_processes_in_its_terminal(device: Device) -> None:
    """A `tty: true` container's command runs in the terminal's session, not the container's
    process group: it counts all the same (the 20 MB its shell holds)."""
    provider = device.provider()
    hold = "x=$(head -c 20000000 /dev/zero | tr '\\0' a); sleep 3600; exit"
    await provider.create_pod(make_pod("tty", "u1", command=["sh", "-c", hold], tty=True))
    await wait_running(provider, "tty")
    await eventually(lambda: provider._facts.get("hz"), within=10, what="discovery")

    async def holding() -> int | None:
        pods = (await provider.stats_summary())["pods"]
        held = int(pods[0]["memory"]["workingSetBytes"]) if pods else 0
        return held if held >= 20_000_000 else None

    await eventually(holding, within=20, interval=0.5, what="the memory held in the terminal")
