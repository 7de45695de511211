"""Downward API field paths (pkg/fieldpath, pkg/apis/core/pods ConvertDownwardAPIFieldLabel):
what `fieldRef` in env vars and downwardAPI volumes read from the pod."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from .jsonvalues import obj, string_map, text
from .podips import sort_pod_ips
from .sources import JSON


class FieldSelectorError(ValueError):
    """A `fieldRef` or `resourceFieldRef` that the kubelet would refuse to resolve."""


_CONVERTIBLE_FIELD_LABELS: Final = frozenset(
    {
        "metadata.annotations",
        "metadata.labels",
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.serviceAccountName",
        "spec.schedulerName",
        "status.phase",
        "status.hostIP",
        "status.hostIPs",
        "status.podIP",
        "status.podIPs",
    }
)
_QUALIFIED_NAME: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN: Final = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_GO_ESCAPES: Final = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def split_subscript(field_path: str) -> tuple[str, str] | None:
    """`metadata.labels['k']` -> ("metadata.labels", "k"); None if not subscripted."""
    if not field_path.endswith("']"):
        return None
    path, sep, key = field_path[:-2].partition("['")
    if not sep or not path:
        return None
    return path, key


def is_qualified_name(value: str) -> bool:
    """Label-key syntax: `[prefix/]name`, the prefix a DNS subdomain, the name <= 63 chars."""
    prefix, slash, name = value.rpartition("/")
    if slash and (
        not prefix or "/" in prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)
    ):
        return False
    return 0 < len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None


def go_quote(value: str) -> str:
    """`value` quoted as Go's `%q` does, which is how the kubelet writes label/annotation values."""
    out = ['"']
    for char in value:
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:  # lone surrogates cannot come out of Go's JSON decoder
            char, code = "\ufffd", 0xFFFD
        if char in '"\\':
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif char in _GO_ESCAPES:
            out.append(_GO_ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def format_map(values: Mapping[str, str]) -> str:
    """Labels or annotations as the downward API writes them: sorted `key="value"` lines."""
    return "\n".join(f"{key}={go_quote(values[key])}" for key in sorted(values))


def extract_field_path(pod: JSON, field_path: str) -> str:
    """The metadata fields both env vars and downward API volumes can read.

    This is all a downwardAPI volume supports (the kubelet does not route volumes through the
    status/spec cases that env vars get).
    """
    metadata = obj(pod.get("metadata"))
    subscripted = split_subscript(field_path)
    if subscripted is not None:
        path, key = subscripted
        if path == "metadata.annotations":
            if not is_qualified_name(key.lower()):
                raise FieldSelectorError(f"invalid key subscript in {field_path}")
            return string_map(metadata.get("annotations")).get(key, "")
        if path == "metadata.labels":
            if not is_qualified_name(key):
                raise FieldSelectorError(f"invalid key subscript in {field_path}")
            return string_map(metadata.get("labels")).get(key, "")
        raise FieldSelectorError(f"fieldPath {go_quote(field_path)} does not support subscript")
    if field_path == "metadata.annotations":
        return format_map(string_map(metadata.get("annotations")))
    if field_path == "metadata.labels":
        return format_map(string_map(metadata.get("labels")))
    if field_path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return text(metadata.get(field_path.removeprefix("metadata.")))
    raise FieldSelectorError(f"unsupported fieldPath: {field_path}")


def _convert_field_label(api_version: str, label: str) -> str:
    """ConvertDownwardAPIFieldLabel: the v1 paths the kubelet accepts for env vars."""
    if api_version != "v1":
        raise FieldSelectorError(f"unsupported pod version: {api_version}")
    subscripted = split_subscript(label)
    if subscripted is not None:
        if subscripted[0] in ("metadata.annotations", "metadata.labels"):
            return label
        raise FieldSelectorError(f"field label does not support subscript: {label}")
    if label == "spec.host":  # what very old v1 clients sent
        return "spec.nodeName"
    if label not in _CONVERTIBLE_FIELD_LABELS:
        raise FieldSelectorError(f"field label not supported: {label}")
    return label


def pod_field_value(
    pod: JSON, selector: JSON, *, pod_ips: Sequence[str], host_ips: Sequence[str]
) -> str:
    """The value of an env var's `fieldRef` (kubelet podFieldSelectorRuntimeValue)."""
    path = _convert_field_label(
        text(selector.get("apiVersion")) or "v1", text(selector.get("fieldPath"))
    )
    spec = obj(pod.get("spec"))
    if path == "spec.nodeName":
        return text(spec.get("nodeName"))
    if path == "spec.serviceAccountName":
        return text(spec.get("serviceAccountName"))
    if path in ("status.hostIP", "status.hostIPs"):
        if not host_ips:
            raise FieldSelectorError(f"{path}: the node's host IP is unknown")
        return host_ips[0] if path == "status.hostIP" else ",".join(host_ips)
    if path in ("status.podIP", "status.podIPs"):
        ips = sort_pod_ips(pod_ips, host_ips)
        return (ips[0] if ips else "") if path == "status.podIP" else ",".join(ips)
    return extract_field_path(pod, path)
