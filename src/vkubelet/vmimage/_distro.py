"""Build the distribution test guest: Debian bookworm with systemd, cloud-init, qemu-ga and sshd.

Where the small guest fakes a distribution with a few lines of init, this one is the real thing,
so a test can prove that *real* cloud-init applies a seed (user-data, SSH keys, hostname,
network-config) the way it would in a downloaded cloud image. It is made only from Debian packages,
from the Debian mirror the host's apt already uses (no downloaded images, nothing committed):

1. `debootstrap --variant=minbase` the release, then `apt-get install --no-install-recommends` the
   cloud kernel, cloud-init, qemu-guest-agent, systemd, sshd in a chroot (with the host's Debian
   suites, so the security kernel is the one the host's apt lists name);
2. configure it like a cloud image (NoCloud only, networkd renders cloud-init's network config,
   host keys and machine-id removed so each VM makes its own, apt caches and docs dropped);
3. write the disk the small guest has too (`_build.write_disk`, no loop devices or mounts): an MBR
   with syslinux's boot code, a FAT boot partition holding syslinux, kernel and initramfs (mtools),
   and the ext4 root written straight into its partition by `mkfs.ext4 -E offset=... -d <tree>`;
   then `qemu-img convert`.

It boots from its own disk (SeaBIOS -> syslinux -> kernel -> initramfs -> systemd) like any cloud
image. The chroot step needs root (debootstrap, chroot, mounting proc/sys inside the tree).

Cached like the small guest under ~/.cache/vkubelet/vm-images/<recipe hash>; the hash covers the
recipe below and the candidate versions of the main packages in the host's apt lists.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import _debian
from ._build import (
    BOOT_START,
    GuestImage,
    ImageBuildError,
    Layout,
    Progress,
    default_cache_dir,
    publish,
    remembered,
    write_disk,
)

RECIPE_VERSION = 1
SUITE = "bookworm"
#: Installed on top of minbase, without recommends; the kernel meta package resolves to the
#: concrete kernel of the host's apt lists.
PACKAGES = (
    "linux-image-cloud-amd64",
    "initramfs-tools",
    "systemd-sysv",
    "udev",
    "dbus",  # hostnamectl (cloud-init's set_hostname under systemd) talks to systemd-hostnamed
    "cloud-init",
    # cloud-init's network config goes to systemd-networkd, which hands DNS servers and search
    # domains to resolved only: without it /etc/resolv.conf would not name the cluster DNS.
    "systemd-resolved",
    "qemu-guest-agent",
    "openssh-server",
)
#: Packages whose versions name the recipe (the rest follow from these and the release).
VERSIONED = ("cloud-init", "qemu-guest-agent", "systemd", "openssh-server", "initramfs-tools")
#: The initramfs only has to find an ext4 root on virtio or SCSI disks; a short list keeps it
#: small (~6 MB) and fast to unpack under TCG.
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_scsi", "sd_mod", "ext4")
#: cloud-init as on a cloud image, minus what only costs time in a test guest: NoCloud is the only
#: datasource looked for, no locale generation, ed25519 + ECDSA host keys (RSA keygen is slow
#: under TCG). User-data may override all of it.
CLOUD_CFG = """\
datasource_list: [NoCloud, None]
locale: false
grub_dpkg: {enabled: false}
ssh_genkeytypes: [ed25519, ecdsa]
"""
DPKG_EXCLUDES = """\
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
"""
#: Units a throwaway test VM does not need (periodic apt, scrubbing, the VGA getty).
DISABLED_UNITS = (
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    "getty@tty1.service",
)
ENABLED_UNITS = ("systemd-networkd.service", "systemd-resolved.service")
KERNEL_CMDLINE = "ro console=ttyS0 panic=-1"
BOOT_MIB = 48
ROOT_MIB = 2048  # virtual size; the qcow2 stores only what is used
#: Compressed clusters: ~160 MB instead of ~415 MB for 3 s of zstd; QEMU inflates them on the
#: host side, which costs nothing next to TCG. Overlays on top write uncompressed as usual.
COMPRESSION = "zstd"


#: Said when a tool the build runs is missing.
TOOLS = (
    "apt-get install -y --no-install-recommends "
    "debootstrap qemu-utils syslinux mtools dosfstools e2fsprogs"
)


def _run(argv: list[str], *, what: str, env: dict[str, str] | None = None) -> str:
    try:
        return _debian.run(argv, what=what, missing=TOOLS, env=env)
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None


def debian_sources(suite: str = SUITE) -> list[tuple[str, str]]:
    """(URI, suite) of every Debian archive of `suite` the host's apt uses, main component.

    Read from `apt-cache policy`, so the guest comes from the same mirror (and the same
    security/updates suites) as the host's own packages; nothing else is contacted.
    """
    try:
        lines = _debian.apt_cache(["policy"], what="read the host's apt sources").splitlines()
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None
    found: list[tuple[str, str]] = []
    for source, release in itertools.pairwise(lines):
        words = source.split()
        if len(words) < 3 or "://" not in words[1] or "release " not in release:
            continue
        fields = dict(
            f.split("=", 1) for f in release.split("release ", 1)[1].split(",") if "=" in f
        )
        name = fields.get("n", "")
        if (
            fields.get("o") == "Debian"
            and fields.get("c") == "main"
            and (name == suite or name.startswith(f"{suite}-"))
        ):
            entry = (words[1].rstrip("/"), name)
            if entry not in found:
                found.append(entry)
    if not any(name == suite for _, name in found):
        raise ImageBuildError(
            f"the host's apt has no Debian {suite} main source (apt-cache policy): "
            "the distribution guest is built from the mirror the host uses"
        )
    return sorted(found, key=lambda e: (e[1] != suite, e[1]))


def resolve_packages() -> dict[str, str]:
    """Candidate versions of the main packages in the local apt lists (one `apt-cache` call).

    The kernel meta package's version pins the concrete kernel, so it stands for it.
    """
    try:
        return _debian.candidate_versions(
            (PACKAGES[0], *VERSIONED), what="resolve the guest's packages"
        )
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None


def recipe_hash(packages: dict[str, str], sources: list[tuple[str, str]]) -> str:
    recipe = {
        "kind": "debian-distro",
        "version": RECIPE_VERSION,
        "suite": SUITE,
        "sources": sources,
        "packages": packages,
        "install": PACKAGES,
        "initramfs": INITRAMFS_MODULES,
        "cloud_cfg": CLOUD_CFG,
        "excludes": DPKG_EXCLUDES,
        "units": [DISABLED_UNITS, ENABLED_UNITS],
        "cmdline": KERNEL_CMDLINE,
        "layout": [BOOT_START, BOOT_MIB, ROOT_MIB, COMPRESSION],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _resolve(cache_dir: Path | None) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Versions and sources (remembered: apt-cache is slow here)."""
    memo = (cache_dir or default_cache_dir()) / "resolved-distro.json"
    found = remembered(memo, lambda: {"packages": resolve_packages(), "sources": debian_sources()})
    return dict(found["packages"]), [(u, n) for u, n in found["sources"]]


def build_distro_image(
    cache_dir: Path | None = None, progress: Progress = lambda _: None, *, force: bool = False
) -> GuestImage:
    """Build the Debian distribution guest, or return the cached one for the same recipe."""
    packages, sources = _resolve(cache_dir)
    digest = recipe_hash(packages, sources)
    target = (cache_dir or default_cache_dir()) / digest
    disk = target / "disk.qcow2"
    if disk.is_file() and not force:
        progress(f"cached distribution guest {disk}")
        return GuestImage(disk, digest, packages)
    if os.geteuid() != 0:
        raise ImageBuildError("building the distribution guest needs root (debootstrap, chroot)")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{digest}-", dir=target.parent))
    try:
        out = work / "out"
        out.mkdir()
        _build(work, out / "disk.qcow2", sources, progress)
        recipe = {"hash": digest, "kind": "debian-distro", "packages": packages, "sources": sources}
        publish(out, recipe, target, replace=force)
    finally:
        _remove_tree(work)
    progress(f"distribution guest ready: {disk}")
    return GuestImage(disk, digest, packages)


def _build(work: Path, qcow2: Path, sources: list[tuple[str, str]], progress: Progress) -> None:
    root = work / "root"
    mirror = sources[0][0]
    progress(f"debootstrap {SUITE} (minbase) from {mirror}")
    _run(
        ["debootstrap", "--variant=minbase", SUITE, str(root), mirror],
        what="debootstrap",
    )
    _prepare_tree(root, sources)
    progress("installing " + ", ".join(PACKAGES))
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "DEBIAN_FRONTEND": "noninteractive",
        "LC_ALL": "C",
    }
    with _chroot_mounts(root):
        _run(["chroot", str(root), "apt-get", "update", "-q"], what="apt-get update", env=env)
        _run(
            ["chroot", str(root), "apt-get", "install", "-y", "-q", *PACKAGES],
            what="apt-get install",
            env=env,
        )
        _run(
            ["chroot", str(root), "systemctl", "disable", *DISABLED_UNITS],
            what="disable units",
            env=env,
        )
        _run(
            ["chroot", str(root), "systemctl", "enable", *ENABLED_UNITS],
            what="enable units",
            env=env,
        )
        _run(["chroot", str(root), "apt-get", "clean"], what="apt-get clean", env=env)
    root_uuid = str(uuid.uuid4())
    _finish_tree(root, root_uuid)
    progress("writing the disk (MBR + syslinux FAT boot partition + ext4 root)")
    _write_disk(work, root, root_uuid, qcow2)


def _prepare_tree(root: Path, sources: list[tuple[str, str]]) -> None:
    """Configuration that must be in place before the packages are installed."""
    (root / "etc/apt/sources.list").write_text(
        "".join(f"deb {uri} {suite} main\n" for uri, suite in sources)
    )
    (root / "etc/apt/apt.conf.d/90vkubelet").write_text('APT::Install-Recommends "false";\n')
    (root / "etc/dpkg/dpkg.cfg.d/90vkubelet-excludes").write_text(DPKG_EXCLUDES)
    policy = root / "usr/sbin/policy-rc.d"  # no service starts inside the chroot
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    initramfs = root / "etc/initramfs-tools"
    (initramfs / "conf.d").mkdir(parents=True, exist_ok=True)
    (initramfs / "conf.d/vkubelet.conf").write_text("MODULES=list\n")
    (initramfs / "modules").write_text("".join(f"{m}\n" for m in INITRAMFS_MODULES))
    cloud = root / "etc/cloud/cloud.cfg.d"
    cloud.mkdir(parents=True, exist_ok=True)
    (cloud / "90-vkubelet.cfg").write_text(CLOUD_CFG)


def _finish_tree(root: Path, root_uuid: str) -> None:
    """Make the tree a fresh image: per-VM identity comes from the VM's first boot."""
    (root / "usr/sbin/policy-rc.d").unlink()
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # cloud-init's ssh module generates them per VM
    (root / "etc/machine-id").write_text("")  # systemd makes one on first boot
    (root / "etc/hostname").write_text("localhost\n")
    (root / "etc/fstab").write_text(f"UUID={root_uuid} / ext4 errors=remount-ro 0 0\n")
    lists = root / "var/lib/apt/lists"
    shutil.rmtree(lists)
    (lists / "partial").mkdir(parents=True)
    for log in (root / "var/log").rglob("*"):
        if log.is_file():
            log.write_bytes(b"")


@contextmanager
def _chroot_mounts(root: Path) -> Iterator[None]:
    """proc and sys inside the tree while packages install (maintainer scripts read them)."""
    mounted: list[Path] = []
    try:
        for fstype, sub in (("proc", "proc"), ("sysfs", "sys")):
            point = root / sub
            _run(["mount", "-t", fstype, fstype, str(point)], what=f"mount {sub} in the chroot")
            mounted.append(point)
        yield
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points


def _remove_tree(path: Path) -> None:
    """Remove a build directory, never through a mount left inside it (that would be the host's)."""
    if not path.exists():
        return
    left = _mounts_under(path)
    if left:
        raise ImageBuildError(f"not removing {path}: still mounted inside it: {', '.join(left)}")
    shutil.rmtree(path)


def _write_disk(work: Path, root: Path, root_uuid: str, qcow2: Path) -> None:
    kernel = next((root / "boot").glob("vmlinuz-*"), None)
    initrd = next((root / "boot").glob("initrd.img-*"), None)
    if kernel is None or initrd is None:
        raise ImageBuildError(f"no kernel or initramfs in {root / 'boot'} after installing")
    write_disk(
        work,
        qcow2,
        kernel=kernel,
        initrd=initrd,
        cmdline=KERNEL_CMDLINE,
        root=root,
        root_uuid=root_uuid,
        layout=Layout(boot_mib=BOOT_MIB, root_mib=ROOT_MIB, compression=COMPRESSION),
    )
