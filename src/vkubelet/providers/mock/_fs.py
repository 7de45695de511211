"""A container's files, in memory: what `kubectl exec` and `kubectl cp` see in a mock pod.

Each container gets its own filesystem on first use, seeded with a few system directories,
/etc/hostname, /etc/hosts and the pod's volume files at their mount paths. Nothing there
outlives the agent.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from collections.abc import Iterable, Iterator, Mapping

from ._records import MockContainer, MockPod

FILESYSTEM_LIMIT = 64 * 2**20  # bytes of files one mock container may hold
_BASE_DIRECTORIES = ("/bin", "/dev", "/etc", "/home", "/proc", "/root", "/usr/bin", "/var")
_TMP = "/tmp"  # noqa: S108 - the mock container's own /tmp, in memory


class FsError(Exception):
    """A failed file operation; the message is what a shell would say ("No such file...")."""


class NoSpace(Exception):
    """The container's filesystem is full."""


def join(base: str, path: str) -> str:
    """`path` made absolute against `base` and normalised (no "..", no "//")."""
    joined = posixpath.normpath(posixpath.join(base, path))
    return "/" + joined.lstrip("/")


class Filesystem:
    """A container's files in memory: absolute path -> contents, and the set of directories.

    Modification times are kept (so that `tar` makes the same archive twice, which
    `kubectl cp --retries` relies on); modes and owners are not: 0644 files, 0755 directories.
    """

    def __init__(self, limit: int = FILESYSTEM_LIMIT) -> None:
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = {"/"}
        self.mtimes: dict[str, int] = {}
        self.limit = limit
        self.used = 0

    def is_dir(self, path: str) -> bool:
        return path in self.dirs

    def is_file(self, path: str) -> bool:
        return path in self.files

    def exists(self, path: str) -> bool:
        return path in self.dirs or path in self.files

    def makedirs(self, path: str) -> None:
        missing = []
        while path not in self.dirs:
            if path in self.files:
                raise FsError("Not a directory")
            missing.append(path)
            path = posixpath.dirname(path)
        self.dirs.update(missing)
        now = int(time.time())
        self.mtimes.update((directory, now) for directory in missing)

    def read(self, path: str) -> bytes:
        if path in self.dirs:
            raise FsError("Is a directory")
        if path not in self.files:
            raise FsError("No such file or directory")
        return bytes(self.files[path])

    def write(self, path: str, data: bytes, *, append: bool = False) -> None:
        """Create or replace (or append to) a file, creating its directories."""
        if path in self.dirs:
            raise FsError("Is a directory")
        old = self.files.get(path)
        growth = len(data) - (0 if append or old is None else len(old))
        if self.used + growth > self.limit:
            raise NoSpace
        self.makedirs(posixpath.dirname(path))
        if old is not None and append:
            old += data
        else:
            self.files[path] = bytearray(data)
        self.used += growth
        self.mtimes[path] = int(time.time())

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        names = {
            entry[len(prefix) :]
            for entry in (*self.files, *self.dirs)
            if entry.startswith(prefix) and entry != prefix and "/" not in entry[len(prefix) :]
        }
        return sorted(names)

    def walk(self, path: str) -> Iterator[str]:
        """`path` and, for a directory, everything below it, parents first, sorted."""
        yield path
        if path in self.dirs:
            for name in self.listdir(path):
                yield from self.walk(posixpath.join(path, name))

    def remove(self, path: str) -> None:
        """A file, or a directory with all it holds (never the root itself)."""
        if path in self.files:
            self.used -= len(self.files.pop(path))
            self.mtimes.pop(path, None)
            return
        prefix = path.rstrip("/") + "/"
        for name in [f for f in self.files if f.startswith(prefix)]:
            self.used -= len(self.files.pop(name))
        self.dirs -= {d for d in self.dirs if d.startswith(prefix)}
        if path != "/":
            self.dirs.discard(path)
        for name in [m for m in self.mtimes if m.startswith(prefix) or m == path]:
            del self.mtimes[name]


def write_mounted(
    fs: Filesystem,
    files: Mapping[str, str],
    mounts: Iterable[tuple[str, str, str]],
    *,
    renew: bool = False,
) -> None:
    """Write `files` ("volume/path" -> text) where `mounts` (volume, path, subPath) put them,
    and nothing else. `renew`: files that change while the container runs (tokens fetched or
    renewed on demand) — a subPath file already there is kept (the kubelet never updates
    those), and an empty directory a subPath mount made before its file was known gives way."""
    for volume, mount_path, sub_path in mounts:
        target = join("/", mount_path)
        sub = sub_path.strip("/")
        for key, text in files.items():
            name, _, rel = key.partition("/")
            if name != volume:
                continue
            if sub and rel == sub:
                destination = target
                if renew and fs.is_file(destination):
                    continue
                if fs.is_dir(destination) and not fs.listdir(destination):
                    fs.remove(destination)
            elif not sub or rel.startswith(sub + "/"):
                destination = join(target, rel[len(sub) + 1 :] if sub else rel)
            else:
                continue
            with contextlib.suppress(FsError, NoSpace):
                fs.write(destination, text.encode())


def mount_volumes(
    fs: Filesystem,
    files: Mapping[str, str],
    container: MockContainer,
    *,
    refresh: bool = False,
) -> None:
    """Put `files` ("volume/path" -> text) where the container mounts their volumes. `refresh`
    replaces the contents of whole-volume mounts (subPath mounts are never updated, as on a
    kubelet)."""
    mounts = [m for m in container.mounts if not (refresh and m[2].strip("/"))]
    for volume, mount_path, sub_path in mounts:
        target = join("/", mount_path)
        sub = sub_path.strip("/")
        if refresh:
            fs.remove(target)
        if not sub or f"{volume}/{sub}" not in files:  # a directory is mounted
            with contextlib.suppress(FsError):
                fs.makedirs(target)
    write_mounted(fs, files, mounts)


def container_filesystem(
    mock: MockPod, container: MockContainer, files: Mapping[str, str]
) -> Filesystem:
    """A new container's files: system directories, host names and the mounted volumes'
    `files` ("volume/path" -> text)."""
    fs = Filesystem()
    for directory in (*_BASE_DIRECTORIES, _TMP):
        fs.makedirs(directory)
    fs.write("/etc/hostname", f"{mock.name}\n".encode())
    fs.write("/etc/hosts", f"127.0.0.1\tlocalhost\n{mock.ip}\t{mock.name}\n".encode())
    mount_volumes(fs, files, container)
    return fs
