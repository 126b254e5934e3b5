"""Batched greedy replies (medusa_runtime/decoding/batched.py) against transformers' generate, prompt by prompt: rows of
different lengths, replies cut by EOS at different steps, more prompts than rows (continuous batching), and
the batch narrowing at the end."""

from __future__ import annotations

import random

import pytest

from medusa_runtime.decoding import batched
from medusa_runtime.decoding.batched import batched_greedy

from .conftest import hf_greedy, tiny_gpt2, tiny_llama


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_batched_replies_equal_generate_prompt_by_prompt(rows, monkeypatch):
    narrowed = []
    real = batched._Batch.narrow
    monkeypatch.setattr(batched._Batch, "narrow", lambda self: (narrowed.append(self.width), real(self)))
    loaded = tiny_llama(seed=2)
    rng = random.Random(rows)
    prompts = [[rng.randrange(loaded.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    free = [hf_greedy(loaded, p, 24) for p in prompts]
    # an EOS that cuts some replies early (at different steps) and leaves others to the length cap
    counts = {}
    for reply in free:
        for t in set(reply[3:]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (0 < counts[t] < len(prompts), counts[t]))
    loaded.model.generation_config.eos_token_id = eos
    want = [hf_greedy(loaded, p, 24) for p in prompts]
    assert any(len(w) < 24 for w in want) and any(len(w) == 24 for w in want)
    got = batched_greedy(loaded, prompts, 24, rows=rows, progress=False)
    assert got == want
    assert rows != 16 or narrowed == [9, 4]  # its tail ran on narrower batches (caches moved to the front)


def test_batched_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="Llama-family"):
        batched_greedy(tiny_gpt2(), [[1, 2]], 4, progress=False)
    with pytest.raises(ValueError, match="empty"):
        batched_greedy(tiny_llama(), [[1], []], 4, progress=False)
    assert batched_greedy(tiny_llama(), [], 4, progress=False) == []


def test_self_distillation_replies_come_from_the_batched_generator(tmp_path):
    """On a Llama-family model the answer store's shards are made batched (said in the manifest), and their
    replies are transformers' greedy ones (float32)."""
    import json

    from medusa_runtime.measure.calibrate import greedy_rollouts
    from medusa_runtime.model import chat_template_ids
    from medusa_runtime.prompts import builtin_prompts
    from medusa_runtime.training.distill import DistillConfig, build_distill_data

    from .conftest import tiny_chat_model

    loaded = tiny_chat_model()
    prompts = builtin_prompts()[:6]
    examples, store = build_distill_data(loaded, prompts, DistillConfig(max_new_tokens=12, batch_size=4,
                                                                        follow_ups=False), progress=False,
                                         store=tmp_path / "answers")
    manifest = json.loads((tmp_path / "answers" / "manifest.json").read_text())
    assert {s["generator"] for s in manifest["shards"]} == {"batched"}
    contexts = [chat_template_ids(loaded, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    want = greedy_rollouts(loaded, contexts, 12, 4, progress=False)
    assert [list(e.input_ids[e.reply_start:]) for e in examples] == want
