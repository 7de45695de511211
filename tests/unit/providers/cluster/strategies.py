"""Generated upper pods with any mix of the constraints the webhook moves: labels and keys that
target virtual nodes or not, affinities, tolerations, spread constraints (hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

JSON = dict[str, Any]

# Keys that target virtual nodes, keys that do not, and odd ones.
label_keys = st.sampled_from(
    [
        "type",
        "kubernetes.io/hostname",
        "kubernetes.io/role",
        "vkubelet.io/cluster",
        "virtual-kubelet.io/provider",
        "disktype",
        "topology.kubernetes.io/zone",
        "node.kubernetes.io/instance-type",
        "kubernetes.io/os",
        "example.com/gpu",
    ]
) | st.from_regex(r"[a-z]{1,6}(\.[a-z]{1,4}/)?[a-z]{1,6}", fullmatch=True)
taint_keys = st.sampled_from(
    [
        "virtual-kubelet.io/provider",
        "vkubelet.io/lower-cannot-fit",
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
        "dedicated",
        "nvidia.com/gpu",
        "example.com/spot",
    ]
)
values = st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True)
value_lists = st.lists(values, min_size=1, max_size=3)


def _maybe(draw: st.DrawFn, key: str, strategy: st.SearchStrategy[Any], holder: JSON) -> None:
    """API form: an omitempty field is absent rather than empty."""
    if draw(st.booleans()):
        value = draw(strategy)
        if value or value == 0:
            holder[key] = value


expression = st.one_of(
    st.fixed_dictionaries(
        {"key": label_keys, "operator": st.sampled_from(["In", "NotIn"]), "values": value_lists}
    ),
    st.fixed_dictionaries(
        {"key": label_keys, "operator": st.sampled_from(["Exists", "DoesNotExist"])}
    ),
    st.fixed_dictionaries(
        {
            "key": label_keys,
            "operator": st.sampled_from(["Gt", "Lt"]),
            "values": st.integers(0, 99).map(lambda n: [str(n)]),
        }
    ),
)
field_expression = st.fixed_dictionaries(
    {
        "key": st.just("metadata.name"),
        "operator": st.sampled_from(["In", "NotIn"]),
        "values": value_lists,
    }
)


@st.composite
def node_selector_terms(draw: st.DrawFn) -> JSON:
    term: JSON = {}
    _maybe(draw, "matchExpressions", st.lists(expression, max_size=3), term)
    _maybe(draw, "matchFields", st.lists(field_expression, max_size=2), term)
    return term


@st.composite
def tolerations(draw: st.DrawFn) -> JSON:
    operator = draw(st.sampled_from(["Exists", "Equal", None]))
    toleration: JSON = {}
    if operator == "Exists":
        _maybe(draw, "key", taint_keys, toleration)  # no key: tolerates every taint
    else:
        toleration["key"] = draw(taint_keys)
        _maybe(draw, "value", values, toleration)
    if operator is not None:
        toleration["operator"] = operator
    _maybe(
        draw, "effect", st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"]), toleration
    )
    if toleration.get("effect") == "NoExecute":
        _maybe(draw, "tolerationSeconds", st.integers(0, 3600), toleration)
    return toleration


label_selector = st.fixed_dictionaries(
    {},
    optional={
        "matchLabels": st.dictionaries(label_keys, values, min_size=1, max_size=2),
        "matchExpressions": st.lists(
            st.fixed_dictionaries(
                {
                    "key": label_keys,
                    "operator": st.sampled_from(["In", "NotIn"]),
                    "values": value_lists,
                }
            ),
            min_size=1,
            max_size=2,
        ),
    },
)


@st.composite
def spread_constraints(draw: st.DrawFn) -> JSON:
    constraint: JSON = {
        "maxSkew": draw(st.integers(1, 3)),
        "topologyKey": draw(label_keys),
        "whenUnsatisfiable": draw(st.sampled_from(["DoNotSchedule", "ScheduleAnyway"])),
    }
    _maybe(draw, "labelSelector", label_selector, constraint)
    _maybe(
        draw,
        "matchLabelKeys",
        st.lists(label_keys, min_size=1, max_size=2, unique=True),
        constraint,
    )
    _maybe(draw, "minDomains", st.integers(1, 3), constraint)
    _maybe(draw, "nodeAffinityPolicy", st.sampled_from(["Honor", "Ignore"]), constraint)
    _maybe(draw, "nodeTaintsPolicy", st.sampled_from(["Honor", "Ignore"]), constraint)
    return constraint


@st.composite
def affinities(draw: st.DrawFn) -> JSON:
    node_affinity: JSON = {}
    if draw(st.booleans()):
        terms = draw(st.lists(node_selector_terms(), min_size=1, max_size=3))
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": terms
        }
    _maybe(
        draw,
        "preferredDuringSchedulingIgnoredDuringExecution",
        st.lists(
            st.fixed_dictionaries(
                {"weight": st.integers(1, 100), "preference": node_selector_terms()}
            ),
            max_size=2,
        ),
        node_affinity,
    )
    affinity: JSON = {}
    if node_affinity:
        affinity["nodeAffinity"] = node_affinity
    if draw(st.booleans()):
        affinity["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": draw(label_keys), "labelSelector": draw(label_selector)}
            ]
        }
    return affinity


@st.composite
def pods(draw: st.DrawFn) -> JSON:
    metadata: JSON = {"name": draw(values), "namespace": "shop", "uid": "u-1"}
    _maybe(draw, "labels", st.dictionaries(label_keys, values, max_size=3), metadata)
    _maybe(
        draw, "annotations", st.dictionaries(label_keys, st.text(max_size=8), max_size=2), metadata
    )
    spec: JSON = {"containers": [{"name": "app", "image": "busybox"}]}
    _maybe(draw, "nodeSelector", st.dictionaries(label_keys, values, max_size=4), spec)
    _maybe(draw, "affinity", affinities(), spec)
    _maybe(draw, "tolerations", st.lists(tolerations(), max_size=5), spec)
    _maybe(draw, "topologySpreadConstraints", st.lists(spread_constraints(), max_size=3), spec)
    _maybe(draw, "priorityClassName", st.just("high"), spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
