"""A pod read as a VM: sizes, disks, files for the seed, and refusals naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.providers.vm._spec import ENV_FILE, SpecError, plan_machine
from vkubelet.sdk import EmptyDirVolume, FileContent, FilesVolume, OtherVolume, ResolvedPod

GI = 2**30


def pod(container: dict[str, Any] | None = None, **spec: Any) -> Pod:
    annotations = spec.pop("annotations", {})
    body = {
        "metadata": {"name": "vm", "namespace": "ns", "uid": "u1", "annotations": annotations},
        "spec": {
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny", **(container or {})}]
        }
        | spec,
    }
    return Pod.from_dict(body)  # type: ignore[return-value]


def plan(p: Pod, volumes: dict[str, Any] | None = None, memory: int = 8 * GI) -> Any:
    return plan_machine(
        ResolvedPod(p, volumes or {}), allocatable_millicpu=4000, allocatable_memory=memory
    )


def test_defaults_make_a_small_virtio_machine() -> None:
    machine = plan(pod())
    assert (machine.vcpus, machine.memory_mib, machine.disk_bus) == (1, 256, "virtio")
    assert machine.root_size is None and machine.files == {} and machine.scratch == ()
    assert machine.image == "vm.vkubelet.io/tiny"


def test_limits_win_over_requests_and_cpus_round_up() -> None:
    machine = plan(
        pod(
            {
                "resources": {
                    "requests": {"cpu": "3", "memory": "1Gi"},
                    "limits": {"cpu": "1500m", "memory": "512Mi"},
                }
            }
        )
    )
    assert (machine.vcpus, machine.memory_mib) == (2, 512)
    machine = plan(pod({"resources": {"requests": {"cpu": "250m", "memory": "300Mi"}}}))
    assert (machine.vcpus, machine.memory_mib) == (1, 300)


def test_more_memory_than_the_node_has_is_refused_naming_the_field() -> None:
    p = pod({"resources": {"limits": {"memory": "64Gi"}}})
    with pytest.raises(SpecError, match=r"spec.containers\[0\].resources.limits.memory: 65536Mi"):
        plan(p)


def test_only_one_container_and_no_init_containers() -> None:
    two = pod()
    assert two.spec is not None
    two.spec.containers.append(two.spec.containers[0])
    with pytest.raises(SpecError, match=r"^spec.containers: a VM pod has exactly one"):
        plan(two)
    init = pod(initContainers=[{"name": "i", "image": "x"}])
    with pytest.raises(SpecError, match=r"^spec\.initContainers"):
        plan(init)


def test_root_size_and_bus_from_our_annotations_or_virtlets() -> None:
    ours = plan(
        pod(
            annotations={
                "vm.vkubelet.io/root-size": "4Gi",
                "VirtletRootVolumeSize": "2Gi",
                "vm.vkubelet.io/disk-bus": "scsi",
            }
        )
    )
    assert (ours.root_size, ours.disk_bus) == (4 * GI, "scsi")
    virtlet = plan(pod(annotations={"VirtletRootVolumeSize": "2Gi", "VirtletDiskDriver": "virtio"}))
    assert (virtlet.root_size, virtlet.disk_bus) == (2 * GI, "virtio")


@pytest.mark.parametrize(
    ("annotations", "field"),
    [
        ({"vm.vkubelet.io/disk-bus": "ide"}, r"metadata.annotations\[vm.vkubelet.io/disk-bus\]"),
        ({"VirtletRootVolumeSize": "big"}, r"metadata.annotations\[VirtletRootVolumeSize\]"),
        ({"VirtletVCPUCount": "300"}, r"metadata.annotations\[VirtletVCPUCount\]"),
    ],
)
def test_bad_annotations_are_refused_naming_them(annotations: dict[str, str], field: str) -> None:
    with pytest.raises(SpecError, match=f"^{field}:"):
        plan(pod(annotations=annotations))


def test_empty_dirs_become_blank_disks() -> None:
    p = pod(
        {"volumeMounts": [{"name": "scratch", "mountPath": "/data"}]},
        volumes=[{"name": "scratch", "emptyDir": {"sizeLimit": "3Gi"}}],
    )
    machine = plan(p, {"scratch": EmptyDirVolume("scratch", size_limit="3Gi")})
    assert [(d.volume, d.size, d.mount_path) for d in machine.scratch] == [
        ("scratch", 3 * GI, "/data")
    ]


def test_volume_files_land_at_their_mount_paths_and_env_in_the_env_file() -> None:
    p = pod(
        {
            "volumeMounts": [
                {"name": "cfg", "mountPath": "/etc/app"},
                {"name": "key", "mountPath": "/etc/key.pem", "subPath": "key.pem"},
            ],
            "env": [{"name": "GREETING", "value": "it's $HOME"}, {"name": "N", "value": "1"}],
        },
        volumes=[
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "key", "secret": {"secretName": "s"}},
        ],
    )
    volumes = {
        "cfg": FilesVolume("cfg", "configMap", {"a.conf": FileContent(b"A", 0o644)}),
        "key": FilesVolume(
            "key",
            "secret",
            {"key.pem": FileContent(b"K", 0o600), "other": FileContent(b"O", 0o600)},
        ),
    }
    machine = plan(p, volumes)
    assert machine.files["/etc/app/a.conf"] == b"A"
    assert machine.files["/etc/key.pem"] == b"K"
    assert "/etc/key.pem/other" not in machine.files
    assert machine.files[ENV_FILE] == b"GREETING='it'\"'\"'s $HOME'\nN=1\n"
    assert machine.secret_files == {"/etc/key.pem", ENV_FILE}


def test_volumes_a_vm_cannot_take_are_refused_naming_them() -> None:
    p = pod(volumes=[{"name": "data", "csi": {"driver": "x"}}])
    with pytest.raises(SpecError, match=r"^spec.volumes\[0\].csi"):
        plan(p, {"data": OtherVolume("data", "csi", {"driver": "x"})})


def test_persistent_volume_claims_become_disks_in_volume_order() -> None:
    p = pod(
        volumes=[
            {"name": "b", "persistentVolumeClaim": {"claimName": "second"}},
            {"name": "a", "persistentVolumeClaim": {"claimName": "first"}},
        ]
    )
    volumes = {
        "b": OtherVolume("b", "persistentVolumeClaim", {"claimName": "second"}),
        "a": OtherVolume("a", "persistentVolumeClaim", {"claimName": "first"}),
    }
    assert plan(p, volumes).claims == ("second", "first")
