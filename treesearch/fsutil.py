"""Atomic writes for every stage (the bottom layer, so that treesearch, the runtime and the bench share them):
build a file or folder beside its target, then swap it in with one rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_UMASK = os.umask(0o022)  # read once: mkstemp/mkdtemp make private (0600/0700) files; results get the usual mode
os.umask(_UMASK)


@contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success it replaces ``target``, on any failure it is removed
    and ``target`` is left as it was (a crash never leaves a half-written folder in its place)."""
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(target: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """Yield the path of an empty temporary file beside ``target``; on success it replaces ``target``,
    on any failure it is removed and ``target`` is left as it was."""
    final = Path(target)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
