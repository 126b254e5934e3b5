"""One forward over several sequences at once: the rows of batched decoding.

Each live request contributes a ``Seq``: its step's tokens (one for plain decoding, the tree's nodes, a lookup
chain), its own cache and its own tree mask. The rows go through the layers together, so the weights stream
once per step for the whole batch::

    x      = embed(all rows)                                   # [rows, H]
    per layer: q, k, v = qkv(all rows)                         # one linear over every row
               per sequence: k, v -> its cache; attention over its own cache and tree mask
               x = x + o(att); x = x + down(silu(gate) * up)   # linears over every row
    logits = lm_head(norm(x))                                  # [rows, V]
    pred   = argmax per row                                    # or, greedy rows alone, through the int8 screen

A row's result does not depend on which rows share the forward: the linears give each row what one row alone
gets (the C forward by construction; oneDNN's packed float32 layers, packed for ``lean.PACK_ROWS`` rows, by one
blocking for every row count), and each sequence's attention is the call its own decode step makes. So a
request's greedy tokens are the same alone and in any batch (tests/test_batch_decode.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa_runtime.engines.base import DecodeStep, EngineError
from medusa_runtime.engines.lean import LeanCache, LeanEngine


@dataclass(frozen=True)
class Seq:
    """One request's rows in a batched forward."""

    ids: torch.Tensor  # [n] int64 tokens, written at cache slots start..start+n-1
    start: int  # the first row's cache slot (the sequence's committed length)
    cache: LeanCache  # this request's own cache (the engine's new_cache)
    tree: torch.Tensor | None = None  # [n, n] bool ancestor mask; None: one causal row (a plain step)
    positions: torch.Tensor | None = None  # [n] int64 RoPE positions (None: the slots)

    def __post_init__(self) -> None:
        n = self.ids.shape[0]
        if self.ids.dim() != 1 or n < 1:
            raise EngineError("a sequence needs at least one token")
        if self.tree is None and n != 1:
            raise EngineError("several rows of one sequence need their tree mask")
        if self.tree is not None and tuple(self.tree.shape) != (n, n):
            raise EngineError(f"the tree mask must be [{n}, {n}], got {list(self.tree.shape)}")
        if self.positions is not None and tuple(self.positions.shape) != (n,):
            raise EngineError(f"positions must be {n} values")
        capacity = getattr(self.cache, "capacity", None)  # transformers' caches grow
        if capacity is not None and self.start + n > capacity:
            raise EngineError(f"cache of {capacity} positions cannot take {self.start + n}")

    def rope_positions(self) -> torch.Tensor:
        n = self.ids.shape[0]
        if self.positions is None:
            return torch.arange(self.start, self.start + n, device=self.ids.device)
        return self.positions.to(self.ids.device)


def forward_rows(engine, seqs: list[Seq], argmax_only: bool = False) -> DecodeStep:
    """The sequences' rows, one after another -> logits [rows, V] float32, hidden [rows, H], and each row's argmax
    where the C forward takes it in the same call (None elsewhere). ``argmax_only``: only the argmax is wanted
    (greedy rows), the logits are None where the C forward gives it, through the int8 screen of the logits where
    the step's rows are few enough. The C forward's outputs are views of the engine's buffers, overwritten by its
    next batched step."""
    if not seqs:
        raise EngineError("a batched forward needs at least one sequence")
    if not isinstance(engine, LeanEngine):  # engines without batched rows take one sequence, their own forward
        if len(seqs) != 1:
            raise EngineError(f"engine '{engine.name}' runs one sequence per forward")
        s = seqs[0]
        logits, hidden = engine.forward(s.ids, s.start, s.cache, tree=s.tree, positions=s.positions)
        return DecodeStep(logits, hidden, None, hidden)
    for s in seqs:
        engine._rope(s.cache.capacity)
    positions = torch.cat([s.rope_positions() for s in seqs]).to(device=engine.device, dtype=torch.int64)
    if int(positions.min()) < 0 or int(positions.max()) >= engine._rope_len:
        raise EngineError(f"positions must lie in [0, {engine._rope_len})")
    if engine.lib is not None:
        return engine.decode_rows(seqs, positions, argmax_only)
    logits, hidden = _torch_rows(engine, seqs, positions)
    return DecodeStep(logits, hidden, None, hidden)


def _masks(engine: LeanEngine, seqs: list[Seq]) -> list[torch.Tensor | None]:
    """Each sequence's additive attention bias, built as its own step builds it (``LeanEngine.forward``): past
    columns visible, the tree's own columns by ancestry (None for a plain step's one row)."""
    biases = []
    for s in seqs:
        if s.tree is None:
            biases.append(None)
            continue
        n, end = s.ids.shape[0], s.start + s.ids.shape[0]
        if n > s.cache.visible.shape[0]:
            s.cache.visible = torch.ones(n, s.cache.capacity, dtype=torch.bool, device=engine.device)
        window = s.cache.visible[:n, :end]
        window[:, s.start:] = s.tree
        biases.append(engine.grouped_bias(window))
        window[:, s.start:] = True  # the window's resting state: all visible
    return biases


def _torch_rows(engine: LeanEngine, seqs: list[Seq], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch path: ``LeanEngine._layers`` with each sequence's cache writes and attention on its own."""
    ids = torch.cat([s.ids for s in seqs]).to(engine.device)
    cos, sin = engine._cos[positions][:, None], engine._sin[positions][:, None]  # [rows, 1, D]
    biases = _masks(engine, seqs)
    bounds, at = [], 0
    for s in seqs:
        bounds.append((at, at + s.ids.shape[0]))
        at += s.ids.shape[0]
    x = F.embedding(ids, engine.embed)  # [rows, H]
    for i, w in enumerate(engine.layers):
        q, k, v = engine.attention_inputs(w, x, cos, sin)
        parts = []
        for s, (a, b), bias in zip(seqs, bounds, biases):
            end = s.start + (b - a)
            s.cache.keys[i, :, s.start:end] = k[a:b].transpose(0, 1)  # [kv, n, D]
            s.cache.values[i, :, s.start:end] = v[a:b].transpose(0, 1)
            parts.append(engine.grouped_attention(q[a:b], s.cache.keys[i:i + 1, :, :end],
                                                  s.cache.values[i:i + 1, :, :end], bias).reshape(b - a, -1))
        x = engine.after_attention(w, x, torch.cat(parts))
    hidden = engine._rms(x, engine.norm)
    return engine._logits(hidden).float(), hidden
