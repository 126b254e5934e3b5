"""What every forward engine shares: the engine names a decoder may ask for, the engines' one-line error, and
the result of a lean decode step."""

from __future__ import annotations

from typing import NamedTuple

import torch

ENGINES = ("auto", "lean", "lean-torch", "lean-static", "hf")


class EngineError(ValueError):
    """An engine that cannot run this model, with a one-line reason."""


class DecodeStep(NamedTuple):
    """What ``LeanEngine.decode_step`` returns: views of the cache's step buffers, valid until its next step."""

    logits: torch.Tensor | None  # [n, V] float32, unrounded (None: a step that took the argmax alone)
    hidden: torch.Tensor  # [n, H]
    pred: list[int]  # each row's argmax (argmax_rows' rule)
    rows: tuple[torch.Tensor, ...] | torch.Tensor  # hidden's rows [H] as views (picking one is no tensor op)
