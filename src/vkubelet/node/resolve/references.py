"""Which API objects a pod reads: what the agent loads and watches for it.

`referenced_objects` is what resolution reads (ConfigMaps and Secrets); `pass_through_references`
is what a pass-through provider gets instead of resolved values: every object the pod names that
the Node authorizer lets this node read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .jsonvalues import obj, seq, text
from .sources import JSON

Kind = Literal["ConfigMap", "Secret", "ServiceAccount", "PersistentVolumeClaim"]
Reference = tuple[Kind, str, str]  # (kind, namespace, name)


ObjectRef = tuple[Literal["ConfigMap", "Secret"], str, str]


@dataclass
class _Refs:
    namespace: str
    found: set[Any] = field(default_factory=set)

    def add(self, kind: Kind, name: Any) -> None:
        if isinstance(name, str) and name:
            self.found.add((kind, self.namespace, name))


def referenced_objects(
    pod: JSON, *, include_env: bool = True, include_volumes: bool = True
) -> set[ObjectRef]:
    """The ConfigMaps and Secrets `pod` reads, as (kind, namespace, name).

    When one of them changes, the agent re-resolves and tells the provider. Note the kubelet's
    own semantics: volume contents follow changes while the pod runs, but a container's
    environment is fixed when it starts; pass `include_env=False` to watch only what can be
    updated live. Service links also depend on the namespace's Services, which are not listed.
    """
    spec = obj(pod.get("spec"))
    refs = _Refs(text(obj(pod.get("metadata")).get("namespace")))
    if include_env:
        for key in ("initContainers", "containers", "ephemeralContainers"):
            for container in (obj(c) for c in seq(spec.get(key))):
                for source in (obj(s) for s in seq(container.get("envFrom"))):
                    refs.add("ConfigMap", obj(source.get("configMapRef")).get("name"))
                    refs.add("Secret", obj(source.get("secretRef")).get("name"))
                for var in (obj(v) for v in seq(container.get("env"))):
                    value_from = obj(var.get("valueFrom"))
                    refs.add("ConfigMap", obj(value_from.get("configMapKeyRef")).get("name"))
                    refs.add("Secret", obj(value_from.get("secretKeyRef")).get("name"))
    if include_volumes:
        for volume in (obj(v) for v in seq(spec.get("volumes"))):
            refs.add("ConfigMap", obj(volume.get("configMap")).get("name"))
            refs.add("Secret", obj(volume.get("secret")).get("secretName"))
            for projection in (obj(p) for p in seq(obj(volume.get("projected")).get("sources"))):
                refs.add("ConfigMap", obj(projection.get("configMap")).get("name"))
                refs.add("Secret", obj(projection.get("secret")).get("name"))
    found: set[ObjectRef] = refs.found
    return found


def pass_through_references(pod: JSON) -> set[Reference]:
    """Everything `pod` names that a provider forwarding it to another cluster must copy there:
    its ConfigMaps and Secrets (env, envFrom, volumes, projections, imagePullSecrets), its
    ServiceAccount and its PersistentVolumeClaims (including those of ephemeral volumes, which
    are named `<pod>-<volume>`). These are exactly what the Node authorizer lets a node read.
    """
    meta = obj(pod.get("metadata"))
    spec = obj(pod.get("spec"))
    refs = _Refs(text(meta.get("namespace")))
    refs.found.update(referenced_objects(pod))
    for secret in (obj(s) for s in seq(spec.get("imagePullSecrets"))):
        refs.add("Secret", secret.get("name"))
    account = text(spec.get("serviceAccountName")) or text(spec.get("serviceAccount"))
    refs.add("ServiceAccount", account or "default")
    for volume in (obj(v) for v in seq(spec.get("volumes"))):
        refs.add("PersistentVolumeClaim", obj(volume.get("persistentVolumeClaim")).get("claimName"))
        if isinstance(volume.get("ephemeral"), dict):
            refs.add(
                "PersistentVolumeClaim", f"{text(meta.get('name'))}-{text(volume.get('name'))}"
            )
    found: set[Reference] = refs.found
    return found
