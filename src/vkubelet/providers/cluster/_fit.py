"""Does a pod fit some single lower node? The aggregate node's honesty check.

The virtual node's allocatable is a sum over the lower nodes, so the upper scheduler may bind a
pod that no single lower node can take (8 free CPUs as 2+2+2+2 and a 3-CPU pod). Left alone,
such a pod stays Pending below forever. This module answers, from a cached snapshot of the lower
nodes and pods (the capacity loop's watch caches), whether the lower scheduler could place the
pod, checking what decides that for most pods: resource requests against each node's free room,
nodeSelector, required node affinity, taints against tolerations, cordons. A node that is
merely not ready counts as a candidate (with the room it has): that passes, and refusing a pod
for it would fail pods during a lower kubelet's hiccup. Pod
(anti-)affinity, topology spread and volume topology are not checked: a pod failing on those
stays Pending below with the lower scheduler's reason, as before.

It also computes, per resource, the largest amount free on any one node (published on the
virtual node as an annotation) so users and tools can see the fragmentation.

Pure: the provider feeds it the snapshot; a stale snapshot errs for seconds at most.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ...sdk.scheduling import term_matches, tolerates
from ._capacity import _value, format_quantity, pod_requests

__all__ = ["Misfit", "NodeUsage", "fit_verdict", "largest_free"]

_TERMINAL = {"Succeeded", "Failed"}
_BLOCKING_EFFECTS = {"NoSchedule", "NoExecute"}
# A node that is not ready (and the taints its node-lifecycle controller adds for that) is a
# passing state: the lower scheduler places the pod once it is back, so it does not refuse.
_TRANSIENT_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


@dataclass(frozen=True)
class Misfit:
    """Why no lower node takes the pod: the scheduler-style summary, and the resources that
    were lacking on nodes that passed every other check (empty when none was about resources)."""

    message: str
    lacking: tuple[str, ...]


class NodeUsage:
    """Per lower node, what its non-terminal pods request (one `pods` each), kept pod by pod as
    the snapshot changes. The fit check runs on every pod create: summing the requests of the
    whole snapshot each time made a 1,000-pod burst quadratic (14 % of the agent's CPU)."""

    def __init__(self, pods: Iterable[tuple[str, Mapping[str, Any]]] = ()) -> None:
        # pod key -> (its node, its spec as last seen, what it takes there)
        self._pods: dict[str, tuple[str, Any, dict[str, Fraction]]] = {}
        self._nodes: dict[str, dict[str, Fraction]] = defaultdict(lambda: defaultdict(Fraction))
        for key, pod in pods:
            self.put(key, pod)

    def put(self, key: str, pod: Mapping[str, Any]) -> None:
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in _TERMINAL:
            self.drop(key)
            return
        known = self._pods.get(key)
        if known is not None and known[0] == node and known[1] == spec:
            return  # a status change (most events): the same room taken
        self.drop(key)
        used = dict(pod_requests(pod))
        used["pods"] = used.get("pods", Fraction(0)) + 1
        self._pods[key] = (str(node), spec, used)
        totals = self._nodes[str(node)]
        for resource, value in used.items():
            totals[resource] += value

    def drop(self, key: str) -> None:
        known = self._pods.pop(key, None)
        if known is None:
            return
        totals = self._nodes[known[0]]
        for resource, value in known[2].items():
            totals[resource] -= value
            if not totals[resource]:
                del totals[resource]  # as if never requested (`largest_free` lists no 0)

    def free(self, node: Mapping[str, Any]) -> dict[str, Fraction]:
        """Allocatable minus the requests of every non-terminal pod bound to the node (ours
        too: for the question "would a new pod fit there" every pod takes its room)."""
        free: dict[str, Fraction] = defaultdict(Fraction)
        for resource, value in ((node.get("status") or {}).get("allocatable") or {}).items():
            free[resource] += _value(value)
        name = str((node.get("metadata") or {}).get("name"))
        for resource, value in self._nodes.get(name, {}).items():
            free[resource] -= value
        return dict(free)


def _usage(pods: Iterable[Mapping[str, Any]] | NodeUsage) -> NodeUsage:
    if isinstance(pods, NodeUsage):
        return pods
    return NodeUsage((str(i), pod) for i, pod in enumerate(pods))


def _schedulable(node: Mapping[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def largest_free(
    nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]] | NodeUsage
) -> dict[str, str]:
    """Per resource, the most any single usable lower node has free (never negative). Nodes
    with a NoSchedule/NoExecute taint count too: a pod tolerating it may land there."""
    usage = _usage(pods)
    best: dict[str, Fraction] = {}
    for node in nodes:
        if not _schedulable(node):
            continue
        for resource, value in usage.free(node).items():
            best[resource] = max(best.get(resource, Fraction(0)), max(value, Fraction(0)))
    return {r: format_quantity(v) for r, v in sorted(best.items())}


def fit_verdict(
    pod: Mapping[str, Any],
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]] | NodeUsage,
) -> Misfit | None:
    """None when some lower node could take `pod` (the lower pod as it will be created), else
    why not, in the scheduler's words: `0/3 nodes can take it: 2 Insufficient cpu, 1 node(s)
    didn't match Pod's node affinity/selector`."""
    spec = pod.get("spec") or {}
    wanted = pod_requests(pod)
    usage = _usage(pods)
    reasons: Counter[str] = Counter()
    lacking: set[str] = set()
    count = 0
    for node in nodes:
        count += 1
        why = _node_refuses(spec, node)
        if why is not None:
            reasons[why] += 1
            continue
        free = usage.free(node)
        short = [
            r
            for r, amount in sorted({**wanted, "pods": Fraction(1)}.items())
            if amount > 0 and amount > free.get(r, Fraction(0))
        ]
        if not short:
            return None
        for resource in short:
            reasons[f"Insufficient {resource}"] += 1
        lacking.update(short)
    summary = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
    message = f"0/{count} nodes can take it" + (f": {summary}" if summary else "")
    return Misfit(message=message, lacking=tuple(sorted(lacking)))


def _node_refuses(spec: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    """The first non-resource reason `node` cannot take a pod of `spec` (as the scheduler's
    filters word it), or None."""
    node_spec = node.get("spec") or {}
    if node_spec.get("unschedulable"):
        return "node(s) were unschedulable"
    metadata = node.get("metadata") or {}
    labels: Mapping[str, str] = metadata.get("labels") or {}
    selector: Mapping[str, str] = spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return "node(s) didn't match Pod's node affinity/selector"
    required = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms")
    if required is not None and not any(
        term_matches(t, labels, str(metadata.get("name"))) for t in required
    ):
        return "node(s) didn't match Pod's node affinity/selector"
    tolerations = spec.get("tolerations") or []
    for taint in node_spec.get("taints") or []:
        if taint.get("key") in _TRANSIENT_TAINTS:
            continue
        if taint.get("effect") in _BLOCKING_EFFECTS and not any(
            tolerates(t, taint) for t in tolerations
        ):
            return "node(s) had untolerated taint(s)"
    return None
