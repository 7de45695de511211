"""Which of a pod's and node's IPs the downward API reports, and in which order."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from .jsonvalues import obj, seq, text
from .sources import JSON


def pod_ips_of(pod: JSON) -> list[str]:
    """The pod's IPs from its status (`podIPs`, falling back to `podIP`)."""
    status = obj(pod.get("status"))
    ips = [text(obj(entry).get("ip")) for entry in seq(status.get("podIPs"))]
    ips = [ip for ip in ips if ip]
    if not ips and text(status.get("podIP")):
        ips = [text(status.get("podIP"))]
    return ips


def host_ips_of(pod: JSON) -> list[str]:
    """The node's IPs as recorded in the pod status (`hostIPs`, falling back to `hostIP`)."""
    status = obj(pod.get("status"))
    ips = [text(obj(entry).get("ip")) for entry in seq(status.get("hostIPs"))]
    ips = [ip for ip in ips if ip]
    if not ips and text(status.get("hostIP")):
        ips = [text(status.get("hostIP"))]
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
