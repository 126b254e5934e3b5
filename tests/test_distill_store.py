"""The answer store of self-distilled replies: shards written whole, a manifest, resume after a stop, reuse of
a store made elsewhere, refusal of one made with other settings."""

from __future__ import annotations

import json
import shutil

import pytest

from medusa_runtime.prompts import builtin_prompts
from medusa_runtime.training import distill
from medusa_runtime.training.distill import (
    AnswerStore,
    DistillConfig,
    build_distill_data,
    legacy_cache_file,
    reply_token_counts,
    store_settings,
)

from .conftest import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model():
    return tiny_chat_model()


class Generator:
    """A stand-in for greedy rollouts: a reply that depends on the context alone, the contexts it was asked
    for counted, and a stop (KeyboardInterrupt) after ``stop_after`` calls."""

    def __init__(self, stop_after: int | None = None):
        self.calls: list[int] = []
        self.stop_after = stop_after

    def __call__(self, loaded, contexts, max_new_tokens, batch_size):
        if self.stop_after is not None and len(self.calls) == self.stop_after:
            raise KeyboardInterrupt
        self.calls.append(len(contexts))
        return [[(sum(c) + k) % 500 for k in range(1 + len(c) % max_new_tokens)] for c in contexts]


def _run(loaded, prompts, cfg, store, gen, monkeypatch):
    monkeypatch.setattr(distill, "generate_replies", lambda *args: (gen(*args), "stand-in"))
    return build_distill_data(loaded, prompts, cfg, progress=False, store=store)


def test_a_stopped_run_keeps_its_shards_and_the_rerun_makes_only_the_rest(chat_model, tmp_path, monkeypatch):
    prompts = builtin_prompts()[:10]
    cfg = DistillConfig(max_new_tokens=8, batch_size=2, follow_ups=False, shard_size=3)
    whole, _ = _run(chat_model, prompts, cfg, tmp_path / "whole", Generator(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _run(chat_model, prompts, cfg, tmp_path / "cut", Generator(stop_after=2), monkeypatch)
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert [s["replies"] for s in manifest["shards"]] == [3, 3] and manifest["replies"] == 6
    assert all(s["device"].startswith("cpu") and s["seconds"] >= 0 for s in manifest["shards"])
    assert not list((tmp_path / "cut").glob(".*"))  # no half-written shard left behind
    rerun = Generator()
    resumed, store = _run(chat_model, prompts, cfg, tmp_path / "cut", rerun, monkeypatch)
    assert rerun.calls == [3, 1]  # the 4 replies not yet kept, in a shard of 3 and one of 1
    assert resumed == whole
    assert store.manifest()["reply_tokens"] == sum(len(e.input_ids) - e.reply_start for e in whole)
    again = Generator()
    _run(chat_model, prompts, cfg, tmp_path / "cut", again, monkeypatch)
    assert again.calls == []


def test_a_store_made_elsewhere_is_reused_and_one_with_other_settings_refused(chat_model, tmp_path, monkeypatch):
    prompts = builtin_prompts()[:4]
    cfg = DistillConfig(max_new_tokens=8, follow_ups=False, shard_size=2)
    made, _ = _run(chat_model, prompts, cfg, tmp_path / "gpu", Generator(), monkeypatch)
    shutil.copytree(tmp_path / "gpu", tmp_path / "copied")  # as brought back from another machine
    reuse = Generator()
    again, store = _run(chat_model, prompts, DistillConfig(max_new_tokens=8, batch_size=64, follow_ups=False),
                        tmp_path / "copied", reuse, monkeypatch)
    assert reuse.calls == [] and again == made  # the batch size is no part of a store's identity
    assert store.summary()["made_on"] == {store.shards[0]["device"]: 4}
    with pytest.raises(ValueError, match=r"holds replies made with .*'max_new_tokens': 8.*not .*'max_new_tokens': 9"):
        _run(chat_model, prompts, DistillConfig(max_new_tokens=9), tmp_path / "copied", Generator(), monkeypatch)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text('{"schema": "other"}')
    with pytest.raises(ValueError, match="not an answer-store manifest"):
        AnswerStore(tmp_path / "bad", store_settings(chat_model, cfg))


def test_a_shard_whose_manifest_entry_was_lost_is_adopted(chat_model, tmp_path, monkeypatch):
    prompts = builtin_prompts()[:5]
    cfg = DistillConfig(max_new_tokens=8, follow_ups=False, shard_size=2)
    _run(chat_model, prompts, cfg, tmp_path / "s", Generator(), monkeypatch)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]  # a stop between the shard's write and the manifest's
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    gen = Generator()
    _, store = _run(chat_model, prompts, cfg, tmp_path / "s", gen, monkeypatch)
    assert gen.calls == [] and len(store.replies) == 5
    assert [s.get("adopted", False) for s in store.shards] == [False, True, True]


def test_reply_counts_read_a_store_as_its_shards(chat_model, tmp_path, monkeypatch):
    prompts = builtin_prompts()[:7]
    cfg = DistillConfig(max_new_tokens=8, follow_ups=False, shard_size=3)
    examples, store = _run(chat_model, prompts, cfg, tmp_path / "s", Generator(), monkeypatch)
    counts, read = reply_token_counts(tmp_path / "s")
    expected = [t for e in examples for t in e.input_ids[e.reply_start:]]
    assert read == 7 and sum(counts.values()) == len(expected)
    assert counts == reply_token_counts(tmp_path / "s", limit=None)[0]
    per_file = sum(sum(reply_token_counts(p)[0].values()) for p in sorted((tmp_path / "s").glob("shard-*.jsonl")))
    assert per_file == len(expected)
    with pytest.raises(FileNotFoundError, match="not an answer store"):
        reply_token_counts(tmp_path)


def test_the_single_file_cache_of_earlier_releases_is_read(chat_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path))
    prompts = builtin_prompts()[:3]
    cfg = DistillConfig(max_new_tokens=8, follow_ups=False)
    legacy = legacy_cache_file(chat_model, cfg)
    legacy.parent.mkdir(parents=True)
    lines = [json.dumps({"turns": list(p.turns[:1]), "reply_start": 2, "input_ids": [1, 2, 3, 4]}) for p in prompts]
    legacy.write_text("\n".join(lines) + '\n{"turns": ["cut by a cra')
    gen = Generator()
    examples, store = _run(chat_model, prompts, cfg, None, gen, monkeypatch)
    assert gen.calls == [] and [e.input_ids for e in examples] == [(1, 2, 3, 4)] * 3
    assert store.root.parent == legacy.parent and not store.shards
