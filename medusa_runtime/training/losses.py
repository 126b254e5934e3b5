"""The Medusa training loss: head j at position t scored against the token t + j + 2, cross-entropy weighted
0.8^(j+1) over the heads, with top-1..5 accuracy kept per head; ``HeadTrainer`` computes it for a batch of
the base's hidden states (every training method's head loss), ``evaluate_heads`` the accuracies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from medusa_runtime.model import cpu_autocast

if TYPE_CHECKING:
    from medusa_runtime.heads.medusa import MedusaHeads

TOPK_LOGGED = 5  # top-k accuracies kept per head


@dataclass
class HeadStats:
    loss: float
    positions: int
    topk_correct: list[int]  # cumulative: correct within top-1 .. top-5



def head_targets(labels: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t whose label t+shift exists and is a reply token. labels [B, T] (-100 = ignore)
    -> (mask [B, T] of usable positions t, targets [B, T] = labels[t + shift] where usable)."""
    b, t = labels.shape
    mask = torch.zeros_like(labels, dtype=torch.bool)
    targets = torch.full_like(labels, -100)
    if shift < t:
        shifted = labels[:, shift:]
        mask[:, : t - shift] = shifted != -100
        targets[:, : t - shift] = shifted
    return mask, targets


def ce_and_accuracy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Mean cross-entropy of [N, V] logits and top-1..5 correct counts."""
    loss = F.cross_entropy(logits.float(), target)
    with torch.no_grad():
        top = torch.topk(logits, min(TOPK_LOGGED, logits.shape[-1]), dim=-1).indices
        hit = (top == target[:, None]).long().cumsum(-1).clamp(max=1).sum(0).tolist()
    hit += [hit[-1]] * (TOPK_LOGGED - len(hit))
    return loss, hit


def medusa_loss(head_logits: Sequence[torch.Tensor], labels: torch.Tensor, loss_decay: float = 0.8
                ) -> tuple[torch.Tensor, list[HeadStats | None]]:
    """head_logits: K tensors [B, T, V] (head j read at position t); labels [B, T] with -100 ignored.
    Head j is scored against labels[:, t + j + 2]; heads without a valid position are skipped."""
    total = labels.new_zeros((), dtype=torch.float32)
    stats: list[HeadStats | None] = []
    for j, logits in enumerate(head_logits):
        mask, targets = head_targets(labels, j + 2)
        n = int(mask.sum())
        if n == 0:
            stats.append(None)
            continue
        loss, hits = ce_and_accuracy(logits[mask], targets[mask])
        total = total + loss_decay ** (j + 1) * loss
        stats.append(HeadStats(float(loss.detach()), n, hits))
    return total, stats


class HeadTrainer:
    """Projection of head states through a vocabulary matrix at the usable positions only."""

    def __init__(self, heads: MedusaHeads, lm_weight: torch.Tensor, cfg,
                 subset: torch.Tensor | None = None, embed: torch.Tensor | None = None):
        self.heads, self.cfg = heads, cfg
        self.lm_weight = lm_weight  # [V, H], frozen (shared format)
        self.embed = embed  # [V, H] the base's input embeddings (root-conditioned heads read the root's row)
        if heads.root_conditioned and embed is None:
            raise ValueError("root-conditioned heads train with the base model's input embeddings")
        # optional training vocabulary: the softmax runs over these token ids only ([S]); targets are remapped
        self.subset = subset
        self.remap = None
        if subset is not None:
            self.remap = torch.full((lm_weight.shape[0],), -1, dtype=torch.long)
            self.remap[subset] = torch.arange(len(subset))

    def logits(self, j: int, states: torch.Tensor) -> torch.Tensor:
        if self.heads.proj is not None:
            w = self.heads.proj[j] if self.subset is None else self.heads.proj[j][self.subset]
        else:  # rows taken per call: Medusa-2's lm_head changes while it trains
            w = self.lm_weight if self.subset is None else self.lm_weight[self.subset]  # [S, H]
        return states @ w.T.to(torch.bfloat16 if torch.is_autocast_enabled("cpu") else states.dtype)

    def _soft_loss(self, logits: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
        """Cross-entropy against the base's own distribution over the token head j predicts.

        Head j at position t predicts token t + j + 2, which the base predicts from its hidden state at
        t + j + 1: ``teacher_hidden`` [N, H] are those states (final norm applied), projected through the
        same vocabulary rows as the head (its softmax renormalised on a training vocabulary). On greedy
        self-distilled data its argmax is the hard label; the rest of it ranks the alternatives.
        """
        with torch.no_grad(), cpu_autocast(teacher_hidden.device):
            w = self.lm_weight if self.subset is None else self.lm_weight[self.subset]
            teacher = torch.softmax((teacher_hidden @ w.T.to(teacher_hidden.dtype)).float(), dim=-1)
        return -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()

    def _conditioning(self, ids: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The embeddings conditioned heads read, or None: roots [sum T, H] (at position t the input
        embedding of token t + 1, the root a decoding step starting there would have) and, for
        path-conditioned heads, parents [sum T, K-1, H] (for head j the embedding of token t + j + 1).
        Positions past an example's end, which no head target reaches, repeat its last token."""
        if not self.heads.root_conditioned:
            return None, None
        if ids is None:
            raise ValueError("root-conditioned heads need the examples' token ids")
        k = self.heads.num_heads
        ahead = []  # per example [T, K]: tokens t + 1 .. t + K
        for row in ids:
            at = (torch.arange(len(row))[:, None] + torch.arange(1, k + 1)).clamp(max=len(row) - 1)
            ahead.append(row[at])
        tokens = torch.cat(ahead).to(self.embed.device)  # [sum T, K]
        roots = self.embed[tokens[:, 0]].float()
        parents = self.embed[tokens[:, 1:]].float() if self.heads.path_conditioned and k > 1 else None
        return roots, parents

    def batch_loss(self, hiddens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                   ids: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[HeadStats | None]]:
        """Concatenate usable positions of all examples per head, then one matmul per head.
        ``ids`` (the examples' tokens, [T] each) are needed by root-conditioned heads only."""
        total = torch.zeros(())
        stats: list[HeadStats | None] = []
        hidden_all = torch.cat(list(hiddens)).float()  # [sum T, H]
        root_embedding, parents = self._conditioning(ids)
        with cpu_autocast(hidden_all.device):
            states = self.heads.head_states(hidden_all, root_embedding, parents)  # [sum T, K, H]
        for j in range(self.heads.num_heads):
            sel, tgt = [], []
            offset = 0
            for lab in labels:
                mask, targets = head_targets(lab[None], j + 2)
                idx = torch.nonzero(mask[0]).flatten()
                sel.append(idx + offset)
                tgt.append(targets[0, idx])
                offset += lab.shape[0]
            index = torch.cat(sel)
            if index.numel() == 0:
                stats.append(None)  # no usable position for this head in this batch: skipped
                continue
            target = torch.cat(tgt)
            if self.remap is not None:
                target = self.remap[target]
                keep = target >= 0  # tokens outside the training vocabulary are not trained on
                index, target = index[keep], target[keep]
                if index.numel() == 0:
                    stats.append(None)
                    continue
            with cpu_autocast(hidden_all.device):
                logits = self.logits(j, states[index, j])  # [N, V] (or [N, S] on a training vocabulary)
            loss, hits = ce_and_accuracy(logits, target)
            if self.cfg.soft_targets > 0:
                loss = (1 - self.cfg.soft_targets) * loss + self.cfg.soft_targets * self._soft_loss(
                    logits, hidden_all[index + j + 1])
            total = total + self.cfg.loss_decay ** (j + 1) * loss
            stats.append(HeadStats(float(loss.detach()), int(index.numel()), hits))
        return total, stats


def accumulate_topk(acc: list[list[float]], stats: list[HeadStats | None]) -> None:
    for j, s in enumerate(stats):
        if s is not None:
            acc[j][0] += s.positions
            for r in range(TOPK_LOGGED):
                acc[j][1 + r] += s.topk_correct[r]


def topk_rates(acc: list[list[float]]) -> list[list[float]]:
    return [[c / a[0] if a[0] else 0.0 for c in a[1:]] for a in acc]


@torch.no_grad()
def evaluate_heads(trainer: HeadTrainer, hiddens: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                   chunk: int = 8, ids: Sequence[torch.Tensor] | None = None) -> list[list[float]]:
    """Per head, top-1..5 accuracy on the given examples."""
    acc = [[0.0] * (1 + TOPK_LOGGED) for _ in range(trainer.heads.num_heads)]
    for s in range(0, len(hiddens), chunk):
        _, stats = trainer.batch_loss(hiddens[s:s + chunk], labels[s:s + chunk],
                                      None if ids is None else ids[s:s + chunk])
        accumulate_topk(acc, stats)
    return topk_rates(acc)
