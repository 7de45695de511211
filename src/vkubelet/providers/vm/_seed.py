"""The cloud-init seed as an ISO 9660 image, written in-process with pycdlib.

In-process (no genisoimage/xorriso subprocess) because it takes milliseconds and leaves nothing to
install. A NoCloud seed is labelled `cidata` with `meta-data`, `user-data` and `network-config` at
its root; a ConfigDrive is labelled `config-2` with `openstack/latest/meta_data.json`, `user_data`
and `network_data.json` (the labels and paths cloud-init's datasources look for; the small test
guest finds either label). The extra files sit at the root of both. With
Rock Ridge (Linux sees real names and file modes: secrets stay 0600 when the guest copies them with
`cp -p`) and Joliet (other readers see real names too). ISO level 4 keeps the plain ISO names close
to the real ones for readers that know neither extension.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Protocol

import pycdlib

from ..._files import write_private

LABEL = "cidata"
CONFIG_DRIVE_LABEL = "config-2"
_CONFIG_DRIVE_DIR = "openstack/latest/"
DEFAULT_FILE_MODE = 0o644
_JOLIET_MAX = 64


class SeedLike(Protocol):
    """What the seed needs of vmstore's `SeedContent` (structural: either side may land first)."""

    @property
    def meta_data(self) -> str: ...
    @property
    def user_data(self) -> str: ...
    @property
    def network_config(self) -> str | None: ...
    @property
    def extra_files(self) -> Mapping[str, bytes]: ...
    @property
    def kind(self) -> str: ...  # "nocloud" or "configdrive"


class SeedError(ValueError):
    """A seed path cannot be written (absolute, `..`, empty or too long a component)."""


def write_seed_iso(
    content: SeedLike, path: Path, *, file_modes: Mapping[str, int] | None = None
) -> None:
    """Write the seed ISO atomically (a VM never sees half a seed).

    `file_modes` maps a path of `extra_files` to its permission bits (default 0644).
    """
    if content.kind == "configdrive":
        label = CONFIG_DRIVE_LABEL
        names = [
            _CONFIG_DRIVE_DIR + name
            for name in ("meta_data.json", "user_data", "network_data.json")
        ]
    elif content.kind == "nocloud":
        label = LABEL
        names = ["meta-data", "user-data", "network-config"]
    else:
        raise SeedError(f"seed kind {content.kind!r}: must be nocloud or configdrive")
    files: dict[str, bytes] = {
        names[0]: content.meta_data.encode(),
        names[1]: content.user_data.encode(),
    }
    if content.network_config is not None:
        files[names[2]] = content.network_config.encode()
    for name, data in content.extra_files.items():
        files[_check(name)] = data
    modes = {_check(k): v for k, v in (file_modes or {}).items()}

    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=4, vol_ident=label, joliet=3, rock_ridge="1.09")
    made: set[str] = set()
    for name in sorted(files):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            directory = "/" + "/".join(parts[:depth])
            if directory not in made:
                iso.add_directory(
                    directory, rr_name=parts[depth - 1], joliet_path=directory, file_mode=0o40755
                )
                made.add(directory)
        data = files[name]
        iso.add_fp(
            io.BytesIO(data),
            len(data),
            "/" + name,
            rr_name=parts[-1],
            joliet_path="/" + name,
            file_mode=0o100000 | (modes.get(name, DEFAULT_FILE_MODE) & 0o7777),
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    iso.write_fp(image)
    iso.close()
    write_private(path, image.getvalue())  # it holds the pod's secrets


def _check(name: str) -> str:
    parts = PurePosixPath(name).parts
    if (
        not parts
        or name.startswith("/")
        or any(p in ("..", ".") for p in parts)
        or any(len(p) > _JOLIET_MAX for p in parts)
    ):
        raise SeedError(f"seed path {name!r}: must be relative, without '..', components <= 64")
    return "/".join(parts)
