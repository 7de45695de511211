"""Build the agent image with podman and check that two builds are bit-for-bit identical.

Why a script and not only `podman build`: the reproducible build needs the same handful of
flags every time (the commit time as `--timestamp` and as SOURCE_DATE_EPOCH, host networking for
pip), a machine without a registry needs a base made from Debian packages, and the proof of
reproducibility is two builds from nothing compared layer by layer.

    python deploy/image/build.py base           # the local Debian base (debootstrap), once
    python deploy/image/build.py build --base local --tag vkubelet:0.1.0
    python deploy/image/build.py verify --base local

`--base registry` (the default) is the Containerfile's pinned python:3.11-slim-bookworm.
Known to work with podman 4.3 (Debian bookworm) as root, cgroupfs, overlay storage.
"""

from __future__ import annotations

import argparse
import email.utils
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "image"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vkubelet" / "image"
LOCAL_BASE = "localhost/vkubelet-base:bookworm"
MIRROR = "http://deb.debian.org/debian"
# What the Containerfile needs from the base: python (3.11) with venv and pip, TLS roots.
PACKAGES = ["python3", "python3-venv", "python-is-python3", "ca-certificates"]
# Left out of the base: state of the machine that built it, not of the packages.
VOLATILE = [
    "var/lib/apt/lists",
    "var/cache/apt",
    "var/log",
    "var/cache/ldconfig/aux-cache",
    "etc/machine-id",
    "etc/hostname",
    "etc/resolv.conf",
    "dev",
    "proc",
    "sys",
    "run",
    "tmp",
]


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    return subprocess.run(argv, check=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def release_epoch(rootfs: Path) -> int:
    """The Date of the mirror's Release file: the base's file times, fixed by the mirror state."""
    (release,) = (rootfs / "var/lib/apt/lists").glob("*_InRelease")
    for line in release.read_text(errors="replace").splitlines():
        if line.startswith("Date:"):
            return int(email.utils.parsedate_to_datetime(line[5:].strip()).timestamp())
    raise SystemExit(f"{release}: no Date")


def base(mirror: str, suite: str, rootfs_from: Path | None) -> None:
    """debootstrap once into CACHE, then make rootfs.tar and the image from it.

    The tar is sorted, with numeric owners, no atime/ctime, times clamped to the mirror's
    Release date, so the same root file system always gives the same image. A new debootstrap
    gives a different tree (maintainer scripts stamp files), hence the cache: delete
    CACHE/context/rootfs.tar to make a new base. `rootfs_from`: a finished debootstrap tree to
    use instead (it is consumed).
    """
    context = CACHE / "context"
    tar = context / "rootfs.tar"
    if not tar.exists():
        rootfs = rootfs_from or CACHE / "rootfs"
        if rootfs_from is None:
            if rootfs.exists():
                shutil.rmtree(rootfs)
            argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}"]
            run([*argv, suite, str(rootfs), mirror])
        epoch = release_epoch(rootfs)
        for name in VOLATILE:
            path = rootfs / name
            if path.is_dir() and not path.is_symlink():
                for child in path.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
            elif path.exists() or path.is_symlink():
                path.unlink()
        context.mkdir(parents=True, exist_ok=True)
        run(
            [
                "tar",
                "--create",
                f"--file={tar}.part",
                "--format=posix",
                "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
                "--sort=name",
                "--numeric-owner",
                f"--mtime=@{epoch}",
                "--clamp-mtime",
                f"--directory={rootfs}",
                ".",
            ]
        )
        Path(f"{tar}.part").rename(tar)
        (context / "epoch").write_text(f"{epoch}\n")
        shutil.rmtree(rootfs)
    epoch = int((context / "epoch").read_text())
    shutil.copy(HERE / "debian-base.Containerfile", context / "Containerfile")
    build = ["podman", "build", f"--timestamp={epoch}", "--tag", LOCAL_BASE, str(context)]
    run(build, stdout=sys.stderr)
    run(["podman", "run", "--rm", LOCAL_BASE, "python3", "--version"], stdout=sys.stderr)


def build(
    base_image: str | None, target: str, tag: str, epoch: int, mirror: str | None, fresh: bool
) -> dict[str, object]:
    """One podman build from the repository root; returns the image's identity."""
    argv = [
        "podman",
        "build",
        "--file",
        str(HERE / "Containerfile"),
        "--target",
        target,
        # Every file in the new layers, the config and the history get this time.
        f"--timestamp={epoch}",
        "--build-arg",
        f"SOURCE_DATE_EPOCH={epoch}",
        "--network=host",
        "--tag",
        tag,
    ]
    if base_image:
        argv += ["--build-arg", f"BASE={base_image}"]
    if mirror:
        argv += ["--build-arg", f"DEBIAN_MIRROR={mirror}"]
    if fresh:
        argv.append("--no-cache")
    # Behind a TLS-intercepting proxy the host's CA bundle must be trusted by pip: bind-mounted
    # for the RUN steps only, it is not part of any layer.
    ca = os.environ.get("VKUBELET_IMAGE_CA_BUNDLE")
    if ca:
        argv.append(f"--volume={ca}:/etc/ssl/certs/ca-certificates.crt:ro")
    run([*argv, str(ROOT)], stdout=sys.stderr)  # stdout is for the result
    return identity(tag)


def identity(tag: str) -> dict[str, object]:
    out = run(["podman", "image", "inspect", tag], capture_output=True).stdout
    (image,) = json.loads(out)
    return {
        "id": f"sha256:{image['Id']}",
        "digest": image["Digest"],
        "layers": image["RootFS"]["Layers"],
    }


def commit_epoch() -> int:
    out = run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True)
    return int(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    base_cmd = commands.add_parser("base", help="the local Debian base image (debootstrap)")
    base_cmd.add_argument("--mirror", default=MIRROR)
    base_cmd.add_argument("--suite", default="bookworm")
    base_cmd.add_argument("--rootfs", type=Path, help="an existing debootstrap tree to use")
    for name in ("build", "verify"):
        cmd = commands.add_parser(name)
        cmd.add_argument("--base", choices=["registry", "local"], default="registry")
        cmd.add_argument("--target", choices=["agent", "vm", "libvirt"], default="agent")
        cmd.add_argument("--source-date-epoch", type=int, default=None)
        cmd.add_argument("--debian-mirror", help="the vm target's Debian source (DEBIAN_MIRROR)")
        cmd.add_argument("--tag", default=None)
    args = parser.parse_args()
    if args.command == "base":
        base(args.mirror, args.suite, args.rootfs)
        return
    base_image = LOCAL_BASE if args.base == "local" else None
    epoch = args.source_date_epoch or int(os.environ.get("SOURCE_DATE_EPOCH") or commit_epoch())
    tag = args.tag or f"localhost/vkubelet:{args.target}-{args.base}"
    if args.command == "build":
        print(json.dumps(build(base_image, args.target, tag, epoch, args.debian_mirror, False)))
        return
    # verify: two builds without the layer cache; same epoch, same base, nothing else shared.
    first = build(base_image, args.target, f"{tag}-a", epoch, args.debian_mirror, True)
    second = build(base_image, args.target, f"{tag}-b", epoch, args.debian_mirror, True)
    print(json.dumps({"source_date_epoch": epoch, "first": first, "second": second}, indent=2))
    if first != second:
        raise SystemExit("the two builds differ")
    print("identical", file=sys.stderr)


if __name__ == "__main__":
    main()
