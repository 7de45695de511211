"""A container's environment, resolved the way the kubelet resolves it before starting it.

The reference virtual-kubelet fails pods that read `status.podIP`, `status.hostIP(s)` or
`status.podIPs` through the downward API and silently drops `resourceFieldRef` variables. A
provider cannot fix that on its own side, because by the time it sees the pod the variables are
already gone or the pod is already failed. So the agent resolves every variable itself, with the
kubelet's rules (`pkg/kubelet/kubelet_pods.go` makeEnvironmentVariables):

1. service-link variables are computed first (lowest precedence);
2. `envFrom` sources are applied in order, a later source overriding an earlier one;
3. `env` entries are applied in order and override everything before them. A literal `value` is
   `$(VAR)`-expanded against the variables defined so far, then the service variables; a
   `valueFrom` is resolved from its source and is never expanded;
4. service variables not shadowed by a container variable are appended.

Everything here is pure: API objects come in as the JSON dicts the API server returns, through the
small `Sources` protocol, and nothing is cached between calls.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from ...sdk.quantity import ZERO, Quantity, QuantityError, divide_ceil, parse_quantity

JSON = Mapping[str, Any]

# Event reasons. The kubelet itself only fails the container (CreateContainerConfigError); these
# are the reasons virtual-kubelet records on the pod, which users and dashboards already know.
# (S105: these name events about Secrets; they are not passwords.)
OPTIONAL_CONFIGMAP_NOT_FOUND: Final = "OptionalConfigMapNotFound"
OPTIONAL_CONFIGMAP_KEY_NOT_FOUND: Final = "OptionalConfigMapKeyNotFound"
FAILED_TO_READ_OPTIONAL_CONFIGMAP: Final = "FailedToReadOptionalConfigMap"
MANDATORY_CONFIGMAP_NOT_FOUND: Final = "MandatoryConfigMapNotFound"
MANDATORY_CONFIGMAP_KEY_NOT_FOUND: Final = "MandatoryConfigMapKeyNotFound"
FAILED_TO_READ_MANDATORY_CONFIGMAP: Final = "FailedToReadMandatoryConfigMap"
OPTIONAL_SECRET_NOT_FOUND: Final = "OptionalSecretNotFound"  # noqa: S105
OPTIONAL_SECRET_KEY_NOT_FOUND: Final = "OptionalSecretKeyNotFound"  # noqa: S105
FAILED_TO_READ_OPTIONAL_SECRET: Final = "FailedToReadOptionalSecret"  # noqa: S105
MANDATORY_SECRET_NOT_FOUND: Final = "MandatorySecretNotFound"  # noqa: S105
MANDATORY_SECRET_KEY_NOT_FOUND: Final = "MandatorySecretKeyNotFound"  # noqa: S105
FAILED_TO_READ_MANDATORY_SECRET: Final = "FailedToReadMandatorySecret"  # noqa: S105
INVALID_ENVIRONMENT_VARIABLE_NAMES: Final = "InvalidEnvironmentVariableNames"

# The kubelet's master services: always visible to every pod, from this namespace by default.
DEFAULT_MASTER_SERVICES_NAMESPACE: Final = "default"
_MASTER_SERVICES: Final = frozenset({"kubernetes"})


# --------------------------------------------------------------------------------------------
# Inputs and outputs
# --------------------------------------------------------------------------------------------


class SourceReadError(Exception):
    """Raised by a `Sources` or token source when an object could not be read.

    "Could not be read" (API unreachable, cache not synced, forbidden) is different from "does not
    exist" (return None): only a missing object lets an optional reference be skipped. A read
    failure fails the container even for an optional reference, as in the kubelet, so that a
    flaky API server never silently starts a container without its configuration.
    """


class Sources(Protocol):
    """Read access to the API objects a pod may reference, as JSON dicts."""

    def get_configmap(self, namespace: str, name: str) -> JSON | None:
        """The ConfigMap, or None if it does not exist; raise `SourceReadError` if unreadable."""
        ...

    def get_secret(self, namespace: str, name: str) -> JSON | None:
        """The Secret (`data` base64-encoded, as the API returns it), or None if missing."""
        ...

    def list_services(self, namespace: str) -> Sequence[JSON]:
        """All Services of the namespace; raise `SourceReadError` if they cannot be listed."""
        ...


@dataclass(frozen=True)
class Event:
    """An event the agent should record on the pod."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class EnvResult:
    """The final environment of one container, in a stable order, and what happened on the way.

    The kubelet builds the environment in a Go map, so its order is unspecified. Here it is:
    variables in the order they were first defined (envFrom keys sorted within each source, then
    `env`), a redefinition keeping the first position; then the service-link variables.
    """

    env: tuple[tuple[str, str], ...]
    events: tuple[Event, ...] = ()

    def as_dict(self) -> dict[str, str]:
        return dict(self.env)

    def as_env_list(self) -> list[dict[str, str]]:
        """The environment as a container's `env` field, for providers that take pod specs."""
        return [{"name": name, "value": value} for name, value in self.env]


class EnvResolutionError(Exception):
    """The container cannot start: a mandatory source is missing, or a field cannot be resolved.

    The kubelet reports this as the container's waiting reason `CreateContainerConfigError` and
    retries on the next sync; `events` holds what should be recorded on the pod (including the
    `Mandatory*`/`FailedToRead*` event for the failure itself, when there is one).
    """

    def __init__(
        self, container: str, variable: str | None, detail: str, events: Sequence[Event] = ()
    ) -> None:
        where = f"container {container!r}"
        if variable is not None:
            where += f", {variable}"
        super().__init__(f"{where}: {detail}")
        self.container = container
        self.variable = variable
        self.detail = detail
        self.events = tuple(events)


class FieldSelectorError(ValueError):
    """A `fieldRef` or `resourceFieldRef` that the kubelet would refuse to resolve."""


# --------------------------------------------------------------------------------------------
# JSON helpers: the input is whatever the API (or a hostile client) sent, so never trust types.
# --------------------------------------------------------------------------------------------


def obj(value: Any) -> JSON:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def seq(value: Any) -> Sequence[Any]:
    """`value` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list | tuple) else ()


def text(value: Any) -> str:
    """`value` if it is a string, else the empty string (what Go's zero value would be)."""
    return value if isinstance(value, str) else ""


def string_map(value: Any) -> dict[str, str]:
    """A `map[string]string` field (labels, ConfigMap data); non-string values are dropped."""
    return {k: v for k, v in obj(value).items() if isinstance(k, str) and isinstance(v, str)}


def decode_base64_map(value: Any) -> dict[str, bytes]:
    """A `map[string][]byte` field (Secret data, ConfigMap binaryData) as the API encodes it.

    Raises `SourceReadError`: an object that does not decode was not read correctly.
    """
    decoded: dict[str, bytes] = {}
    for key, encoded in obj(value).items():
        if not isinstance(key, str) or not isinstance(encoded, str):
            raise SourceReadError(f"key {key!r}: value is not a base64 string")
        try:
            decoded[key] = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as err:
            raise SourceReadError(f"key {key!r}: invalid base64: {err}") from err
    return decoded


def utf8_bytes(value: str) -> bytes:
    """`value` as UTF-8, lone surrogates becoming U+FFFD as Go's JSON decoder would make them
    (Python's decoder keeps them, and `str.encode` would then fail on hostile input)."""
    return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode()


def bytes_to_env(value: bytes) -> str:
    """Secret bytes as a variable value, byte for byte (Go's `string(b)` keeps invalid UTF-8).

    Invalid UTF-8 survives as surrogate escapes: `value.encode("utf-8", "surrogateescape")`
    gives the original bytes back.
    """
    return value.decode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------------------------
# $(VAR) expansion (third_party/forked/golang/expansion)
# --------------------------------------------------------------------------------------------


def expand(value: str, *scopes: Mapping[str, str]) -> str:
    """Expand `$(NAME)` references in `value`, looking NAME up in each scope in turn.

    Kubernetes' rules, which are not the shell's: `$$` is a literal `$`; an unknown or
    unterminated reference is kept verbatim; `$` followed by anything else is kept with that
    character; there is no nesting and no `${}`; the result is not expanded again.
    """
    out: list[str] = []
    start = i = 0
    while i < len(value):
        if value[i] != "$" or i + 1 == len(value):
            i += 1
            continue
        out.append(value[start:i])
        after = value[i + 1]
        if after == "$":
            out.append("$")
            i += 2
        elif after == "(":
            close = value.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
            else:
                out.append(_lookup(value[i + 2 : close], scopes))
                i = close + 1
        else:
            out.append("$" + after)
            i += 2
        start = i
    out.append(value[start:])
    return "".join(out)


def _lookup(name: str, scopes: Sequence[Mapping[str, str]]) -> str:
    for scope in scopes:
        if name in scope:
            return scope[name]
    return f"$({name})"


def expand_command_and_args(
    container: JSON, env: Sequence[tuple[str, str]]
) -> tuple[list[str], list[str]]:
    """The container's `command` and `args` with `$(VAR)` expanded against its final env.

    The kubelet does this too (ExpandContainerCommandAndArgs), so a provider that runs the
    command itself must use these, not the raw spec.
    """
    scope = dict(env)
    command = [expand(text(part), scope) for part in seq(container.get("command"))]
    args = [expand(text(part), scope) for part in seq(container.get("args"))]
    return command, args


# --------------------------------------------------------------------------------------------
# Field paths (pkg/fieldpath, pkg/apis/core/pods ConvertDownwardAPIFieldLabel)
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Resource fields (pkg/api/v1/resource, kubelet defaultPodLimitsForDownwardAPI)
# --------------------------------------------------------------------------------------------

_STANDARD_RESOURCES: Final = frozenset({"cpu", "memory", "ephemeral-storage"})
_POD_LEVEL_RESOURCES: Final = ("cpu", "memory")


def _quantity_of(values: JSON, name: str, what: str) -> Quantity:
    raw = values.get(name)
    if raw is None:
        return ZERO
    try:
        return parse_quantity(raw)
    except QuantityError as err:
        raise FieldSelectorError(f"{what} {name}: {err}") from err


def default_limits(container: JSON, allocatable: JSON) -> dict[str, Any]:
    """The container's limits, with unset or zero cpu/memory/ephemeral-storage limits replaced by
    `allocatable` (MergeContainerResourceLimits). A container without a limit can use the whole
    node, so that is what `limits.*` reports; hugepages are never overcommitted, so never defaulted.
    """
    limits = dict(obj(obj(container.get("resources")).get("limits")))
    for name in sorted(_STANDARD_RESOURCES):
        if _quantity_of(limits, name, "limit").is_zero and name in allocatable:
            limits[name] = allocatable[name]
    return limits


def env_allocatable(pod: JSON, node_allocatable: JSON) -> JSON:
    """What unset container limits default to for env vars: pod-level limits when the pod has
    them (PodLevelResources), else the node's allocatable."""
    pod_limits = obj(obj(obj(pod.get("spec")).get("resources")).get("limits"))
    supported = [k for k in pod_limits if k in _POD_LEVEL_RESOURCES or k.startswith("hugepages-")]
    if not supported:
        return node_allocatable
    allocatable = dict(node_allocatable)
    for name in _POD_LEVEL_RESOURCES:
        if name in allocatable and not _quantity_of(pod_limits, name, "pod limit").is_zero:
            allocatable[name] = pod_limits[name]
    return allocatable


def resource_field_value(selector: JSON, limits: JSON, requests: JSON) -> str:
    """The value of a `resourceFieldRef` given the (already defaulted) limits and requests.

    The result is ceil(value / divisor); an unset or zero divisor means 1.
    """
    resource = text(selector.get("resource"))
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not (
        name in _STANDARD_RESOURCES or name.startswith("hugepages-")
    ):
        raise FieldSelectorError(f"unsupported container resource : {resource}")
    raw_divisor = selector.get("divisor")
    try:
        divisor = ZERO if raw_divisor is None else parse_quantity(raw_divisor)
    except QuantityError as err:
        raise FieldSelectorError(f"divisor: {err}") from err
    if divisor.is_zero:
        divisor = Quantity(1, 0)
    quantity = _quantity_of(limits if kind == "limits" else requests, name, kind)
    return str(divide_ceil(quantity, divisor))


def find_container(pod: JSON, name: str) -> JSON:
    """A regular or init container by name (findContainerInPod; ephemeral ones have no limits)."""
    spec = obj(pod.get("spec"))
    for key in ("containers", "initContainers"):
        for container in seq(spec.get(key)):
            if text(obj(container).get("name")) == name:
                return obj(container)
    raise FieldSelectorError(f"container {name} not found")


def _env_resource_value(selector: JSON, pod: JSON, container: JSON, allocatable: JSON) -> str:
    """containerResourceRuntimeValue over the kubelet's defaulted pod copy.

    Quirk kept: the kubelet defaults the limits of the container being started and of the pod's
    regular containers, not of init containers looked up by `containerName`.
    """
    target_name = text(selector.get("containerName"))
    if target_name:
        target = find_container(pod, target_name)
        is_regular = any(
            text(obj(c).get("name")) == target_name
            for c in seq(obj(pod.get("spec")).get("containers"))
        )
        if not is_regular:
            limits: JSON = obj(obj(target.get("resources")).get("limits"))
            return resource_field_value(selector, limits, _requests(target))
        container = target
    return resource_field_value(
        selector, default_limits(container, allocatable), _requests(container)
    )


def _requests(container: JSON) -> JSON:
    return obj(obj(container.get("resources")).get("requests"))


# --------------------------------------------------------------------------------------------
# Service links (pkg/kubelet/envvars)
# --------------------------------------------------------------------------------------------


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


def _linked_services(
    sources: Sources, namespace: str, enable_links: bool, master_namespace: str
) -> list[JSON]:
    """The services a pod sees: the master `kubernetes` service always, plus its own
    namespace's services when service links are enabled (a same-namespace service with the same
    name wins over the master one)."""
    master = sources.list_services(master_namespace)
    own = master if namespace == master_namespace else sources.list_services(namespace)
    chosen: dict[str, JSON] = {}
    for service in master:
        name = text(obj(service.get("metadata")).get("name"))
        if name in _MASTER_SERVICES and _has_cluster_ip(service):
            chosen[name] = service
    if enable_links:
        for service in own:
            name = text(obj(service.get("metadata")).get("name"))
            if _has_cluster_ip(service) and (namespace != master_namespace or name not in chosen):
                chosen[name] = service
    return [chosen[name] for name in sorted(chosen)]


# --------------------------------------------------------------------------------------------
# resolve_env
# --------------------------------------------------------------------------------------------


def is_env_var_name(name: str) -> bool:
    """Whether the runtime can take `name`: non-empty printable ASCII without "=".

    That is the kubelet's rule since relaxed environment variable validation (every key a
    ConfigMap or Secret can have passes); virtual-kubelet's older C-identifier check would drop
    valid keys such as "my-key".
    """
    return bool(name) and all(" " <= c <= "~" for c in name) and "=" not in name


@dataclass(frozen=True)
class _Kind:
    label: str  # how messages name it: "configmap", "secret"
    optional_not_found: str
    optional_key_not_found: str
    optional_failed: str
    mandatory_not_found: str
    mandatory_key_not_found: str
    mandatory_failed: str


_CONFIGMAP: Final = _Kind(
    "configmap",
    OPTIONAL_CONFIGMAP_NOT_FOUND,
    OPTIONAL_CONFIGMAP_KEY_NOT_FOUND,
    FAILED_TO_READ_OPTIONAL_CONFIGMAP,
    MANDATORY_CONFIGMAP_NOT_FOUND,
    MANDATORY_CONFIGMAP_KEY_NOT_FOUND,
    FAILED_TO_READ_MANDATORY_CONFIGMAP,
)
_SECRET: Final = _Kind(
    "secret",
    OPTIONAL_SECRET_NOT_FOUND,
    OPTIONAL_SECRET_KEY_NOT_FOUND,
    FAILED_TO_READ_OPTIONAL_SECRET,
    MANDATORY_SECRET_NOT_FOUND,
    MANDATORY_SECRET_KEY_NOT_FOUND,
    FAILED_TO_READ_MANDATORY_SECRET,
)


class _EnvResolver:
    """One container's resolution; holds the events so far and a per-call object cache."""

    def __init__(self, pod: JSON, container: JSON, sources: Sources) -> None:
        self.pod = pod
        self.container = container
        self.sources = sources
        self.namespace = text(obj(pod.get("metadata")).get("namespace"))
        self.name = text(container.get("name"))
        self.events: list[Event] = []
        self._cache: dict[tuple[str, str], dict[str, str] | None] = {}

    def fail(self, variable: str | None, detail: str) -> EnvResolutionError:
        return EnvResolutionError(self.name, variable, detail, self.events)

    def warn(self, reason: str, message: str) -> None:
        self.events.append(Event("Warning", reason, f"container {self.name!r}: {message}"))

    def data(self, kind: _Kind, ref: JSON, what: str) -> dict[str, str] | None:
        """The string data of a referenced object; None when it is optional and missing."""
        name = text(ref.get("name"))
        optional = ref.get("optional") is True
        ref_name = f'{kind.label} "{self.namespace}/{name}"'
        cache_key = (kind.label, name)
        try:
            if cache_key not in self._cache:
                self._cache[cache_key] = self._read(kind, name)
        except SourceReadError as err:
            reason = kind.optional_failed if optional else kind.mandatory_failed
            self.warn(reason, f"{what}: failed to read {ref_name}: {err}")
            raise self.fail(what, f"failed to read {ref_name}: {err}") from err
        data = self._cache[cache_key]
        if data is None:
            if optional:
                self.warn(
                    kind.optional_not_found, f"skipping {what}: optional {ref_name} not found"
                )
                return None
            self.warn(kind.mandatory_not_found, f"{what}: {ref_name} not found")
            raise self.fail(what, f"{ref_name} not found")
        return data

    def _read(self, kind: _Kind, name: str) -> dict[str, str] | None:
        if kind is _CONFIGMAP:
            configmap = self.sources.get_configmap(self.namespace, name)
            return None if configmap is None else string_map(configmap.get("data"))
        secret = self.sources.get_secret(self.namespace, name)
        if secret is None:
            return None
        return {k: bytes_to_env(v) for k, v in decode_base64_map(secret.get("data")).items()}

    def apply_env_from(self, index: int, source: JSON, env: dict[str, str]) -> None:
        """Add one `envFrom` source's keys (sorted, prefixed) to `env`, overriding earlier ones."""
        if isinstance(source.get("configMapRef"), Mapping):
            kind, ref = _CONFIGMAP, obj(source["configMapRef"])
        elif isinstance(source.get("secretRef"), Mapping):
            kind, ref = _SECRET, obj(source["secretRef"])
        else:
            return
        data = self.data(kind, ref, f"envFrom[{index}]")
        if data is None:
            return
        prefix = text(source.get("prefix"))
        invalid = []
        for key in sorted(data):
            if is_env_var_name(prefix + key):
                env[prefix + key] = data[key]
            else:
                invalid.append(prefix + key)
        if invalid:
            self.warn(
                INVALID_ENVIRONMENT_VARIABLE_NAMES,
                f"keys [{', '.join(invalid)}] from {kind.label} "
                f'"{self.namespace}/{text(ref.get("name"))}" were skipped since they are '
                "invalid as environment variable names",
            )

    def key(self, kind: _Kind, ref: JSON, variable: str) -> str | None:
        """A `configMapKeyRef`/`secretKeyRef` value; None when optional and missing."""
        what = f"env var {variable!r}"
        data = self.data(kind, ref, what)
        if data is None:
            return None
        key = text(ref.get("key"))
        if key in data:
            return data[key]
        ref_name = f'{kind.label} "{self.namespace}/{text(ref.get("name"))}"'
        if ref.get("optional") is True:
            self.warn(
                kind.optional_key_not_found,
                f"skipping optional {what}: key {key!r} does not exist in {ref_name}",
            )
            return None
        self.warn(kind.mandatory_key_not_found, f"{what}: key {key!r} does not exist in {ref_name}")
        raise self.fail(what, f"couldn't find key {key!r} in {ref_name}")


def resolve_env(
    pod: JSON,
    container: JSON,
    sources: Sources,
    *,
    node_allocatable: JSON,
    pod_ips: Sequence[str] | None = None,
    host_ips: Sequence[str] | None = None,
    master_services_namespace: str = DEFAULT_MASTER_SERVICES_NAMESPACE,
) -> EnvResult:
    """Resolve `container`'s environment (init, regular or ephemeral) exactly as the kubelet does.

    `pod_ips`/`host_ips` are what the provider knows; when omitted they are read from
    `pod["status"]`. `node_allocatable` is the node's `status.allocatable`, which unset limits
    default to. Raises `EnvResolutionError` when the container cannot start.
    """
    resolver = _EnvResolver(pod, container, sources)
    spec = obj(pod.get("spec"))
    known_pod_ips = list(pod_ips) if pod_ips is not None else pod_ips_of(pod)
    known_host_ips = list(host_ips) if host_ips is not None else host_ips_of(pod)
    enable_links = spec.get("enableServiceLinks", True) is not False
    try:
        services = _linked_services(
            sources, resolver.namespace, enable_links, master_services_namespace
        )
    except SourceReadError as err:
        detail = f"failed to list services when setting up env vars: {err}"
        raise resolver.fail(None, detail) from err
    service_env = service_link_variables(services)

    env: dict[str, str] = {}
    for index, source in enumerate(seq(container.get("envFrom"))):
        resolver.apply_env_from(index, obj(source), env)

    allocatable = env_allocatable(pod, node_allocatable)
    for raw_var in seq(container.get("env")):
        var = obj(raw_var)
        name = text(var.get("name"))
        if not name:  # API validation requires one; a nameless entry cannot reach a runtime
            continue
        value = text(var.get("value"))
        value_from = obj(var.get("valueFrom"))
        if value:
            value = expand(value, env, service_env)
        elif value_from:
            resolved = _value_from(
                resolver, name, value_from, allocatable, known_pod_ips, known_host_ips
            )
            if resolved is None:
                continue
            value = resolved
        env[name] = value

    for name, value in service_env.items():
        env.setdefault(name, value)
    return EnvResult(tuple(env.items()), tuple(resolver.events))


def _value_from(
    resolver: _EnvResolver,
    name: str,
    source: JSON,
    allocatable: JSON,
    pod_ips: Sequence[str],
    host_ips: Sequence[str],
) -> str | None:
    """One `valueFrom`; None means "optional and missing: leave the variable out"."""
    what = f"env var {name!r}"
    try:
        if isinstance(source.get("fieldRef"), Mapping):
            return pod_field_value(
                resolver.pod, obj(source["fieldRef"]), pod_ips=pod_ips, host_ips=host_ips
            )
        if isinstance(source.get("resourceFieldRef"), Mapping):
            return _env_resource_value(
                obj(source["resourceFieldRef"]), resolver.pod, resolver.container, allocatable
            )
    except FieldSelectorError as err:
        raise resolver.fail(what, str(err)) from err
    if isinstance(source.get("configMapKeyRef"), Mapping):
        return resolver.key(_CONFIGMAP, obj(source["configMapKeyRef"]), name)
    if isinstance(source.get("secretKeyRef"), Mapping):
        return resolver.key(_SECRET, obj(source["secretKeyRef"]), name)
    if "fileKeyRef" in source:
        raise resolver.fail(what, "valueFrom.fileKeyRef is not supported")
    raise resolver.fail(what, "valueFrom has no supported source")
