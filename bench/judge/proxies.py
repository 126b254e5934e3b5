"""Quality proxies that need no judge: agreement with the baseline's tokens, and the mean
log-likelihood of each answer under the base model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bench.replay.analyze import token_agreement
from medusa_runtime.measure.calibrate import greedy_rollouts
from medusa_runtime.model import LoadedModel


def _answer_logits(loaded: LoadedModel, prompt: Sequence[int], answer: Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [A, V] float32 that predict each answer token, the answer's ids [A, 1]) from one forward."""
    ids = torch.tensor([list(prompt) + list(answer)], device=loaded.device)
    logits = loaded.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [A, V]
    return logits, torch.tensor(list(answer), device=loaded.device)[:, None]


@torch.inference_mode()
def answer_scores(loaded: LoadedModel, prompt: Sequence[int], answer: Sequence[int], temperature: float = 0.0
                  ) -> tuple[float, float]:
    """(sum over the answer's tokens of log p(token) under the base model, sum of the regret) in one forward.

    regret_t = log p_T(argmax) - log p_T(token_t), p_T the base model's distribution at ``temperature`` (its
    own, T = 1, when 0): what the typical-acceptance search predicts per committed token; 0 for every token a
    greedy decoder picks (ties aside)."""
    if not answer:
        return 0.0, 0.0
    logits, target = _answer_logits(loaded, prompt, answer)
    ll = torch.log_softmax(logits, dim=-1).gather(1, target)
    warped = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    regret = warped.max(dim=-1, keepdim=True).values - warped.gather(1, target)
    return float(ll.sum()), float(regret.sum())


@torch.inference_mode()
def mean_log_likelihood(loaded: LoadedModel, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Mean log p(answer token | prompt, earlier answer tokens) under the base model."""
    if not answer:
        return float("nan")
    logits, target = _answer_logits(loaded, prompt, answer)
    return float(torch.log_softmax(logits, dim=-1).gather(1, target).mean())


@dataclass(frozen=True)
class Fidelity:
    """How far a retrained model (Medusa-2) drifted from the original on the same prompts."""

    prompts: int
    agreement: float  # mean token agreement of the trained model's greedy answers with the original's
    identical: float  # share of answers identical to the original's
    ll_original: float  # mean log-likelihood of the original's answers under the original (per token)
    ll_trained: float  # the same answers under the trained model

    @property
    def ll_drop(self) -> float:
        """Nats per token the trained model gives up on the original's own answers (>= 0 is a loss)."""
        return self.ll_original - self.ll_trained


def _mean_ll(loaded: LoadedModel, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> float:
    total = count = 0.0
    for p, a in zip(prompts, answers):
        if a:
            total += mean_log_likelihood(loaded, p, a) * len(a)
            count += len(a)
    return total / count if count else float("nan")


def fidelity(original: LoadedModel, trained: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             batch_size: int = 8, progress: bool = True) -> Fidelity:
    """Greedy answers of both models on ``prompts``: token agreement, and the log-likelihood of the
    original's answers under each model (token-weighted means)."""
    ref = greedy_rollouts(original, prompts, max_new_tokens, batch_size, progress, desc="original answers")
    got = greedy_rollouts(trained, prompts, max_new_tokens, batch_size, progress, desc="trained answers")
    agreement = sum(token_agreement(g, r) for g, r in zip(got, ref)) / len(prompts)
    identical = sum(list(g) == list(r) for g, r in zip(got, ref)) / len(prompts)
    return Fidelity(len(prompts), agreement, identical, _mean_ll(original, prompts, ref), _mean_ll(trained, prompts, ref))
