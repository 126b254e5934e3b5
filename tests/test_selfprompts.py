"""Self-generated training prompts: the filters, the exclusion of replayed questions, the shards' resume, and
sampling from the open user turn of a real chat template."""

from __future__ import annotations

import json

import pytest

from bench.replay.mtbench import load_questions
from medusa_runtime.training.selfprompts import (
    MANIFEST,
    PromptFilter,
    SelfPromptConfig,
    clean,
    generate_prompts,
    model_sampler,
    ngrams,
    open_user_turn,
    overlaps,
    reference_ngrams,
    rejection,
    words,
)

CFG = SelfPromptConfig(count=5, shard_size=4, min_words=3, ngram=5)


def test_ngrams_and_overlap_against_a_brute_force_scan():
    ref = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."]
    grams = reference_ngrams(ref, 5)
    assert ngrams(words("a b c"), 5) == {("a", "b", "c")}
    for text in ("Please compose an engaging travel blog post about my dog",  # shares 'compose ... blog'
                 "Write a travel blog about Hawaii",  # the same topic, no shared 5-gram
                 "COMPOSE AN ENGAGING TRAVEL BLOG!"):
        brute = any(" ".join(words(text)[i:i + 5]) in " ".join(words(ref[0]))
                    for i in range(len(words(text)) - 4))
        assert overlaps(text, grams, 5) == brute


def test_every_mt_bench_question_is_excluded_and_unrelated_prompts_are_kept():
    questions = load_questions(None, log=lambda m: None)
    turns = [t for q in questions for t in q.turns]
    filt = PromptFilter(SelfPromptConfig(), turns)
    # a question itself, and one with a few words changed around a shared 8-word stretch, are both dropped
    assert not any(filt.keep(t) for t in turns[:20])
    assert filt.dropped == {"overlaps a replayed question": 20}
    reworded = "Hi! " + " ".join(turns[0].split()[:10]) + " but make it about cats instead."
    assert not filt.keep(reworded)
    assert filt.keep("What are three good habits for keeping a small vegetable garden healthy in summer?")


def test_filters_drop_short_long_foreign_markup_and_duplicates():
    cfg = SelfPromptConfig(min_words=3, max_words=12)
    assert rejection("", cfg) == "empty or unfinished" and rejection("Hi there", cfg) == "short"
    assert rejection("word " * 13, cfg) == "long" and rejection("Как приготовить борщ дома быстро", cfg) == "language"
    assert clean("user: How do <|im_end|> magnets   work?") == "How do magnets work?"
    filt = PromptFilter(cfg)
    assert filt.keep("How do magnets work in a fridge door?")
    assert not filt.keep("how do MAGNETS work in a fridge door")  # the same words: a duplicate
    assert not filt.keep("How do magnets work in a fridge door, really?")  # near duplicate (3-gram Jaccard)
    assert filt.keep("Explain how a bicycle gear system changes effort.")
    assert filt.dropped == {"duplicate": 1, "near duplicate": 1}


def test_shards_resume_where_a_stopped_run_left_off(tmp_path):
    calls: list[int] = []

    def sampler(index, size):
        calls.append(index)
        if index == 1 and len(calls) == 2:
            raise KeyboardInterrupt  # stopped while sampling the second shard
        return [f"Question number {index} {i} about topic {index * 10 + i} please" for i in range(size)]

    with pytest.raises(KeyboardInterrupt):
        generate_prompts(sampler, tmp_path, CFG, log=lambda m: None)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert list(manifest["shards"]) == ["shard-00000.jsonl"] and not (tmp_path / "shard-00001.jsonl").exists()
    kept = generate_prompts(sampler, tmp_path, CFG, log=lambda m: None)
    assert calls == [0, 1, 1]  # shard 0 read back from disk, shard 1 sampled again, nothing else
    assert len(kept) == 5 and kept[0].id == "0:0" and kept[4].id == "1:0"
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert [json.loads(x)["turns"][0] for x in lines] == [p.turns[0] for p in kept]
    with pytest.raises(ValueError, match="other settings"):
        generate_prompts(sampler, tmp_path, SelfPromptConfig(count=5, shard_size=8), log=lambda m: None)


def test_the_model_writes_a_user_turn_from_the_open_template(default_model):
    prefix, end = open_user_turn(default_model.tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and end == "<|im_end|>"
    sample = model_sampler(default_model, SelfPromptConfig(shard_size=4, batch_size=4, max_prompt_tokens=48))
    first = sample(0, 4)
    assert len(first) == 4 and first == sample(0, 4)  # seeded by the shard index
    finished = [t for t in first if t]
    assert finished and sample(1, 4) != first
    assert all("<|im_end|>" not in t and "<|im_start|>" not in t for t in first)


def test_a_mix_spreads_its_sources_and_keys_the_train_stage_on_each_file(tmp_path):
    from bench.stages.jobs import TrainJob, stage_key
    from medusa_runtime.prompts import builtin_split, load_prompt_source, mix_parts, mixed_prompts

    own = tmp_path / "prompts.jsonl"
    own.write_text("".join(json.dumps({"turns": [f"Self question {i} about gardens"]}) + "\n" for i in range(30)))
    builtin = builtin_split(load_prompt_source("builtin"), "train")
    prompts, available = mixed_prompts(f"builtin+{own}")
    assert available == {"builtin": len(builtin), str(own): 30} and len(prompts) == len(builtin) + 30
    head = prompts[: len(prompts) // 3]  # any prefix holds both sources in proportion
    share = sum(p.source == str(own) for p in head) / len(head)
    assert abs(share - 30 / len(prompts)) < 0.02
    assert [p for p in prompts if p.source != str(own)] == builtin  # each source keeps its order
    assert mixed_prompts("builtin")[0] == builtin and mix_parts(str(own)) == [str(own)]
    key = stage_key(TrainJob(data=f"builtin+{own}"))
    assert f"data:{own}" in key["reads"] and key["depends"]["builtin_prompts"]
    own.write_text(own.read_text() + json.dumps({"turns": ["One more self question here"]}) + "\n")
    assert stage_key(TrainJob(data=f"builtin+{own}")) != key  # the file's contents key the stage
