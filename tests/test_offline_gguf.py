"""A machine without the package registry (a GPU box): the default model's GGUF copied by hand, given with
``--gguf PATH``, checked against its pinned sha256 and found in the cache by every later command."""

from __future__ import annotations

import shutil

import pytest

from bench.cli import main
from medusa_runtime import model as model_mod
from medusa_runtime.model import DEFAULT_SOURCE, ModelError, adopt_gguf, gguf_cache_path, locate_gguf, sha256_file


@pytest.fixture(scope="module")
def real_gguf(default_model):  # default_model: the packaged model is prepared, so its GGUF is at hand
    return locate_gguf(log=lambda m: None)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty cache, no installed copy of the model's package, and a registry that cannot be reached."""
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_mod, "_installed_member", lambda part: None)

    def no_registry(*args, **kwargs):
        raise ModelError("no package registry here")

    monkeypatch.setattr(model_mod, "download_wheel", no_registry)
    return tmp_path


def test_without_the_gguf_an_offline_machine_fails_in_one_line(offline):
    with pytest.raises(ModelError, match="no package registry"):
        locate_gguf(log=lambda m: None)


def test_a_hand_copied_gguf_is_checked_and_then_found_offline(offline, real_gguf):
    copy = offline / "by-hand" / real_gguf.name
    copy.parent.mkdir()
    shutil.copyfile(real_gguf, copy)
    lines = []
    cached = adopt_gguf(copy, log=lines.append)
    assert cached == gguf_cache_path() and cached.parent.parent == offline / "cache"
    assert sha256_file(cached) == DEFAULT_SOURCE.gguf_sha256 and "pinned sha256" in lines[0]
    assert locate_gguf(log=lambda m: None) == cached  # no registry was asked
    assert adopt_gguf(copy, log=lines.append) == cached and len(lines) == 1  # already there: not copied again


def test_a_gguf_that_is_not_the_pinned_one_is_refused(offline, real_gguf, capsys):
    bad = offline / "bad.gguf"
    with open(real_gguf, "rb") as src, open(bad, "wb") as out:
        out.write(src.read(1 << 20))  # a truncated copy
    assert main(["model", "--gguf", str(bad)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pinned" in err[0] and not gguf_cache_path().exists()
    assert main(["model", "--gguf", str(offline / "missing.gguf")]) != 0
    assert "no GGUF file" in capsys.readouterr().err
    assert main(["model", "--model", "org/other", "--gguf", str(bad)]) != 0
    assert "packaged model" in capsys.readouterr().err
