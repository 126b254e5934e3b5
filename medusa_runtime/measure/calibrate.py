"""Calibration: measure how often each head's rank-r guess is right on real greedy rollouts.

For every calibration prompt the base model's greedy continuation y_1..y_M is generated (by the runtime's
own plain decoding, the text its greedy configurations decode, or by transformers' batched generate);
one forward over prompt + continuation gives the hidden state at every position, the heads give
their top-k there, and position i (the hidden state of y_i, y_0 being the prompt's last token)
records, for each head j, the rank of y_{i+j+2} in head j's top-k (or a miss). Positions
i = 0..M-2 are exactly the states a greedy Medusa step can start from, so the rank vectors replay
any tree (see ``treesearch.stats``). Beside them each rollout keeps its prompt's id, its prompt and
output token ids (the prompt-lookup chain and every step's context replay from them) and, per position,
the heads' top-1 probabilities along their own top-1 chain (what the decoder's confidence gate reads),
so whole configurations replay (``treesearch.replay``). A held-out share of the prompts is stored
separately.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.heads.medusa import MedusaHeads
from medusa_runtime.model import LoadedModel, software_versions
from medusa_runtime.prompts import Prompt
from treesearch.stats import AcceptanceStats, RolloutText, marginal_from_rollouts
from treesearch.typical import TypicalSeq, TypicalStats


@dataclass(frozen=True)
class CalibrationConfig:
    max_new_tokens: int = 128  # length of each greedy rollout
    topk: int = 10  # ranks recorded per head (at most 36)
    heldout_fraction: float = 0.2  # share of prompts kept for validation
    batch_size: int = 16  # prompts generated together
    limit: int | None = None  # use only the first N prompts
    seed: int = 0  # split seed
    typical_temperature: float | None = None  # also store typical-acceptance arrays at this temperature
    # whose greedy text the rollouts are: 'runtime' (the decoder's own plain decoding, the text Medusa decodes
    # too: in bf16 it parts from transformers' generate at many positions, and a lookup chain's acceptance
    # follows the text) or 'generate' (transformers, batched: faster)
    rollouts: str = "runtime"

    def __post_init__(self) -> None:
        if not 1 <= self.topk <= 36:
            raise ValueError(f"topk must be within 1..36, got {self.topk}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.typical_temperature is not None and self.typical_temperature <= 0:
            raise ValueError(f"typical_temperature must be > 0, got {self.typical_temperature}")
        if self.rollouts not in ("runtime", "generate"):
            raise ValueError(f"rollouts must be runtime or generate, got {self.rollouts!r}")


@torch.inference_mode()
def greedy_rollouts(loaded: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int,
                    progress: bool = True, desc: str = "rollouts") -> list[list[int]]:
    """Greedy continuations, generated in left-padded batches; each stops at EOS."""
    eos = set(loaded.eos_token_ids)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer is not None else None
    pad = pad if pad is not None else (min(eos) if eos else 0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    out: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, unit="prompt")
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = list(prompts[i])
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        gen = loaded.model.generate(ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                    max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                    eos_token_id=sorted(eos) or None, top_p=None, top_k=None, temperature=None)
        for row, i in enumerate(idx):
            seq = gen[row, width:].tolist()
            cut = next((k + 1 for k, t in enumerate(seq) if t in eos), len(seq))
            out[i] = seq[:cut]
        bar.update(len(idx))
    bar.close()
    return out


def runtime_rollouts(loaded: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     progress: bool = True) -> list[list[int]]:
    """Greedy continuations by the runtime's own plain decoding (each stops at EOS, kept): the text every
    greedy configuration of the runtime decodes, token for token."""
    dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=max_new_tokens))
    return [dec.generate(list(p)).token_ids for p in tqdm(prompts, desc="rollouts", disable=not progress,
                                                          unit="prompt")]


def _head_topk(loaded: LoadedModel, heads: MedusaHeads, hidden: torch.Tensor, topk: int,
               following: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's top-k token ids [P, K, topk] at each of the P hidden states [P, H], and the gate's
    probabilities [P, K] float32 there (see :func:`_gate_probs`).

    ``following`` [>= P] are the tokens after the positions: following[i] is the token after position i
    (a greedy step's root there, read by root-conditioned heads) and following[i + j] the parent that
    path-conditioned head j reads (clamped at the end, where no target is left to score)."""
    lm_weight = loaded.model.get_output_embeddings().weight
    embed = loaded.model.get_input_embeddings()
    conditioned = heads.root_conditioned and following is not None
    tops, gates = [], []
    for s in range(0, hidden.shape[0], 64):  # [p, K, S] logits at a time (S: the heads' draft vocabulary, else V)
        rows = torch.arange(s, min(s + 64, hidden.shape[0]), device=hidden.device)
        root_embedding = embed(following[rows]) if conditioned else None
        parents = None
        if conditioned and heads.path_conditioned:  # [p, K-1]: token i + j for head j = 1..K-1
            at = (rows[:, None] + torch.arange(1, heads.num_heads, device=hidden.device)).clamp(max=len(following) - 1)
            parents = embed(following[at])  # [p, K-1, H]
        logits = heads.draft_logits(heads.head_states(hidden[s:s + 64], root_embedding, parents), lm_weight)
        tops.append(heads.token_ids(torch.topk(logits.float(), topk, dim=-1).indices))
        gates.append(_gate_probs(heads, hidden[s:s + 64], root_embedding, embed, lm_weight, logits))
    return torch.cat(tops), torch.cat(gates)


def _gate_probs(heads: MedusaHeads, hidden: torch.Tensor, root_embedding: torch.Tensor | None, embed,
                lm_weight: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[p, K] float32: head j's top-1 softmax probability when it reads, as path-conditioned heads do, the
    top-1 guess of head j-1 (itself read the same way) as its parent: the decoder's confidence gate takes
    the cumulative product of these along the tree's top-1 chain. Heads that read no parent all score the
    one state, so ``logits`` [p, K, S] (scored with the true parents) already hold them."""
    def top1(lg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.softmax(lg.float(), dim=-1).amax(dim=-1), heads.token_ids(torch.topk(lg.float(), 1, dim=-1).indices[..., 0])

    if not (heads.path_conditioned and root_embedding is not None):
        return top1(logits)[0]
    probs, token = top1(logits[:, 0])
    chain = [probs]
    for j in range(1, heads.num_heads):
        state = heads.conditioned_state(j, hidden, root_embedding, embed(token))  # [p, H]
        probs, token = top1(heads.draft_logits(state[:, None, :], lm_weight)[:, 0])
        chain.append(probs)
    return torch.stack(chain, dim=1)


def _ranks(top: torch.Tensor, rollout: torch.Tensor) -> list[tuple[int, ...]]:
    """Rank of y_{i+j+2} in head j's top-k (top: [P, K, k], P = M - 1), -1 when absent or past the end."""
    p, k_heads, _ = top.shape
    m = rollout.shape[0]
    ranks = torch.full((p, k_heads), -1, dtype=torch.long)
    i = torch.arange(p, device=top.device)
    for j in range(k_heads):
        tgt_pos = i + j + 1  # index of y_{i+j+2} in the rollout (y_1 is rollout[0])
        valid = tgt_pos < m
        hit = (top[:, j] == rollout[tgt_pos.clamp(max=m - 1)][:, None]) & valid[:, None]  # [P, k]
        found = hit.any(dim=-1)
        ranks[found.cpu(), j] = hit.float().argmax(dim=-1)[found].cpu()
    return [tuple(r) for r in ranks.tolist()]


def _typical_seq(base_logits: torch.Tensor, top: torch.Tensor, temperature: float) -> TypicalSeq:
    """Typical-acceptance arrays of one rollout (see ``treesearch.typical``).

    base_logits: [M, V], row q predicts rollout token q; top: [P, K, k] head guesses at step positions.
    """
    lp = torch.log_softmax(base_logits.float() / temperature, dim=-1)  # [M, V]
    m = lp.shape[0]
    entropy = -(lp.exp() * lp).sum(-1)  # [M]
    own = lp.max(dim=-1).values  # [M]: the argmax token's log p
    p, k_heads, _ = top.shape
    dev = lp.device
    q = torch.arange(p, device=dev)[:, None] + torch.arange(k_heads, device=dev)[None, :] + 1  # [P, K]: verify position
    inside = q < m
    logp = lp[q.clamp(max=m - 1)[:, :, None], top.to(dev)]  # [P, K, k]
    logp = torch.where(inside[:, :, None], logp, torch.full_like(logp, float("-inf")))
    return TypicalSeq(logp.cpu().numpy(), entropy.cpu().numpy(), own.cpu().numpy())


@dataclass(frozen=True)
class RolloutStatistics:
    """What calibration measures on one rollout."""

    ranks: list[tuple[int, ...]]  # [M-1] per position, head j's rank of y_{i+j+2} (-1: not in the top-k)
    gate: np.ndarray  # [M-1, K] float32: the heads' top-1 probabilities along their top-1 chain
    typical: TypicalSeq | None  # typical-acceptance arrays (with a typical temperature)


@torch.inference_mode()
def rollout_statistics(loaded: LoadedModel, heads: MedusaHeads, prompt: Sequence[int], rollout: Sequence[int],
                       topk: int, typical_temperature: float | None = None) -> RolloutStatistics:
    """Rank vectors of one rollout, its gate probabilities and, with a temperature, its typical arrays."""
    m = len(rollout)
    if m < 2:
        empty = TypicalSeq(np.zeros((0, heads.num_heads, topk), np.float32), np.zeros(1, np.float32),
                           np.zeros(1, np.float32))
        return RolloutStatistics([], np.zeros((0, heads.num_heads), np.float32),
                                 empty if typical_temperature else None)
    ids = torch.tensor([list(prompt) + list(rollout)], device=loaded.device)
    # logits of the last M + 1 positions: prompt's last token .. y_M; rows 0..M-1 predict y_1..y_M
    out = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=m + 1 if typical_temperature else 1)
    p = len(prompt)
    hidden = out.hidden_states[-1][0, p - 1 : p - 1 + m - 1]  # [M-1, H]: states of y_0 .. y_{M-2}
    following = torch.tensor(list(rollout), device=loaded.device)  # y_1 .. y_M: roots and parents
    top, gate = _head_topk(loaded, heads, hidden, topk, following)  # [M-1, K, topk], [M-1, K]
    ranks = _ranks(top, following)
    typical = _typical_seq(out.logits[0, :m].cpu(), top.cpu(), typical_temperature) if typical_temperature else None
    return RolloutStatistics(ranks, gate.float().cpu().numpy(), typical)


def rank_vectors(loaded: LoadedModel, heads: MedusaHeads, prompt: Sequence[int], rollout: Sequence[int],
                 topk: int) -> list[tuple[int, ...]]:
    """Rank of y_{i+j+2} in head j's top-k at each position i = 0..M-2 (-1: not in the top-k)."""
    return rollout_statistics(loaded, heads, prompt, rollout, topk).ranks


def split_prompts(n: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_held = int(round(n * heldout_fraction))
    return sorted(idx[n_held:]), sorted(idx[:n_held])


def calibrate(loaded: LoadedModel, heads: MedusaHeads, prompts: Sequence[Prompt], cfg: CalibrationConfig,
              provenance: dict | None = None, progress: bool = True,
              log: Callable[[str], None] = print) -> AcceptanceStats:
    prompts = list(prompts)[: cfg.limit] if cfg.limit else list(prompts)
    if not prompts:
        raise ValueError("no calibration prompts")
    heads = heads.to(device=loaded.device, dtype=loaded.dtype).eval()
    encoded = [encode_prompt(loaded, p.turns[0], chat=bool(getattr(loaded.tokenizer, "chat_template", None)))
               for p in prompts]
    rollouts = (runtime_rollouts(loaded, encoded, cfg.max_new_tokens, progress) if cfg.rollouts == "runtime" else
                greedy_rollouts(loaded, encoded, cfg.max_new_tokens, cfg.batch_size, progress))
    fit_idx, held_idx = split_prompts(len(prompts), cfg.heldout_fraction, cfg.seed)
    measured = [rollout_statistics(loaded, heads, encoded[i], rollouts[i], cfg.topk, cfg.typical_temperature)
                for i in tqdm(range(len(prompts)), desc="head ranks", disable=not progress, unit="prompt")]
    texts = [RolloutText(prompts[i].id or f"#{i}", tuple(encoded[i]), tuple(rollouts[i]), measured[i].gate)
             for i in range(len(prompts))]
    fit = tuple(tuple(measured[i].ranks) for i in fit_idx)
    held = tuple(tuple(measured[i].ranks) for i in held_idx)
    typical = None
    if cfg.typical_temperature:
        typical = TypicalStats(cfg.typical_temperature, tuple(measured[i].typical for i in fit_idx),
                               tuple(measured[i].typical for i in held_idx))
    meta = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights,
            "rule": "greedy",
            "draft_vocab": None if heads.draft_vocab is None else int(heads.draft_vocab.numel()),
            "num_prompts": len(prompts), "heldout_prompts": [int(i) for i in held_idx],
            "heldout_positions": sum(len(s) for s in held), "config": asdict(cfg),
            "machine": platform.node(), "versions": software_versions(), **(provenance or {})}
    return AcceptanceStats(marginal_from_rollouts(fit, heads.num_heads, cfg.topk), fit, held, meta, typical=typical,
                           texts=tuple(texts[i] for i in fit_idx), heldout_texts=tuple(texts[i] for i in held_idx))
