"""What a provider receives for each of a pod's volumes: file contents or declarations.

The agent resolves configMap, secret, downwardAPI and projected volumes into files exactly as the
kubelet's volume plugins would write them, so a provider only writes `{path: FileContent}` below
the volume's directory; emptyDir and hostPath arrive as declarations, anything else as declared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

JSON = Mapping[str, Any]

FileKind = Literal["configMap", "secret", "downwardAPI", "projected"]


@dataclass(frozen=True)
class FileContent:
    """One file of a volume. `owner_uid` is set where the kubelet chowns the file (token and
    trust-bundle files, when all containers run as the same user)."""

    data: bytes
    mode: int
    owner_uid: int | None = None


@dataclass(frozen=True)
class FilesVolume:
    """A configMap, secret, downwardAPI or projected volume: a read-only tree of files.

    `files` maps clean relative paths ("a/b.txt") to contents. `fs_group`, when set, is the
    group that should own the files (their modes already include the group-read bits).
    """

    name: str
    kind: FileKind
    files: Mapping[str, FileContent]
    fs_group: int | None = None


@dataclass(frozen=True)
class EmptyDirVolume:
    """A scratch directory; `medium` "" (node disk), "Memory" or "HugePages[-<size>]"."""

    name: str
    medium: str = ""
    size_limit: str | None = None


@dataclass(frozen=True)
class HostPathVolume:
    name: str
    path: str
    type: str = ""


@dataclass(frozen=True)
class OtherVolume:
    """Any other volume type (persistentVolumeClaim, csi, image, ...), as declared."""

    name: str
    kind: str
    source: JSON


ResolvedVolume = FilesVolume | EmptyDirVolume | HostPathVolume | OtherVolume
