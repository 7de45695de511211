"""Dependencies follow the pods: created before them, kept current, deleted when unused, and
only ever our own stamped objects touched."""

from __future__ import annotations

from typing import Any

from vkubelet.providers.cluster import plan_dependencies, stamp
from vkubelet.providers.cluster._deps import SOURCE_VERSION

from .pods import OTHER, OWNER, how, upper_pod

JSON = dict[str, Any]
SUFFIX = "-" + OWNER.key[:8]


def upper_object(kind: str, name: str, version: str = "1", **body: Any) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "shop",
            "uid": f"uid-{name}",
            "resourceVersion": version,
            "labels": {"app": "web"},
        },
        **body,
    }


def references(version: str = "1") -> dict[tuple[str, str, str], Any]:
    objects = [
        upper_object("ConfigMap", "web-config", version, data={"color": "blue"}),
        upper_object("Secret", "web-secret", version, type="Opaque", data={"pw": "aHVudGVyMg=="}),
        upper_object("Secret", "web-env", version, type="Opaque", data={}),
        upper_object("Secret", "web-tls", version, type="kubernetes.io/tls", data={}),
        upper_object("Secret", "registry-creds", version, type="kubernetes.io/dockerconfigjson"),
        upper_object("ServiceAccount", "web", version, automountServiceAccountToken=False),
        upper_object(
            "PersistentVolumeClaim",
            "web-data",
            version,
            spec={
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
                "storageClassName": "fast",
                "volumeName": "pv-upstairs",
            },
        ),
    ]
    return {(o["kind"], "shop", o["metadata"]["name"]): o for o in objects}


def lower_key(obj: JSON) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])


def test_every_referenced_object_is_created_below_stamped_and_renamed() -> None:
    plan = plan_dependencies([upper_pod()], references(), {}, how())
    created = {lower_key(o): o for o in plan.create}
    assert set(created) == {
        ("ConfigMap", "shop", "web-config" + SUFFIX),
        ("Secret", "shop", "web-secret" + SUFFIX),
        ("Secret", "shop", "web-env" + SUFFIX),
        ("Secret", "shop", "web-tls" + SUFFIX),
        ("Secret", "shop", "registry-creds" + SUFFIX),
        ("ServiceAccount", "shop", "web" + SUFFIX),
        ("PersistentVolumeClaim", "shop", "web-data" + SUFFIX),
    }
    assert plan.namespaces == {"shop"}
    secret = created[("Secret", "shop", "web-secret" + SUFFIX)]
    assert secret["data"] == {"pw": "aHVudGVyMg=="} and secret["type"] == "Opaque"
    assert secret["metadata"]["annotations"][SOURCE_VERSION] == "1"
    assert secret["metadata"]["annotations"]["vkubelet.io/upper-name"] == "web-secret"
    assert created[("ServiceAccount", "shop", "web" + SUFFIX)] == {
        **created[("ServiceAccount", "shop", "web" + SUFFIX)],
        "automountServiceAccountToken": False,
    }
    claim = created[("PersistentVolumeClaim", "shop", "web-data" + SUFFIX)]["spec"]
    assert claim == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Gi"}},
        "storageClassName": "fast",
    }
    assert not (plan.update or plan.delete or plan.missing or plan.conflicts or plan.blocked)


def test_a_changed_upper_object_updates_the_lower_copy() -> None:
    existing = {
        lower_key(o): o for o in plan_dependencies([upper_pod()], references(), {}, how()).create
    }
    for obj in existing.values():
        obj["metadata"]["resourceVersion"] = "77"
    plan = plan_dependencies([upper_pod()], references("2"), existing, how())
    updated = {lower_key(o) for o in plan.update}
    assert ("ConfigMap", "shop", "web-config" + SUFFIX) in updated
    assert ("PersistentVolumeClaim", "shop", "web-data" + SUFFIX) not in updated  # immutable
    assert all(o["metadata"]["resourceVersion"] == "77" for o in plan.update)
    assert not plan.create
    unchanged = plan_dependencies([upper_pod()], references("1"), existing, how())
    assert not (unchanged.create or unchanged.update or unchanged.replace)


def test_an_immutable_or_retyped_copy_is_replaced() -> None:
    refs = references()
    refs[("ConfigMap", "shop", "web-config")]["immutable"] = True
    existing = {lower_key(o): o for o in plan_dependencies([upper_pod()], refs, {}, how()).create}
    refs = references("2")
    refs[("ConfigMap", "shop", "web-config")]["immutable"] = True
    refs[("Secret", "shop", "web-env")]["type"] = "example.com/other"
    plan = plan_dependencies([upper_pod()], refs, existing, how())
    assert {lower_key(o)[2] for o in plan.replace} == {"web-config" + SUFFIX, "web-env" + SUFFIX}


def test_a_claim_re_created_upstairs_gets_a_new_claim_below_not_the_old_ones_data() -> None:
    existing = {
        lower_key(o): o for o in plan_dependencies([upper_pod()], references(), {}, how()).create
    }
    for obj in existing.values():
        obj["metadata"]["uid"] = "lower-" + obj["metadata"]["name"]
    refs = references("2")
    refs[("ConfigMap", "shop", "web-config")]["metadata"]["uid"] = "uid-re-created"
    refs[("PersistentVolumeClaim", "shop", "web-data")]["metadata"]["uid"] = "uid-re-created"
    plan = plan_dependencies([upper_pod()], refs, existing, how())
    claim = ("PersistentVolumeClaim", "shop", "web-data" + SUFFIX)
    assert [lower_key(o) for o in plan.replace] == [claim]
    assert plan.uids[claim] == "lower-web-data" + SUFFIX  # the old claim, by its UID
    # A ConfigMap is shared by name: its copy is updated in place.
    assert ("ConfigMap", "shop", "web-config" + SUFFIX) in {lower_key(o) for o in plan.update}


def test_copies_no_pod_uses_any_more_are_deleted_but_claims_only_released() -> None:
    existing = {
        lower_key(o): o for o in plan_dependencies([upper_pod()], references(), {}, how()).create
    }
    plan = plan_dependencies([], {}, existing, how())
    assert len(plan.delete) == 6
    assert plan.release == [("PersistentVolumeClaim", "shop", "web-data" + SUFFIX)]
    done = upper_pod()
    done["status"]["phase"] = "Succeeded"
    assert len(plan_dependencies([done], references(), existing, how()).delete) == 6


def test_a_copy_still_used_by_another_pod_is_kept() -> None:
    existing = {
        lower_key(o): o for o in plan_dependencies([upper_pod()], references(), {}, how()).create
    }
    other = upper_pod(volumes=[], imagePullSecrets=[], serviceAccountName="default")
    other["spec"]["containers"][0]["envFrom"] = []
    other["spec"]["containers"][0]["env"] = [
        {"name": "C", "valueFrom": {"configMapKeyRef": {"name": "web-config", "key": "color"}}}
    ]
    other["spec"]["initContainers"] = []
    plan = plan_dependencies([other], references(), existing, how())
    assert ("ConfigMap", "shop", "web-config" + SUFFIX) not in plan.delete
    assert len(plan.delete) == 5


def test_other_owners_and_the_users_objects_are_never_touched() -> None:
    theirs = stamp(
        upper_object("ConfigMap", "web-config"), OTHER, namespace="shop", name="x", uid="u"
    )
    users = upper_object("Secret", "web-secret")
    lower = {
        ("ConfigMap", "shop", "web-config"): theirs,
        ("Secret", "shop", "web-secret"): users,
        ("ConfigMap", "shop", "unrelated"): upper_object("ConfigMap", "unrelated"),
    }
    plan = plan_dependencies([upper_pod()], references(), lower, how(dependency_names="same"))
    assert {c.key for c in plan.conflicts} == {
        ("ConfigMap", "shop", "web-config"),
        ("Secret", "shop", "web-secret"),
    }
    message = next(c.message for c in plan.conflicts if c.key[0] == "ConfigMap")
    assert "owned by virtual node 'vk-lower' of upper cluster 'upper-b'" in message
    assert plan.blocked["shop/web-7d9f-abcde"].startswith("lower ConfigMap shop/web-config")
    touched = [lower_key(o) for o in plan.create + plan.update + plan.replace] + plan.delete
    assert not set(touched) & set(lower)
    # With suffixed names (the default) the same situation has no conflict at all.
    assert not plan_dependencies([upper_pod()], references(), lower, how()).conflicts


def test_a_missing_required_object_blocks_its_pods_and_an_optional_one_does_not() -> None:
    refs = references()
    refs[("ConfigMap", "shop", "web-config")] = None
    refs[("Secret", "shop", "registry-creds")] = None  # imagePullSecrets are optional
    plan = plan_dependencies([upper_pod()], refs, {}, how())
    assert [m.key for m in plan.missing] == [("ConfigMap", "shop", "web-config")]
    assert plan.blocked == {"shop/web-7d9f-abcde": "ConfigMap shop/web-config not found"}


def test_upper_service_account_tokens_are_never_copied() -> None:
    refs = references()
    refs[("Secret", "shop", "web-tls")]["type"] = "kubernetes.io/service-account-token"
    plan = plan_dependencies([upper_pod()], refs, {}, how())
    assert [key for key, _ in plan.refused] == [("Secret", "shop", "web-tls")]
    assert "service-account token" in plan.blocked["shop/web-7d9f-abcde"]
    assert all(o["metadata"]["name"] != "web-tls" + SUFFIX for o in plan.create)


def test_no_service_account_is_copied_when_pods_get_none_or_the_default() -> None:
    plan = plan_dependencies([upper_pod()], references(), {}, how(service_accounts="none"))
    assert all(o["kind"] != "ServiceAccount" for o in plan.create)


def test_the_pvc_storage_class_option_overrides_the_upper_class() -> None:
    default = plan_dependencies([upper_pod()], references(), {}, how(), pvc_storage_class="")
    [claim] = [o for o in default.create if o["kind"] == "PersistentVolumeClaim"]
    assert "storageClassName" not in claim["spec"]
    named = plan_dependencies([upper_pod()], references(), {}, how(), pvc_storage_class="local")
    [claim] = [o for o in named.create if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "local"


def test_objects_without_kind_as_lists_and_watches_deliver_them_are_copied_by_their_key() -> None:
    refs = {
        key: {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
        for key, obj in references().items()
    }
    plan = plan_dependencies([upper_pod()], refs, {}, how())
    kinds = sorted(o["kind"] for o in plan.create)
    assert kinds == [
        "ConfigMap",
        "PersistentVolumeClaim",
        "Secret",
        "Secret",
        "Secret",
        "Secret",
        "ServiceAccount",
    ]
