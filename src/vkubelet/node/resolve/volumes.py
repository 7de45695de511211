"""A pod's volumes, resolved into the files a provider should materialise.

The reference virtual-kubelet leaves configMap, secret, downwardAPI and projected volumes (and so
service-account tokens) to every provider, and most get them wrong or skip them. Here the agent
computes, per volume, exactly the files the kubelet's volume plugins would write: paths after the
atomic writer's validation and cleaning, contents, and modes including the `fsGroup` adjustment.
A provider only has to write `{path: FileContent}` below the volume's directory.

Volumes that are not file projections are passed through as declarations (emptyDir, hostPath)
or untouched (everything else), for the provider to decide on.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from ...sdk.volumes import (
    EmptyDirVolume,
    FileContent,
    FileKind,
    FilesVolume,
    HostPathVolume,
    OtherVolume,
    ResolvedVolume,
)
from .fieldpath import FieldSelectorError, extract_field_path
from .jsonvalues import decode_base64_map, obj, seq, string_map, text, utf8_bytes
from .resourcefields import default_limits, find_container, resource_field_value
from .sources import JSON, SourceReadError, Sources

FAILED_MOUNT: Final = "FailedMount"

_FILE_KINDS: Final[dict[str, FileKind]] = {
    "configMap": "configMap",
    "secret": "secret",
    "downwardAPI": "downwardAPI",
    "projected": "projected",
}

# The API server defaults every configMap/secret/downwardAPI/projected defaultMode to 0644.
DEFAULT_MODE: Final = 0o644
# TokenRequest's default (the API server defaults expirationSeconds to one hour).
DEFAULT_TOKEN_EXPIRATION_SECONDS: Final = 3600
# What the atomic writer allows.
_MAX_PATH_BYTES: Final = 4096
_MAX_NAME_BYTES: Final = 255
# Volumes are read-only, so with an fsGroup the kubelet makes every file group-readable.
_FS_GROUP_READ: Final = 0o440


class TokenSource(Protocol):
    """Issues service-account tokens (the TokenRequest API, bound to the pod)."""

    def request_token(
        self,
        namespace: str,
        service_account: str,
        audience: str | None,
        expiration_seconds: int,
        pod: JSON,
    ) -> tuple[str, datetime]:
        """A token for the pod and its expiry; raise `SourceReadError` if none can be had.

        `audience` None means the API server's default audiences.
        """
        ...


@dataclass(frozen=True)
class TokenFile:
    """A service-account token file left out of its volume, for the provider to ask for when
    it needs it (`TokensOnDemand`): where it goes, with what mode and owner, and what to
    request."""

    volume: str
    path: str
    mode: int
    owner_uid: int | None
    audience: str | None
    expiration_seconds: int


@dataclass(frozen=True)
class _PendingToken(FileContent):
    """A token file's place in a projected payload, before its path is cleaned and its mode
    gets the fsGroup bits: it goes through the same merging and checks as every other file."""

    audience: str | None = None
    expiration_seconds: int = DEFAULT_TOKEN_EXPIRATION_SECONDS


@dataclass(frozen=True)
class VolumeError:
    """A volume the pod cannot start without; record it as a Warning event on the pod."""

    volume: str
    message: str
    reason: str = FAILED_MOUNT


@dataclass(frozen=True)
class VolumeResult:
    """The resolved volumes (those that failed are absent) and the failures.

    `token_expiry` is the earliest expiry of the service-account tokens written, so the agent
    knows when it must resolve again (the kubelet refreshes a token once 80% of its lifetime
    has passed, or after 24 hours).
    """

    volumes: tuple[ResolvedVolume, ...]
    errors: tuple[VolumeError, ...] = ()
    token_expiry: datetime | None = None
    deferred_tokens: tuple[TokenFile, ...] = ()  # with `defer_tokens`: left out of `volumes`

    @property
    def ok(self) -> bool:
        return not self.errors

    def get(self, name: str) -> ResolvedVolume | None:
        return next((v for v in self.volumes if v.name == name), None)


class _MountError(Exception):
    """One reason a volume cannot be set up; several are aggregated per volume."""


# --------------------------------------------------------------------------------------------
# Paths and modes
# --------------------------------------------------------------------------------------------


def clean_volume_path(path: str) -> str:
    """Validate a file path inside a volume and return it cleaned ("a//./b" -> "a/b").

    The atomic writer's rules: not empty, relative, no ".." element, no first element starting
    with ".." (reserved for its own "..data" links), names <= 255 and paths <= 4096 bytes. The
    reserved-prefix rule is checked again after cleaning, so "./..data" cannot sneak through,
    and NUL bytes are refused. Raises ValueError.
    """
    if not path:
        raise ValueError("invalid path: must not be empty")
    if "\x00" in path:
        raise ValueError(f"invalid path: must not contain NUL bytes: {path!r}")
    if path.startswith("/"):
        raise ValueError(f"invalid path: must be relative path: {path}")
    if len(path.encode()) > _MAX_PATH_BYTES:
        raise ValueError(f"invalid path: must be less than or equal to {_MAX_PATH_BYTES} bytes")
    items = path.split("/")
    for item in items:
        if item == "..":
            raise ValueError(f"invalid path: must not contain '..': {path}")
        if len(item.encode()) > _MAX_NAME_BYTES:
            raise ValueError(f"invalid path: file names must be at most {_MAX_NAME_BYTES} bytes")
    cleaned = posixpath.normpath(path)
    first = cleaned.split("/")[0]
    if cleaned == "." or (first.startswith("..") and len(first) > 2):
        raise ValueError(f"invalid path: must not start with '..' or be empty: {path}")
    return cleaned


def _mode(value: Any, default: int) -> int:
    """A `mode`/`defaultMode` field; setuid/setgid/sticky bits are refused like the API does."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
        raise _MountError(f"invalid file mode {value!r}: must be between 0 and 0777")
    return value


def fs_user_of(pod: JSON) -> int | None:
    """The uid every container runs as, if they all agree (kubelet FsUserFrom), else None.

    Token files are owned by this user so that a non-root container can read its 0600 token.
    """
    spec = obj(pod.get("spec"))
    pod_user = obj(spec.get("securityContext")).get("runAsUser")
    user: int | None = None
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for container in seq(spec.get(key)):
            run_as = obj(obj(container).get("securityContext")).get("runAsUser", pod_user)
            if not isinstance(run_as, int) or isinstance(run_as, bool):
                return None
            if user is not None and run_as != user:
                return None
            user = run_as
    return user


def fs_group_of(pod: JSON) -> int | None:
    group = obj(obj(pod.get("spec")).get("securityContext")).get("fsGroup")
    return group if isinstance(group, int) and not isinstance(group, bool) else None


def _finish(payload: Mapping[str, FileContent], fs_group: int | None) -> dict[str, FileContent]:
    """Validate and clean every path, refuse a path that is both a file and a directory, and
    apply the fsGroup's group-read bits (SetVolumeOwnership on a read-only volume)."""
    files: dict[str, FileContent] = {}
    for path, content in payload.items():
        try:
            cleaned = clean_volume_path(path)
        except ValueError as err:
            raise _MountError(str(err)) from err
        if fs_group is not None:
            content = dataclasses.replace(content, mode=content.mode | _FS_GROUP_READ)
        files[cleaned] = content
    for path in files:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in files:
                raise _MountError(f"invalid path: {parent!r} is both a file and a directory")
    return files


# --------------------------------------------------------------------------------------------
# Payloads, one per source type (pkg/volume/{configmap,secret,downwardapi,projected})
# --------------------------------------------------------------------------------------------


class _VolumeResolver:
    def __init__(
        self,
        pod: JSON,
        sources: Sources,
        token_source: TokenSource | None,
        node_allocatable: JSON,
        defer_tokens: bool = False,
    ) -> None:
        self.pod = pod
        self.sources = sources
        self.token_source = token_source
        self.defer_tokens = defer_tokens
        self.deferred: list[TokenFile] = []
        self.node_allocatable = node_allocatable
        self.namespace = text(obj(pod.get("metadata")).get("namespace"))
        self.fs_group = fs_group_of(pod)
        self.fs_user = fs_user_of(pod)
        self.token_expiry: datetime | None = None

    def object_files(
        self, kind: str, source: JSON, name: str, default_mode: int, errors: list[str]
    ) -> dict[str, FileContent]:
        """A ConfigMap's (`kind` "configmap") or a Secret's ("secret") keys as files."""
        optional = source.get("optional") is True
        try:
            if kind == "configmap":
                found = self.sources.get_configmap(self.namespace, name)
                binary = decode_base64_map(obj(found).get("binaryData"))
            else:
                found = self.sources.get_secret(self.namespace, name)
                binary = decode_base64_map(obj(found).get("data"))
        except SourceReadError as err:
            errors.append(f'failed to read {kind} "{self.namespace}/{name}": {err}')
            return {}
        if found is None and not optional:
            errors.append(f'{kind} "{name}" not found')
            return {}
        if kind == "secret":
            missing = "references non-existent secret key"
            return self._items(source, binary, (binary,), default_mode, optional, errors, missing)
        data = string_map(obj(found).get("data"))
        contents = {key: utf8_bytes(value) for key, value in data.items()}
        # With no items, every key becomes a file; binaryData wins a (forbidden) duplicate key.
        contents_for_all = {**contents, **binary}
        missing = "configmap references non-existent config key"
        tables = (contents, binary)
        return self._items(
            source, contents_for_all, tables, default_mode, optional, errors, missing
        )

    def _items(
        self,
        source: JSON,
        everything: Mapping[str, bytes],
        lookup: Sequence[Mapping[str, bytes]],
        default_mode: int,
        optional: bool,
        errors: list[str],
        missing: str,
    ) -> dict[str, FileContent]:
        """MakePayload: every key as a file, or only `items` (key -> path, own mode)."""
        items = [obj(item) for item in seq(source.get("items"))]
        if not items:
            return {key: FileContent(everything[key], default_mode) for key in sorted(everything)}
        payload: dict[str, FileContent] = {}
        for item in items:
            key = text(item.get("key"))
            found = next((table[key] for table in lookup if key in table), None)
            if found is None:
                if not optional:
                    errors.append(f"{missing}: {key}")
                continue
            payload[text(item.get("path"))] = FileContent(
                found, _mode(item.get("mode"), default_mode)
            )
        return payload

    def downward_api(
        self, source: JSON, default_mode: int, errors: list[str]
    ) -> dict[str, FileContent]:
        """CollectData: metadata fields and (node-allocatable-defaulted) resource fields."""
        payload: dict[str, FileContent] = {}
        for item in (obj(i) for i in seq(source.get("items"))):
            path = text(item.get("path"))
            mode = _mode(item.get("mode"), default_mode)
            data = b""
            try:
                if isinstance(item.get("fieldRef"), Mapping):
                    field_path = text(obj(item["fieldRef"]).get("fieldPath"))
                    data = utf8_bytes(extract_field_path(self.pod, field_path))
                elif isinstance(item.get("resourceFieldRef"), Mapping):
                    selector = obj(item["resourceFieldRef"])
                    container = find_container(self.pod, text(selector.get("containerName")))
                    limits = default_limits(container, self.node_allocatable)
                    requests = obj(obj(container.get("resources")).get("requests"))
                    data = resource_field_value(selector, limits, requests).encode()
            except FieldSelectorError as err:
                errors.append(str(err))
                continue
            payload[path] = FileContent(data, mode)
        return payload

    def _secret_file_mode(self, default_mode: int) -> int:
        # Token-like files are 0600 once someone owns them (then 0640 with the fsGroup bits).
        return 0o600 if self.fs_user is not None or self.fs_group is not None else default_mode

    def service_account_token(
        self, source: JSON, default_mode: int, errors: list[str]
    ) -> dict[str, FileContent]:
        expiration = source.get("expirationSeconds")
        if not isinstance(expiration, int) or isinstance(expiration, bool):
            expiration = DEFAULT_TOKEN_EXPIRATION_SECONDS
        mode = self._secret_file_mode(default_mode)
        path = text(source.get("path"))
        if self.defer_tokens:
            audience = text(source.get("audience")) or None
            return {path: _PendingToken(b"", mode, self.fs_user, audience, expiration)}
        if self.token_source is None:
            errors.append("service account token projection is not supported by this node")
            return {}
        spec = obj(self.pod.get("spec"))
        account = text(spec.get("serviceAccountName")) or "default"
        try:
            token, expiry = self.token_source.request_token(
                self.namespace, account, text(source.get("audience")) or None, expiration, self.pod
            )
        except SourceReadError as err:
            errors.append(f"failed to fetch token: {err}")
            return {}
        if self.token_expiry is None or expiry < self.token_expiry:
            self.token_expiry = expiry
        return {path: FileContent(utf8_bytes(token), mode, self.fs_user)}

    def cluster_trust_bundle(
        self, source: JSON, default_mode: int, errors: list[str]
    ) -> dict[str, FileContent]:
        """No ClusterTrustBundle source exists here: an optional bundle is written empty (what
        the kubelet writes when none matches), a mandatory one fails the volume."""
        if source.get("optional") is not True:
            errors.append("clusterTrustBundle projection is not supported by this node")
            return {}
        mode = self._secret_file_mode(default_mode)
        return {text(source.get("path")): FileContent(b"", mode, self.fs_user)}

    def projected(self, source: JSON, errors: list[str]) -> dict[str, FileContent]:
        """Sources merged in order into one tree; a later source overwrites an earlier path."""
        default_mode = _mode(source.get("defaultMode"), DEFAULT_MODE)
        payload: dict[str, FileContent] = {}
        for projection in (obj(p) for p in seq(source.get("sources"))):
            if isinstance(projection.get("configMap"), Mapping):
                configmap = obj(projection["configMap"])
                name = text(configmap.get("name"))
                payload |= self.object_files("configmap", configmap, name, default_mode, errors)
            elif isinstance(projection.get("secret"), Mapping):
                secret = obj(projection["secret"])
                name = text(secret.get("name"))
                payload |= self.object_files("secret", secret, name, default_mode, errors)
            elif isinstance(projection.get("downwardAPI"), Mapping):
                downward = obj(projection["downwardAPI"])
                payload |= self.downward_api(downward, default_mode, errors)
            elif isinstance(projection.get("serviceAccountToken"), Mapping):
                token = obj(projection["serviceAccountToken"])
                payload |= self.service_account_token(token, default_mode, errors)
            elif isinstance(projection.get("clusterTrustBundle"), Mapping):
                bundle = obj(projection["clusterTrustBundle"])
                payload |= self.cluster_trust_bundle(bundle, default_mode, errors)
            else:
                kinds = ", ".join(sorted(projection)) or "none"
                errors.append(f"unsupported projected volume source: {kinds}")
        return payload

    def resolve(self, volume: JSON) -> ResolvedVolume:
        name = text(volume.get("name"))
        kinds = [key for key in volume if key != "name"]
        # The API server defaults a volume without a source to an emptyDir.
        kind = kinds[0] if kinds else "emptyDir"
        source = obj(volume.get(kind))
        if kind == "emptyDir":
            size = source.get("sizeLimit")
            return EmptyDirVolume(
                name, text(source.get("medium")), None if size is None else str(size)
            )
        if kind == "hostPath":
            return HostPathVolume(name, text(source.get("path")), text(source.get("type")))
        if kind not in _FILE_KINDS:
            return OtherVolume(name, kind, source)
        errors: list[str] = []
        payload: dict[str, FileContent]
        if kind == "projected":
            payload = self.projected(source, errors)
        else:
            default_mode = _mode(source.get("defaultMode"), DEFAULT_MODE)
            if kind in ("configMap", "secret"):
                named = text(source.get("name" if kind == "configMap" else "secretName"))
                payload = self.object_files(kind.lower(), source, named, default_mode, errors)
            else:
                payload = self.downward_api(source, default_mode, errors)
        if errors:
            # Go's aggregate error: one message alone, several as "[a, b]".
            raise _MountError(errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]")
        files = _finish(payload, self.fs_group)
        for path, content in list(files.items()):
            if isinstance(content, _PendingToken):
                del files[path]
                self.deferred.append(
                    TokenFile(
                        name,
                        path,
                        content.mode,
                        content.owner_uid,
                        content.audience,
                        content.expiration_seconds,
                    )
                )
        return FilesVolume(name, _FILE_KINDS[kind], files, self.fs_group)


def resolve_volumes(
    pod: JSON,
    sources: Sources,
    *,
    token_source: TokenSource | None,
    node_allocatable: JSON,
    defer_tokens: bool = False,
) -> VolumeResult:
    """Resolve every volume of `pod` as the kubelet's volume plugins would set it up.

    A volume that cannot be set up (missing mandatory ConfigMap/Secret or key, unreadable
    source, bad field reference, hostile path) is reported in `errors` with the kubelet's
    `FailedMount` message and left out of `volumes`; the pod must not start until it resolves.
    Missing optional sources give empty volumes or skipped keys. `token_source` None means
    this node cannot issue service-account tokens (volumes that need one fail).
    `defer_tokens` requests no token: each token file is left out of its volume and listed in
    `deferred_tokens` instead, for a provider that asks for tokens when it needs them.
    """
    resolver = _VolumeResolver(pod, sources, token_source, node_allocatable, defer_tokens)
    volumes: list[ResolvedVolume] = []
    errors: list[VolumeError] = []
    for volume in (obj(v) for v in seq(obj(pod.get("spec")).get("volumes"))):
        name = text(volume.get("name"))
        try:
            volumes.append(resolver.resolve(volume))
        except _MountError as err:
            errors.append(
                VolumeError(name, f'MountVolume.SetUp failed for volume "{name}" : {err}')
            )
    return VolumeResult(
        tuple(volumes), tuple(errors), resolver.token_expiry, tuple(resolver.deferred)
    )


# --------------------------------------------------------------------------------------------
# What a pod depends on
