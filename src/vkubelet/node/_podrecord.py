"""A compact, immutable record of an API pod, as the agent keeps it for every pod of its node.

A fully decoded lightkube Pod costs about 5.5 KiB of memory; the agent keeps one per pod and looks
at only a few of its fields most of the time. A record keeps the pod's JSON (without
managedFields, about 1.5 KiB) plus those few fields and digests of the parts whose changes matter,
and decodes the full pod only when a sync actually needs it.

Records are built for every watch event, so building one is on the agent's hottest path: the
pod's JSON is split at its top level and at its metadata's fields without being parsed further
(msgspec `Raw`), managedFields are dropped there, the spec, labels and annotations are digested
as the bytes the API sent (the apiserver serializes equal objects identically), and only the
status and a handful of small metadata fields are decoded. Decoding into the full model and
encoding it again cost about three times as much.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from lightkube.resources.core_v1 import Pod

_decode_pod = msgspec.json.Decoder(Pod).decode
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class _Wire(msgspec.Struct):
    """A pod split at its top level; the parts are left as the API's bytes."""

    metadata: dict[str, msgspec.Raw]
    apiVersion: str = "v1"
    kind: str = "Pod"
    spec: msgspec.Raw = msgspec.Raw()  # empty: absent
    status: msgspec.Raw = msgspec.Raw()


_decode_wire = msgspec.json.Decoder(_Wire).decode
_NULL = msgspec.Raw(b"null")


def digest(value: Any) -> bytes:
    return hashlib.blake2b(_encode(value), digest_size=16).digest()


def _raw_digest(raw: msgspec.Raw | None) -> bytes:
    return hashlib.blake2b(raw if raw else _NULL, digest_size=16).digest()


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

    ephemeral = status.get("ephemeralContainerStatuses")
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
            # Only when there are any: the digests of every other pod stay as they were.
            *([containers(ephemeral)] if ephemeral else []),
        )
    )


def merged_status(current: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`current` with the status `patch` merged in as the pod controller's strategic merge
    patch does, as far as `visible_status` looks: top-level fields replaced, conditions
    replaced by type (the patch clears a reason it leaves out), container statuses by name."""
    merged = {**current, **patch}
    for field, key in _MERGED_LISTS:
        if field in patch:
            entries = {entry.get(key): entry for entry in current.get(field) or []}
            entries.update((entry.get(key), entry) for entry in patch[field] or [])
            merged[field] = list(entries.values())
    return merged


_MERGED_LISTS = (
    ("conditions", "type"),
    ("containerStatuses", "name"),
    ("initContainerStatuses", "name"),
    ("ephemeralContainerStatuses", "name"),
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

    def __init__(self, raw: bytes | str) -> None:
        wire = _decode_wire(raw)
        meta = wire.metadata
        meta.pop("managedFields", None)  # a large share of every pod, of no use to an agent
        field = meta.get
        self.namespace: str = _decode(field("namespace") or b'""')
        self.name: str = _decode(field("name") or b'""')
        self.key = f"{self.namespace}/{self.name}"
        self.uid: str = _decode(field("uid") or b'""')
        self.resource_version: str | None = _decode(field("resourceVersion") or _NULL)
        self.deleting = _decode(field("deletionTimestamp") or _NULL) is not None
        self.deletion_grace: int | None = _decode(field("deletionGracePeriodSeconds") or _NULL)
        self.finalizers = bool(_decode(field("finalizers") or _NULL))
        self.labels_digest = _raw_digest(field("labels"))
        self.annotations_digest = _raw_digest(field("annotations"))
        self.spec_digest = _raw_digest(wire.spec)
        status: dict[str, Any] | None = _decode(wire.status) if wire.status else None
        self.phase: str | None = status.get("phase") if status else None
        self.status_digest = visible_status(status)
        parts: dict[str, Any] = {"kind": wire.kind, "apiVersion": wire.apiVersion, "metadata": meta}
        if wire.spec:
            parts["spec"] = wire.spec
        if wire.status:
            parts["status"] = wire.status
        self.raw = _encode(parts)

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
