"""A real distribution guest: Debian (debootstrap) with systemd, cloud-init and qemu-guest-agent.

Slow to build (minutes) and to boot (tens of seconds under TCG); it exists to prove that a real
cloud-init applies the seed's user-data, SSH keys and hostname. Like the small guest it is built
from Debian's repositories only and boots from its own disk: an MBR disk with a FAT boot partition
(syslinux, kernel, initramfs) and an ext4 root, each file system written straight into the disk
file at its offset (`mkfs.fat --offset`, `mkfs.ext4 -E offset=`, `syslinux --offset`, mtools'
`@@offset`), so no loop device and no mount are needed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from ._build import (
    GuestImage,
    ImageBuildError,
    Progress,
    _run,
    candidate_versions,
    default_cache_dir,
)

DISTRO_RECIPE_VERSION = 1
SUITE = "bookworm"
PACKAGES = (
    "systemd-sysv",
    "udev",
    "dbus",  # logind (power button) and `shutdown` (what guest-shutdown runs) need it
    "linux-image-cloud-amd64",
    "cloud-init",
    "python3-cffi-backend",  # debootstrap does not resolve the virtual package cryptography needs
    "qemu-guest-agent",
    "ifupdown",
    "isc-dhcp-client",
    "iproute2",
    "openssh-server",
)
_MIB = 1 << 20
_BOOT_START = 1 * _MIB
_BOOT_SIZE = 64 * _MIB
_ROOT_START = _BOOT_START + _BOOT_SIZE
_ROOT_LABEL = "vkroot"
_CMDLINE = f"root=LABEL={_ROOT_LABEL} ro console=ttyS0 quiet panic=-1"
_SYSLINUX_CFG = f"""DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.img
  APPEND {_CMDLINE}
"""
#: NoCloud only (no minute spent probing cloud metadata services); one SSH host key type, as an
#: RSA 3072 key alone takes a minute to generate under TCG; no locale (minbase has no `locales`).
_CLOUD_CFG = "datasource_list: [NoCloud, None]\nssh_genkeytypes: [ed25519]\nlocale: false\n"
_FSTAB = f"LABEL={_ROOT_LABEL} / ext4 defaults 0 1\n"


def _mirror() -> str:
    """The Debian mirror apt uses here (so the build needs no other network access)."""
    for source in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for line in source.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split(":", 1)[1].split()[0]
    return "http://deb.debian.org/debian"


def build_distro_image(
    cache_dir: Path | None = None, progress: Progress = lambda _: None, *, force: bool = False
) -> GuestImage:
    """Build (or reuse) the Debian cloud-init guest; needs root (debootstrap)."""
    versions = candidate_versions(("linux-image-cloud-amd64", "cloud-init", "qemu-guest-agent"))
    recipe = {
        "version": DISTRO_RECIPE_VERSION,
        "suite": SUITE,
        "packages": PACKAGES,
        "versions": versions,
        "syslinux": _SYSLINUX_CFG,
        "cloud": _CLOUD_CFG,
    }
    digest = (
        "distro-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    )
    target = (cache_dir or default_cache_dir()) / digest
    disk = target / "disk.qcow2"
    if disk.is_file() and not force:
        progress(f"cached distribution guest {disk}")
        return GuestImage(disk, digest, versions)
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap not found (apt-get install -y debootstrap)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".build-{digest}-", dir=target.parent) as tmp:
        work = Path(tmp)
        root = work / "root"
        progress(f"debootstrap {SUITE} with {', '.join(PACKAGES)} (a few minutes)")
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(root),
                _mirror(),
            ],
            what="debootstrap",
        )
        _configure(root)
        progress("writing the disk (boot: FAT + syslinux, root: ext4)")
        out = work / "out"
        out.mkdir()
        _make_disk(work, root, out / "disk.qcow2")
        (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
        if not disk.is_file():
            if target.exists():
                shutil.rmtree(target)
            (work / "out").rename(target)
    progress(f"distribution guest ready: {disk}")
    return GuestImage(disk, digest, versions)


def _configure(root: Path) -> None:
    (root / "etc" / "fstab").write_text(_FSTAB)
    (root / "etc" / "cloud" / "cloud.cfg.d" / "99-vkubelet.cfg").write_text(_CLOUD_CFG)
    (root / "etc" / "machine-id").write_text("")  # a fresh one per VM
    (root / "etc" / "hostname").unlink(missing_ok=True)  # cloud-init sets it
    for key in (root / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()  # regenerated per VM at first boot
    subprocess.run(["chroot", str(root), "apt-get", "clean"], check=False, capture_output=True)
    for lists in (root / "var" / "lib" / "apt" / "lists").glob("*_*"):
        lists.unlink()


def _mbr_entry(bootable: bool, kind: int, start: int, size: int) -> bytes:
    # CHS fields say "use LBA" (0xFE/0xFF/0xFF); the BIOS and syslinux's MBR use LBA.
    chs = b"\xfe\xff\xff"
    return struct.pack(
        "<B3sB3sII", 0x80 if bootable else 0, chs, kind, chs, start // 512, size // 512
    )


def _make_disk(work: Path, root: Path, qcow2: Path) -> None:
    kernel = max((root / "boot").glob("vmlinuz-*"))
    initrd = root / "boot" / ("initrd.img-" + kernel.name.removeprefix("vmlinuz-"))
    if not initrd.is_file():
        raise ImageBuildError(f"debootstrap made no initramfs ({initrd.name})")
    used = int(_run(["du", "-sb", str(root)], what="du").split()[0])
    root_size = (used * 3 // 2 // _MIB + 512) * _MIB
    raw = work / "disk.raw"
    with raw.open("wb") as f:
        f.truncate(_ROOT_START + root_size)
        mbr = Path("/usr/lib/syslinux/mbr/mbr.bin").read_bytes()[:440]
        table = _mbr_entry(True, 0x0E, _BOOT_START, _BOOT_SIZE)
        table += _mbr_entry(False, 0x83, _ROOT_START, root_size)
        f.write(mbr.ljust(440, b"\0") + b"\0" * 6 + table + b"\0" * 32 + b"\x55\xaa")
    sectors = _BOOT_START // 512
    _run(
        ["mkfs.fat", "-F", "16", "--offset", str(sectors), "-h", str(sectors), "-n", "VKBOOT",
         str(raw), str(_BOOT_SIZE // 1024)],
        what="mkfs.fat",
    )  # fmt: skip
    _run(["syslinux", "--install", "--offset", str(_BOOT_START), str(raw)], what="syslinux")
    cfg = work / "syslinux.cfg"
    cfg.write_text(_SYSLINUX_CFG)
    fat = f"{raw}@@{_BOOT_START}"
    for src, name in ((kernel, "vmlinuz"), (initrd, "initrd.img"), (cfg, "syslinux.cfg")):
        _run(["mcopy", "-o", "-i", fat, str(src), f"::{name}"], what=f"mcopy {name}")
    _run(
        ["mkfs.ext4", "-q", "-F", "-L", _ROOT_LABEL, "-d", str(root), "-E",
         f"offset={_ROOT_START}", str(raw), f"{root_size // 1024}k"],
        what="mkfs.ext4",
    )  # fmt: skip
    _run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)], what="qcow2")
