"""The int8 screen of the logits projection for greedy decode steps (the C library's ``screen_argmax_in_team``).

A greedy step needs each verified row's argmax, not its logits. The C decode step reads an int8 copy of the
lm_head (half the bytes of the bf16 one: for the default model 28 of the 57 MB that are a fifth of a step's
reads), takes the activations in int16, bounds each estimate's distance to the exact float32 logit rigorously
(Cauchy-Schwarz on the weights' quantisation residual, the activations' rounding, the float32 rounding of the
exact sums), and computes exactly, as the full projection does, only the rows whose bound still reaches the best
lower bound: the argmax is the full projection's, bit for bit, ties included. On 512 positions of the default
model's greedy answers to 8 MT-Bench questions that left 3 rows to compute exactly at the median and 57 at most
(docs/reports/logit-screen.md).

This module builds the screen's tensors from the bf16 weight (the engine does so once per model, with the
other weights it packs for the C library: ``engine._kernel_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from medusa_runtime.kernels import hugepages

BLOCK = 64  # vocabulary rows side by side per pair of inputs in the int8 layout (SCREEN_BLOCK in lean_cpu.c)
_CHUNK = 4096  # vocabulary rows quantised at a time (float64 temporaries of _CHUNK x hidden)


@dataclass(frozen=True)
class LogitScreen:
    """What the C screen reads: ``q`` int8 [ceil(V / 64) * ceil(H / 2) * 64 * 2] (block b, input pair p: rows
    64 b .. 64 b + 63 side by side, each its inputs 2 p and 2 p + 1), and per vocabulary row float32 ``scale``
    s_v = max |w_v| / 127, ``err`` >= ||w_v - s_v q_v||_2, ``csum`` >= s_v |q_v|_1 and ``maxw`` = max |w_v|."""

    q: torch.Tensor
    scale: torch.Tensor
    err: torch.Tensor
    csum: torch.Tensor
    maxw: torch.Tensor

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (q, scale, err, csum, maxw), as LeanModel's screen fields."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def pointers(self) -> tuple[int, ...]:
        """Addresses in the order of LeanModel's screen fields."""
        return tuple(t.data_ptr() for t in self._tensors())

    @property
    def nbytes(self) -> int:
        """What a step reads of it (all of it)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def rows(self, vocab: int, hidden: int) -> torch.Tensor:
        """``q`` back as [vocab, hidden] int8 rows (tests)."""
        pairs = -(-hidden // 2)
        return self.q.view(-1, pairs, BLOCK, 2).permute(0, 2, 1, 3).reshape(-1, 2 * pairs)[:vocab, :hidden]


def build_screen(weight: torch.Tensor) -> LogitScreen:
    """The screen of a [V, H] weight (any float dtype; the exact values are the weight's own)."""
    vocab, hidden = weight.shape
    blocks, pairs = -(-vocab // BLOCK), -(-hidden // 2)
    q = hugepages.huge_buffer(blocks * pairs * BLOCK * 2).view(torch.int8).view(blocks, pairs, BLOCK, 2)  # zeroed
    scale, err, csum, maxw = (torch.zeros(vocab, dtype=torch.float32) for _ in range(4))
    with torch.no_grad():
        for at in range(0, vocab, _CHUNK):
            w = weight[at:at + _CHUNK].detach().to(torch.float64)  # [c, H], exact
            top = w.abs().amax(dim=1)
            s = (top / 127).to(torch.float32)  # the scale the C sums use
            s64 = s.to(torch.float64)
            qc = torch.where(s64[:, None] > 0, torch.round(w / s64.clamp_min(1e-300)[:, None]), 0.0).clamp(-127, 127)
            n = len(w)
            scale[at:at + n] = s
            maxw[at:at + n] = top.to(torch.float32)  # bf16 / float32 weights: exact
            # float64 sums, ~1e-16 relative: rounded up past that before the float32 rounding up
            err[at:at + n] = _round_up((w - s64[:, None] * qc).norm(dim=1) * (1 + 1e-9))
            csum[at:at + n] = _round_up(s64 * qc.abs().sum(dim=1) * (1 + 1e-9))
            padded = torch.zeros(n, 2 * pairs, dtype=torch.int8)
            padded[:, :hidden] = qc.to(torch.int8)
            rows = torch.arange(at, at + n)
            q[rows // BLOCK, :, rows % BLOCK, :] = padded.view(n, pairs, 2)
    return LogitScreen(q.reshape(-1), scale, err, csum, maxw)


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest float32 at or above each value."""
    f = x.to(torch.float32)
    return torch.where(f.to(torch.float64) < x, torch.nextafter(f, torch.tensor(float("inf"))), f)
