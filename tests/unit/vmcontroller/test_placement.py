"""A running VM whose template's node selection changed: whether it moves, and where to."""

from __future__ import annotations

from typing import Any

from vkubelet.vmcontroller._migration import decide as decide_migration
from vkubelet.vmcontroller._placement import (
    TRIGGER_ANNOTATION,
    decide_placement,
    node_admits,
)


def node(name: str, vm: bool = True, ready: bool = True, **labels: str) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if vm:
        conditions.append({"type": "Accelerator", "status": "True"})
    taint = {"key": "virtual-kubelet.io/provider", "value": "vm", "effect": "NoSchedule"}
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {"taints": [taint]},
        "status": {"conditions": conditions},
    }


TOLERATE = [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]
NODES = {
    "hv-1": node("hv-1", rack="a"),
    "hv-2": node("hv-2", rack="b"),
    "hv-3": node("hv-3", ready=False, rack="b"),
    "worker": node("worker", vm=False, rack="b"),
}


def vm(generation: int = 2, **template_spec: Any) -> dict[str, Any]:
    spec = {"tolerations": TOLERATE, "containers": [{"name": "vm"}], **template_spec}
    return {
        "metadata": {"name": "db", "namespace": "ns", "uid": "u1", "generation": generation},
        "spec": {"replicas": 1, "template": {"spec": spec}},
    }


POD = {"metadata": {"name": "db-x"}, "spec": {"nodeName": "hv-1"}}


def test_a_vm_whose_node_still_matches_stays() -> None:
    placement = decide_placement(vm(nodeSelector={"rack": "a"}), POD, NODES, [])
    assert placement is not None and placement.create is None
    assert (placement.status, placement.reason) == ("True", "Matches")
    assert decide_placement(vm(), POD, NODES, [])  # no selection at all: matches
    assert decide_placement(vm(), POD, NODES, []).create is None  # type: ignore[union-attr]


def test_a_changed_node_selector_moves_the_vm_to_the_ready_vm_node_that_matches() -> None:
    placement = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [])
    assert placement is not None and placement.create is not None
    assert placement.reason == "Migrating"
    migration = placement.create
    # Not hv-3 (not Ready), not worker (not a vm node).
    assert migration["spec"] == {"vmName": "db", "targetNode": "hv-2"}
    assert migration["metadata"]["name"] == "db-nodeselection-2"
    assert migration["metadata"]["annotations"] == {TRIGGER_ANNOTATION: "NodeSelection"}
    assert migration["metadata"]["ownerReferences"][0]["uid"] == "u1"


def test_a_changed_node_affinity_moves_the_vm() -> None:
    term = {"matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["a"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}  # fmt: skip
    placement = decide_placement(vm(affinity=affinity), POD, NODES, [])
    assert placement is not None and placement.create is not None
    assert placement.create["spec"]["targetNode"] == "hv-2"


def test_no_matching_vm_node_changes_nothing_and_says_so() -> None:
    placement = decide_placement(vm(nodeSelector={"rack": "c"}), POD, NODES, [])
    assert placement is not None and placement.create is None
    assert (placement.status, placement.reason) == ("False", "NoMatchingNode")
    assert "hv-1" in placement.message
    # A node whose taint the template does not tolerate does not match either (the vm
    # provider's own taint is tolerated for every VM: another one).
    untolerant = vm(nodeSelector={"rack": "b"})
    untolerant["spec"]["template"]["spec"]["tolerations"] = []
    dedicated = {"key": "dedicated", "value": "db", "effect": "NoSchedule"}
    tainted = {**NODES, "hv-2": node("hv-2", rack="b")}
    tainted["hv-2"]["spec"]["taints"].append(dedicated)
    placement = decide_placement(untolerant, POD, tainted, [])
    assert placement is not None and placement.reason == "NoMatchingNode"


def test_one_migration_per_change_and_a_failed_one_is_not_retried() -> None:
    made = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [])
    assert made is not None and made.create is not None
    existing = {**made.create, "status": {"phase": "Migrating"}}
    again = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [existing])
    assert again is not None and again.create is None and again.reason == "Migrating"
    failed = {**made.create, "status": {"phase": "Failed", "message": "target died"}}
    after = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [failed])
    assert after is not None and after.create is None
    assert after.reason == "MigrationFailed" and "target died" in after.message
    # A new change of the template (a new generation) tries again.
    newer = decide_placement(vm(3, nodeSelector={"rack": "b"}), POD, NODES, [failed])
    assert newer is not None and newer.create is not None


def test_a_users_migration_in_progress_is_left_to_end() -> None:
    theirs = {
        "metadata": {"name": "mine"},
        "spec": {"vmName": "db"},
        "status": {"phase": "Scheduling"},
    }
    placement = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [theirs])
    assert placement is not None and placement.create is None and placement.reason == "Migrating"


def test_a_template_without_tolerations_moves_to_a_vm_node_all_the_same() -> None:
    # The controller tolerates the vm taint for it, as in the pod it makes.
    placement = decide_placement(vm(nodeSelector={"rack": "b"}, tolerations=[]), POD, NODES, [])
    assert placement is not None and placement.create is not None
    assert placement.create["spec"]["targetNode"] == "hv-2"


def test_a_taint_the_template_does_not_tolerate_never_moves_a_running_vm() -> None:
    pinned = vm(nodeName="hv-1", tolerations=[])  # nodeName: the scheduler never looked
    placement = decide_placement(pinned, POD, NODES, [])
    assert placement is not None and placement.status == "True" and placement.create is None


def test_node_admits_checks_name_selector_affinity_fields_and_taints() -> None:
    hv2 = NODES["hv-2"]
    assert node_admits(hv2, {"tolerations": TOLERATE})
    assert not node_admits(hv2, {})  # the provider taint
    assert not node_admits(hv2, {"tolerations": TOLERATE, "nodeName": "hv-1"})
    fields = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["hv-2"]}]}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": []}, fields]}}}  # fmt: skip
    assert node_admits(hv2, {"tolerations": TOLERATE, "affinity": affinity})
    assert not node_admits(NODES["hv-1"], {"tolerations": TOLERATE, "affinity": affinity})


def test_the_target_pod_of_a_node_selection_migration_carries_the_new_selection() -> None:
    made = decide_placement(vm(nodeSelector={"rack": "b"}), POD, NODES, [])
    assert made is not None and made.create is not None
    source = {
        "metadata": {"name": "db-x", "namespace": "ns", "labels": {"vm.vkubelet.io/name": "db"}},
        "spec": {
            "nodeName": "hv-1",
            "nodeSelector": {"rack": "a"},
            "containers": [{"name": "vm"}],
        },
        "status": {"phase": "Running"},
    }
    step = decide_migration(made.create, vm(nodeSelector={"rack": "b"}), [source], NODES)
    assert step.create is not None
    spec = step.create["spec"]
    assert spec["nodeName"] == "hv-2" and spec["nodeSelector"] == {"rack": "b"}
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["hv-2"]
