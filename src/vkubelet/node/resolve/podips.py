"""Which of a pod's and node's IPs the downward API reports, and in which order."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from .jsonvalues import obj, seq, text
from .sources import JSON


def ips_of(pod: JSON, single: str) -> list[str]:
    """The pod's (`single` "podIP") or its node's ("hostIP") IPs as its status records them:
    the list field (`podIPs`), falling back to the single one."""
    status = obj(pod.get("status"))
    ips = [text(obj(entry).get("ip")) for entry in seq(status.get(f"{single}s"))]
    ips = [ip for ip in ips if ip]
    if not ips and text(status.get(single)):
        ips = [text(status.get(single))]
    return ips


def _ip_version(value: str) -> int | None:
    try:
        return ipaddress.ip_address(value).version
    except ValueError:
        return None


def sort_pod_ips(pod_ips: Sequence[str], host_ips: Sequence[str]) -> list[str]:
    """At most one IP per family, the node's primary family first (kubelet sortPodIPs).

    That is what `status.podIP` and `status.podIPs` report in a dual-stack pod: the IP of the
    family the node prefers, whatever order the network plugin returned them in.
    """
    primary = _ip_version(host_ips[0]) if host_ips else None
    order = (6, 4) if primary == 6 else (4, 6)
    result: list[str] = []
    for family in order:
        match = next((ip for ip in pod_ips if _ip_version(ip) == family), None)
        if match is not None:
            result.append(match)
    return result
