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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from .expansion import expand
from .fieldpath import FieldSelectorError, pod_field_value
from .jsonvalues import bytes_to_env, decode_base64_map, obj, seq, string_map, text
from .podips import ips_of
from .resourcefields import env_allocatable, env_resource_value
from .servicelinks import DEFAULT_MASTER_SERVICES_NAMESPACE, pod_service_env
from .sources import JSON, SourceReadError, Sources

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
    `Mandatory*`/`FailedToRead*` event for the failure itself, when there is one). `permanent`
    means retrying cannot help until a referenced object changes (whose watch re-syncs the pod).
    """

    def __init__(
        self,
        container: str,
        variable: str | None,
        detail: str,
        events: Sequence[Event] = (),
        *,
        permanent: bool = False,
    ) -> None:
        where = f"container {container!r}"
        if variable is not None:
            where += f", {variable}"
        super().__init__(f"{where}: {detail}")
        self.container = container
        self.variable = variable
        self.events = tuple(events)
        self.permanent = permanent


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

    def fail(
        self, variable: str | None, detail: str, *, permanent: bool = False
    ) -> EnvResolutionError:
        return EnvResolutionError(self.name, variable, detail, self.events, permanent=permanent)

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

    def usable(self, kind: _Kind, ref: JSON, key: str, value: str, what: str) -> str:
        """`value`, if a process environment can hold it; else a permanent error that names the
        object and key but never the value (it may be a secret, and errors reach events, the
        pod's status and logs). Neither a NUL byte nor invalid UTF-8 (which `bytes_to_env`
        keeps as surrogate escapes, and which no JSON status or CRI string can carry) can be an
        environment variable: retrying cannot help until the object changes.
        """
        problem = _unusable(value)
        if problem is None:
            return value
        ref_name = f'{kind.label} "{self.namespace}/{text(ref.get("name"))}"'
        detail = f"{ref_name} key {key!r}: value {problem} and cannot be an environment variable"
        raise self.fail(what, detail, permanent=True)

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
                env[prefix + key] = self.usable(kind, ref, key, data[key], f"envFrom[{index}]")
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
            return self.usable(kind, ref, key, data[key], what)
        ref_name = f'{kind.label} "{self.namespace}/{text(ref.get("name"))}"'
        if ref.get("optional") is True:
            self.warn(
                kind.optional_key_not_found,
                f"skipping optional {what}: key {key!r} does not exist in {ref_name}",
            )
            return None
        self.warn(kind.mandatory_key_not_found, f"{what}: key {key!r} does not exist in {ref_name}")
        raise self.fail(what, f"couldn't find key {key!r} in {ref_name}")


def _unusable(value: str) -> str | None:
    """Why `value` cannot be an environment variable's value, or None if it can."""
    if "\x00" in value:
        return "contains a NUL byte"
    try:
        value.encode()
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def resolve_env(
    pod: JSON,
    container: JSON,
    sources: Sources,
    *,
    node_allocatable: JSON,
    pod_ips: Sequence[str] | None = None,
    host_ips: Sequence[str] | None = None,
    master_services_namespace: str = DEFAULT_MASTER_SERVICES_NAMESPACE,
    service_env: Mapping[str, str] | None = None,
) -> EnvResult:
    """Resolve `container`'s environment (init, regular or ephemeral) exactly as the kubelet does.

    `pod_ips`/`host_ips` are what the provider knows; when omitted they are read from
    `pod["status"]`. `node_allocatable` is the node's `status.allocatable`, which unset limits
    default to. `service_env` is the pod's `pod_service_env`, computed once for all its
    containers; when omitted it is computed here. Raises `EnvResolutionError` when the container
    cannot start.
    """
    resolver = _EnvResolver(pod, container, sources)
    known_pod_ips = list(pod_ips) if pod_ips is not None else ips_of(pod, "podIP")
    known_host_ips = list(host_ips) if host_ips is not None else ips_of(pod, "hostIP")
    if service_env is None:
        try:
            service_env = pod_service_env(pod, sources, master_services_namespace)
        except SourceReadError as err:
            detail = f"failed to list services when setting up env vars: {err}"
            raise resolver.fail(None, detail) from err

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
            return env_resource_value(
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
