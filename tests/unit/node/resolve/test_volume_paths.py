"""Hostile paths from pod specs or API objects never escape the volume."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.node.resolve import FilesVolume, clean_volume_path, resolve_volumes

from .fakes import ALLOCATABLE, FakeSources, configmap, pod

HOSTILE = [
    "../etc/passwd",
    "/etc/passwd",
    "a/../../b",
    "a/..",
    "..",
    "..data/token",
    "./..data/token",
    "..2024_01_01_00_00_00.123/x",
    "",
    ".",
    "./",
    "a\x00b",
    "x" * 256,
    "a/" * 2049,
]


@pytest.mark.parametrize("path", HOSTILE, ids=repr)
def test_hostile_item_paths_fail_the_mount(path: str) -> None:
    sources = FakeSources(objects=[configmap("cfg", {"k": "v"})])
    volume = {"name": "v", "configMap": {"name": "cfg", "items": [{"key": "k", "path": path}]}}
    result = resolve_volumes(
        pod(volumes=[volume]), sources, token_source=None, node_allocatable=ALLOCATABLE
    )
    assert result.volumes == ()
    assert "invalid path" in result.errors[0].message


@pytest.mark.parametrize("key", ["../escape", "/abs", "..data"])
def test_hostile_keys_in_a_config_map_fail_the_mount(key: str) -> None:
    hostile: dict[str, Any] = configmap("cfg", {key: "pwned"})
    volume = {"name": "v", "configMap": {"name": "cfg"}}
    result = resolve_volumes(
        pod(volumes=[volume]),
        FakeSources(objects=[hostile]),
        token_source=None,
        node_allocatable=ALLOCATABLE,
    )
    assert "invalid path" in result.errors[0].message


def test_hostile_downward_api_paths_fail_the_mount() -> None:
    volume = {
        "name": "v",
        "downwardAPI": {"items": [{"path": "../x", "fieldRef": {"fieldPath": "metadata.name"}}]},
    }
    result = resolve_volumes(
        pod(volumes=[volume]), FakeSources(), token_source=None, node_allocatable=ALLOCATABLE
    )
    assert "invalid path" in result.errors[0].message


@pytest.mark.parametrize(
    ("path", "clean"),
    [("a//b/./c", "a/b/c"), ("./a", "a"), ("a/", "a"), ("dir/..hidden", "dir/..hidden")],
)
def test_harmless_paths_are_cleaned(path: str, clean: str) -> None:
    assert clean_volume_path(path) == clean


def test_a_path_cannot_be_both_a_file_and_a_directory() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"a": "1", "b": "2"})])
    items = [{"key": "a", "path": "conf"}, {"key": "b", "path": "conf/b"}]
    volume = {"name": "v", "configMap": {"name": "cfg", "items": items}}
    result = resolve_volumes(
        pod(volumes=[volume]), sources, token_source=None, node_allocatable=ALLOCATABLE
    )
    assert "both a file and a directory" in result.errors[0].message


def test_the_same_path_twice_keeps_the_last_item() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"a": "1", "b": "2"})])
    items = [{"key": "a", "path": "x/f"}, {"key": "b", "path": "x//f"}]
    volume = {"name": "v", "configMap": {"name": "cfg", "items": items}}
    result = resolve_volumes(
        pod(volumes=[volume]), sources, token_source=None, node_allocatable=ALLOCATABLE
    )
    resolved = result.get("v")
    assert isinstance(resolved, FilesVolume)
    assert dict(resolved.files) == {"x/f": resolved.files["x/f"]}
    assert resolved.files["x/f"].data == b"2"


def test_malformed_pod_specs_do_not_crash_resolution() -> None:
    the_pod: dict[str, Any] = {
        "metadata": "nonsense",
        "spec": {"volumes": [None, 3, {"name": "v", "configMap": "cfg"}], "containers": "x"},
    }
    result = resolve_volumes(
        the_pod, FakeSources(), token_source=None, node_allocatable=ALLOCATABLE
    )
    assert len(result.volumes) + len(result.errors) == 3


def test_lone_surrogates_from_hostile_json_become_replacement_characters() -> None:
    hostile = configmap("cfg", {"k": "a\ud800b"})
    volume = {"name": "v", "configMap": {"name": "cfg"}}
    result = resolve_volumes(
        pod(volumes=[volume]),
        FakeSources(objects=[hostile]),
        token_source=None,
        node_allocatable=ALLOCATABLE,
    )
    resolved = result.get("v")
    assert isinstance(resolved, FilesVolume)
    assert resolved.files["k"].data == "a\ufffdb".encode()
