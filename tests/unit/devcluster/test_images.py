"""Local image archives: well-formed OCI layouts, reproducible bytes, the recipes' pure parts."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import DevClusterError, _images
from vkubelet.devcluster._images import (
    ImageBuildError,
    _busybox_tree,
    _check_lock_covers,
    _closure,
    _Recipe,
    _upstream_version,
    _write_archive,
    _write_layer,
    build_image,
)

REFERENCE = "vkubelet.local/test:1.0"
CONFIG: dict[str, object] = {"Entrypoint": ["/bin/true"], "User": "65532:65532"}


def _tree(root: Path, text: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "tool").write_text(text)
    (root / "bin" / "tool").chmod(0o755)
    (root / "bin" / "alias").symlink_to("tool")
    (root / "etc").mkdir()
    (root / "etc" / "conf").write_text("a=1\n")
    os.link(root / "etc" / "conf", root / "etc" / "conf.hardlink")
    return root


def _archive(tmp: Path, epoch: int = 0) -> Path:
    layers = []
    for number, text in enumerate(("one", "two")):
        layers.append(tmp / f"layer{number}.tar")
        _write_layer(_tree(tmp / f"tree{number}", text), layers[-1], epoch)
    out = tmp / "image.tar"
    _write_archive(out, REFERENCE, CONFIG, layers, epoch)
    return out


def _read(archive: tarfile.TarFile, name: str) -> bytes:
    member = archive.extractfile(name)
    assert member is not None, name
    return member.read()


def _blob(archive: tarfile.TarFile, digest: str) -> bytes:
    return _read(archive, "blobs/sha256/" + digest.removeprefix("sha256:"))


def test_layout_digests_sizes_and_diff_ids_are_consistent(tmp_path: Path) -> None:
    with tarfile.open(_archive(tmp_path)) as archive:
        for name in archive.getnames():
            if name.startswith("blobs/sha256/"):
                assert hashlib.sha256(_read(archive, name)).hexdigest() == name.rsplit("/", 1)[1]
        assert json.loads(_read(archive, "oci-layout")) == {"imageLayoutVersion": "1.0.0"}
        [descriptor] = json.loads(_read(archive, "index.json"))["manifests"]
        manifest_bytes = _blob(archive, descriptor["digest"])
        assert len(manifest_bytes) == descriptor["size"]
        manifest = json.loads(manifest_bytes)
        config_bytes = _blob(archive, manifest["config"]["digest"])
        assert len(config_bytes) == manifest["config"]["size"]
        config = json.loads(config_bytes)
        assert (config["architecture"], config["os"]) == ("amd64", "linux")
        assert config["config"] == CONFIG
        diff_ids = []
        for layer in manifest["layers"]:
            assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
            compressed = _blob(archive, layer["digest"])
            assert len(compressed) == layer["size"]
            diff_ids.append("sha256:" + hashlib.sha256(gzip.decompress(compressed)).hexdigest())
        assert config["rootfs"] == {"type": "layers", "diff_ids": diff_ids}


def test_both_loaders_find_the_full_reference(tmp_path: Path) -> None:
    with tarfile.open(_archive(tmp_path)) as archive:
        [descriptor] = json.loads(_read(archive, "index.json"))["manifests"]
        [docker] = json.loads(_read(archive, "manifest.json"))
        manifest = json.loads(_blob(archive, descriptor["digest"]))
    assert descriptor["annotations"] == {
        "org.opencontainers.image.ref.name": "1.0",
        "io.containerd.image.name": REFERENCE,
    }
    assert docker["RepoTags"] == [REFERENCE]
    assert docker["Config"] == "blobs/sha256/" + manifest["config"]["digest"][7:]
    assert docker["Layers"] == [
        "blobs/sha256/" + layer["digest"][7:] for layer in manifest["layers"]
    ]


def test_the_same_trees_give_byte_identical_archives(tmp_path: Path) -> None:
    first = _archive(tmp_path / "a")
    os.utime(first, (1, 1))  # different file times and places must not matter
    second = _archive(tmp_path / "b")
    assert first.read_bytes() == second.read_bytes()
    assert _archive(tmp_path / "c", epoch=1700000000).read_bytes() != first.read_bytes()


def test_layer_entries_are_sorted_owned_by_root_with_one_mtime(tmp_path: Path) -> None:
    layer = tmp_path / "layer.tar"
    _write_layer(_tree(tmp_path / "tree", "x"), layer, 1234)
    with tarfile.open(layer) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == [
        "bin",
        "bin/alias",
        "bin/tool",
        "etc",
        "etc/conf",
        "etc/conf.hardlink",
    ]
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members} == {(0, 0, "", "", 1234)}
    by_name = {m.name: m for m in members}
    assert by_name["bin/alias"].issym() and by_name["bin/alias"].linkname == "tool"
    assert by_name["bin/tool"].mode == 0o755
    assert by_name["etc/conf.hardlink"].islnk()
    assert by_name["etc/conf.hardlink"].linkname == "etc/conf"


FAKE_BUSYBOX = """#!/bin/sh
[ "$1" = --list-full ] || exit 1
printf '%s\\n' bin/busybox bin/sh usr/bin/wget sbin/ifconfig linuxrc
"""


def test_busybox_tree_links_every_applet_to_the_binary(tmp_path: Path) -> None:
    pkgroot = tmp_path / "pkg"
    (pkgroot / "bin").mkdir(parents=True)
    (pkgroot / "bin" / "busybox").write_text(FAKE_BUSYBOX)
    (pkgroot / "bin" / "busybox").chmod(0o700)
    dest = tmp_path / "rootfs"
    _busybox_tree(pkgroot, dest)
    for applet in ("bin/sh", "usr/bin/wget", "sbin/ifconfig", "linuxrc"):
        assert (dest / applet).readlink() == Path("/bin/busybox")
    busybox = dest / "bin" / "busybox"
    assert not busybox.is_symlink()
    assert busybox.stat().st_mode & 0o7777 == 0o755
    assert (dest / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert (dest / "root").stat().st_mode & 0o7777 == 0o700
    assert (dest / "usr").stat().st_mode & 0o7777 == 0o755
    assert (dest / "etc" / "passwd").read_text().startswith("root:x:0:0:")
    assert "nobody:x:65534:" in (dest / "etc" / "group").read_text()


DEPENDS = """python3
  PreDepends: python3-minimal
  Depends: libpython3-stdlib
ca-certificates
  Depends: openssl
 |Depends: debconf
  Depends: <debconf-2.0>
    cdebconf
    debconf
python3-minimal
  Depends: needs-virtual
libpython3-stdlib
 |Depends: media-types
  Depends: mime-support
openssl
debconf
cdebconf
  Depends: libnewt0.52
media-types
mime-support
  Depends: mailcap
mailcap
  Depends: perl
perl
libnewt0.52
needs-virtual
  Depends: <awk>
    mawk
    gawk
<awk>
<debconf-2.0>
mawk
gawk
"""


def test_closure_takes_the_first_alternative_like_apt() -> None:
    assert _closure(DEPENDS, ["python3", "ca-certificates"]) == [
        "ca-certificates",
        "debconf",  # not cdebconf, the other provider of debconf-2.0
        "libpython3-stdlib",
        "mawk",  # the first provider of the virtual package
        "media-types",  # not mime-support, which would drag in mailcap and perl
        "needs-virtual",
        "openssl",
        "python3",
        "python3-minimal",
    ]


def test_an_unknown_package_says_to_update_the_apt_lists() -> None:
    with pytest.raises(ImageBuildError, match="run apt-get update"):
        _closure(DEPENDS, ["python3", "not-a-package"])


@pytest.mark.parametrize(
    ("debian", "upstream"),
    [("1:1.35.0-4+b3", "1.35.0"), ("1:1.35.0-4+deb12u1+b1", "1.35.0"), ("3.11.2-1+b1", "3.11.2")],
)
def test_the_image_tag_is_the_upstream_version(debian: str, upstream: str) -> None:
    assert _upstream_version(debian) == upstream


def test_missing_apt_tools_are_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VKUBELET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(DevClusterError, match=r"apt-cache not found .*Debian"):
        build_image("busybox", progress=lambda _: None)


def test_unknown_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ImageBuildError, match="known: busybox, pause, agent"):
        build_image("nginx")


def _wheel(directory: Path, requirements: str) -> Path:
    directory.mkdir()
    wheel = directory / "vkubelet-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        metadata = f"Metadata-Version: 2.3\nName: vkubelet\n{requirements}"
        archive.writestr("vkubelet-0.1.0.dist-info/METADATA", metadata)
    return wheel


def test_a_lock_without_a_required_package_is_reported(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "typing_extensions-4.16.0.dist-info").mkdir(parents=True)
    (site / "PyYAML-6.0.4.dist-info").mkdir()
    lock = tmp_path / "requirements.lock"
    covered = _wheel(
        tmp_path / "a",
        "Requires-Dist: pyyaml>=6\nRequires-Dist: typing-extensions\n"
        "Requires-Dist: rich-click>=1; extra == 'dev'\n",
    )
    _check_lock_covers(site, covered, lock)
    wheel = _wheel(tmp_path / "b", "Requires-Dist: pyyaml>=6\nRequires-Dist: New.Thing>=1\n")
    with pytest.raises(ImageBuildError, match=r"lacks new-thing, which pyproject\.toml requires"):
        _check_lock_covers(site, wheel, lock)


def test_a_cached_archive_is_reused_and_force_rebuilds_it_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VKUBELET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assembled: list[Path] = []

    def assemble(work: Path, progress: Any) -> list[Path]:
        assembled.append(work)
        return [_tree(work / "tree", "fake")]

    recipe = _Recipe(REFERENCE, {"packages": {"fake": "1"}}, CONFIG, assemble)
    monkeypatch.setattr(_images, "_busybox_recipe", lambda progress: recipe)
    first = build_image("busybox", progress=lambda _: None)
    assert first.path.is_file() and first.reference == REFERENCE
    assert build_image("busybox", progress=lambda _: None) == first
    assert len(assembled) == 1
    first_bytes = first.path.read_bytes()
    assert build_image("busybox", progress=lambda _: None, force=True) == first
    assert len(assembled) == 2
    assert first.path.read_bytes() == first_bytes
    with tarfile.open(fileobj=io.BytesIO(first_bytes)) as archive:
        [descriptor] = json.loads(_read(archive, "index.json"))["manifests"]
    assert descriptor["digest"] == first.digest
    assert [p.name for p in first.path.parent.parent.iterdir() if not p.name.endswith(".lock")] == [
        first.path.parent.name
    ]
