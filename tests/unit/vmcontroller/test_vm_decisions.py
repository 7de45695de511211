"""The VirtualMachine reconciler's decisions (pure: a VM and its pods in, actions out).

The rule that matters most: never two pods of one VM, whatever state a restarted controller
finds (a pod still terminating, several pods after an accident, a migration target)."""

from __future__ import annotations

from datetime import UTC, datetime

from vkubelet.vmcontroller._base import (
    MACHINE_ANNOTATION,
    MIGRATION_SOURCE_ANNOTATION,
    NAME_LABEL,
    POWER_OFF_ANNOTATION,
    ROOT_DISK_SIZE_ANNOTATION,
    VM_TOLERATION,
)
from vkubelet.vmcontroller._vm import decide, pod_for

from .fakes import UID, pod, vm


def test_replicas_one_without_a_pod_creates_one_from_the_template() -> None:
    decision = decide(vm(), [])
    assert decision.create is not None
    meta = decision.create["metadata"]
    assert meta["generateName"] == "db-"
    assert meta["labels"] == {"app": "db", NAME_LABEL: "db"}
    assert meta["annotations"][MACHINE_ANNOTATION] == UID
    assert meta["ownerReferences"][0]["uid"] == UID and meta["ownerReferences"][0]["controller"]
    assert decision.create["spec"]["containers"][0]["image"] == "vm.vkubelet.io/tiny"
    assert decision.status["phase"] == "Starting"
    assert decision.requeue is not None


def test_a_running_pod_makes_the_vm_running_with_its_node_and_ip() -> None:
    decision = decide(vm(), [pod()])
    assert decision.create is None and not decision.power_off and not decision.delete
    status = decision.status
    assert (status["phase"], status["nodeName"], status["ip"], status["podName"]) == (
        "Running",
        "hv-1",
        "10.213.0.5",
        "db-aaaaa",
    )
    assert (status["replicas"], status["selector"], status["observedGeneration"]) == (
        1,
        f"{NAME_LABEL}=db",
        3,
    )
    assert (
        status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"
    )


def test_no_second_pod_while_the_previous_one_still_terminates() -> None:
    decision = decide(vm(), [pod(deleting=True)])
    assert decision.create is None
    assert decision.status["phase"] == "Stopping"


def test_a_pod_of_another_vm_with_the_same_name_does_not_count() -> None:
    stranger = pod()
    stranger["metadata"]["ownerReferences"] = [{"uid": "other"}]
    stranger["metadata"]["annotations"] = {MACHINE_ANNOTATION: "other"}
    assert decide(vm(), [stranger]).create is not None


def test_of_several_pods_the_running_one_stays_and_the_others_are_shut_down() -> None:
    pods = [
        pod("db-new", running=False, created="2026-01-02T00:00:00Z"),
        pod("db-old", running=True, created="2026-01-01T00:00:00Z"),
        pod("db-older", running=False, created="2025-01-01T00:00:00Z"),
    ]
    decision = decide(vm(), pods)
    assert decision.create is None
    assert decision.power_off == {"db-new": "Shutdown", "db-older": "Shutdown"}
    assert decision.status["podName"] == "db-old"


def test_replicas_zero_powers_the_pod_off_in_the_vm_s_mode() -> None:
    decision = decide(vm(replicas=0, mode="Hibernate"), [pod()])
    assert decision.power_off == {"db-aaaaa": "Hibernate"}
    assert decision.create is None
    assert decision.status["phase"] == "Stopping"
    assert decision.status["replicas"] == 0 or decision.status["replicas"] == 1
    after = vm(replicas=0, mode="Hibernate")
    after["status"] = decision.status
    gone = decide(after, [])
    assert gone.status["phase"] == "Hibernated" and gone.status["replicas"] == 0
    assert gone.status["nodeName"] is None and gone.status["podName"] is None


def test_replicas_zero_without_pods_is_stopped() -> None:
    decision = decide(vm(replicas=0), [])
    assert decision.status["phase"] == "Stopped"
    assert not decision.power_off and decision.create is None


def test_a_terminal_pod_is_deleted_and_replaced_only_once_it_is_gone() -> None:
    failed = vm()
    failed["status"] = {  # its back-off (test_vm_backoff) is over
        "lastFailure": {"podName": "db-aaaaa", "reason": "Error", "observedGeneration": 3},
        "nextStartAfter": "2026-01-01T00:00:10Z",
    }
    later = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    decision = decide(failed, [pod(phase="Failed", running=False)], now=later)
    assert decision.delete == ["db-aaaaa"] and decision.create is None
    assert decision.status["phase"] == "Failed"


def test_a_migration_target_is_left_to_the_migration() -> None:
    target = pod("db-target", annotations={MIGRATION_SOURCE_ANNOTATION: "db-aaaaa"})
    decision = decide(vm(), [pod(), target])
    assert not decision.power_off and not decision.delete and decision.create is None
    assert decision.status["phase"] == "Migrating" and decision.status["podName"] == "db-aaaaa"


def test_a_source_that_ended_mid_migration_is_left_to_the_migration_and_keeps_the_machine() -> None:
    """Its QEMU died while its agent was away: whether the guest reached the target is the
    migration reconciler's to find out; until then neither pod is the VM's, nothing is created,
    and the machine stays on the source's node."""
    source = pod(running=False, phase="Failed")
    source["spec"]["nodeName"] = "hv-1"
    target = pod("db-target", annotations={MIGRATION_SOURCE_ANNOTATION: "db-aaaaa"})
    target["spec"]["nodeName"] = "hv-2"
    old = vm()
    old["status"] = {"machineNode": "hv-1"}
    decision = decide(old, [source, target])
    assert not decision.delete and not decision.power_off and decision.create is None
    assert decision.status["phase"] == "Migrating"
    assert decision.status["machineNode"] == "hv-1" and decision.status["podName"] is None


def test_template_labels_reach_the_pod_and_removed_ones_go() -> None:
    running = pod(labels={"app": "db", "tier": "old", NAME_LABEL: "db"})
    decision = decide(vm(meta={"labels": {"app": "db", "team": "a"}}), [running])
    assert decision.patch["db-aaaaa"] == {"metadata": {"labels": {"team": "a", "tier": None}}}


def test_cpu_and_memory_changes_go_through_pods_resize() -> None:
    spec = {
        "containers": [
            {
                "name": "vm",
                "image": "vm.vkubelet.io/tiny",
                "resources": {"limits": {"cpu": "2", "memory": "1Gi"}},
            }
        ]
    }
    decision = decide(vm(spec=spec), [pod()])
    assert decision.resize == {
        "db-aaaaa": {
            "spec": {
                "containers": [
                    {
                        "name": "vm",
                        "resources": {
                            "requests": {"cpu": "2", "memory": "1Gi"},
                            "limits": {"cpu": "2", "memory": "1Gi"},
                        },
                    }
                ]
            }
        }
    }
    assert decide(vm(), [pod()]).resize == {}  # unchanged: nothing
    # The apiserver's defaulting (requests = limits) and spelling ("1024Mi" -> "1Gi") are no change.
    defaulted = pod(
        resources={
            "requests": {"cpu": "1000m", "memory": "512Mi"},
            "limits": {"cpu": "1", "memory": "0.5Gi"},
        }
    )
    assert decide(vm(), [defaulted]).resize == {}


def test_a_root_disk_size_change_becomes_the_pod_annotation() -> None:
    meta = {"labels": {"app": "db"}, "annotations": {"vm.vkubelet.io/root-size": "2Gi"}}
    decision = decide(vm(meta=meta), [pod()])
    assert decision.patch["db-aaaaa"]["metadata"]["annotations"][ROOT_DISK_SIZE_ANNOTATION] == "2Gi"
    created = pod_for(vm(meta=meta))
    assert created["metadata"]["annotations"][ROOT_DISK_SIZE_ANNOTATION] == "2Gi"


def test_a_refused_create_fails_the_vm_with_the_apiserver_s_words() -> None:
    decision = decide(vm(), [], failure=("FailedCreate", "the pod was refused: bad"))
    assert decision.create is None
    assert decision.status["phase"] == "Failed"
    synced = decision.status["conditions"][1]
    assert (synced["type"], synced["status"], synced["message"]) == (
        "Synced",
        "False",
        "the pod was refused: bad",
    )


def test_a_deleted_vm_is_left_to_the_garbage_collector() -> None:
    deleted = vm()
    deleted["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    decision = decide(deleted, [pod()])
    assert decision.create is None and not decision.power_off and not decision.status


def test_power_off_annotation_name_is_the_contract_s() -> None:
    assert POWER_OFF_ANNOTATION == "vm.vkubelet.io/power-off"


def test_a_failed_hibernation_seen_while_stopping_makes_the_vm_stopped_not_hibernated() -> None:
    stopping = pod(deleting=True, running=False)
    stopping["status"]["containerStatuses"][0]["state"] = {
        "terminated": {"reason": "HibernateFailed", "exitCode": 0}
    }
    during = decide(vm(replicas=0, mode="Hibernate"), [stopping])
    assert during.status["phase"] == "Stopping"
    after = vm(replicas=0, mode="Hibernate")
    after["status"] = during.status
    assert decide(after, []).status["phase"] == "Stopped"


def test_an_unschedulable_pod_shows_the_scheduler_s_reason_in_ready() -> None:
    pending = pod(running=False, phase="Pending")
    pending["spec"].pop("nodeName")
    pending["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available",
            }
        ],
    }
    ready = decide(vm(), [pending]).status["conditions"][0]
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False",
        "Unschedulable",
        "0/3 nodes are available",
    )


def test_a_vm_powers_on_where_its_disks_are() -> None:
    running = decide(vm(), [pod()])
    assert running.status["machineNode"] == "hv-1"
    off = vm(replicas=0)
    off["status"] = decide(off, [pod()]).status
    stopped = decide(off, [])
    assert stopped.status["machineNode"] == "hv-1"  # remembered while off
    on = vm()
    on["status"] = stopped.status
    created = decide(on, []).create
    assert created is not None
    terms = created["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["hv-1"]}]}
    ]


def test_the_disk_pin_is_anded_into_the_template_s_terms_and_a_named_node_wins() -> None:
    term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    spec = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        },
        "containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}],
    }
    on = vm(spec=spec)
    on["status"] = {"machineNode": "hv-1"}
    created = pod_for(on)
    (pinned,) = created["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert pinned["matchExpressions"] == term["matchExpressions"]
    assert pinned["matchFields"][0]["values"] == ["hv-1"]
    assert on["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"] == [term]  # the VM itself unchanged
    named = vm(spec={"nodeName": "hv-2", "containers": spec["containers"]})
    named["status"] = {"machineNode": "hv-1"}
    assert "affinity" not in pod_for(named)["spec"]


def test_only_the_first_power_on_restores_from_a_backup() -> None:
    restoring = vm()
    restoring["spec"]["restoreFrom"] = {"backup": "nightly"}
    created = decide(restoring, []).create
    assert created is not None
    assert created["metadata"]["annotations"]["vm.vkubelet.io/restore-from"] == "nightly"
    restoring["status"] = {"machineNode": "hv-1"}  # it ran: its disks exist
    again = decide(restoring, []).create
    assert again is not None
    assert "vm.vkubelet.io/restore-from" not in again["metadata"]["annotations"]


# -- the VM keeps its address (issue 26) ---------------------------------------------------------
ADDRESS = "vm.vkubelet.io/address"


def test_a_powered_off_vm_keeps_its_ip_and_its_next_pod_asks_for_it() -> None:
    running = vm()
    running["status"] = decide(running, [pod()]).status
    stopped = decide({**running, "spec": {**running["spec"], "replicas": 0}}, [])
    assert (stopped.status["phase"], stopped.status["ip"]) == ("Stopped", "10.213.0.5")
    powered_on = decide({**running, "status": stopped.status}, [])
    assert powered_on.create is not None
    assert powered_on.create["metadata"]["annotations"][ADDRESS] == "10.213.0.5"
    assert powered_on.status["ip"] == "10.213.0.5"  # while the new pod has none yet


def test_the_first_pod_asks_for_no_address_and_a_template_s_own_address_wins() -> None:
    assert ADDRESS not in pod_for(vm())["metadata"]["annotations"]
    chosen = vm(meta={"annotations": {ADDRESS: "10.213.0.77"}})
    chosen["status"] = {"ip": "10.213.0.5"}
    assert pod_for(chosen)["metadata"]["annotations"][ADDRESS] == "10.213.0.77"


def test_the_pod_tolerates_the_vm_taint_without_the_template_saying_so() -> None:
    assert pod_for(vm())["spec"]["tolerations"] == [VM_TOLERATION]


def test_the_template_s_tolerations_are_kept_and_the_vm_one_is_never_doubled() -> None:
    other = {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"}
    mock = {"key": "virtual-kubelet.io/provider", "value": "mock"}
    # Without an effect it covers the taint already, as does `Exists`: left as written.
    no_effect = {"key": "virtual-kubelet.io/provider", "value": "vm"}
    spec = vm()["spec"]["template"]["spec"]
    for tolerations, want in [
        ([other], [other, VM_TOLERATION]),
        ([mock], [mock, VM_TOLERATION]),
        ([dict(VM_TOLERATION)], [VM_TOLERATION]),
        ([no_effect], [no_effect]),
        ([{"operator": "Exists"}], [{"operator": "Exists"}]),
    ]:
        template = vm(spec={**spec, "tolerations": tolerations})
        assert pod_for(template)["spec"]["tolerations"] == want, tolerations
        assert template["spec"]["template"]["spec"]["tolerations"] == tolerations  # untouched


def test_the_status_says_which_runtime_runs_the_vm_and_keeps_it_while_off() -> None:
    on_libvirt = pod()
    on_libvirt["status"]["containerStatuses"][0]["containerID"] = "libvirt://7"
    running = decide(vm(), [on_libvirt])
    assert running.status["runtime"] == "libvirt"
    off = vm(replicas=0)
    off["status"] = running.status
    assert decide(off, []).status["runtime"] == "libvirt"
    assert decide(vm(), [pod()]).status["runtime"] is None  # no container ID (older agent)


# -- an imported libvirt domain (issue 29) ------------------------------------------------------
def test_an_imported_domain_and_its_deletion_policy_reach_every_pod_of_the_vm() -> None:
    imported = vm()
    imported["spec"]["importDomain"] = {"name": "legacy-db", "deletionPolicy": "Delete"}
    imported["spec"]["template"]["metadata"] = {
        "annotations": {"vm.vkubelet.io/domain": "someone-else"}  # the VM's field wins
    }
    for status in ({}, {"machineNode": "hv-1"}):  # first power on, and the next ones
        imported["status"] = status
        created = decide(imported, []).create
        assert created is not None
        annotations = created["metadata"]["annotations"]
        assert annotations["vm.vkubelet.io/domain"] == "legacy-db"
        assert annotations["vm.vkubelet.io/domain-deletion-policy"] == "Delete"
        assert annotations["vm.vkubelet.io/machine"] == UID
    plain = decide(vm(), []).create
    assert plain is not None and "vm.vkubelet.io/domain" not in plain["metadata"]["annotations"]
