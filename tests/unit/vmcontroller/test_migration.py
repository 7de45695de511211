"""The VirtualMachineMigration reconciler: its decisions from the objects alone, and one whole
migration through the fake apiserver (the providers' part played by the test)."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import pytest

from vkubelet.testing.fakeapi import FakeApiServer
from vkubelet.vmcontroller._base import MIGRATE_TO_ANNOTATION as MIGRATE_TO
from vkubelet.vmcontroller._base import MIGRATION_SOURCE_ANNOTATION as MIGRATION_SOURCE
from vkubelet.vmcontroller._base import Context, Watched
from vkubelet.vmcontroller._migration import (
    MIGRATION_CONDITION,
    MIGRATION_LABEL,
    MIGRATION_TOKEN,
    TARGET_CONDITION,
    MigrationReconciler,
    decide,
)
from vkubelet.vmcontroller._resources import (
    VirtualMachineMigration,
)

ENDPOINT = {"host": "10.0.0.2", "migrationPort": 4000, "nbdPort": 4001, "consolePort": 4002}
HERE = "10.0.0.2:4000"
TOKEN = "a1" * 32


def vm_node(name: str) -> dict[str, Any]:
    condition = {"type": "Accelerator", "status": "True", "reason": "TCG"}
    return {"metadata": {"name": name}, "status": {"conditions": [condition]}}


NODES = {
    "hv-1": vm_node("hv-1"),
    "hv-2": vm_node("hv-2"),
    "worker": {"metadata": {"name": "worker"}, "status": {"conditions": []}},
}


def migration(target: str | None = "hv-2", **status: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"vmName": "db"}
    if target:
        spec["targetNode"] = target
    return {"metadata": {"name": "move", "namespace": "ns"}, "spec": spec, "status": status}


VM = {"metadata": {"name": "db", "namespace": "ns", "uid": "vm-uid"}, "spec": {"replicas": 1}}


def source_pod(**extra: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {
            "name": "db-abcde",
            "namespace": "ns",
            "labels": {"vm.vkubelet.io/name": "db", "app": "db"},
            "annotations": {"vm.vkubelet.io/machine": "vm-uid"},
            "ownerReferences": [
                {
                    "apiVersion": "vkubelet.io/v1alpha1",
                    "kind": "VirtualMachine",
                    "name": "db",
                    "uid": "vm-uid",
                }
            ],
        },
        "spec": {
            "nodeName": "hv-1",
            "nodeSelector": {"hv": "yes"},
            "volumes": [{"name": "kube-api-access-x1"}, {"name": "data", "emptyDir": {}}],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "volumeMounts": [{"name": "kube-api-access-x1", "mountPath": "/var/run"}],
                }
            ],
        },
        "status": {"phase": "Running", "conditions": []},
    }
    pod.update(extra)
    return pod


def target_pod(name: str = "db-fghij", node: str | None = "hv-2", **status: Any) -> dict[str, Any]:
    pod = source_pod()
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"][MIGRATION_LABEL] = "move"
    pod["metadata"]["annotations"][MIGRATION_SOURCE] = "db-abcde"
    pod["metadata"]["annotations"][MIGRATION_TOKEN] = TOKEN
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Pending", "conditions": [], **status}
    return pod


def with_condition(pod: dict[str, Any], kind: str, status: str, reason: str, message: Any) -> Any:
    text = message if isinstance(message, str) else json.dumps(message)
    condition = {"type": kind, "status": status, "reason": reason, "message": text}
    pod["status"]["conditions"] = [*pod["status"]["conditions"], condition]
    return pod


def test_a_migration_to_a_vm_node_creates_the_target_as_a_copy_of_the_vm_pod() -> None:
    step = decide(migration(), VM, [source_pod()], NODES)
    assert step.status["phase"] == "Preparing"
    assert (step.status["sourcePod"], step.status["sourceNode"]) == ("db-abcde", "hv-1")
    pod = step.create
    assert pod is not None
    assert pod["spec"]["nodeName"] == "hv-2"
    assert pod["metadata"]["generateName"] == "db-"
    assert pod["metadata"]["annotations"][MIGRATION_SOURCE] == "db-abcde"
    assert pod["metadata"]["annotations"]["vm.vkubelet.io/machine"] == "vm-uid"
    assert pod["metadata"]["labels"][MIGRATION_LABEL] == "move"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "vm-uid"
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["data"]  # the token is admission's
    assert pod["spec"]["containers"][0]["volumeMounts"] == []


@pytest.mark.parametrize(
    ("node", "why"),
    [
        ("worker", "node worker is not a vm node"),
        ("nowhere", "node nowhere does not exist"),
        ("hv-1", "node hv-1 already runs the VM"),
    ],
)
def test_a_target_that_is_not_another_vm_node_fails_and_changes_nothing(
    node: str, why: str
) -> None:
    step = decide(migration(node), VM, [source_pod()], NODES)
    assert (step.status["phase"], step.status["message"]) == ("Failed", why)
    assert step.create is None and not step.delete and not step.annotate


def test_a_target_outside_the_vm_templates_node_selection_is_refused() -> None:
    pinned: dict[str, Any] = copy.deepcopy(VM)
    pinned["spec"]["template"] = {"spec": {"nodeSelector": {"kubernetes.io/hostname": "hv-1"}}}
    step = decide(migration("hv-2"), pinned, [source_pod()], NODES)
    assert (step.status["phase"], step.status["reason"]) == ("Failed", "InvalidTarget")
    assert "node hv-2 does not match the VirtualMachine's node selection" in step.status["message"]
    assert step.create is None and not step.delete and not step.annotate


def test_a_target_inside_the_vm_templates_node_selection_is_taken() -> None:
    nodes = copy.deepcopy(NODES)
    nodes["hv-2"]["metadata"]["labels"] = {"zone": "b"}
    zoned: dict[str, Any] = copy.deepcopy(VM)
    zoned["spec"]["template"] = {"spec": {"nodeSelector": {"zone": "b"}}}
    step = decide(migration("hv-2"), zoned, [source_pod()], nodes)
    assert step.create is not None and step.create["spec"]["nodeName"] == "hv-2"


def test_without_a_target_node_the_scheduler_picks_another_vm_node() -> None:
    source = source_pod()
    source["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "a", "operator": "Exists"}]},
                    {"matchExpressions": [{"key": "b", "operator": "Exists"}]},
                ]
            }
        }
    }
    step = decide(migration(None), VM, [source], NODES)
    assert step.status["phase"] == "Scheduling"
    pod = step.create
    assert pod is not None and "nodeName" not in pod["spec"]
    assert pod["spec"]["nodeSelector"] == {"hv": "yes"}  # the template's constraints kept
    affinity = pod["spec"]["affinity"]["nodeAffinity"]
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    away = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["hv-1"]}
    # Only vm nodes: "worker" (another provider's node the pod may tolerate) is never picked.
    vm_only = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["hv-2"]}
    for term in required["nodeSelectorTerms"]:  # ORed terms: each keeps away
        assert away in term["matchExpressions"] and vm_only in term["matchExpressions"]
        assert len(term["matchExpressions"]) == 3


def test_a_scheduled_target_on_a_node_that_is_not_a_vm_node_fails_and_is_deleted() -> None:
    state = migration(None, phase="Scheduling", sourcePod="db-abcde", sourceNode="hv-1")
    step = decide(state, VM, [source_pod(), target_pod(node="worker")], NODES)
    assert step.status["message"] == "node worker is not a vm node"
    assert step.delete == ["db-fghij"]


def test_the_target_s_endpoint_goes_onto_the_source_then_progress_is_reported() -> None:
    state = migration(phase="Preparing", sourcePod="db-abcde", sourceNode="hv-1")
    target = with_condition(target_pod(), TARGET_CONDITION, "True", "Ready", ENDPOINT)
    step = decide(state, VM, [source_pod(), target], NODES)
    assert step.status["phase"] == "Migrating"
    assert step.annotate == {
        "db-abcde": {
            MIGRATE_TO: json.dumps(ENDPOINT),
            MIGRATION_LABEL: "move",
            MIGRATION_TOKEN: TOKEN,
        }
    }
    source = source_pod()
    source["metadata"]["annotations"][MIGRATE_TO] = json.dumps(ENDPOINT)
    source["metadata"]["annotations"][MIGRATION_LABEL] = "move"
    report = {"phase": "migrating", "progress": 42, "target": HERE}
    with_condition(source, MIGRATION_CONDITION, "True", "Running", report)
    step = decide(state, VM, [source, target], NODES)
    assert (step.status["phase"], step.status["progress"]) == ("Migrating", 42)
    assert not step.annotate and not step.delete


def _migrating(outcome: str, report: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    state = migration(phase="Migrating", sourcePod="db-abcde", sourceNode="hv-1")
    target = with_condition(target_pod(), TARGET_CONDITION, "True", "Ready", ENDPOINT)
    source = source_pod()
    source["metadata"]["annotations"][MIGRATE_TO] = json.dumps(ENDPOINT)
    source["metadata"]["annotations"][MIGRATION_LABEL] = "move"
    with_condition(source, MIGRATION_CONDITION, "True", outcome, {**report, "target": HERE})
    return state, [source, target]


def test_a_completed_migration_succeeds_after_the_target_stopped_advertising_itself() -> None:
    state, pods = _migrating("Completed", {"downtimeMilliseconds": 21, "totalMilliseconds": 730})
    pods[1]["status"]["conditions"] = [
        {"type": TARGET_CONDITION, "status": "False", "reason": "Completed", "message": "here"}
    ]
    assert decide(state, VM, pods, NODES).status["phase"] == "Succeeded"


def test_an_outcome_on_a_source_this_migration_did_not_annotate_is_not_its_own() -> None:
    state, pods = _migrating("Failed", {"error": "someone else's"})
    del pods[0]["metadata"]["annotations"][MIGRATION_LABEL]
    step = decide(state, VM, pods, NODES)
    assert step.status["phase"] == "Migrating" and not step.delete


def test_a_completed_migration_succeeds_with_its_downtime_and_deletes_the_source() -> None:
    state, pods = _migrating("Completed", {"downtimeMilliseconds": 21, "totalMilliseconds": 730})
    step = decide(state, VM, pods, NODES)
    assert step.status["phase"] == "Succeeded"
    assert (step.status["downtimeMilliseconds"], step.status["totalMilliseconds"]) == (21, 730)
    assert step.delete == ["db-abcde"]


def test_a_failed_migration_deletes_the_target_and_the_vm_stays_at_the_source() -> None:
    state, pods = _migrating("Failed", {"error": "migration failed: Broken pipe"})
    step = decide(state, VM, pods, NODES)
    assert step.status["phase"] == "Failed"
    assert step.status["message"] == "migration failed: Broken pipe"
    assert step.delete == ["db-fghij"]
    assert step.annotate == {"db-abcde": {MIGRATE_TO: None, MIGRATION_TOKEN: None}}


def test_the_outcome_of_an_earlier_migration_to_another_target_is_not_taken_for_this_one() -> None:
    state, pods = _migrating("Failed", {"error": "old"})
    old = pods[0]["status"]["conditions"][0]
    old["message"] = json.dumps({"error": "old", "target": "10.9.9.9:1"})
    step = decide(state, VM, pods, NODES)
    assert step.status["phase"] == "Migrating" and not step.delete


def test_a_restarted_controller_takes_up_a_target_it_created_without_making_another() -> None:
    step = decide(migration(), VM, [source_pod(), target_pod()], NODES)
    assert step.create is None
    assert (step.status["sourcePod"], step.status["targetPod"]) == ("db-abcde", "db-fghij")


def test_a_source_already_deleted_after_the_target_completed_is_a_success() -> None:
    state = migration(phase="Migrating", sourcePod="db-abcde", sourceNode="hv-1")
    target = with_condition(target_pod(), TARGET_CONDITION, "False", "Completed", "runs here")
    assert decide(state, VM, [target], NODES).status["phase"] == "Succeeded"


def test_a_missing_vm_fails_the_migration() -> None:
    step = decide(migration(), None, [], NODES)
    assert step.status["message"] == "VirtualMachine db does not exist"


# -- through the fake apiserver -------------------------------------------------------------
class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def emit(self, obj: Any, type: str, reason: str, message: str) -> None:
        self.seen.append((type, reason))


def _created(api: FakeApiServer) -> int:
    return sum(1 for c in api.calls if c.method == "POST" and c.path.endswith("/pods"))


async def test_a_whole_migration_through_the_api_with_a_controller_restart_in_the_middle() -> None:
    api = FakeApiServer()
    for node in NODES.values():
        api.create("nodes", copy.deepcopy(node))
    api.create("virtualmachinemigrations", migration())
    vm_uid = api.create("virtualmachines", copy.deepcopy(VM))["metadata"]["uid"]
    source = source_pod()
    source["metadata"]["ownerReferences"][0]["uid"] = vm_uid
    source["metadata"]["annotations"]["vm.vkubelet.io/machine"] = vm_uid
    api.create("pods", source)
    events = Events()
    ctx = Context(client=api.client(), events=events)  # type: ignore[arg-type]

    def status() -> dict[str, Any]:
        found = api.get("virtualmachinemigrations", "move", "ns")
        assert found is not None
        return dict(found["status"])

    def add_condition(name: str, *condition: Any) -> dict[str, Any]:
        pod = api.get("pods", name, "ns")
        assert pod is not None
        pod["status"].setdefault("conditions", [])
        with_condition(pod, *condition)
        api.patch("pods", name, {"status": pod["status"]}, "ns", subresource="status")
        return pod

    assert await MigrationReconciler().reconcile(ctx, "ns", "move") is not None
    assert status()["phase"] == "Preparing"
    target = status()["targetPod"]
    pod = api.get("pods", target, "ns")
    assert pod is not None and pod["spec"]["nodeName"] == "hv-2"
    # The target's provider is ready; a fresh reconciler (a restarted controller) goes on.
    add_condition(target, TARGET_CONDITION, "True", "Ready", ENDPOINT)
    await MigrationReconciler().reconcile(ctx, "ns", "move")
    assert status()["phase"] == "Migrating"
    annotated = api.get("pods", "db-abcde", "ns")
    assert annotated is not None
    assert json.loads(annotated["metadata"]["annotations"][MIGRATE_TO]) == ENDPOINT
    report = {"downtimeMilliseconds": 19, "totalMilliseconds": 700, "target": HERE}
    add_condition("db-abcde", MIGRATION_CONDITION, "True", "Completed", report)
    assert await MigrationReconciler().reconcile(ctx, "ns", "move") is None
    assert status()["phase"] == "Succeeded" and status()["downtimeMilliseconds"] == 19
    # The source is deleted (gracefully: its QEMU stops), the target stays.
    deleted = api.get("pods", "db-abcde", "ns")
    assert deleted is None or deleted["metadata"].get("deletionTimestamp")
    assert api.get("pods", target, "ns") is not None
    assert ("Normal", "Migrated") in events.seen
    assert _created(api) == 1
    # Finished: nothing more happens.
    assert await MigrationReconciler().reconcile(ctx, "ns", "move") is None
    assert _created(api) == 1


def test_the_reconciler_watches_its_resource_and_the_pods_that_name_it() -> None:
    reconciler = MigrationReconciler()
    assert reconciler.resource is VirtualMachineMigration
    target = msgspec.convert(target_pod(), Watched)
    assert list(reconciler.keys_for_pod(target)) == [("ns", "move")]


def test_a_vm_pod_that_arrived_by_an_earlier_migration_can_move_again() -> None:
    arrived = source_pod()
    arrived["metadata"]["annotations"][MIGRATION_SOURCE] = "db-gone1"  # its source ended
    step = decide(migration(), VM, [arrived], NODES)
    assert step.create is not None and step.status["sourcePod"] == "db-abcde"
    assert step.create["metadata"]["annotations"][MIGRATION_SOURCE] == "db-abcde"


def _arrived(pods: list[Any]) -> None:
    pods[1]["status"]["conditions"] = [
        {"type": TARGET_CONDITION, "status": "False", "reason": "Completed", "message": "here"}
    ]


def test_the_targets_word_that_the_vm_arrived_wins_over_a_source_that_lost_track() -> None:
    """A source whose agent or QEMU went away after the switchover may report Failed (or
    nothing, its conditions lost with the agent): the guest runs at the target, so the
    migration succeeded and the source is deleted, never the target."""
    for outcome in ("Failed", None):
        state, pods = _migrating("Failed", {"error": "the source QEMU ended"})
        if outcome is None:
            pods[0]["status"]["conditions"] = []
        _arrived(pods)
        step = decide(state, VM, pods, NODES)
        assert step.status["phase"] == "Succeeded", outcome
        assert step.delete == ["db-abcde"]


def test_a_target_that_arrived_waits_for_the_source_still_sending_its_history() -> None:
    state, pods = _migrating("Running", {"phase": "migrating", "progress": 99})
    _arrived(pods)
    step = decide(state, VM, pods, NODES)
    assert step.status["phase"] not in ("Succeeded", "Failed") and not step.delete


def test_each_target_pod_gets_its_own_token_never_the_sources_old_one() -> None:
    source = source_pod()
    source["metadata"]["annotations"][MIGRATION_TOKEN] = TOKEN
    first = decide(migration(), VM, [source], NODES).create
    second = decide(migration(), VM, [source], NODES).create
    assert first is not None and second is not None
    tokens = {p["metadata"]["annotations"][MIGRATION_TOKEN] for p in (first, second)}
    assert len(tokens) == 2 and TOKEN not in tokens and all(len(t) == 64 for t in tokens)


# -- the VM keeps its address (issue 26) ---------------------------------------------------------
ADDRESS = "vm.vkubelet.io/address"


def test_the_target_asks_for_the_source_s_address() -> None:
    source = source_pod()
    source["status"]["podIP"] = "10.224.1.5"
    step = decide(migration(), VM, [source], NODES)
    assert step.create is not None
    assert step.create["metadata"]["annotations"][ADDRESS] == "10.224.1.5"


def test_a_target_node_that_refuses_the_address_fails_the_migration_naming_it() -> None:
    waiting = {"reason": "AddressOutOfRange", "message": "address 10.224.1.5 is outside"}
    refused = target_pod(containerStatuses=[{"name": "vm", "state": {"waiting": waiting}}])
    step = decide(migration(sourcePod="db-abcde"), VM, [source_pod(), refused], NODES)
    assert step.status["phase"] == "Failed"
    assert step.status["reason"] == "AddressRefused"
    assert step.status["message"] == (
        "node hv-2 cannot take the VM's address: AddressOutOfRange: address 10.224.1.5 is outside"
    )
    assert step.delete == ["db-fghij"]
