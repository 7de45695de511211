"""Build the small test guest from Debian packages: cloud kernel + busybox + qemu-ga on ext4.

Everything comes from Debian's repositories through `apt-get download` (nothing else is fetched,
nothing binary is committed). The result is a qcow2 disk that boots like any other image and
keeps what the guest writes, like any real VM (`write_disk`, shared with the distribution guest):
an MBR, a FAT boot partition with syslinux, the kernel and a tiny initramfs (busybox and the
virtio disk modules: it mounts the root and `switch_root`s into it), and an ext4 root partition
with busybox, the guest's init, its modules and qemu-ga, made by `mkfs.ext4 -d` (no loop mount,
no root needed). The provider therefore treats the test guest exactly as a downloaded cloud image.

Builds are cached under ~/.cache/vkubelet/vm-images/<recipe hash>; the hash covers this module's
recipe (init script, module list, boot config) and the exact Debian package versions, so a new
kernel in the archive or an edited init script gives a new image and an unchanged recipe reuses
the old one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import struct
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .. import _debian
from .._files import write_atomic

Progress = Callable[[str], None]

RECIPE_VERSION = 2  # 2: the root file system on the root disk (1 ran from the initramfs)
KERNEL_META = "linux-image-cloud-amd64"
AGENT_PACKAGE = "qemu-guest-agent"
BUSYBOX_PACKAGE = "busybox-static"
#: Modules the guest loads, by name; their dependencies are found in the .ko files and loaded
#: first (virtio_ring before virtio, failover before virtio_net, ...).
GUEST_MODULES = (
    "pvpanic_pci",  # first: a crash later in /init reaches QEMU as GUEST_PANICKED
    "virtio_pci",
    "virtio_blk",
    "virtio_net",
    "virtio_console",
    "virtio_balloon",
    "isofs",
    "button",
    "evdev",
)
#: Fast-boot switches for an emulated CPU: no i8042 probing, trust the TSC, no self-tests, no KASLR
#: relocation, no speculative-execution mitigations (a throwaway test guest).
KERNEL_CMDLINE = (
    "console=ttyS0 quiet panic=-1 i8042.noaux i8042.nomux i8042.nopnp i8042.nokbd tsc=reliable "
    "no_timer_check cryptomgr.notests rcupdate.rcu_expedited=1 nokaslr mitigations=off"
)
REBOOT_SCRIPT = """#!/bin/sh
echo "vkubelet-guest: reboot requested" > /dev/console
sync
mount -o remount,ro / 2>/dev/null
exec busybox reboot -f
"""
#: busybox acpid runs /etc/acpi/PWRF/00000080 on the ACPI power button (QMP system_powerdown).
ACPI_POWER_SCRIPT = """#!/bin/sh
echo "vkubelet-guest: ACPI power button" > /dev/console
exec /sbin/poweroff
"""

SYSLINUX_MBR = Path("/usr/lib/syslinux/mbr/mbr.bin")
SECTOR = 512
BOOT_START = 2048  # sectors: 1 MiB alignment, as partitioning tools do


@dataclass(frozen=True)
class Layout:
    """A guest disk's partition sizes and options (part of each guest's recipe hash)."""

    boot_mib: int
    root_mib: int  # the root partition's size; the qcow2 stores only what is used
    #: qcow2 cluster compression (e.g. "zstd"), or None: QEMU inflates clusters on every read.
    compression: str | None = None
    #: More `mkfs.ext4 -E` options, after the partition's offset.
    ext4_extended: tuple[str, ...] = ()

    @property
    def root_start(self) -> int:
        """The root partition's first sector."""
        return BOOT_START + self.boot_mib * 1024 * 1024 // SECTOR


#: The small guest: 1 + 32 + 224 MiB, so a disk grown to 1 GiB has free space past the partitions
#: (tests write marks there). Inode tables zeroed at build time: else the guest's kernel zeroes
#: them in the background at first mount, writing megabytes into every VM's overlay.
LAYOUT = Layout(boot_mib=32, root_mib=224, ext4_extended=("lazy_itable_init=0",))


class ImageBuildError(RuntimeError):
    """A build step failed; the message says which and what to install or fix."""


@dataclass(frozen=True)
class GuestImage:
    """A built (or cached) test guest."""

    disk: Path  # qcow2, boots from its own disk (SeaBIOS -> syslinux -> kernel + initramfs)
    recipe_hash: str
    packages: dict[str, str]  # Debian package -> version used


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vkubelet" / "vm-images"


#: Said when a tool the build runs is missing.
TOOLS = (
    "apt-get install -y --no-install-recommends "
    "qemu-utils syslinux mtools dosfstools e2fsprogs cpio"
)


def _run(argv: list[str], *, what: str) -> str:
    try:
        return _debian.run(argv, what=what, missing=TOOLS)
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None


def _data(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def remembered(memo: Path, resolve: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """What `resolve()` answers, remembered in `memo` until the apt lists change (apt-get
    update): apt-cache takes a second or more per call here (no binary package cache)."""
    stamp = hashlib.sha256(_debian.lists_stamp().encode()).hexdigest()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        known = json.loads(memo.read_text())
        if known["stamp"] == stamp:
            return {key: value for key, value in known.items() if key != "stamp"}
    answer = resolve()
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, json.dumps({"stamp": stamp, **answer}) + "\n")
    return answer


def resolve_packages(cache_dir: Path | None = None) -> dict[str, str]:
    """The concrete Debian packages and versions the recipe uses (from the local apt lists)."""
    memo = (cache_dir or default_cache_dir()) / "resolved.json"
    return dict(remembered(memo, lambda: {"packages": _versions()})["packages"])


def _versions() -> dict[str, str]:
    try:
        deps = _debian.apt_cache(["depends", KERNEL_META], what="resolve the cloud kernel")
        kernel = next(
            (line.split(":", 1)[1].strip() for line in deps.splitlines() if "Depends:" in line),
            None,
        )
        if kernel is None or not kernel.startswith("linux-image-"):
            raise ImageBuildError(f"{KERNEL_META} not in the apt lists: run apt-get update")
        wanted = (kernel, AGENT_PACKAGE, BUSYBOX_PACKAGE)
        return _debian.candidate_versions(wanted, what="resolve package versions")
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None


def recipe_hash(packages: dict[str, str]) -> str:
    recipe = {
        "version": RECIPE_VERSION,
        "packages": packages,
        "modules": GUEST_MODULES,
        "cmdline": KERNEL_CMDLINE,
        "layout": [BOOT_START, *astuple(LAYOUT)],
        "initramfs": _data("guest-initramfs.sh"),
        "init": _data("guest-init.sh"),
        "shutdown": _data("guest-shutdown.sh"),
        "reboot": REBOOT_SCRIPT,
        "acpi": ACPI_POWER_SCRIPT,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _today(cache_dir: Path | None) -> GuestImage:
    """Today's recipe: its image, built or not."""
    packages = resolve_packages(cache_dir)
    digest = recipe_hash(packages)
    return GuestImage((cache_dir or default_cache_dir()) / digest / "disk.qcow2", digest, packages)


def cached_image(cache_dir: Path | None = None) -> GuestImage | None:
    """The image for today's recipe if it was built before (no build, no download)."""
    image = _today(cache_dir)
    return image if image.disk.is_file() else None


def publish(out: Path, recipe: dict[str, Any], target: Path, *, replace: bool) -> None:
    """Move a finished build (`out`) into the cache as `target`, its recipe beside the disk."""
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    if replace or not (target / "disk.qcow2").is_file():  # else a concurrent build won: keep it
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)  # atomic: a half-built image is never seen as cached


def build_guest_image(
    cache_dir: Path | None = None, progress: Progress = lambda _: None, *, force: bool = False
) -> GuestImage:
    """Build the test guest, or return the cached one for the same recipe."""
    image = _today(cache_dir)
    if image.disk.is_file() and not force:
        progress(f"cached test guest {image.disk}")
        return image
    target = image.disk.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix=f".build-{image.recipe_hash}-", dir=target.parent
    ) as tmp:
        work = Path(tmp)
        _build(work, image.packages, image.recipe_hash, progress)
        recipe = {"hash": image.recipe_hash, "packages": image.packages}
        publish(work / "out", recipe, target, replace=False)
    progress(f"test guest ready: {image.disk}")
    return image


def _build(work: Path, packages: dict[str, str], digest: str, progress: Progress) -> None:
    progress("downloading " + ", ".join(f"{p} {v}" for p, v in packages.items()))
    pkgroot = work / "pkgroot"
    try:
        _debian.download_and_unpack(packages, pkgroot)
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None
    kernel = next((pkgroot / "boot").glob("vmlinuz-*"))
    release = kernel.name.removeprefix("vmlinuz-")
    moddir = pkgroot / "lib" / "modules" / release

    progress("assembling the initramfs and the root file system")
    initramfs = work / "initramfs"
    _install_busybox(initramfs, pkgroot)
    _install_modules(initramfs, moddir, GUEST_MODULES)
    _install_script(initramfs / "init", _data("guest-initramfs.sh"))
    (initramfs / "newroot").mkdir()
    initrd = work / "initrd.img"
    _write_cpio_gz(initramfs, initrd)
    root = work / "root"
    _assemble_root(root, pkgroot)

    progress(f"writing the disk (kernel {release}, initramfs {initrd.stat().st_size} bytes)")
    out = work / "out"
    out.mkdir()
    root_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"vkubelet-test-guest/{digest}"))
    write_disk(
        work,
        out / "disk.qcow2",
        kernel=kernel,
        initrd=initrd,
        cmdline=KERNEL_CMDLINE,
        root=root,
        root_uuid=root_uuid,
        layout=LAYOUT,
    )


def _install_busybox(dest: Path, pkgroot: Path) -> None:
    """busybox and a link per applet in `dest`/bin, plus the mount points of proc, sys, dev."""
    for sub in ("bin", "proc", "sys", "dev"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    busybox = dest / "bin" / "busybox"
    shutil.copy2(pkgroot / "bin" / "busybox", busybox)
    applets = _run([str(busybox), "--list"], what="list busybox applets").split()
    for applet in applets:
        link = dest / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")


def _install_modules(dest: Path, moddir: Path, wanted: Iterable[str]) -> None:
    """The modules, dependencies first, and /etc/vkubelet-modules: the order to load them in."""
    (dest / "lib" / "modules").mkdir(parents=True, exist_ok=True)
    (dest / "etc").mkdir(exist_ok=True)
    modules = _module_order(moddir, wanted)
    for name, path in modules:
        shutil.copy2(path, dest / "lib" / "modules" / f"{name}.ko")
    (dest / "etc" / "vkubelet-modules").write_text("".join(f"{n}\n" for n, _ in modules))


def _install_script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def _assemble_root(dest: Path, pkgroot: Path) -> None:
    """The root file system: busybox, the init and power scripts and qemu-ga."""
    _install_busybox(dest, pkgroot)
    scripts = {
        "sbin/init": _data("guest-init.sh"),
        "sbin/shutdown": _data("guest-shutdown.sh"),
        "sbin/reboot": REBOOT_SCRIPT,
        "etc/acpi/PWRF/00000080": ACPI_POWER_SCRIPT,
    }
    for name, text in scripts.items():
        _install_script(dest / name, text)
    for alias in ("poweroff", "halt"):
        (dest / "sbin" / alias).symlink_to("shutdown")
    for sub in ("run", "tmp", "root", "seed", "var/log"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    (dest / "var" / "run").symlink_to("../run")  # /run is a tmpfs: pid files never outlive a boot
    (dest / "etc" / "hostname").write_text("vkubelet-guest\n")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\n")
    (dest / "etc" / "profile").write_text('export PATH=/sbin:/bin\nPS1="$(hostname):\\w# "\n')

    agent = pkgroot / "usr" / "sbin" / "qemu-ga"
    shutil.copy2(agent, dest / "bin" / "qemu-ga")
    for lib in _shared_libraries(agent):
        target = dest / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(lib.resolve(), target)


def _module_order(moddir: Path, wanted: Iterable[str]) -> list[tuple[str, Path]]:
    """Modules with their dependencies first, read from each .ko's `depends=` modinfo field."""
    by_name = {p.name.removesuffix(".ko").replace("-", "_"): p for p in moddir.rglob("*.ko")}
    ordered: list[tuple[str, Path]] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = by_name.get(name)
        if path is None:
            raise ImageBuildError(f"kernel module {name} not found under {moddir}")
        data = path.read_bytes()
        start = data.find(b"\0depends=")
        deps = b""
        if start >= 0:
            deps = data[start + 9 : data.index(b"\0", start + 9)]
        for dep in filter(None, deps.decode().split(",")):
            visit(dep.replace("-", "_"))
        ordered.append((name, path))

    for name in wanted:
        visit(name)
    return ordered


def _shared_libraries(binary: Path) -> list[Path]:
    """The libraries `ldd` resolves for the binary (the host's Debian libraries, same release)."""
    libs: list[Path] = []
    for line in _run(["ldd", str(binary)], what="ldd qemu-ga").splitlines():
        if "not found" in line:
            raise ImageBuildError(
                f"qemu-ga needs a library missing on this host: {line.strip()} "
                "(apt-get install the package that ships it)"
            )
        for word in line.split():
            if word.startswith("/"):
                libs.append(Path(word))
    return libs


def _write_cpio_gz(source: Path, out: Path) -> None:
    names = sorted(str(p.relative_to(source)) for p in source.rglob("*"))
    archive = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
        cwd=source,
        input="\n".join([".", *names]).encode() + b"\n",
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise ImageBuildError(f"cpio failed: {archive.stderr.decode(errors='replace')}")
    out.write_bytes(gzip.compress(archive.stdout, compresslevel=6))


def mbr(partitions: list[tuple[bool, int, int, int]]) -> bytes:
    """A DOS partition table (active, type, first sector, sectors) behind syslinux's MBR code.

    Written here (a few bytes of struct) rather than with sfdisk, which Debian hosts without
    `fdisk` lack; entries are LBA-only (CHS fields at their "use LBA" maximum), which SeaBIOS
    and syslinux's mbr.bin read.
    """
    code = SYSLINUX_MBR.read_bytes()[:440] if SYSLINUX_MBR.is_file() else b""
    if len(code) < 64:
        raise ImageBuildError(f"{SYSLINUX_MBR} missing (apt-get install syslinux-common)")
    lba_only = b"\xfe\xff\xff"
    table = b"".join(
        struct.pack("<B3sB3sII", 0x80 if active else 0, lba_only, kind, lba_only, start, count)
        for active, kind, start, count in partitions
    )
    return code.ljust(440, b"\0") + b"\0" * 6 + table.ljust(64, b"\0") + b"\x55\xaa"


def write_disk(
    work: Path,
    qcow2: Path,
    *,
    kernel: Path,
    initrd: Path,
    cmdline: str,
    root: Path,
    root_uuid: str,
    layout: Layout,
) -> None:
    """Both guests' disk, written without loop devices, mounts or root: an MBR with syslinux's
    boot code, an active FAT boot partition holding syslinux, `kernel`, `initrd` and a
    syslinux.cfg booting them with `root=UUID=<root_uuid> <cmdline>`, and the tree `root` as the
    ext4 root partition (`mkfs.ext4 -E offset=... -d`); then qcow2. `work` holds scratch files.

    `mkfs.ext4 -d` keeps the tree's owners: built by root (as the tests and CI do), the guest's
    files belong to root."""
    boot_sectors = layout.boot_mib * 1024 * 1024 // SECTOR
    root_start = layout.root_start
    root_sectors = layout.root_mib * 1024 * 1024 // SECTOR
    raw = work / "disk.raw"
    with raw.open("wb") as disk:
        disk.truncate((root_start + root_sectors) * SECTOR)
        disk.write(
            mbr([(True, 0x0C, BOOT_START, boot_sectors), (False, 0x83, root_start, root_sectors)])
        )

    fat = work / "boot.fat"
    # Hidden sectors = the partition's start: syslinux's boot sector finds itself with it.
    _run(
        ["mkfs.fat", "-C", "-h", str(BOOT_START), "-n", "VKBOOT", str(fat), str(boot_sectors // 2)],
        what="mkfs.fat",
    )
    _run(["syslinux", "--install", str(fat)], what="syslinux --install")
    cfg = work / "syslinux.cfg"
    cfg.write_text(
        "DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL /vmlinuz\n"
        f"  INITRD /initrd.img\n  APPEND root=UUID={root_uuid} {cmdline}\n"
    )
    for src, name in ((kernel, "vmlinuz"), (initrd, "initrd.img"), (cfg, "syslinux.cfg")):
        _run(["mcopy", "-o", "-i", str(fat), str(src), f"::{name}"], what=f"mcopy {name}")
    with raw.open("r+b") as disk, fat.open("rb") as part:
        disk.seek(BOOT_START * SECTOR)
        shutil.copyfileobj(part, disk)

    extended = ",".join([f"offset={root_start * SECTOR}", *layout.ext4_extended])
    _run(
        ["mkfs.ext4", "-q", "-F", "-L", "vkroot", "-U", root_uuid,
         "-E", extended, "-d", str(root), str(raw), f"{layout.root_mib * 1024}k"],
        what="mkfs.ext4 -d",
    )  # fmt: skip
    compress = ["-c", "-o", f"compression_type={layout.compression}"] if layout.compression else []
    _run(
        ["qemu-img", "convert", *compress, "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)],
        what="qemu-img convert",
    )
