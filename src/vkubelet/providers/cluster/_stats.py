"""`kubectl top` for the virtual node: the lower kubelets' numbers for our pods, renamed upstairs.

Pure. The provider fetches `/stats/summary` and `/metrics/resource` of each lower node that runs
one of our pods (through the lower apiserver's node proxy) and hands them here with a map from
lower (namespace, name) to the upper pod. Only our pods are kept, under their upper names; the
virtual node's own usage is the sum of theirs, so `kubectl top node` compares what this node runs
with what it offers (its allocatable leaves out other owners' pods too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from ...sdk.metrics import RESOURCE_METRIC_FAMILIES

__all__ = ["UpperRef", "merge_resource_metrics", "merge_summaries"]

JSON = dict[str, Any]
UpperRef = tuple[str, str, str]  # upper (namespace, name, uid)
Renames = Mapping[tuple[str, str], UpperRef]  # lower (namespace, name) -> upper pod

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(\S+))?")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def merge_summaries(
    node_name: str, summaries: Iterable[Mapping[str, Any]], renames: Renames
) -> JSON:
    """One `stats/v1alpha1` Summary for the virtual node from the lower nodes' summaries."""
    pods: list[JSON] = []
    for summary in summaries:
        for pod in summary.get("pods") or []:
            ref = pod.get("podRef") or {}
            upper = renames.get((str(ref.get("namespace")), str(ref.get("name"))))
            if upper is None:
                continue
            namespace, name, uid = upper
            pods.append({**pod, "podRef": {"namespace": namespace, "name": name, "uid": uid}})
    cpu = _sum(pods, "cpu", ("usageNanoCores", "usageCoreNanoSeconds"))
    memory = _sum(pods, "memory", ("usageBytes", "workingSetBytes", "rssBytes"))
    node: JSON = {"nodeName": node_name, "cpu": cpu, "memory": memory}
    starts = [
        str(s["node"]["startTime"]) for s in summaries if (s.get("node") or {}).get("startTime")
    ]
    if starts:
        node["startTime"] = min(starts)
    return {"node": node, "pods": pods}


def _sum(pods: list[JSON], section: str, fields: tuple[str, ...]) -> JSON:
    out: JSON = {}
    times = [str(p[section]["time"]) for p in pods if (p.get(section) or {}).get("time")]
    if times:
        out["time"] = max(times)
    for field in fields:
        values = [p[section][field] for p in pods if field in (p.get(section) or {})]
        out[field] = sum(values)
    return out


def merge_resource_metrics(texts: Iterable[str], renames: Renames) -> str:
    """The kubelet's `/metrics/resource` text for the virtual node from the lower nodes' texts."""
    samples: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    node_cpu = node_memory = 0.0
    newest = 0  # milliseconds: the node's samples are stamped like the newest container's
    for text in texts:
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.fullmatch(line.strip())
            if match is None:
                continue
            family, labels_text, value_text, timestamp = match.groups()
            if not family.startswith(("container_", "pod_")):
                continue
            labels = dict(_LABEL.findall(labels_text or ""))
            upper = renames.get((labels.get("namespace", ""), labels.get("pod", "")))
            if upper is None:
                continue
            labels["namespace"], labels["pod"] = upper[0], upper[1]
            value = float(value_text)
            samples.setdefault(family, []).append((labels, value, timestamp or ""))
            if timestamp and timestamp.isdigit():
                newest = max(newest, int(timestamp))
            if family == "container_cpu_usage_seconds_total":
                node_cpu += value
            elif family == "container_memory_working_set_bytes":
                node_memory += value
    stamp = str(newest) if newest else ""
    samples["node_cpu_usage_seconds_total"] = [({}, node_cpu, stamp)]
    samples["node_memory_working_set_bytes"] = [({}, node_memory, stamp)]
    samples["scrape_error"] = [({}, 0.0, "")]
    lines: list[str] = []
    for family in sorted(samples):
        kind, text = RESOURCE_METRIC_FAMILIES.get(family, ("gauge", family))
        lines.append(f"# HELP {family} [STABLE] {text}")
        lines.append(f"# TYPE {family} {kind}")
        for labels, value, timestamp in samples[family]:
            rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            name = f"{family}{{{rendered}}}" if rendered else family
            lines.append(f"{name} {_number(value)}" + (f" {timestamp}" if timestamp else ""))
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
