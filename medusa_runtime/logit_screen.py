"""The int8 screen of the logits projection for greedy decode steps (the C library's ``screen_argmax_in_team``).

A greedy step needs each verified row's argmax, not its logits. The C decode step reads an int8 copy of the
lm_head (half the bytes of the bf16 one: for the default model 28 of the 57 MB that are a fifth of a step's
reads), bounds each estimate's distance to the exact float32 logit rigorously (Cauchy-Schwarz on the
quantisation residual, float32 rounding of both sums), and computes exactly, as the full projection does, only
the rows whose bound still reaches the best lower bound: the argmax is the full projection's, bit for bit, ties
included. On 635 positions of the default model's own answers that left 3 rows to compute exactly at the median
and 34 at most (docs/reports/2026-12-03-logit-screen.md).

This module builds the screen's tensors from the bf16 weight, once per model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .kernels import hugepages

BLOCK = 64  # vocabulary rows side by side per input in the int8 layout (SCREEN_BLOCK in lean_cpu.c)
_CHUNK = 4096  # vocabulary rows quantised at a time (float64 temporaries of _CHUNK x hidden)


@dataclass(frozen=True)
class LogitScreen:
    """What the C screen reads: ``q`` int8 [ceil(V / 64) * H * 64] (block b, input k: rows 64 b .. 64 b + 63 side
    by side), and per vocabulary row float32 ``scale`` (max |w| / 127), ``err`` (>= ||w - scale q||_2) and
    ``maxw`` (max |w|)."""

    q: torch.Tensor
    scale: torch.Tensor
    err: torch.Tensor
    maxw: torch.Tensor

    def pointers(self) -> tuple[int, int, int, int]:
        return self.q.data_ptr(), self.scale.data_ptr(), self.err.data_ptr(), self.maxw.data_ptr()

    @property
    def nbytes(self) -> int:
        """What a step reads of it (all of it)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.err, self.maxw))


def build_screen(weight: torch.Tensor) -> LogitScreen:
    """The screen of a [V, H] weight (any float dtype; the exact values are the weight's own)."""
    vocab, hidden = weight.shape
    blocks = -(-vocab // BLOCK)
    q = hugepages.huge_buffer(blocks * BLOCK * hidden).view(torch.int8).view(blocks, hidden, BLOCK)  # zero padded
    scale, err, maxw = (torch.zeros(vocab, dtype=torch.float32) for _ in range(3))
    with torch.no_grad():
        for at in range(0, vocab, _CHUNK):
            w = weight[at:at + _CHUNK].detach().to(torch.float64)  # [c, H], exact
            top = w.abs().amax(dim=1)
            s = (top / 127).to(torch.float32)  # the scale the C sums use
            s64 = s.to(torch.float64)
            qc = torch.where(s64[:, None] > 0, torch.round(w / s64.clamp_min(1e-300)[:, None]), 0.0).clamp(-127, 127)
            residual = (w - s64[:, None] * qc).norm(dim=1)  # float64: its own rounding ~1e-16 relative
            scale[at:at + len(w)] = s
            maxw[at:at + len(w)] = top.to(torch.float32)  # bf16 / float32 weights: exact
            err[at:at + len(w)] = _round_up(residual * (1 + 1e-9))
            rows = torch.arange(at, at + len(w))
            q[rows // BLOCK, :, rows % BLOCK] = qc.to(torch.int8)
    return LogitScreen(q.reshape(-1), scale, err, maxw)


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest float32 at or above each value."""
    f = x.to(torch.float32)
    return torch.where(f.to(torch.float64) < x, torch.nextafter(f, torch.tensor(float("inf"))), f)


_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per model: (parameters' versions, screen)


def screen_for(model: torch.nn.Module, weight: torch.Tensor) -> LogitScreen:
    """``build_screen(weight)`` once per model (again after its parameters changed in place)."""
    stamp = sum(p._version for p in model.parameters())
    hit = _SCREENS.get(model)
    if hit is None or hit[0] != stamp:
        hit = _SCREENS[model] = (stamp, build_screen(weight))
    return hit[1]
