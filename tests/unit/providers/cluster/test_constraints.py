"""The constraint webhook's core: constraints for the lower cluster move into one versioned
annotation and come back exactly (`restore(move(x)) == x` over generated pods), `move` is
idempotent, what stays upstairs only targets virtual nodes, and the lower pod is the same whether
the webhook ran or not."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings

from vkubelet.providers.cluster import Owner, PodTranslation, translate_pod
from vkubelet.providers.cluster._constraints import (
    ANNOTATION,
    ConstraintsError,
    VirtualKeys,
    move,
    moved_constraints,
    restore,
)
from vkubelet.sdk.provider import ProviderError

from .strategies import pods

JSON = dict[str, Any]
KEYS = VirtualKeys()


@settings(max_examples=120)
@given(pods())
def test_restore_after_move_gives_back_every_field(pod: JSON) -> None:
    original = copy.deepcopy(pod)
    moved = move(pod)
    assert pod == original, "move must not change its argument"
    assert restore(moved) == original


@settings(max_examples=100)
@given(pods())
def test_move_is_idempotent(pod: JSON) -> None:
    once = move(pod)
    assert move(once) == once


@settings(max_examples=100)
@given(pods())
def test_what_stays_upstairs_only_targets_virtual_nodes(pod: JSON) -> None:
    spec = move(pod)["spec"]
    assert all(KEYS.label(k) for k in spec.get("nodeSelector") or {})
    assert all(KEYS.taint(str(t.get("key", ""))) for t in spec.get("tolerations") or [])
    assert all(KEYS.label(c["topologyKey"]) for c in spec.get("topologySpreadConstraints") or [])
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    for term in (required or {}).get("nodeSelectorTerms") or []:
        assert all(KEYS.label(e["key"]) for e in term.get("matchExpressions") or [])
    # Soft and pod-related terms are not touched.
    original = pod["spec"].get("affinity") or {}
    assert node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") == (
        original.get("nodeAffinity") or {}
    ).get("preferredDuringSchedulingIgnoredDuringExecution")
    assert (spec.get("affinity") or {}).get("podAntiAffinity") == original.get("podAntiAffinity")
    assert spec.get("containers") == pod["spec"]["containers"]
    assert spec.get("priorityClassName") == pod["spec"].get("priorityClassName")


@settings(max_examples=120)
@given(pods())
def test_the_lower_pod_is_the_same_whether_the_webhook_ran_or_not(pod: JSON) -> None:
    how = PodTranslation(
        owner=Owner("up", "vk-1"),
        virtual_labels={"type": "virtual-kubelet", "kubernetes.io/hostname": "vk-1"},
    )
    assert translate_pod(move(pod), how) == translate_pod(pod, how)


def test_a_ssd_selector_moves_while_the_virtual_node_selection_stays() -> None:
    pod = {
        "metadata": {"name": "db", "namespace": "shop"},
        "spec": {
            "nodeSelector": {"disktype": "ssd", "type": "virtual-kubelet"},
            "tolerations": [
                {"key": "virtual-kubelet.io/provider", "operator": "Exists"},
                {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"},
            ],
            "containers": [{"name": "db", "image": "postgres"}],
        },
    }
    moved = move(pod)
    assert moved["spec"]["nodeSelector"] == {"type": "virtual-kubelet"}
    assert moved["spec"]["tolerations"] == [
        {"key": "virtual-kubelet.io/provider", "operator": "Exists"}
    ]
    assert json.loads(moved["metadata"]["annotations"][ANNOTATION]) == {
        "v": 1,
        "nodeSelector": {"disktype": "ssd"},
        "tolerations": [
            [1, {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"}]
        ],
    }


def test_a_required_term_met_by_any_node_leaves_the_upper_pod_unconstrained() -> None:
    required = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [
                    {"key": "type", "operator": "In", "values": ["virtual-kubelet"]}
                ]
            },
            {"matchExpressions": [{"key": "disktype", "operator": "In", "values": ["ssd"]}]},
        ]
    }
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "affinity": {
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
            }
        },
    }
    moved = move(pod)
    assert "affinity" not in moved["spec"]
    assert moved_constraints(moved) == {"v": 1, "requiredNodeAffinity": required}


def test_a_pod_with_nothing_to_move_is_still_marked_as_seen() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"nodeSelector": {"type": "virtual-kubelet"}}}
    moved = move(pod)
    assert moved["metadata"]["annotations"] == {ANNOTATION: '{"v":1}'}
    assert moved["spec"] == pod["spec"]
    assert restore(moved) == pod


def test_extra_keep_keys_stay_upstairs() -> None:
    keys = VirtualKeys().with_extra(["topology.kubernetes.io/region"])
    pod = {
        "metadata": {"name": "p"},
        "spec": {"nodeSelector": {"topology.kubernetes.io/region": "eu", "disktype": "ssd"}},
    }
    assert move(pod, keys)["spec"]["nodeSelector"] == {"topology.kubernetes.io/region": "eu"}


def test_constraints_added_after_a_move_are_moved_on_reinvocation() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"tolerations": [{"key": "a", "operator": "Exists"}]}}
    moved = move(pod)
    moved["spec"]["tolerations"] = [{"key": "b", "operator": "Exists"}]  # a later webhook
    again = move(moved)
    assert "tolerations" not in again["spec"]
    assert restore(again)["spec"]["tolerations"] == [
        {"key": "a", "operator": "Exists"},
        {"key": "b", "operator": "Exists"},
    ]


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("{", "not JSON"),
        ("[]", "expected a JSON object"),
        ('{"v":2}', "version 2 is unknown"),
        ('{"v":1,"x":1}', "unknown field 'x'"),
        ('{"v":1,"nodeSelector":{"a":1}}', "string keys and values"),
        ('{"v":1,"tolerations":[[0]]}', "[index, object]"),
        ('{"v":1,"tolerations":[[1,{}],[0,{}]]}', "must ascend"),
    ],
)
def test_an_unreadable_annotation_is_refused_with_the_reason(raw: str, problem: str) -> None:
    with pytest.raises(ConstraintsError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        restore({"metadata": {"annotations": {ANNOTATION: raw}}, "spec": {}})


def test_a_bound_pod_with_an_unreadable_annotation_fails_rather_than_run_unconstrained() -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "shop", "annotations": {ANNOTATION: '{"v":7}'}},
        "spec": {"containers": [{"name": "app", "image": "busybox"}]},
    }
    with pytest.raises(ProviderError) as raised:
        translate_pod(pod, PodTranslation(owner=Owner("up", "vk-1")))
    assert raised.value.reason == "LowerConstraintsUnreadable"
    assert "version 7 is unknown" in raised.value.message
