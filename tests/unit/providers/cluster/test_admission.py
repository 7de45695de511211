"""The constraint webhook's answers, configuration and audit verdicts (sans I/O); the real
apiserver applying them is tests/integration/cluster/test_webhook.py."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings

from vkubelet.node import ConfigError
from vkubelet.providers.cluster._admission import (
    OPT_IN_LABEL,
    ConstraintWebhook,
    json_patch,
)
from vkubelet.providers.cluster._config import parse_lower_config
from vkubelet.providers.cluster._constraints import ANNOTATION, move, restore
from vkubelet.providers.cluster._webhookconfig import WebhookConfig, parse_webhook_config

from .strategies import pods

JSON = dict[str, Any]


def webhook(**config: Any) -> ConstraintWebhook:
    return ConstraintWebhook("vk-1", WebhookConfig(enabled=True, **config), "10.0.0.7")


def review(pod: JSON, namespace: str = "shop", operation: str = "CREATE") -> bytes:
    request = {
        "uid": "r-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": namespace,
        "operation": operation,
        "object": pod,
    }
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return json.dumps(body).encode()


def apply_patch(doc: JSON, ops: list[JSON]) -> JSON:
    """RFC 6902 for the paths json_patch emits (two levels at most)."""
    out = copy.deepcopy(doc)
    for op in ops:
        parts = op["path"].lstrip("/").split("/")
        holder = out
        for part in parts[:-1]:
            holder = holder[part]
        if op["op"] == "remove":
            del holder[parts[-1]]
        elif op["op"] == "add" or parts[-1] in holder:
            holder[parts[-1]] = op["value"]
        else:
            raise AssertionError(f"replace of a missing member: {op}")
    return out


def answer(body: bytes) -> JSON:
    decoded: JSON = json.loads(body)
    assert decoded["apiVersion"] == "admission.k8s.io/v1"
    assert decoded["kind"] == "AdmissionReview"
    response: JSON = decoded["response"]
    assert response["uid"] == "r-1"
    return response


SSD_POD: JSON = {
    "metadata": {"name": "db", "namespace": "shop", "labels": {OPT_IN_LABEL: "enabled"}},
    "spec": {
        "nodeSelector": {"disktype": "ssd", "kubernetes.io/hostname": "vk-1"},
        "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
        "containers": [{"name": "db", "image": "postgres"}],
    },
}


def test_an_opted_in_pod_gets_a_json_patch_moving_its_ssd_selector() -> None:
    response = answer(webhook().review(review(SSD_POD)))
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    patched = apply_patch(SSD_POD, ops)
    assert patched["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "vk-1"}
    assert json.loads(patched["metadata"]["annotations"][ANNOTATION])["nodeSelector"] == {
        "disktype": "ssd"
    }


@settings(max_examples=60)
@given(pods())
def test_the_patch_gives_exactly_what_move_gives(pod: JSON) -> None:
    patched = apply_patch(pod, json_patch(pod, move(pod)))
    assert patched == move(pod)
    assert restore(patched) == pod


@pytest.mark.parametrize(
    ("namespace", "operation", "labels"),
    [
        ("kube-system", "CREATE", {OPT_IN_LABEL: "enabled"}),
        ("shop", "UPDATE", {}),
        ("shop", "CREATE", {OPT_IN_LABEL: "disabled"}),
    ],
)
def test_kube_system_updates_and_opted_out_pods_are_never_patched(
    namespace: str, operation: str, labels: JSON
) -> None:
    pod = copy.deepcopy(SSD_POD)
    pod["metadata"]["labels"] = labels
    response = answer(webhook().review(review(pod, namespace, operation)))
    assert response == {"uid": "r-1", "allowed": True}


def test_an_unreadable_annotation_is_refused_with_its_reason() -> None:
    pod = copy.deepcopy(SSD_POD)
    pod["metadata"]["annotations"] = {ANNOTATION: '{"v":9}'}
    response = answer(webhook().review(review(pod)))
    assert response["allowed"] is False
    assert "version 9 is unknown" in response["status"]["message"]


def test_a_body_that_is_no_admission_review_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not an AdmissionReview"):
        webhook().review(b"{}")


def test_the_configuration_fails_open_excludes_kube_system_and_needs_an_opt_in() -> None:
    config = webhook(timeout_seconds=2).configuration("https://10.0.0.7:10260/mutate", b"PEM")
    assert config["metadata"]["name"] == "vkubelet-constraints-vk-1"
    by_namespace, by_pod = config["webhooks"]
    for hook in (by_namespace, by_pod):
        assert hook["failurePolicy"] == "Ignore"
        assert hook["sideEffects"] == "None"
        assert hook["timeoutSeconds"] == 2
        assert hook["reinvocationPolicy"] == "IfNeeded"
        assert hook["clientConfig"] == {
            "url": "https://10.0.0.7:10260/mutate",
            "caBundle": base64.b64encode(b"PEM").decode(),
        }
        assert hook["rules"][0]["operations"] == ["CREATE"]
        assert {
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["kube-system"],
        } in hook["namespaceSelector"]["matchExpressions"]
    assert {"key": OPT_IN_LABEL, "operator": "In", "values": ["enabled"]} in by_namespace[
        "namespaceSelector"
    ]["matchExpressions"]
    assert by_pod["objectSelector"] == {"matchLabels": {OPT_IN_LABEL: "enabled"}}


def namespace(name: str, opted_in: bool) -> JSON:
    labels = {OPT_IN_LABEL: "enabled"} if opted_in else {}
    return {"metadata": {"name": name, "labels": labels}}


def test_the_audit_names_opted_in_live_pods_without_the_annotation_only() -> None:
    hook = webhook()
    namespaces = {"shop": namespace("shop", True), "other": namespace("other", False)}
    namespaces["kube-system"] = namespace("kube-system", True)

    def pod(ns: str, label: str | None = None, seen: bool = False, phase: str = "Pending") -> JSON:
        metadata: JSON = {"name": "p", "namespace": ns}
        if label:
            metadata["labels"] = {OPT_IN_LABEL: label}
        if seen:
            metadata["annotations"] = {ANNOTATION: '{"v":1}'}
        return {"metadata": metadata, "status": {"phase": phase}}

    message = hook.skipped(pod("shop"), namespaces)
    assert message is not None and "vkubelet-constraints-vk-1" in message
    assert hook.skipped(pod("other", "enabled"), namespaces) is not None
    assert hook.skipped(pod("shop", seen=True), namespaces) is None
    assert hook.skipped(pod("shop", "disabled"), namespaces) is None
    assert hook.skipped(pod("other"), namespaces) is None
    assert hook.skipped(pod("kube-system", "enabled"), namespaces) is None
    assert hook.skipped(pod("shop", phase="Succeeded"), namespaces) is None
    lists = hook.audit_lists(list(namespaces.values()))
    assert [path for path, _ in lists] == ["/api/v1/pods", "/api/v1/namespaces/shop/pods"]


def test_webhook_options_are_checked_naming_the_field(tmp_path: Path) -> None:
    config = parse_webhook_config(
        "lower.yaml",
        {"enabled": True, "port": 9443, "certFile": "w.crt", "keyFile": "w.key"},
        tmp_path,
    )
    assert config.cert_file == tmp_path / "w.crt"
    for raw, problem in [
        ({"port": 0}, "webhook.port"),
        ({"certFile": "a"}, "certFile and keyFile go together"),
        ({"timeoutSeconds": 31}, "webhook.timeoutSeconds"),
        ({"keepKeys": "a"}, "webhook.keepKeys"),
        ({"bogus": 1}, "webhook.bogus: unknown field"),
    ]:
        with pytest.raises(ConfigError, match=problem):
            parse_webhook_config("lower.yaml", raw, tmp_path)
    with pytest.raises(ConfigError, match="mode: aggregate"):
        parse_lower_config(
            {"kubeconfig": "k", "mode": "mirror", "webhook": {"enabled": True}},
            tmp_path / "lower.yaml",
        )
