"""Docker-link style service variables (pkg/kubelet/envvars, kubelet getServiceEnvVarMap)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from .jsonvalues import obj, seq, text
from .sources import JSON, Sources

# The kubelet's master services: always visible to every pod, from this namespace by default.
DEFAULT_MASTER_SERVICES_NAMESPACE: Final = "default"
_MASTER_SERVICES: Final = frozenset({"kubernetes"})


def _service_prefix(name: str) -> str:
    return name.replace("-", "_").upper()


def _has_cluster_ip(service: JSON) -> bool:
    cluster_ip = text(obj(service.get("spec")).get("clusterIP"))
    return cluster_ip not in ("", "None")


def _join_host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def service_link_variables(services: Sequence[JSON]) -> dict[str, str]:
    """Docker-link style variables for `services` (headless and ExternalName ones are skipped)."""
    result: dict[str, str] = {}
    for service in services:
        if not _has_cluster_ip(service):
            continue
        spec = obj(service.get("spec"))
        cluster_ip = text(spec.get("clusterIP"))
        prefix = _service_prefix(text(obj(service.get("metadata")).get("name")))
        ports = [obj(p) for p in seq(spec.get("ports"))]
        result[f"{prefix}_SERVICE_HOST"] = cluster_ip
        if not ports:  # API validation requires ports; do not crash on a service without any
            continue
        result[f"{prefix}_SERVICE_PORT"] = str(ports[0].get("port", 0))
        for port in ports:
            if text(port.get("name")):
                named = f"{prefix}_SERVICE_PORT_{_service_prefix(text(port['name']))}"
                result[named] = str(port.get("port", 0))
        for index, port in enumerate(ports):
            protocol = text(port.get("protocol")) or "TCP"
            number = str(port.get("port", 0))
            url = f"{protocol.lower()}://{_join_host_port(cluster_ip, number)}"
            if index == 0:
                result[f"{prefix}_PORT"] = url
            port_prefix = f"{prefix}_PORT_{number}_{protocol.upper()}"
            result[port_prefix] = url
            result[f"{port_prefix}_PROTO"] = protocol.lower()
            result[f"{port_prefix}_PORT"] = number
            result[f"{port_prefix}_ADDR"] = cluster_ip
    return result


def linked_services(
    sources: Sources, namespace: str, enable_links: bool, master_namespace: str
) -> list[JSON]:
    """The services a pod sees: the master `kubernetes` service always, plus its own
    namespace's services when service links are enabled (a same-namespace service with the same
    name wins over the master one).

    With links disabled no namespace is listed: the master services are read by name, so a pod
    that opted out costs nothing per Service in the cluster.
    """
    chosen: dict[str, JSON] = {}
    for name in sorted(_MASTER_SERVICES):
        service = sources.get_service(master_namespace, name)
        if service is not None and _has_cluster_ip(service):
            chosen[name] = service
    if enable_links:
        for service in sources.list_services(namespace):
            name = text(obj(service.get("metadata")).get("name"))
            if _has_cluster_ip(service) and (namespace != master_namespace or name not in chosen):
                chosen[name] = service
    return [chosen[name] for name in sorted(chosen)]


def pod_service_env(
    pod: JSON, sources: Sources, master_namespace: str = DEFAULT_MASTER_SERVICES_NAMESPACE
) -> dict[str, str]:
    """The service-link variables every container of `pod` gets (the same for all of them, so
    compute them once per pod). Raises `SourceReadError` if the Services cannot be read."""
    namespace = text(obj(pod.get("metadata")).get("namespace"))
    enable_links = obj(pod.get("spec")).get("enableServiceLinks", True) is not False
    return service_link_variables(
        linked_services(sources, namespace, enable_links, master_namespace)
    )
