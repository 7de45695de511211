"""The device provider as a whole against a local "device" (`LocalLink`: its scripts run with the
local sh in a temporary HOME): deletions, values it cannot carry, adoption after a restart."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from lightkube.models.core_v1 import (
    Container,
    ContainerPort,
    EnvVar,
    ExecAction,
    PodSpec,
    PodStatus,
    Probe,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.ssh._inventory import DeviceConfig
from vkubelet.providers.ssh._provider import DeviceProvider
from vkubelet.providers.ssh._remote import Runtime
from vkubelet.sdk import ContainerLogOptions, ProviderError, ResolvedPod
from vkubelet.testing.harness import eventually

from .local_link import LocalLink

pytestmark = pytest.mark.timeout(60)

SECOND = 0.05  # a probe second


class Device:
    """A device's home, and the providers (agent processes) that run its pods one after the
    other."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.link = LocalLink(home)
        self.providers: list[DeviceProvider] = []

    def provider(self) -> DeviceProvider:
        config = DeviceConfig(name="dev", address="127.0.0.1", backoff_initial=1)
        provider = DeviceProvider(config, link=self.link, probe_second=SECOND)  # type: ignore[arg-type]
        provider.start()
        self.providers.append(provider)
        return provider

    def pod_fs(self, uid: str) -> Path:
        return self.home / ".vkubelet" / "pods" / uid / "fs"


def make_pod(name: str, uid: str, **container: Any) -> ResolvedPod:
    container.setdefault("command", ["sleep", "3600"])
    container.setdefault("image", "host")
    pod = Pod(
        metadata=ObjectMeta(name=name, namespace="ns", uid=uid),
        spec=PodSpec(
            containers=[Container(name="main", **container)],
            terminationGracePeriodSeconds=1,
        ),
    )
    return ResolvedPod(pod)


async def status(provider: DeviceProvider, name: str) -> PodStatus | None:
    return await provider.get_pod_status("ns", name)


def main_status(s: PodStatus | None) -> Any:
    assert s is not None and s.containerStatuses
    return s.containerStatuses[0]


async def wait_running(provider: DeviceProvider, name: str) -> None:
    async def running() -> bool:
        s = await status(provider, name)
        return s is not None and s.phase == "Running"

    await eventually(running, within=15, what=f"{name} to run")


# -- deletions ------------------------------------------------------------------------------------
async def test_deleted_pods_leave_no_task_behind(device: Device) -> None:
    provider = device.provider()
    names = [f"p{i}" for i in range(3)]
    for i, name in enumerate(names):
        await provider.create_pod(make_pod(name, f"u{i}"))
    for name in names:
        await wait_running(provider, name)
    for i, name in enumerate(names):
        pod = make_pod(name, f"u{i}").pod
        await provider.delete_pod(pod, 0)
        await provider.delete_pod(pod, 0)  # again, as the agent may: still one removal
    assert provider.pending_removals == 3
    await eventually(lambda: not provider._pods, within=20)
    await eventually(lambda: provider.pending_removals == 0, within=15)
    assert all(not task.done() for task in provider._tasks)  # only the long-lived ones


# -- values a device cannot carry -----------------------------------------------------------------
SECRET = "s3cr3t-value"


@pytest.mark.parametrize(
    ("container", "named"),
    [
        ({"env": [EnvVar(name="TOKEN", value=f"{SECRET}\0rest")]}, "environment variable TOKEN"),
        ({"command": ["sh", "-c", f"echo {SECRET}\0"]}, "word 3 of command and args"),
    ],
)
async def test_a_secret_value_the_device_cannot_carry_is_named_never_echoed(
    device: Device, caplog: pytest.LogCaptureFixture, container: dict[str, Any], named: str
) -> None:
    caplog.set_level(logging.DEBUG)
    provider = device.provider()
    with pytest.raises(ProviderError) as raised:
        await provider.create_pod(make_pod("p", "u1", **container))
    message = raised.value.message
    assert named in message and "NUL" in message
    assert SECRET not in message and SECRET not in str(raised.value)
    assert SECRET not in caplog.text


# -- adoption -------------------------------------------------------------------------------------
async def test_an_adopted_pod_keeps_its_probes_and_image(device: Device) -> None:
    probe = Probe(exec=ExecAction(command=["test", "-f", "ready"]), periodSeconds=1)
    first = device.provider()
    await first.create_pod(make_pod("p", "u1", readinessProbe=probe))
    await wait_running(first, "p")
    (device.pod_fs("u1") / "ready").touch()
    await eventually(lambda: first._pods["ns/p"].prober is not None, within=15)
    await first.aclose()  # the agent stops; the pod runs on

    second = device.provider()  # the agent restarted: it adopts the pod
    [pod] = await second.list_pods()
    assert pod.spec is not None
    [container] = pod.spec.containers
    assert container.image == "host"
    assert container.readinessProbe is not None
    assert container.env is None and container.command is None  # never kept on the device
    await wait_running(second, "p")
    entry = second._pods["ns/p"]
    await eventually(lambda: entry.prober is not None and entry.prober.ready("main"), within=15)
    ready = main_status(await status(second, "p"))
    assert ready.ready and ready.image == "host"
    (device.pod_fs("u1") / "ready").unlink()  # the readiness probe still runs: not ready
    await eventually(
        lambda: (
            entry.status is not None
            and entry.status.containerStatuses is not None
            and not entry.status.containerStatuses[0].ready
        ),
        within=15,
    )
    assert not main_status(await status(second, "p")).ready


# -- one port, one pod ----------------------------------------------------------------------------
def serving(port: int, protocol: str = "TCP") -> dict[str, Any]:
    return {"ports": [ContainerPort(containerPort=port, protocol=protocol)]}


async def test_a_second_pod_declaring_a_port_of_the_device_is_refused_naming_port_and_holder(
    device: Device,
) -> None:
    provider = device.provider()
    await provider.create_pod(make_pod("first", "u1", **serving(8080)))
    with pytest.raises(ProviderError) as raised:
        await provider.create_pod(make_pod("second", "u2", **serving(8080)))
    error = raised.value
    assert error.reason == "PortInUse" and error.permanent
    assert "port 8080/TCP" in error.message and "pod ns/first" in error.message
    assert "ns/second" not in provider._pods  # nothing started for it
    # Another port, or the same number over another protocol, is the device's to give.
    await provider.create_pod(make_pod("other", "u3", **serving(8081)))
    await provider.create_pod(make_pod("udp", "u4", **serving(8080, "UDP")))
    await wait_running(provider, "other")


async def test_a_pod_waits_for_a_stopping_holder_of_its_port_then_starts(device: Device) -> None:
    provider = device.provider()
    first = make_pod("first", "u1", **serving(8080))
    await provider.create_pod(first)
    await wait_running(provider, "first")
    await provider.delete_pod(first.pod, 0)
    with pytest.raises(ProviderError) as raised:
        await provider.create_pod(make_pod("second", "u2", **serving(8080)))
    assert raised.value.reason == "PortInUse" and not raised.value.permanent
    assert "stopping" in raised.value.message
    await eventually(lambda: "ns/first" not in provider._pods, within=20)
    await provider.create_pod(make_pod("second", "u2", **serving(8080)))
    await wait_running(provider, "second")


async def test_a_finished_pod_no_longer_holds_its_port(device: Device) -> None:
    provider = device.provider()
    done = make_pod("done", "u1", command=["true"], **serving(8080))
    assert done.pod.spec is not None
    done.pod.spec.restartPolicy = "Never"
    await provider.create_pod(done)

    async def succeeded() -> bool:
        s = await status(provider, "done")
        return s is not None and s.phase == "Succeeded"

    await eventually(succeeded, within=15, what="the first pod to succeed")
    await provider.create_pod(make_pod("next", "u2", **serving(8080)))
    await wait_running(provider, "next")


# -- container runtimes ---------------------------------------------------------------------------
async def test_auto_runs_images_with_the_podman_it_finds_and_none_refuses_naming_the_setting(
    device: Device, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A "podman" first on the device's PATH that runs the image's args as the container.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "podman"
    fake.write_text(
        '#!/bin/sh\ncase $1 in image) exit 0 ;; run) while [ "$1" != -- ]; do '
        '[ "$1" != --pidfile ] || echo $$ >"$2"; shift; done; shift 2; exec "$@" ;; esac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    image = {
        "image": "busybox:1",
        "command": None,
        "args": ["sh", "-c", "echo in $0; exec sleep 60"],
    }

    none = DeviceProvider(DeviceConfig(name="dev", address="127.0.0.1"), link=device.link)  # type: ignore[arg-type]
    with pytest.raises(ProviderError) as refused:
        await none.create_pod(make_pod("p", "u1", **image))
    assert refused.value.reason == "ImageNotSupported"
    assert "containerRuntime in the inventory is none" in refused.value.message
    assert "hostImages (host)" in refused.value.message

    config = DeviceConfig(name="dev", address="127.0.0.1", container_runtime="auto")
    provider = DeviceProvider(config, link=device.link)  # type: ignore[arg-type]
    with pytest.raises(ProviderError) as early:  # before it has looked: retried, not failed
        await provider.create_pod(make_pod("p", "u1", **image))
    assert early.value.reason == "ContainerRuntimeUnknown" and not early.value.permanent
    device.providers.append(provider)
    provider.start()

    def detected() -> bool:
        try:
            return provider.runtime() is not None
        except ProviderError:
            return False

    await eventually(detected, within=15, what="podman detected")
    assert provider.runtime() == Runtime(["podman"], [])
    pod = make_pod("p", "u1", **image)
    await provider.create_pod(pod)
    await wait_running(provider, "p")

    async def printed() -> bool:
        logs = provider.container_logs("ns", "p", "main", ContainerLogOptions())
        return b"".join([chunk async for chunk in logs]) == b"in sh\n"

    await eventually(printed, within=15, what="the container's output")
    await provider.delete_pod(pod.pod, 0)
    await eventually(lambda: provider.pending_removals == 0, within=15, what="removed")
