"""The Medusa training loss: head j at position t scored against the token t + j + 2, cross-entropy weighted
0.8^(j+1) over the heads, with top-1..5 accuracy kept per head."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
