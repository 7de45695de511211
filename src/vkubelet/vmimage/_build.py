"""Build the small test guest from Debian packages: cloud kernel + busybox initramfs + qemu-ga.

Everything comes from Debian's repositories through `apt-get download` (nothing else is fetched,
nothing binary is committed). The result is a qcow2 disk that boots like any other image: an
unpartitioned FAT file system with syslinux in its boot sector (installed with mtools, so no loop
mount and no root needed for this part) holding the kernel, the initramfs and syslinux.cfg. The
provider therefore treats the test guest exactly as it treats a downloaded cloud image.

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
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .. import _debian
from .._files import write_atomic

Progress = Callable[[str], None]

RECIPE_VERSION = 1
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
FAT_SIZE_MIB = 40
SYSLINUX_CFG = f"""DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.img
  APPEND {KERNEL_CMDLINE}
"""
REBOOT_SCRIPT = """#!/bin/sh
echo "vkubelet-guest: reboot requested" > /dev/console
sync
exec busybox reboot -f
"""
#: busybox acpid runs /etc/acpi/PWRF/00000080 on the ACPI power button (QMP system_powerdown).
ACPI_POWER_SCRIPT = """#!/bin/sh
echo "vkubelet-guest: ACPI power button" > /dev/console
exec /sbin/poweroff
"""


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
TOOLS = "apt-get install -y --no-install-recommends qemu-utils syslinux mtools dosfstools cpio"


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
        "syslinux": SYSLINUX_CFG,
        "fat_mib": FAT_SIZE_MIB,
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
        _build(work, image.packages, progress)
        recipe = {"hash": image.recipe_hash, "packages": image.packages}
        publish(work / "out", recipe, target, replace=False)
    progress(f"test guest ready: {image.disk}")
    return image


def _build(work: Path, packages: dict[str, str], progress: Progress) -> None:
    progress("downloading " + ", ".join(f"{p} {v}" for p, v in packages.items()))
    root = work / "pkgroot"
    try:
        _debian.download_and_unpack(packages, root)
    except _debian.AptError as e:
        raise ImageBuildError(str(e)) from None
    kernel = next((root / "boot").glob("vmlinuz-*"))
    release = kernel.name.removeprefix("vmlinuz-")

    progress("assembling the initramfs")
    initramfs = work / "initramfs"
    _assemble_initramfs(initramfs, root, release)
    initrd = work / "initrd.img"
    _write_cpio_gz(initramfs, initrd)

    progress(f"writing the boot disk (kernel {release}, initramfs {initrd.stat().st_size} bytes)")
    out = work / "out"
    out.mkdir()
    _make_boot_disk(work, kernel, initrd, out / "disk.qcow2")


def _assemble_initramfs(dest: Path, root: Path, release: str) -> None:
    for sub in ("bin", "sbin", "etc/acpi/PWRF", "lib/modules", "proc", "sys", "dev", "run"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    busybox = dest / "bin" / "busybox"
    shutil.copy2(root / "bin" / "busybox", busybox)
    applets = _run([str(busybox), "--list"], what="list busybox applets").split()
    for applet in applets:
        link = dest / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    scripts = {
        "init": _data("guest-init.sh"),
        "sbin/shutdown": _data("guest-shutdown.sh"),
        "sbin/reboot": REBOOT_SCRIPT,
        "etc/acpi/PWRF/00000080": ACPI_POWER_SCRIPT,
    }
    for name, text in scripts.items():
        (dest / name).write_text(text)
        (dest / name).chmod(0o755)
    for alias in ("poweroff", "halt"):
        (dest / "sbin" / alias).symlink_to("shutdown")
    (dest / "etc" / "hostname").write_text("vkubelet-guest\n")
    (dest / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc" / "group").write_text("root:x:0:\n")
    (dest / "etc" / "profile").write_text('export PATH=/sbin:/bin\nPS1="$(hostname):\\w# "\n')

    modules = _module_order(root / "lib" / "modules" / release, GUEST_MODULES)
    for name, path in modules:
        shutil.copy2(path, dest / "lib" / "modules" / f"{name}.ko")
    (dest / "etc" / "vkubelet-modules").write_text("".join(f"{n}\n" for n, _ in modules))

    agent = root / "usr" / "sbin" / "qemu-ga"
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


def _make_boot_disk(work: Path, kernel: Path, initrd: Path, qcow2: Path) -> None:
    fat = work / "boot.img"
    _run(
        ["mkfs.fat", "-C", "-n", "VKGUEST", str(fat), str(FAT_SIZE_MIB * 1024)],
        what="mkfs.fat",
    )
    _run(["syslinux", "--install", str(fat)], what="syslinux --install")
    cfg = work / "syslinux.cfg"
    cfg.write_text(SYSLINUX_CFG)
    for src, name in ((kernel, "vmlinuz"), (initrd, "initrd.img"), (cfg, "syslinux.cfg")):
        _run(["mcopy", "-o", "-i", str(fat), str(src), f"::{name}"], what=f"mcopy {name}")
    _run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(fat), str(qcow2)],
        what="qemu-img convert",
    )
