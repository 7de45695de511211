# ruff: noqa: ASYNC240
"""The VM provider's kubelet logic on a fake runtime: pull, boot, restart, stop, adopt, verbs.

The real runtime (QEMU, image store, network) is proven by tests/integration/vm; here each rule
of the provider is checked quickly and deterministically.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.core_v1 import EnvVar, EphemeralContainer, VolumeMount
from lightkube.resources.core_v1 import Node, Pod

from vkubelet.providers.vm._config import VMConfig
from vkubelet.providers.vm._provider import VMProvider
from vkubelet.sdk import (
    AttachIO,
    ContainerLogOptions,
    FileContent,
    FilesVolume,
    ProviderError,
    ResolvedPod,
)
from vkubelet.testing.harness import eventually

from .fakes import GI, PUSHED, Events, FakeRuntime, launched, make_pod, provider_for, state


async def logs(provider: VMProvider, previous: bool = False) -> bytes:
    chunks = [
        chunk
        async for chunk in provider.container_logs(
            "ns", "vm", "vm", ContainerLogOptions(previous=previous)
        )
    ]
    return b"".join(chunks)


async def test_capacity_is_the_host_minus_the_reserve_and_the_accelerator_is_reported(
    provider: VMProvider, events: Events
) -> None:
    node = Node.from_dict({"metadata": {"name": "hv-1"}, "spec": {}, "status": {}})
    assert isinstance(node, Node)
    provider.configure_node(node)
    assert node.status is not None and node.status.capacity is not None
    assert node.status.capacity["cpu"] == "3"
    assert node.status.capacity["memory"] == f"{7 * GI // 1024}Ki"
    await provider.ping()
    (condition,) = provider.node_conditions()
    assert (condition.type, condition.status, condition.reason) == (
        "Accelerator",
        "True",
        "TCGFallback",
    )
    assert events.node == [("Warning", "Accelerator", "tcg: KVM cannot boot a guest here")]


async def test_a_pod_is_running_with_its_ip_once_the_guest_agent_answers(
    provider: VMProvider, runtime: FakeRuntime, events: Events
) -> None:
    runtime.boot_at_once = False
    PUSHED.clear()
    assert await provider.pod_ips(make_pod()) == ["10.213.0.2"]  # known before the start
    await provider.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: launched(runtime))
    _, status = await state(provider)
    assert status.state.waiting is not None  # QEMU runs, the guest boots
    machine = next(iter(runtime.machines.values()))
    await asyncio.sleep(0.3)  # a broken provider would report Running meanwhile
    booting = len(PUSHED)
    machine.agent_up.set()

    async def running() -> bool:
        _, status = await state(provider)
        return status is not None and status.state.running is not None

    await eventually(running)
    assert not any(_is_running(p) for p in PUSHED[:booting])  # not before the agent answered
    assert all(p.status and p.status.podIP == "10.213.0.2" for p in PUSHED)
    pod = await provider.get_pod("ns", "vm")
    assert pod is not None and pod.status is not None and pod.status.podIP == "10.213.0.2"
    assert runtime.seeds[0]["name"] == "vm"
    reasons = [reason for _, reason, _ in events.pod]
    assert reasons[:4] == ["Pulling", "Pulling", "Pulled", "Created"]
    assert "Started" in reasons

    async def console_logged() -> bool:
        return b"booting vm\n" in await logs(provider)

    await eventually(console_logged)


def _is_running(pod: Pod) -> bool:
    statuses = (pod.status.containerStatuses if pod.status else None) or []
    return bool(statuses and statuses[0].state and statuses[0].state.running)


async def test_an_unknown_image_waits_in_image_pull_back_off(provider: VMProvider) -> None:
    await provider.create_pod(ResolvedPod(make_pod(image="vm.vkubelet.io/nope")))

    async def backing_off() -> bool:
        _, status = await state(provider)
        waiting = status.state.waiting if status else None
        return waiting is not None and waiting.reason == "ImagePullBackOff"

    async def err_pull() -> bool:
        _, status = await state(provider)
        waiting = status.state.waiting if status else None
        return waiting is not None and waiting.reason == "ErrImagePull"

    await eventually(err_pull)
    await eventually(backing_off)
    _, status = await state(provider)
    assert "no translation rule matches" in status.state.waiting.message


async def test_a_guest_poweroff_restarts_the_vm_and_the_previous_log_is_kept(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    await provider.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: launched(runtime))
    first = next(iter(runtime.machines.values()))

    async def restarted() -> bool:
        _, status = await state(provider)
        return status.restartCount == 1 and status.state.running is not None

    await eventually(lambda: _logged(provider, b"booting vm"))
    first.power_off()
    await eventually(restarted)
    assert len(runtime.launches) == 2
    previous = await logs(provider, previous=True)
    assert b"reboot: Power down\n" in previous


async def _logged(provider: VMProvider, text: bytes) -> bool:
    try:
        return text in await logs(provider)
    except ProviderError:
        return False


async def test_deleting_the_pod_stops_the_guest_gracefully_and_cleans_up(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    pod = make_pod(terminationGracePeriodSeconds=7)
    await provider.create_pod(ResolvedPod(pod))
    await eventually(lambda: _logged(provider, b"booting"))
    machine = next(iter(runtime.machines.values()))
    await provider.delete_pod(pod, 7)

    async def gone() -> bool:
        return await provider.get_pod("ns", "vm") is None

    await eventually(gone)
    assert machine.stops == [7.0]
    assert runtime.detached == ["uid-vm"]
    assert not (tmp_path / "s" / "vms" / "uid-vm").exists()


async def test_a_restarted_agent_adopts_the_running_vm_with_its_restart_count(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    first = provider_for(tmp_path, runtime, events)
    await first.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: _logged(first, b"booting"))
    next(iter(runtime.machines.values())).power_off()

    async def restarted() -> bool:
        _, status = await state(first)
        return status.restartCount == 1 and status.state.running is not None

    await eventually(restarted)
    await eventually(lambda: _logged(first, b"booting"))
    machine = runtime.machines[runtime.launches[-1].run_dir]
    machine.console(b"line before the agent died\r\n")
    await eventually(lambda: _logged(first, b"before the agent died"))
    before = await first.get_pod("ns", "vm")
    assert before is not None and before.status is not None
    await first.aclose()  # the agent goes; the VM does not
    await asyncio.sleep(1.1)  # a restarted agent's "now" is another second (the API's unit)

    machine.console(b"line while no agent ran\r\n")
    second = provider_for(tmp_path, runtime, events)
    (pod,) = await second.list_pods()
    assert pod.status is not None
    assert pod.status.containerStatuses[0].restartCount == 1  # type: ignore[index]
    assert len(runtime.launches) == 2  # adopted, not booted again
    await eventually(lambda: _logged(second, b"while no agent ran"))
    text = await logs(second)
    assert text.count(b"before the agent died") == 1
    assert second.vms["ns/vm"].machine is machine
    after = await second.get_pod("ns", "vm")
    assert after is not None and after.status is not None
    assert after.status.startTime == before.status.startTime is not None
    [was], [now] = before.status.containerStatuses or [], after.status.containerStatuses or []
    assert was.state is not None and now.state is not None
    assert now.state.running is not None and was.state.running is not None
    assert now.state.running.startedAt == was.state.running.startedAt


async def test_a_vm_adopted_while_booting_is_running_only_once_its_guest_agent_answers(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    runtime.boot_at_once = False
    first = provider_for(tmp_path, runtime, events)
    await first.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: launched(runtime))
    await first.aclose()  # the agent goes while the guest boots
    second = provider_for(tmp_path, runtime, events)
    await second.list_pods()
    for _ in range(5):  # a broken adoption would report it Running at once
        _, status = await state(second)
        assert status.state.waiting is not None
        assert status.state.waiting.reason == "ContainerCreating"
        await asyncio.sleep(0.05)
    next(iter(runtime.machines.values())).agent_up.set()

    async def running() -> bool:
        _, status = await state(second)
        return status.state.running is not None

    await eventually(running)
    assert len(runtime.launches) == 1  # adopted, not booted again
    await second.aclose()


async def test_exec_runs_through_the_guest_agent_and_a_terminal_is_refused(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    await provider.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: _logged(provider, b"booting"))

    class In:
        def __init__(self) -> None:
            self.parts = [b"hello ", b"world", b""]

        async def read(self, max_bytes: int = 65536) -> bytes:
            return self.parts.pop(0)

    class Out:
        def __init__(self) -> None:
            self.data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    out, err = Out(), Out()
    code = await provider.exec_in_container("ns", "vm", "vm", ["cat"], AttachIO(In(), out, err))
    assert (code, out.data) == (0, b"out:hello world")
    code = await provider.exec_in_container("ns", "vm", "vm", ["false"], AttachIO(None, out, err))
    assert (code, err.data) == (3, b"no\n")
    with pytest.raises(ProviderError, match="exec -t is not supported"):
        await provider.exec_in_container(
            "ns", "vm", "vm", ["sh"], AttachIO(None, out, None, tty=True)
        )


async def test_pods_that_cannot_be_vms_are_refused_with_the_field(provider: VMProvider) -> None:
    with pytest.raises(ProviderError) as refused:
        await provider.create_pod(ResolvedPod(make_pod(image="nginx")))
    assert refused.value.reason == "UnsupportedImage"
    assert "spec.containers[0].image" in refused.value.message
    big = make_pod(name="big")
    assert big.spec is not None
    big.spec.containers[0].resources = {"limits": {"memory": "64Gi"}}  # type: ignore[assignment]
    big = Pod.from_dict(big.to_dict())  # type: ignore[assignment]
    with pytest.raises(ProviderError, match=r"resources.limits.memory") as refused:
        await provider.create_pod(ResolvedPod(big))
    assert refused.value.reason == "InvalidVMSpec"


async def test_stats_report_each_vm_s_qemu(provider: VMProvider, runtime: FakeRuntime) -> None:
    await provider.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: _logged(provider, b"booting"))
    summary = await provider.stats_summary()
    (pod,) = summary["pods"]
    assert pod["podRef"]["name"] == "vm"
    assert pod["memory"]["workingSetBytes"] == 300 * 2**20
    assert pod["cpu"]["usageCoreNanoSeconds"] == 5 * 10**9
    text = await provider.metrics_resource()
    assert 'container_cpu_usage_seconds_total{container="vm",namespace="ns",pod="vm"} 5.0 ' in text
    assert 'pod_memory_working_set_bytes{namespace="ns",pod="vm"} 314572800.0 ' in text
    assert "# TYPE node_cpu_usage_seconds_total counter" in text


async def test_the_node_cpu_counter_does_not_go_back_when_a_vm_stops(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    """metrics-server drops a node whose CPU counter decreases: a VM's QEMU time stays counted
    after the VM is gone."""
    first, second = make_pod(name="a"), make_pod(name="b")
    for pod in (first, second):
        await provider.create_pod(ResolvedPod(pod))

    async def both_measured() -> bool:
        return len((await provider.stats_summary())["pods"]) == 2

    await eventually(both_measured)
    await provider.delete_pod(first, 0)

    async def one_measured() -> bool:
        return len((await provider.stats_summary())["pods"]) == 1

    await eventually(one_measured)
    summary = await provider.stats_summary()
    assert summary["node"]["cpu"]["usageCoreNanoSeconds"] == 10 * 10**9
    assert summary["node"]["memory"]["workingSetBytes"] == 300 * 2**20
    assert "node_cpu_usage_seconds_total 10.0 " in await provider.metrics_resource()


async def test_images_no_pod_uses_are_garbage_collected(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    seen: list[set[str]] = []

    def gc(in_use: Collection[str]) -> list[str]:
        seen.append(set(in_use))
        return []

    runtime.gc_images = gc  # type: ignore[method-assign]
    provider = provider_for(tmp_path, runtime, events, gc_interval=0.05)
    await provider.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: _logged(provider, b"booting"))
    seen.clear()

    async def collected_with_the_pods_image_kept() -> bool:
        return bool(seen) and seen[-1] == {"abc"}

    await eventually(collected_with_the_pods_image_kept)
    await provider.aclose()


async def test_a_vm_that_ended_while_no_agent_ran_is_a_run_that_ended(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    first = provider_for(tmp_path, runtime, events)
    await first.create_pod(ResolvedPod(make_pod()))
    await eventually(lambda: _logged(first, b"booting"))
    await first.aclose()
    machine = next(iter(runtime.machines.values()))
    machine.console(b"last words\r\n")
    machine.power_off()  # meanwhile
    (machine.spec.run_dir / "exit.json").write_text('{"code": 0, "reason": "Completed"}')

    second = provider_for(tmp_path, runtime, events)
    await second.list_pods()

    async def restarted() -> bool:
        _, status = await state(second)
        return status.restartCount == 1 and status.state.running is not None

    await eventually(restarted)  # restartPolicy Always
    assert len(runtime.launches) == 2
    previous = await logs(second, previous=True)
    assert b"last words\n" in previous and b"reboot: Power down\n" in previous
    pod = await second.get_pod("ns", "vm")
    assert pod is not None and pod.status is not None and pod.status.containerStatuses
    last = pod.status.containerStatuses[0].lastState
    assert last is not None and last.terminated is not None and last.terminated.exitCode == 0


async def test_new_volume_contents_are_written_into_the_running_guest(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    def resolved(content: bytes, env: str) -> ResolvedPod:
        pod = make_pod(volumes=[{"name": "cfg", "configMap": {"name": "c"}}])
        assert pod.spec is not None
        pod.spec.containers[0].volumeMounts = [VolumeMount(name="cfg", mountPath="/etc/app")]
        pod.spec.containers[0].env = [EnvVar(name="E", value=env)]
        files = {"a.conf": FileContent(content, 0o644)}
        return ResolvedPod(pod, {"cfg": FilesVolume("cfg", "configMap", files)})

    await provider.create_pod(resolved(b"one", "1"))
    await eventually(lambda: _logged(provider, b"booting"))
    machine = next(iter(runtime.machines.values()))

    async def booted() -> bool:
        return provider.vms["ns/vm"].booted_at is not None

    await eventually(booted)
    await provider.update_pod(resolved(b"two", "2"))
    ((argv, stdin),) = machine.execs
    assert argv[:2] == ["sh", "-c"] and argv[3:] == ["sh", "/etc/app/a.conf", "644"]
    assert stdin == b"two"
    assert runtime.seeds[-1]["files"]["/etc/app/a.conf"] == b"two"
    assert runtime.seeds[-1]["files"]["/etc/vkubelet/env"] == b"E=1\n"  # start-time env


async def test_volume_updates_reach_a_vm_adopted_after_a_restart(
    tmp_path: Path, runtime: FakeRuntime, events: Events
) -> None:
    """Handed back unchanged (`adopt_pod`), then updated: only the changed file is written.
    Changed while no agent ran (`update_pod` at once): every file is written again."""

    def resolved(files: dict[str, bytes]) -> ResolvedPod:
        pod = make_pod(volumes=[{"name": "cfg", "configMap": {"name": "c"}}])
        assert pod.spec is not None
        pod.spec.containers[0].volumeMounts = [VolumeMount(name="cfg", mountPath="/etc/app")]
        contents = {name: FileContent(data, 0o644) for name, data in files.items()}
        return ResolvedPod(pod, {"cfg": FilesVolume("cfg", "configMap", contents)})

    async def restart(previous: VMProvider) -> VMProvider:
        await previous.aclose()  # the agent goes; the VM does not
        again = provider_for(tmp_path, runtime, events)
        await again.list_pods()

        async def booted() -> bool:
            return again.vms["ns/vm"].booted_at is not None

        await eventually(booted)
        return again

    first = provider_for(tmp_path, runtime, events)
    await first.create_pod(resolved({"a.conf": b"one", "b.conf": b"b"}))
    await eventually(lambda: _logged(first, b"booting"))
    second = await restart(first)
    machine = runtime.machines[runtime.launches[-1].run_dir]
    await second.adopt_pod(resolved({"a.conf": b"one", "b.conf": b"b"}))
    await second.update_pod(resolved({"a.conf": b"two", "b.conf": b"b"}))
    assert [argv[-2] for argv, _ in machine.execs] == ["/etc/app/a.conf"]
    assert runtime.seeds[-1]["files"]["/etc/app/a.conf"] == b"two"
    machine.execs.clear()
    third = await restart(second)
    await third.update_pod(resolved({"a.conf": b"three", "b.conf": b"b"}))
    assert sorted(argv[-2] for argv, _ in machine.execs) == ["/etc/app/a.conf", "/etc/app/b.conf"]
    assert runtime.seeds[-1]["files"]["/etc/app/a.conf"] == b"three"
    await third.aclose()


def test_config_map_rules_win_over_the_config_file_s_and_go_when_it_goes(tmp_path: Path) -> None:
    from vkubelet.providers.vm._runtime import QemuRuntime

    config = VMConfig(
        state_dir=tmp_path,
        image_store=tmp_path / "images",
        translations=[{"name": "tiny", "url": "file:///file.qcow2"}],
    )
    runtime = QemuRuntime(config)
    assert runtime.translate("vm.vkubelet.io/tiny") == ("file:///file.qcow2", None)
    rules = "translations: [{name: tiny, url: 'file:///cm.qcow2'}, {name: new, url: 'file:///n'}]"
    runtime.set_translation_overrides({"rules.yaml": rules}, "ConfigMap a/b")
    assert runtime.translate("vm.vkubelet.io/tiny") == ("file:///cm.qcow2", None)
    assert runtime.translate("vm.vkubelet.io/new") == ("file:///n", None)
    with pytest.raises(ValueError, match="ConfigMap a/b"):
        runtime.set_translation_overrides({"rules.yaml": "translations: 3"}, "ConfigMap a/b")
    assert runtime.translate("vm.vkubelet.io/new") == ("file:///n", None)  # kept
    runtime.set_translation_overrides(None, "ConfigMap a/b")
    assert runtime.translate("vm.vkubelet.io/tiny") == ("file:///file.qcow2", None)


async def test_the_pod_kept_on_the_host_is_readable_by_its_owner_only(
    provider: VMProvider, runtime: FakeRuntime, tmp_path: Path
) -> None:
    """Its env holds the values of the Secrets it refers to (the node resolves them)."""
    secret_env = [{"name": "DB_PASSWORD", "value": "s3cret"}]
    pod = make_pod(containers=[{"name": "vm", "image": "vm.vkubelet.io/tiny", "env": secret_env}])
    await provider.create_pod(ResolvedPod(pod))
    await eventually(lambda: launched(runtime))
    [kept] = list(tmp_path.rglob("pod.json"))
    assert b"s3cret" in kept.read_bytes()
    assert kept.stat().st_mode & 0o777 == 0o600
    assert kept.parent.stat().st_mode & 0o077 == 0


async def test_kubectl_debug_runs_its_command_through_the_guest_agent(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    """Without stdin at once (its output is its log); with stdin (`debug -i`) when attached,
    stdin whole first. (`-it` is the serial console, as `attach` is: tests/integration/vm.)"""
    pod = make_pod()
    await provider.create_pod(ResolvedPod(pod))
    await eventually(lambda: _logged(provider, b"booting"))
    debugged = make_pod()
    assert debugged.spec is not None
    debugged.spec.ephemeralContainers = [
        EphemeralContainer(name="once", image="busybox", command=["false"]),
        EphemeralContainer(name="dbg", image="busybox", command=["cat"], stdin=True),
    ]
    await provider.start_ephemeral_container(ResolvedPod(debugged), "once")
    await provider.start_ephemeral_container(ResolvedPod(debugged), "dbg")

    async def ephemeral() -> dict[str, Any]:
        found = await provider.get_pod("ns", "vm")
        assert found is not None and found.status is not None
        return {s.name: s.state for s in found.status.ephemeralContainerStatuses or []}

    async def once_ended() -> bool:
        state = (await ephemeral())["once"]
        return state.terminated is not None and state.terminated.exitCode == 3

    await eventually(once_ended)
    chunks = [c async for c in provider.container_logs("ns", "vm", "once", ContainerLogOptions())]
    assert b"".join(chunks) == b"no\n"
    assert (await ephemeral())["dbg"].running is not None  # waits for its client

    class In:
        def __init__(self) -> None:
            self.parts = [b"typed", b""]

        async def read(self, max_bytes: int = 65536) -> bytes:
            return self.parts.pop(0)

    class Out:
        data = b""

        async def write(self, data: bytes) -> None:
            self.data += data

    out = Out()
    await provider.attach_to_container("ns", "vm", "dbg", AttachIO(In(), out, out))
    assert out.data == b"out:typed"
    dbg = (await ephemeral())["dbg"]
    assert dbg.terminated is not None and dbg.terminated.exitCode == 0
    found = await provider.get_pod("ns", "vm")
    assert found is not None and found.spec is not None
    assert [c.name for c in found.spec.ephemeralContainers or []] == ["once", "dbg"]


async def test_a_machine_the_runtime_refuses_fails_the_pod_with_its_reason_and_makes_nothing(
    provider: VMProvider, runtime: FakeRuntime, events: Events, tmp_path: Path
) -> None:
    runtime.refused = "libvirt has a domain 'ns_vm' that is not this pod's"
    await provider.create_pod(ResolvedPod(make_pod()))

    async def refused() -> bool:
        _, status = await state(provider)
        waiting = status.state.waiting if status else None
        return waiting is not None and waiting.reason == "DomainExists"

    await eventually(refused)
    _, status = await state(provider)
    assert "not this pod's" in status.state.waiting.message
    assert ("Warning", "Failed", f"Error: {runtime.refused}") in events.pod
    assert not runtime.machines
    assert not list((tmp_path / "s" / "vms").glob("*/root.qcow2"))  # no disk was made


async def test_a_runtime_that_cannot_run_machines_makes_the_node_unhealthy_saying_why(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    runtime.unhealthy = "libvirt qemu+ssh://hv-2/system: Cannot recv data: Permission denied"
    with pytest.raises(RuntimeError, match="Permission denied"):
        await provider.ping()
    runtime.unhealthy = None
    await provider.ping()


async def test_a_runtime_on_another_host_gives_the_node_that_host_s_capacity(
    provider: VMProvider, runtime: FakeRuntime
) -> None:
    runtime.remote_host = (64000, 256 * GI)  # a libvirt daemon's host
    await provider.ping()
    node = Node.from_dict({"metadata": {"name": "hv-1"}, "spec": {}, "status": {}})
    assert isinstance(node, Node)
    provider.configure_node(node)
    assert node.status is not None and node.status.capacity is not None
    assert node.status.capacity["cpu"] == "63"  # less the 1 CPU and 1 GiB reserved
    assert node.status.capacity["memory"] == f"{255 * GI // 1024}Ki"
