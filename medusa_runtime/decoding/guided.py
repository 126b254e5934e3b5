"""Decoding constrained to a fixed set of strings (what vLLM calls ``guided_choice``).

Each step takes the likeliest token that keeps the output a prefix of at least one choice's token ids; where
the output already spells a whole choice, the end of the answer (the model's first EOS token) competes with
the tokens that would continue it. The answer is therefore always one of the choices, and where the model's
own greedy answer is a choice, it is that choice. The judge uses it to get a rating from a model that does
not write FastChat's ``[[rating]]`` format by itself (the served endpoint accepts ``guided_choice`` as vLLM's
does; the local judge calls it directly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_runtime.decoding import decode as _decode  # noqa: F401 - silences transformers' notice on past_key_values (see decode)
from medusa_runtime.model import LoadedModel


def check_choices(choices: object) -> None:
    """Refuse what is not a non-empty list of non-empty strings (the server answers 400 with this)."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")


def choice_ids(tokenizer, choices: Sequence[str]) -> dict[tuple[int, ...], str]:
    """Each choice's token ids as the tokenizer writes it after a prompt (no special tokens) -> the choice."""
    check_choices(choices)
    return {tuple(tokenizer.encode(c, add_special_tokens=False)): c for c in reversed(choices)}


def allowed_next(seqs: dict[tuple[int, ...], str], prefix: tuple[int, ...]) -> tuple[set[int], bool]:
    """(tokens that continue ``prefix`` towards some choice, whether ``prefix`` is itself a whole choice)."""
    n = len(prefix)
    nxt = {s[n] for s in seqs if len(s) > n and s[:n] == prefix}
    return nxt, prefix in seqs


@torch.inference_mode()
def guided_choice(loaded: LoadedModel, prompt_ids: Sequence[int], choices: Sequence[str]) -> str:
    """The choice greedy decoding reaches from ``prompt_ids`` when only the choices' token paths are allowed."""
    seqs = choice_ids(loaded.tokenizer, choices)
    eos = loaded.eos_token_ids[0] if loaded.eos_token_ids else None
    ids = torch.tensor([list(prompt_ids)], device=loaded.device)
    out = loaded.model(input_ids=ids, use_cache=True)
    prefix: tuple[int, ...] = ()
    while True:
        nxt, whole = allowed_next(seqs, prefix)
        if not nxt:  # a whole choice that nothing continues
            break
        logits = out.logits[0, -1].float()  # (vocab,)
        best = max(nxt, key=lambda t: float(logits[t]))
        if whole and (eos is None or float(logits[eos]) > float(logits[best])):
            break  # the model would end here (or cannot say): the shorter choice
        prefix += (best,)
        out = loaded.model(input_ids=torch.tensor([[best]], device=loaded.device), past_key_values=out.past_key_values,
                           use_cache=True)
    return seqs[prefix]
