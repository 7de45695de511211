"""A compact, immutable record of an API pod, as the agent keeps it for every pod of its node.

A fully decoded lightkube Pod costs about 5.5 KiB of memory; the agent keeps one per pod and looks
at only a few of its fields most of the time. A record keeps the pod's JSON (without
managedFields, about 1.5 KiB) plus those few fields and digests of the parts whose changes matter,
and decodes the full pod only when a sync actually needs it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Pod

_decode_pod = msgspec.json.Decoder(Pod).decode
_encode = msgspec.json.encode


def digest(value: Any) -> bytes:
    return hashlib.blake2b(_encode(value), digest_size=16).digest()


def visible_status(status: dict[str, Any] | None) -> bytes:
    """A digest of the parts of a pod status a user sees; equal digests mean no write is needed.

    Timestamps of conditions are left out (a provider that rebuilds its status each time would
    otherwise cause a write per report); container state, including its times, is kept.
    """
    status = status or {}

    def conditions(items: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
        return sorted(
            (c.get("type"), c.get("status"), c.get("reason"), c.get("message")) for c in items or []
        )

    def containers(items: list[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
        return sorted(
            (
                c.get("name"),
                c.get("ready"),
                c.get("started"),
                c.get("restartCount"),
                _encode(c.get("state") or {}),
                _encode(c.get("lastState") or {}),
            )
            for c in items or []
        )

    return digest(
        (
            status.get("phase"),
            status.get("reason"),
            status.get("message"),
            status.get("podIP"),
            _ips(status.get("podIPs")),
            status.get("hostIP"),
            _normal_time(status.get("startTime")),
            conditions(status.get("conditions")),
            containers(status.get("containerStatuses")),
            containers(status.get("initContainerStatuses")),
        )
    )


def _ips(entries: Any) -> list[Any]:
    return [e.get("ip") if isinstance(e, dict) else e for e in entries or []]


def _normal_time(value: Any) -> Any:
    # The API stores whole seconds; a provider may report fractions. Compare what will be stored.
    return value[:19] if isinstance(value, str) else value


class PodRecord:
    __slots__ = (
        "annotations_digest",
        "deleting",
        "deletion_grace",
        "finalizers",
        "key",
        "labels_digest",
        "name",
        "namespace",
        "phase",
        "raw",
        "resource_version",
        "spec_digest",
        "status_digest",
        "uid",
    )

    def __init__(self, pod: Pod) -> None:
        meta = pod.metadata
        assert meta is not None
        meta.managedFields = None
        self.raw = _encode(pod)
        self.namespace = meta.namespace or ""
        self.name = meta.name or ""
        self.key = f"{self.namespace}/{self.name}"
        self.uid = meta.uid or ""
        self.resource_version = meta.resourceVersion
        self.deleting = meta.deletionTimestamp is not None
        self.deletion_grace = meta.deletionGracePeriodSeconds
        self.finalizers = bool(meta.finalizers)
        self.labels_digest = digest(meta.labels)
        self.annotations_digest = digest(meta.annotations)
        self.spec_digest = digest(pod.spec)
        status = msgspec.to_builtins(pod.status) if pod.status else None
        self.phase: str | None = status.get("phase") if status else None
        self.status_digest = visible_status(status)

    @classmethod
    def from_json(cls, raw: bytes | str) -> PodRecord:
        return cls(_decode_pod(raw))

    @property
    def metadata(self) -> PodRecord:
        """Lets the reflector read `.metadata.name` etc. without decoding the pod."""
        return self

    @property
    def resourceVersion(self) -> str | None:
        return self.resource_version

    @property
    def managedFields(self) -> None:
        return None

    @managedFields.setter
    def managedFields(self, value: object) -> None:
        pass

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def pod(self) -> Pod:
        """The full pod, decoded afresh (callers may modify it)."""
        return _decode_pod(self.raw)

    def spec_or_meta_changed(self, other: PodRecord) -> bool:
        return (
            self.spec_digest != other.spec_digest
            or self.labels_digest != other.labels_digest
            or self.annotations_digest != other.annotations_digest
            or self.uid != other.uid
            or self.deleting != other.deleting
        )
