"""Upper pod -> lower pod: the workload's meaning kept, references never resolved, the virtual
node's own scheduling terms and the upper API's bookkeeping dropped."""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from vkubelet.providers.cluster import (
    NamespaceMapping,
    is_ours,
    plan_dependencies,
    pod_references,
    translate_pod,
)
from vkubelet.providers.cluster._stamps import LABEL_OWNER, LABEL_UID
from vkubelet.providers.cluster._translate import ephemeral_containers

from .pods import OTHER, OWNER, TOKEN_MOUNT, how, upper_pod

SUFFIX = "-" + OWNER.key[:8]


def test_the_lower_pod_keeps_containers_probes_resources_and_security() -> None:
    upper = upper_pod()
    lower = translate_pod(upper, how(dependency_names="same"))
    [app] = lower["spec"]["containers"]
    expected = {k: v for k, v in upper["spec"]["containers"][0].items() if k != "volumeMounts"}
    assert {k: v for k, v in app.items() if k != "volumeMounts"} == expected
    assert app["volumeMounts"] == [{"name": "certs", "mountPath": "/certs"}]
    for field in (
        "restartPolicy",
        "terminationGracePeriodSeconds",
        "dnsPolicy",
        "securityContext",
        "enableServiceLinks",
        "topologySpreadConstraints",
        "imagePullSecrets",
    ):
        assert lower["spec"][field] == upper["spec"][field], field
    assert lower["spec"]["initContainers"][0]["name"] == "migrate"


def test_env_and_volumes_stay_references_renamed_to_the_lower_copies() -> None:
    lower = translate_pod(upper_pod(), how())
    spec = lower["spec"]
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["MODE"] == {"name": "MODE", "value": "prod"}
    assert env["COLOR"]["valueFrom"]["configMapKeyRef"] == {
        "name": "web-config" + SUFFIX,
        "key": "color",
    }
    assert env["PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "web-secret" + SUFFIX
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "web-env" + SUFFIX}}]
    assert spec["initContainers"][0]["envFrom"] == [
        {"configMapRef": {"name": "web-config" + SUFFIX}}
    ]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["certs"]["secret"] == {"secretName": "web-tls" + SUFFIX, "defaultMode": 256}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "web-data" + SUFFIX
    assert spec["imagePullSecrets"] == [{"name": "registry-creds" + SUFFIX}]
    assert spec["serviceAccountName"] == "web" + SUFFIX


def test_the_upper_token_volume_is_dropped_so_the_lower_account_mounts_its_own() -> None:
    lower = translate_pod(upper_pod(), how())
    spec = lower["spec"]
    assert not any(v["name"].startswith("kube-api-access-") for v in spec["volumes"])
    for container in spec["containers"] + spec["initContainers"]:
        assert TOKEN_MOUNT not in container.get("volumeMounts", [])
    assert "serviceAccount" not in spec  # the deprecated alias would name the upper account
    assert "automountServiceAccountToken" not in spec  # the lower account's own default


def test_a_projected_token_the_user_asked_for_is_kept_and_minted_below() -> None:
    vault = {
        "name": "vault-token",
        "projected": {"sources": [{"serviceAccountToken": {"audience": "vault", "path": "t"}}]},
    }
    lower = translate_pod(upper_pod(volumes=[vault]), how())
    assert lower["spec"]["volumes"] == [vault]


def test_without_service_accounts_the_pod_gets_no_token_at_all() -> None:
    lower = translate_pod(upper_pod(), how(service_accounts="none"))
    assert lower["spec"]["serviceAccountName"] == "default"
    assert lower["spec"]["automountServiceAccountToken"] is False


def test_the_default_service_account_is_the_lower_namespaces_own() -> None:
    pod = upper_pod(serviceAccountName="default")
    del pod["spec"]["serviceAccount"]
    assert translate_pod(pod, how())["spec"]["serviceAccountName"] == "default"


def test_upper_bookkeeping_is_dropped_and_owner_stamps_added() -> None:
    upper = upper_pod()
    lower = translate_pod(upper, how(namespaces=NamespaceMapping(prefix="up-")))
    metadata = lower["metadata"]
    assert set(metadata) == {"name", "namespace", "labels", "annotations"}
    assert (metadata["name"], metadata["namespace"]) == ("web-7d9f-abcde", "up-shop")
    assert metadata["labels"]["app"] == "web"
    assert metadata["labels"][LABEL_UID] == upper["metadata"]["uid"]
    assert metadata["annotations"]["team"] == "shop"
    assert metadata["annotations"]["vkubelet.io/upper-namespace"] == "shop"
    assert "status" not in lower
    for field in ("nodeName", "priority", "preemptionPolicy", "schedulerName"):
        assert field not in lower["spec"]
    assert is_ours(lower, OWNER) and not is_ours(lower, OTHER)


def test_stamps_forged_on_the_upper_pod_are_replaced() -> None:
    pod = upper_pod()
    pod["metadata"]["labels"][LABEL_OWNER] = OTHER.key
    pod["metadata"]["annotations"]["vkubelet.io/upper-cluster"] = OTHER.cluster_id
    lower = translate_pod(pod, how())
    assert is_ours(lower, OWNER) and not is_ours(lower, OTHER)


def test_terms_that_only_select_the_virtual_node_are_dropped_the_rest_kept() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "type", "operator": "In", "values": ["virtual-kubelet"]},
                            {"key": "zone", "operator": "In", "values": ["a", "b"]},
                        ],
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": ["vk-lower"]}
                        ],
                    }
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "preference": {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["x"]}
                        ]
                    },
                },
                {
                    "weight": 5,
                    "preference": {"matchExpressions": [{"key": "disk", "operator": "Exists"}]},
                },
            ],
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app": "web"}},
                    },
                }
            ]
        },
    }
    lower = translate_pod(upper_pod(affinity=affinity), how())
    spec = lower["spec"]
    assert spec["nodeSelector"] == {"disktype": "ssd"}
    assert [t["key"] for t in spec["tolerations"]] == ["node.kubernetes.io/not-ready", "gpu"]
    node = spec["affinity"]["nodeAffinity"]
    assert node["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}
        ]
    }
    assert node["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 5, "preference": {"matchExpressions": [{"key": "disk", "operator": "Exists"}]}}
    ]
    assert spec["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]


def test_a_required_term_met_by_the_virtual_node_alone_leaves_the_lower_scheduler_free() -> None:
    # Terms are ORed and an empty term matches nothing: keeping `zone` alone would forbid what
    # the first term allowed.
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "type", "operator": "In", "values": ["virtual-kubelet"]}
                        ]
                    },
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                ]
            }
        }
    }
    lower = translate_pod(
        upper_pod(affinity=affinity, nodeSelector={"type": "virtual-kubelet"}), how()
    )
    assert "affinity" not in lower["spec"]
    assert "nodeSelector" not in lower["spec"]


def test_a_selector_on_a_label_the_lower_nodes_publish_is_kept() -> None:
    # `topology.kubernetes.io/region` came up from the lower nodes: it is not virtual-only.
    pod = upper_pod(nodeSelector={"topology.kubernetes.io/region": "eu", "type": "virtual-kubelet"})
    lower = translate_pod(pod, how())
    assert lower["spec"]["nodeSelector"] == {"topology.kubernetes.io/region": "eu"}


def test_upper_only_fields_are_not_sent_down() -> None:
    pod = upper_pod(
        readinessGates=[{"conditionType": "example.com/lb"}],
        ephemeralContainers=[{"name": "debug", "image": "busybox"}],
        overhead={"cpu": "10m"},
        priorityClassName="high",
    )
    spec = translate_pod(pod, how())["spec"]
    for field in ("readinessGates", "ephemeralContainers", "overhead", "priorityClassName"):
        assert field not in spec


def test_ephemeral_containers_go_down_with_their_references_renamed() -> None:
    debug = {
        "name": "debug",
        "image": "busybox",
        "stdin": True,
        "tty": True,
        "targetContainerName": "app",
        "env": [{"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "pw"}}}],
    }
    down = ephemeral_containers(upper_pod(ephemeralContainers=[debug]), how())
    ref = down[0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref["name"] != "creds" and ref["key"] == "pw"  # the lower copy's name
    assert {k: v for k, v in down[0].items() if k != "env"} == {
        k: v for k, v in debug.items() if k != "env"
    }
    assert ephemeral_containers(upper_pod(), how()) == []


# -- properties -----------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9-]{0,12}[a-z0-9]", fullmatch=True)
# Distinctive secret values: long enough that a coincidental match with pod text is impossible.
secret_values = st.text(min_size=12, max_size=40).map(lambda s: "S3CR3T:" + s)


@st.composite
def pods_with_secrets(draw: st.DrawFn) -> tuple[dict[str, Any], dict[Any, Any], list[str]]:
    secret_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    secrets: dict[Any, Any] = {}
    values: list[str] = []
    for name in secret_names:
        data = draw(st.dictionaries(names, secret_values, min_size=1, max_size=3))
        values += data.values()
        secrets[("Secret", "shop", name)] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": "shop",
                "uid": "u-" + name,
                "resourceVersion": "1",
            },
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }

    def secret_ref() -> str:
        return draw(st.sampled_from(secret_names))

    env = [
        {"name": f"E{i}", "valueFrom": {"secretKeyRef": {"name": secret_ref(), "key": "k"}}}
        for i in range(draw(st.integers(0, 4)))
    ]
    env_from = [{"secretRef": {"name": secret_ref()}} for _ in range(draw(st.integers(0, 2)))]
    volumes = [
        {"name": f"s{i}", "secret": {"secretName": secret_ref()}}
        for i in range(draw(st.integers(0, 2)))
    ] + [
        {
            "name": f"p{i}",
            "projected": {"sources": [{"secret": {"name": secret_ref()}}]},
        }
        for i in range(draw(st.integers(0, 2)))
    ]
    pulls = [{"name": secret_ref()} for _ in range(draw(st.integers(0, 2)))]
    container = {"name": "app", "image": "img", "env": env, "envFrom": env_from}
    pod = upper_pod(
        containers=[container],
        initContainers=[dict(container, name="init")],
        volumes=volumes,
        imagePullSecrets=pulls,
    )
    return pod, secrets, values


@settings(max_examples=150, deadline=None)
@given(pods_with_secrets(), st.sampled_from(["same", "suffixed"]))
def test_no_secret_value_reaches_the_lower_pod_spec(
    case: tuple[dict[str, Any], dict[Any, Any], list[str]], naming: str
) -> None:
    pod, secrets, values = case
    translation = how(dependency_names=naming)
    lower = translate_pod(pod, translation)
    plan = plan_dependencies([pod], secrets, {}, translation)
    text = json.dumps(lower)
    for value in values:
        encoded = base64.b64encode(value.encode()).decode()
        assert value not in text and encoded not in text
        assert json.dumps(value)[1:-1] not in text
    # The values go only into the lower Secrets, never into anything else the plan writes.
    for obj in plan.create:
        if obj["kind"] != "Secret":
            assert not any(base64.b64encode(v.encode()).decode() in json.dumps(obj) for v in values)
    # Every secret the pod references is planned as a stamped lower copy, nothing unreferenced.
    referenced = {r.name for r in pod_references(pod["spec"]) if r.kind == "Secret"}
    created = {o["metadata"]["annotations"]["vkubelet.io/upper-name"] for o in plan.create}
    assert created == referenced


containers = st.fixed_dictionaries(
    {
        "name": names,
        "image": st.sampled_from(["busybox", "registry.example/app:2", "nginx@sha256:" + "a" * 64]),
    },
    optional={
        "command": st.lists(st.text(max_size=10), max_size=3),
        "args": st.lists(st.text(max_size=10), max_size=3),
        "workingDir": st.just("/srv"),
        "env": st.lists(
            st.fixed_dictionaries({"name": names, "value": st.text(max_size=10)}), max_size=3
        ),
        "ports": st.lists(
            st.fixed_dictionaries({"containerPort": st.integers(1, 65535)}), max_size=2
        ),
        "resources": st.fixed_dictionaries(
            {},
            optional={
                "requests": st.fixed_dictionaries({"cpu": st.sampled_from(["100m", "1", "2500m"])}),
                "limits": st.fixed_dictionaries({"memory": st.sampled_from(["64Mi", "1Gi"])}),
            },
        ),
        "livenessProbe": st.fixed_dictionaries(
            {"exec": st.fixed_dictionaries({"command": st.lists(st.text(max_size=5), min_size=1)})},
            optional={"periodSeconds": st.integers(1, 60)},
        ),
        "readinessProbe": st.fixed_dictionaries(
            {"tcpSocket": st.fixed_dictionaries({"port": st.integers(1, 65535)})}
        ),
        "startupProbe": st.fixed_dictionaries(
            {"httpGet": st.fixed_dictionaries({"path": st.just("/"), "port": st.integers(1, 9)})}
        ),
        "securityContext": st.fixed_dictionaries(
            {}, optional={"runAsUser": st.integers(0, 65535), "privileged": st.booleans()}
        ),
        "lifecycle": st.just({"preStop": {"exec": {"command": ["sleep", "1"]}}}),
        "stdin": st.booleans(),
        "tty": st.booleans(),
    },
)
KEPT_SPEC_FIELDS = {
    "containers": st.lists(containers, min_size=1, max_size=3),
    "initContainers": st.lists(containers, max_size=2),
    "restartPolicy": st.sampled_from(["Always", "OnFailure", "Never"]),
    "activeDeadlineSeconds": st.integers(1, 10**6),
    "terminationGracePeriodSeconds": st.integers(0, 3600),
    "securityContext": st.fixed_dictionaries({}, optional={"fsGroup": st.integers(0, 9999)}),
    "hostname": names,
    "subdomain": names,
    "dnsPolicy": st.sampled_from(["ClusterFirst", "Default", "None"]),
    "dnsConfig": st.just({"nameservers": ["10.0.0.10"]}),
    "hostAliases": st.just([{"ip": "10.1.1.1", "hostnames": ["db"]}]),
    "runtimeClassName": names,
    "shareProcessNamespace": st.booleans(),
    "enableServiceLinks": st.booleans(),
    "topologySpreadConstraints": st.just(
        [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]
    ),
    "volumes": st.just([{"name": "scratch", "emptyDir": {"medium": "Memory"}}]),
    "automountServiceAccountToken": st.booleans(),
}


@settings(max_examples=150, deadline=None)
@given(st.fixed_dictionaries({}, optional=KEPT_SPEC_FIELDS))
def test_translation_keeps_every_field_of_the_workload(fields: dict[str, Any]) -> None:
    pod = upper_pod()
    pod["spec"] = {"containers": pod["spec"]["containers"], "nodeName": "vk-lower", **fields}
    lower = translate_pod(pod, how(dependency_names="same"))
    for field, value in fields.items():
        assert lower["spec"][field] == value, field
