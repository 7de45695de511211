"""Building a node's provider from its spec, and the event sink every provider reports through.

A factory that fails is a configuration error that must stop the start loudly, naming the
provider given; the agent builds every provider before it connects anywhere.
"""

from __future__ import annotations

import functools
import logging

from ..kube import EventRecorder, ObjectRef
from ..node import (
    NodeFleet,
    NodeSpec,
    PodLifecycleHandler,
    ProviderContext,
    ProviderLoadError,
    load_provider,
    provider_label,
)
from ..sdk.provider import EventType, Pod

log = logging.getLogger(__name__)

# Looking a provider up scans every installed distribution's entry points (tens of ms, hundreds
# on a loaded host): once per name, not once per node of a large config or per sharded claim.
_load_provider = functools.lru_cache(maxsize=64)(load_provider)


class NodeEventRouter:
    """The `EventSink` of every provider of the process: a pod's events go to the recorder of
    the node it is bound to (`spec.nodeName`), a node's to that node's recorder, so that a fleet's
    members share one sink and everything is rate-limited with the agent's own events."""

    def __init__(self) -> None:
        self._recorders: dict[str, EventRecorder] = {}

    def add(self, node_name: str, recorder: EventRecorder) -> None:
        self._recorders[node_name] = recorder

    def remove(self, node_name: str) -> None:
        self._recorders.pop(node_name, None)

    def pod_event(self, pod: Pod, type: EventType, reason: str, message: str) -> None:
        meta, spec = pod.metadata, pod.spec
        node = spec.nodeName if spec is not None else None
        recorder = self._recorders.get(node or "")
        if recorder is None or meta is None:
            log.debug("event %s for a pod of no node of ours (%s) dropped", reason, node)
            return
        ref = ObjectRef("Pod", meta.namespace or "default", meta.name or "", meta.uid or "")
        recorder.emit(ref, type, reason, message)

    def node_event(self, node_name: str, type: EventType, reason: str, message: str) -> None:
        recorder = self._recorders.get(node_name)
        if recorder is None:
            log.debug("event %s for unknown node %s dropped", reason, node_name)
            return
        # Node events live in "default", with the node's name as UID, as the kubelet's do.
        recorder.emit(ObjectRef("Node", "default", node_name, node_name), type, reason, message)


def build_provider(spec: NodeSpec, events: NodeEventRouter) -> PodLifecycleHandler | NodeFleet:
    """The provider of one configured node (or fleet); ProviderLoadError says what went wrong.

    A provider given as module or file gets a short name (`spec.settings.provider`, used in the
    node's taint and nodeInfo) from its module or file name.
    """
    given = spec.settings.provider
    factory = _load_provider(given)
    spec.settings.provider = provider_label(given)
    try:
        built = factory(
            ProviderContext(
                node_name=spec.settings.name,
                config_path=spec.provider_config,
                internal_ip=spec.settings.internal_ip,
                kubelet_port=spec.settings.kubelet_port,
                events=events,
            )
        )
    except ProviderLoadError:
        raise
    except Exception as e:
        raise ProviderLoadError(
            f"node {spec.settings.name}: provider {given!r}: its factory raised "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(built, PodLifecycleHandler | NodeFleet):
        raise ProviderLoadError(
            f"node {spec.settings.name}: provider {given!r}: its factory returned a "
            f"{type(built).__name__}, neither a PodLifecycleHandler nor a NodeFleet"
        )
    return built
