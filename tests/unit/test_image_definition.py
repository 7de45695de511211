"""The container image definition (deploy/image) pins everything it installs.

No registry is reachable here, so the image is not built in tests: these checks hold the file
to what makes a build reproducible, offline. `make image-check` additionally downloads every
locked file from PyPI against its hash.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE = Path(__file__).resolve().parents[2] / "deploy" / "image"
CONTAINERFILE = (IMAGE / "Containerfile").read_text()


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a pip-compile --generate-hashes lock."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())  # join continuation lines
    entries: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert match, f"{path.name}: not pinned with hashes: {line}"
        hashes = re.findall(r"sha256:([0-9a-f]{64})", match.group(3))
        entries[canonicalize_name(match.group(1))] = (match.group(2), hashes)
    return entries


def runtime_closure(name: str, seen: set[str] | None = None) -> set[str]:
    """The installed distribution's dependencies, transitively, without extras' own."""
    seen = set() if seen is None else seen
    key = canonicalize_name(name)
    if key in seen:
        return seen
    seen.add(key)
    try:
        requires = distribution(name).requires or []
    except PackageNotFoundError:
        return seen
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        runtime_closure(requirement.name, seen)
        for extra in requirement.extras:  # httpx2[http2]
            for extra_text in distribution(requirement.name).requires or []:
                dep = Requirement(extra_text)
                if dep.marker and dep.marker.evaluate({"extra": extra}):
                    runtime_closure(dep.name, seen)
    return seen


def test_the_base_image_is_pinned_by_digest() -> None:
    base = re.search(r"^ARG BASE=(\S+)$", CONTAINERFILE, re.MULTILINE)
    assert base and re.search(r"@sha256:[0-9a-f]{64}$", base.group(1))
    stages: set[str] = set()
    for line in re.findall(r"^FROM (.+)$", CONTAINERFILE, re.MULTILINE):
        image, *alias = line.split(" AS ")
        assert image == "${BASE}" or image in stages, f"FROM {image}: not the pinned base"
        stages.update(alias)


def test_every_dependency_is_installed_from_a_lock_with_hashes() -> None:
    commands = [line for line in CONTAINERFILE.splitlines() if not line.startswith("#")]
    installs = [m for line in commands for m in re.findall(r"bin/pip install ([^&]+)", line)]
    assert len(installs) == 3
    for args in installs:
        assert "--no-deps" in args, args
        # A lock, hash-checked; or the wheel just built from this tree.
        assert "--require-hashes" in args or args.rstrip(" \\").endswith(
            "/wheels/vkubelet-*.whl"
        ), args
    assert locked(IMAGE / "requirements.lock")
    assert "hatchling" in locked(IMAGE / "build-requirements.lock")


def test_the_lock_holds_exactly_the_agents_runtime_dependencies() -> None:
    lock = set(locked(IMAGE / "requirements.lock"))
    needed = runtime_closure("vkubelet") - {"vkubelet"}
    assert needed - lock == set(), (
        "missing from requirements.lock: run pip-compile (docs/deploy.md)"
    )
    assert lock - needed == set(), "requirements.lock holds packages vkubelet does not need"


def test_the_build_is_stamped_with_source_date_epoch() -> None:
    assert "ARG SOURCE_DATE_EPOCH" in CONTAINERFILE
    assert "SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH}" in CONTAINERFILE
    assert "--invalidation-mode checked-hash" in CONTAINERFILE  # no mtimes in .pyc files
