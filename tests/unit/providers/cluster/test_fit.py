"""The aggregate node's honesty check: does a pod fit some single lower node of a snapshot, and
what is the most free on one node. Then the provider refusing such a pod at create, tainting
its node for a back-off so that the pod's replacement is not bound to it again at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Node, Pod

from vkubelet.providers.cluster._fit import NodeUsage, fit_verdict, largest_free
from vkubelet.sdk import EventType, ProviderError, ResolvedPod

from .fakes import node, pod, resolved, scripted

JSON = dict[str, Any]


# 8 CPUs free as 2+2+2+2 (each 4-CPU node runs a 2-CPU pod).
FOUR = [node(f"n{i}", "4") for i in range(4)]
BUSY = [pod("2", f"n{i}") for i in range(4)]


def test_a_pod_larger_than_every_single_node_does_not_fit_and_the_lacking_resource_is_named() -> (
    None
):
    misfit = fit_verdict(pod("3"), FOUR, BUSY)
    assert misfit is not None
    assert misfit.lacking == ("cpu",)
    assert misfit.message == "0/4 nodes can take it: 4 Insufficient cpu"
    assert fit_verdict(pod("2"), FOUR, BUSY) is None


def test_the_largest_free_per_resource_is_that_of_one_node_not_the_sum() -> None:
    free = largest_free(FOUR, [*BUSY[:3]])
    assert free["cpu"] == "4"  # n3 is empty
    assert largest_free(FOUR, BUSY)["cpu"] == "2"
    assert largest_free(FOUR, BUSY)["pods"] == "9"


def test_the_running_usage_follows_pods_as_they_are_bound_finish_and_go() -> None:
    usage = NodeUsage()
    pending = pod("2")
    usage.put("a", pending)
    assert largest_free(FOUR, usage)["cpu"] == "4", "a pod not bound yet takes no room"
    for i in range(4):
        usage.put(f"busy-{i}", pod("2", f"n{i}"))
    usage.put("a", pod("2", "n0"))  # bound: n0 now runs 4 CPUs' worth
    assert fit_verdict(pod("2"), FOUR, usage) is None
    assert usage.free(FOUR[0])["cpu"] == 0 and usage.free(FOUR[0])["pods"] == 8
    running = pod("2", "n0")
    running["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    usage.put("a", running)  # a status change: the same room
    assert usage.free(FOUR[0])["cpu"] == 0
    usage.put("a", {**running, "status": {"phase": "Succeeded"}})
    assert usage.free(FOUR[0])["cpu"] == 2, "a finished pod takes nothing"
    usage.put("a", running)
    usage.drop("a")
    usage.drop("a")  # twice (a relist, then a late event): no harm
    assert usage.free(FOUR[0]) == {"cpu": 2, "memory": 8 * 2**30, "pods": 9}
    assert largest_free(FOUR, usage) == largest_free(FOUR, BUSY)
    gpu = pod("1", "n1")
    gpu["spec"]["containers"][0]["resources"]["requests"]["example.com/gpu"] = "1"
    usage.put("g", gpu)
    usage.drop("g")
    assert "example.com/gpu" not in largest_free(FOUR, usage), "a resource nobody asks for"


def test_cordoned_nodes_refuse_and_not_ready_ones_are_still_candidates() -> None:
    cordoned = node("big", "64", unschedulable=True)
    not_ready = node(
        "gone", "64", taints=[{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]
    )
    not_ready["status"]["conditions"] = [{"type": "Ready", "status": "Unknown"}]
    misfit = fit_verdict(pod("8"), [cordoned, *FOUR], BUSY)
    assert misfit is not None
    assert "1 node(s) were unschedulable" in misfit.message
    # A lower kubelet's hiccup is no reason to fail a pod: it will fit once the node is back.
    assert fit_verdict(pod("8"), [not_ready, *FOUR], BUSY) is None
    assert largest_free([cordoned, not_ready], []) == {}, "neither has room now"


def test_node_selector_and_required_affinity_decide_which_nodes_count() -> None:
    ssd = node("ssd", "8", labels={"disk": "ssd", "zone": "a"})
    hdd = node("hdd", "8", labels={"disk": "hdd", "zone": "b"})
    assert fit_verdict(pod("4", nodeSelector={"disk": "ssd"}), [ssd, hdd], []) is None
    misfit = fit_verdict(pod("4", nodeSelector={"disk": "nvme"}), [ssd, hdd], [])
    assert misfit is not None and misfit.lacking == ()
    assert "2 node(s) didn't match Pod's node affinity/selector" in misfit.message

    def affinity(operator: str, *values: str) -> JSON:
        term = {"matchExpressions": [{"key": "zone", "operator": operator, "values": [*values]}]}
        return {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }

    assert fit_verdict(pod("4", affinity=affinity("In", "b")), [ssd, hdd], []) is None
    assert fit_verdict(pod("4", affinity=affinity("NotIn", "a", "b")), [ssd, hdd], []) is not None
    # Fits by labels only where the room is lacking: the resource is named.
    misfit = fit_verdict(pod("4", affinity=affinity("In", "a")), [ssd, hdd], [pod("6", "ssd")])
    assert misfit is not None and misfit.lacking == ("cpu",)


def test_a_taint_is_a_refusal_unless_tolerated() -> None:
    tainted = node("gpu", "16", taints=[{"key": "gpu", "value": "yes", "effect": "NoSchedule"}])
    misfit = fit_verdict(pod("8"), [tainted, *FOUR], BUSY)
    assert misfit is not None and "1 node(s) had untolerated taint(s)" in misfit.message
    tolerating = pod("8", tolerations=[{"key": "gpu", "operator": "Equal", "value": "yes"}])
    assert fit_verdict(tolerating, [tainted, *FOUR], BUSY) is None
    assert fit_verdict(pod("8", tolerations=[{"operator": "Exists"}]), [tainted], []) is None


class NodeEvents:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def pod_event(self, pod: Pod, type: EventType, reason: str, message: str) -> None:
        pass

    def node_event(self, node_name: str, type: EventType, reason: str, message: str) -> None:
        self.reasons.append(reason)


def test_a_pod_that_fits_no_single_lower_node_is_refused_and_the_node_tainted_for_a_while(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        writes: list[Any] = []
        events = NodeEvents()
        provider = scripted(tmp_path, None, writes, events)
        provider.capacity.snapshot = {
            "Node": {n["metadata"]["uid"]: n for n in FOUR},
            "Pod": {p["metadata"]["uid"]: p for p in BUSY},
        }
        object.__setattr__(provider.config, "cannot_fit_backoff", 0.3)
        big = resolved()
        raw = msgspec.to_builtins(big.pod)
        raw["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "3"}}
        raw["spec"]["nodeSelector"] = {}
        try:
            try:
                await provider.create_pod(ResolvedPod(msgspec.convert(raw, Pod)))
            except ProviderError as e:
                error = e
            else:
                raise AssertionError("the 3-CPU pod was accepted")
            assert (error.reason, error.permanent) == ("LowerClusterCannotFit", True)
            assert "lacking cpu" in error.message and "4 Insufficient cpu" in error.message
            assert not any(w[1].endswith("/pods") for w in writes), "nothing created below"

            def taints() -> set[str]:
                configured = msgspec.convert(
                    {"metadata": {"name": "vk-lower"}, "spec": {}, "status": {}}, Node
                )
                provider.configure_node(configured)
                assert configured.spec is not None
                return {t.key for t in configured.spec.taints or []}

            assert taints() == {"vkubelet.io/lower-cannot-fit"}
            assert events.reasons == ["LowerClusterCannotFit"]
            await asyncio.sleep(0.4)
            assert taints() == set(), "the taint is short-lived"
        finally:
            await provider.aclose()

    asyncio.run(scenario())
