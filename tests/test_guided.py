"""Decoding constrained to a set of strings (guided_choice), against a brute-force reference: every step a full
forward of prompt + text so far (no cache), the allowed tokens found by matching the choices' token lists."""

from __future__ import annotations

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.decoding.guided import guided_choice
from medusa_runtime.model import chat_template_ids

from .conftest import tiny_chat_model


def _reference(loaded, prompt: list[int], choices: list[str]) -> str:
    tok = loaded.tokenizer
    paths = {c: tok.encode(c, add_special_tokens=False) for c in choices}
    eos = loaded.eos_token_ids[0]
    done: list[int] = []
    while True:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([prompt + done])).logits[0, -1].float()
        options = {p[len(done)] for p in paths.values() if len(p) > len(done) and p[:len(done)] == done}
        finished = [c for c, p in paths.items() if p == done]
        if finished and (not options or logits[eos] > max(logits[t] for t in options)):
            return finished[0]
        done.append(max(options, key=lambda t: logits[t].item()))


@pytest.fixture(scope="module")
def loaded():
    return tiny_chat_model()


def test_guided_choice_is_greedy_decoding_over_the_choices_paths(loaded):
    ratings = [str(i) for i in range(1, 11)]  # "10" shares its first token with "1": the end competes with "0"
    words = ["yes", "no", "maybe so", "yes indeed", "noon"]
    for k, text in enumerate(["Rate it.", "Is it so?", "Pick one of the options please.", "Hello"]):
        prompt = chat_template_ids(loaded, [{"role": "user", "content": text}])
        for choices in (ratings, words, ratings[::-1]):
            got = guided_choice(loaded, prompt, choices)
            assert got in choices and got == _reference(loaded, prompt, choices), (k, choices)


def test_guided_choice_returns_the_models_own_greedy_answer_when_it_is_a_choice(loaded):
    prompt = chat_template_ids(loaded, [{"role": "user", "content": "Say something."}])
    own = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=3)).generate(prompt).token_ids
    text = loaded.tokenizer.decode(own, skip_special_tokens=True)
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == own  # a text whose tokens are these
    others = ["a", "b c", text + " and more", text[:-1] or "z"]
    assert guided_choice(loaded, prompt, [*others, text]) in {text, text + " and more"}
    # its continuation after the 3 tokens is not EOS here unless the model ends: only then the shorter one
    assert guided_choice(loaded, prompt, [*others[:2], text]) == text


def test_guided_choice_refuses_an_empty_choice(loaded):
    prompt = chat_template_ids(loaded, [{"role": "user", "content": "x"}])
    for bad in ([], [""], ["a", ""]):
        with pytest.raises(ValueError, match="non-empty"):
            guided_choice(loaded, prompt, bad)
