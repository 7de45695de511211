"""Files written whole: the old content or the new, never a mix, and private from the start."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet._files import write_atomic, write_private


def test_a_rewrite_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, "old")
    write_atomic(path, b"new", durable=True)
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_private_file_is_owner_only_even_over_a_readable_one(tmp_path: Path) -> None:
    path = tmp_path / "key.pem"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, b"secret")
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.read_bytes() == b"secret"


def test_a_failed_write_keeps_the_old_content_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, "old")

    def full(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("os.fsync", full)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new", durable=True)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
