"""Quality proxies that need no judge: agreement with the baseline's tokens, and the mean
log-likelihood of each answer under the base model."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from medusa_runtime.model import LoadedModel


def token_agreement(answer: Sequence[int], reference: Sequence[int]) -> float:
    """Share of the reference's positions where the answer has the same token (1.0 = identical)."""
    if not reference:
        return 1.0 if not answer else 0.0
    same = sum(a == b for a, b in zip(answer, reference))
    return same / max(len(reference), len(answer))


@torch.inference_mode()
def mean_log_likelihood(loaded: LoadedModel, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Mean log p(answer token | prompt, earlier answer tokens) under the base model."""
    if not answer:
        return float("nan")
    ids = torch.tensor([list(prompt) + list(answer)], device=loaded.device)
    logits = loaded.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [A, V]
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(list(answer), device=loaded.device)
    return float(logp.gather(1, target[:, None]).mean())
