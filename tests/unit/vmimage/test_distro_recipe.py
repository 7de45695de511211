"""The distribution guest's recipe inputs: the host's Debian sources, package versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet import _debian
from vkubelet.vmimage import _distro
from vkubelet.vmimage._build import ImageBuildError

POLICY = """Package files:
 100 /var/lib/dpkg/status
     release a=now
 500 https://packages.example.com/apt cloud-sdk main amd64 Packages
     release o=Example,n=cloud-sdk,c=main,b=amd64
     origin packages.example.com
 500 http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
     release v=12,o=Debian,a=oldstable-security,n=bookworm-security,l=Debian-Security,c=main,b=amd64
     origin deb.debian.org
 500 http://mirror.local/debian/ bookworm-updates/main amd64 Packages
     release v=12-updates,o=Debian,a=oldstable-updates,n=bookworm-updates,l=Debian,c=main,b=amd64
     origin mirror.local
 500 http://mirror.local/debian/ bookworm/contrib amd64 Packages
     release v=12.15,o=Debian,a=oldstable,n=bookworm,l=Debian,c=contrib,b=amd64
     origin mirror.local
 500 http://mirror.local/debian/ bookworm/main amd64 Packages
     release v=12.15,o=Debian,a=oldstable,n=bookworm,l=Debian,c=main,b=amd64
     origin mirror.local
 500 http://mirror.local/debian/ trixie/main amd64 Packages
     release v=13,o=Debian,a=stable,n=trixie,l=Debian,c=main,b=amd64
     origin mirror.local
Pinned packages:
"""


def _fake_apt(monkeypatch: pytest.MonkeyPatch, outputs: dict[str, str]) -> None:
    def run(argv: list[str], *, what: str, cwd: Path | None = None) -> str:
        return outputs[" ".join(argv)]

    monkeypatch.setattr(_debian, "run", run)


def test_the_guest_uses_the_hosts_debian_mirror_release_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_apt(monkeypatch, {"apt-cache policy": POLICY})
    assert _distro.debian_sources() == [
        ("http://mirror.local/debian", "bookworm"),
        ("http://deb.debian.org/debian-security", "bookworm-security"),
        ("http://mirror.local/debian", "bookworm-updates"),
    ]


def test_a_host_without_a_debian_bookworm_source_cannot_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    only_trixie = "\n".join(POLICY.splitlines()[:4] + POLICY.splitlines()[-4:])
    _fake_apt(monkeypatch, {"apt-cache policy": only_trixie})
    with pytest.raises(ImageBuildError, match="no Debian bookworm main source"):
        _distro.debian_sources()


def _policy(versions: dict[str, str]) -> str:
    return "".join(
        f"{p}:\n  Installed: (none)\n  Candidate: {v}\n  Version table:\n     {v} 500\n"
        for p, v in versions.items()
    )


def test_package_versions_name_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = (_distro.PACKAGES[0], *_distro.VERSIONED)
    versions = {p: f"1.{i}" for i, p in enumerate(wanted)}
    key = "apt-cache policy " + " ".join(wanted)
    _fake_apt(monkeypatch, {key: _policy(versions)})
    assert _distro.resolve_packages() == versions
    sources = [("http://mirror.local/debian", "bookworm")]
    same = _distro.recipe_hash(versions, sources)
    newer_kernel = {**versions, _distro.PACKAGES[0]: "2.0"}
    assert _distro.recipe_hash(versions, sources) == same
    assert _distro.recipe_hash(newer_kernel, sources) != same
    assert _distro.recipe_hash(versions, [("http://other/debian", "bookworm")]) != same


def test_a_package_missing_from_the_apt_lists_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = (_distro.PACKAGES[0], *_distro.VERSIONED)
    versions = {p: "1.0" for p in wanted}
    versions["cloud-init"] = "(none)"
    key = "apt-cache policy " + " ".join(wanted)
    _fake_apt(monkeypatch, {key: _policy(versions)})
    with pytest.raises(ImageBuildError, match="cloud-init not in the apt lists"):
        _distro.resolve_packages()


def test_resolution_is_remembered_until_the_apt_lists_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []

    def packages() -> dict[str, str]:
        calls.append("p")
        return {"a": "1"}

    def sources() -> list[tuple[str, str]]:
        calls.append("s")
        return [("u", "n")]

    monkeypatch.setattr(_distro, "resolve_packages", packages)
    monkeypatch.setattr(_distro, "debian_sources", sources)
    stamp = ["lists-1"]
    monkeypatch.setattr(_debian, "lists_stamp", lambda: stamp[0])
    assert _distro._resolve(tmp_path) == ({"a": "1"}, [("u", "n")])
    assert _distro._resolve(tmp_path) == ({"a": "1"}, [("u", "n")])
    assert calls == ["p", "s"]
    stamp[0] = "lists-2"  # apt-get update
    _distro._resolve(tmp_path)
    assert calls == ["p", "s", "p", "s"]
