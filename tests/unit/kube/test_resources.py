"""A resource's paths: core and grouped kinds, namespaced or not, an object's subresource."""

from __future__ import annotations

from vkubelet.kube import NODES, PODS, Resource, label_selector


def test_paths_of_core_grouped_namespaced_and_cluster_kinds() -> None:
    vms = Resource("vkubelet.io/v1alpha1", "VirtualMachine", "virtualmachines")
    assert PODS.path() == "/api/v1/pods"
    assert PODS.path("ns", "web", "resize") == "/api/v1/namespaces/ns/pods/web/resize"
    assert NODES.path("ignored", "hv-1") == "/api/v1/nodes/hv-1"
    assert vms.path("ns", "db", "status") == (
        "/apis/vkubelet.io/v1alpha1/namespaces/ns/virtualmachines/db/status"
    )


def test_a_label_selector_asks_for_values_or_presence() -> None:
    assert label_selector({"app": "db", "vm.vkubelet.io/name": None}) == (
        "app=db,vm.vkubelet.io/name"
    )
