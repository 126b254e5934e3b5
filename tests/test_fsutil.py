"""Atomic writes: a target is replaced whole on success and left as it was on failure, no temporaries left."""

from __future__ import annotations

import pytest

from treesearch.fsutil import atomic_dir, atomic_file


def test_atomic_file_replaces_on_success_and_keeps_target_on_failure(tmp_path):
    target = tmp_path / "sub" / "data.bin"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp != target and not target.exists()
        tmp.write_bytes(b"first")
    assert target.read_bytes() == b"first"
    with pytest.raises(OSError, match="disk full"):
        with atomic_file(target) as tmp:
            tmp.write_bytes(b"half")
            raise OSError("disk full")
    assert target.read_bytes() == b"first"
    with atomic_file(target, suffix=".so") as tmp:
        assert tmp.name.endswith(".so")
        tmp.write_bytes(b"second")
    assert target.read_bytes() == b"second"
    assert sorted(p.name for p in target.parent.iterdir()) == ["data.bin"]


def test_atomic_dir_replaces_on_success_and_keeps_target_on_failure(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("a")
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(target) as tmp:
            (tmp / "b.txt").write_text("b")
            raise KeyboardInterrupt
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
