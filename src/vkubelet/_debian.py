"""Debian packages from the host's apt: candidate versions, and .deb files unpacked into a tree.

The dev images (devcluster's container images, vmimage's test guests) are made only from the
packages of the mirror the host's apt already uses, with tools Debian packages provide, so both
builders ask apt the same questions and run their tools the same way. Failures raise AptError,
which each builder turns into its own error type.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

LISTS = Path("/var/lib/apt/lists")
APT_TOOLS = (
    "images are built from Debian packages: this needs apt-get, apt-cache and dpkg-deb, "
    "i.e. a Debian or Ubuntu host"
)


class AptError(RuntimeError):
    """A build tool failed or is not installed; the message says what to run or install."""


def run(
    argv: list[str],
    *,
    what: str,
    missing: str = APT_TOOLS,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """A build tool's output; `missing` says which Debian packages to install if it is absent.

    umask 022: what the tools write ends up in images, whose modes must not depend on the caller's.
    """
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, check=False, umask=0o022
        )
    except FileNotFoundError:
        raise AptError(f"{what}: {argv[0]} not found ({missing})") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-4000:]
        raise AptError(f"{what}: {' '.join(argv)} exited {done.returncode}: {tail}")
    return done.stdout


def apt_cache(args: Sequence[str], *, what: str) -> str:
    """The output of `apt-cache <args>` (depends, policy, ...), for the caller to read."""
    return run(["apt-cache", *args], what=what)


def lists_stamp() -> str:
    """Changes whenever the apt lists do (apt-get update).

    apt-cache takes seconds per call here (no binary package cache), so callers remember its
    answers under this stamp instead of asking again.
    """
    try:
        return ",".join(f"{p.name}:{p.stat().st_mtime_ns}" for p in sorted(LISTS.iterdir()))
    except OSError:
        return ""


def candidate_versions(packages: Sequence[str], *, what: str) -> dict[str, str]:
    """apt's candidate version of each package, in the order asked (one apt-cache call)."""
    return parse_candidates(apt_cache(["policy", *packages], what=what), packages)


def parse_candidates(policy: str, packages: Sequence[str]) -> dict[str, str]:
    """The candidate versions in `apt-cache policy <packages>` output; one missing is an error.

    A package apt does not know is left out of the output or has the candidate "(none)"; either
    way the apt lists are older than the recipe, which `apt-get update` fixes.
    """
    versions: dict[str, str] = {}
    current = ""
    for line in policy.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1]
        elif line.strip().startswith("Candidate:") and current in packages:
            candidate = line.split(":", 1)[1].strip()
            if candidate != "(none)":
                versions[current] = candidate
    missing = [p for p in packages if p not in versions]
    if missing:
        raise AptError(f"{', '.join(missing)} not in the apt lists: run apt-get update")
    return {p: versions[p] for p in packages}


def download_and_unpack(packages: Mapping[str, str], into: Path) -> None:
    """Fetch the exact package versions and unpack them all into one tree.

    Maintainer scripts do not run (nothing is installed, no root needed): a caller does what it
    needs of them itself. The .deb files go in a directory beside `into` that is removed after.
    """
    into.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".debs-", dir=into.parent) as tmp:
        debs = Path(tmp)
        run(
            ["apt-get", "download", "-q", *(f"{p}={v}" for p, v in packages.items())],
            cwd=debs,
            what="apt-get download",
        )
        for deb in sorted(debs.glob("*.deb")):
            run(["dpkg-deb", "-x", str(deb), str(into)], what=f"unpack {deb.name}")
