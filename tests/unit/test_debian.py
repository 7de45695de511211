"""The apt questions both image builders ask: candidate versions, the lists' stamp, unpacking."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vkubelet import _debian
from vkubelet._debian import AptError, candidate_versions, download_and_unpack, parse_candidates

POLICY = """busybox-static:
  Installed: (none)
  Candidate: 1:1.35.0-4+deb12u1+b1
  Version table:
     1:1.35.0-4+deb12u1+b1 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
linux-image-cloud-amd64:
  Installed: (none)
  Candidate: 6.1.192-2
  Version table:
     6.1.192-2 500
        500 http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
     6.1.158-1 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
removed-package:
  Installed: (none)
  Candidate: (none)
  Version table:
"""


def test_candidates_come_in_the_order_asked() -> None:
    assert list(
        parse_candidates(POLICY, ["linux-image-cloud-amd64", "busybox-static"]).items()
    ) == [("linux-image-cloud-amd64", "6.1.192-2"), ("busybox-static", "1:1.35.0-4+deb12u1+b1")]


@pytest.mark.parametrize("missing", ["removed-package", "never-heard-of"])
def test_a_package_without_candidate_says_to_update_the_apt_lists(missing: str) -> None:
    with pytest.raises(AptError, match=f"^{missing} not in the apt lists: run apt-get update$"):
        parse_candidates(POLICY, ["busybox-static", missing])


def test_missing_tools_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(AptError, match=r"^resolve: apt-cache not found .*Debian or Ubuntu host"):
        candidate_versions(["busybox-static"], what="resolve")
    with pytest.raises(AptError, match=r"^format: mkfs\.fat not found \(apt-get install x\)$"):
        _debian.run(["mkfs.fat"], what="format", missing="apt-get install x")


def test_the_stamp_changes_with_the_apt_lists(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_debian, "LISTS", tmp_path / "lists")
    assert _debian.lists_stamp() == ""  # no lists at all: nothing to remember answers by
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "deb.debian.org_debian_dists_bookworm_InRelease").write_text("a")
    before = _debian.lists_stamp()
    os.utime(tmp_path / "lists" / "deb.debian.org_debian_dists_bookworm_InRelease", ns=(1, 1))
    assert _debian.lists_stamp() not in ("", before)


def test_packages_are_unpacked_into_one_tree_and_the_debs_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[list[str]] = []

    def run(argv: list[str], *, what: str, cwd: Path | None = None) -> str:
        calls.append(argv)
        if argv[:2] == ["apt-get", "download"]:
            assert cwd is not None and cwd.parent == tmp_path
            for name in ("b_2_amd64.deb", "a_1_amd64.deb"):
                (cwd / name).write_bytes(b"")
        return ""

    monkeypatch.setattr(_debian, "run", run)
    root = tmp_path / "root"
    download_and_unpack({"a": "1", "b": "1:2"}, root)
    debs = Path(calls[1][2]).parent
    assert calls == [
        ["apt-get", "download", "-q", "a=1", "b=1:2"],
        ["dpkg-deb", "-x", str(debs / "a_1_amd64.deb"), str(root)],
        ["dpkg-deb", "-x", str(debs / "b_2_amd64.deb"), str(root)],
    ]
    assert not debs.exists()
