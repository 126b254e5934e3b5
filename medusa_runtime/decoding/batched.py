"""Greedy replies to many prompts at once on the lean engine's weights, with continuous batching.

A batch of ``rows`` decodes together, one token per row per step, over a KV cache preallocated once
``[layers, rows, kv_heads, capacity, head_dim]``; each row holds its own prompt at its own position::

    admit(row)  : the next prompt's forward alone into the row's cache slots 0..n-1 -> its first token
    step        : every live row's token at its own slot pos[b]; attention over slots 0..max(pos) with
                  row b seeing slots <= pos[b]; argmax per row
    finish(row) : EOS or the length cap; the row takes the next prompt (the batch stays full)

When the prompts run out and half the rows are idle, the live rows move to the front of the cache and the
batch narrows, so the last replies do not pay for a full batch. transformers' ``generate`` instead grows its
cache by concatenation every step and pads every prompt of a batch to the longest; here neither happens.
The maths is the lean engine's (``LeanEngine.attention_inputs`` and ``after_attention``, its RoPE tables
and fused weights).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from medusa_runtime.engines.lean import LeanEngine, lean_support
from medusa_runtime.model import LoadedModel


def batched_support(loaded: LoadedModel) -> str | None:
    """None when :func:`batched_greedy` runs this model (the lean engine's), else why not."""
    return lean_support(loaded)


class _Batch:
    """The batch's cache and each row's state: the prompt it answers (-1: idle), its next slot, its last token."""

    def __init__(self, engine: LeanEngine, rows: int, capacity: int):
        shape = (len(engine.layers), rows, engine.kv_heads, capacity, engine.head_dim)
        self.keys = torch.zeros(shape, dtype=engine.dtype, device=engine.device)
        self.values = torch.zeros_like(self.keys)
        self.prompt = [-1] * rows
        self.pos = [0] * rows
        self.token = [0] * rows
        self.width = rows  # rows 0..width-1 take part in steps

    def live(self) -> list[int]:
        return [b for b in range(self.width) if self.prompt[b] >= 0]

    def narrow(self) -> None:
        """Move the live rows to the front (their caches with them) and step only those."""
        live = self.live()
        for new, old in enumerate(live):
            if new != old:
                self.keys[:, new] = self.keys[:, old]
                self.values[:, new] = self.values[:, old]
                for field in (self.prompt, self.pos, self.token):
                    field[new] = field[old]
                self.prompt[old] = -1
        self.width = len(live)


def batched_greedy(loaded: LoadedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, rows: int = 128,
                   progress: bool = True, desc: str = "replies") -> list[list[int]]:
    """Greedy continuations of ``prompts`` (each stops at EOS, kept) decoded ``rows`` at a time."""
    why = batched_support(loaded)
    if why:
        raise ValueError(f"batched generation runs Llama-family models only: {why}")
    if max_new_tokens < 1 or rows < 1:
        raise ValueError("max_new_tokens and rows must be >= 1")
    out: list[list[int]] = [[] for _ in prompts]
    if not prompts:
        return out
    if min(len(p) for p in prompts) < 1:
        raise ValueError("a prompt is empty")
    engine = LeanEngine(loaded, use_kernels=False, static_steps=False)
    capacity = max(len(p) for p in prompts) + max_new_tokens
    engine._rope(capacity)
    eos = set(loaded.eos_token_ids)
    # longest first: rows admitted together have similar lengths, so attention's window fits them all
    queue = deque(sorted(range(len(prompts)), key=lambda i: -len(prompts[i])))
    batch = _Batch(engine, min(rows, len(prompts)), capacity)
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, unit="reply")

    def emit(b: int, token: int) -> None:
        i = batch.prompt[b]
        out[i].append(token)
        batch.token[b] = token
        if token in eos or len(out[i]) >= max_new_tokens:
            batch.prompt[b] = -1
            bar.update(1)

    def admit(b: int) -> None:
        while queue and batch.prompt[b] < 0:
            i = queue.popleft()
            ids = torch.as_tensor(list(prompts[i]), dtype=torch.long, device=engine.device)
            n = ids.shape[0]
            hidden = engine._layers(ids, engine._cos[:n, None], engine._sin[:n, None], batch.keys[:, b],
                                    batch.values[:, b], None, causal=n > 1)
            batch.prompt[b], batch.pos[b] = i, n
            emit(b, int(engine._logits(hidden[-1:]).float().argmax()))

    with torch.inference_mode():
        for b in range(batch.width):
            admit(b)
        while batch.live():
            if not queue and 2 * len(batch.live()) <= batch.width:
                batch.narrow()
            _step(engine, batch)
            for b in range(batch.width):
                if batch.prompt[b] >= 0:
                    batch.pos[b] += 1
                    emit(b, batch.token[b])
                if batch.prompt[b] < 0:
                    admit(b)
    bar.close()
    return out


def _step(engine: LeanEngine, batch: _Batch) -> None:
    """One token per row (idle rows too: their values are never read) -> each row's argmax into ``batch.token``.

    Shapes: x [w, H]; keys [layers, w, kv, T, D] read up to T = max(pos) + 1; row b sees slots <= pos[b]."""
    w, dev = batch.width, engine.device
    pos = torch.tensor(batch.pos[:w], dtype=torch.long, device=dev)
    ids = torch.tensor(batch.token[:w], dtype=torch.long, device=dev)
    rows = torch.arange(w, device=dev)
    span = max(batch.pos[:w]) + 1
    visible = (torch.arange(span, device=dev)[None, :] <= pos[:, None])[:, None, None, :]  # [w, 1, 1, T]
    cos, sin = engine._cos[pos][:, None], engine._sin[pos][:, None]  # [w, 1, D]
    x = F.embedding(ids, engine.embed)
    for i, lw in enumerate(engine.layers):
        q, k, v = engine.attention_inputs(lw, x, cos, sin)
        batch.keys[i, rows, :, pos] = k  # [w, kv, D] at each row's own slot
        batch.values[i, rows, :, pos] = v
        att = F.scaled_dot_product_attention(q[:, :, None], batch.keys[i, :w, :, :span],
                                             batch.values[i, :w, :, :span], attn_mask=visible,
                                             enable_gqa=True)  # [w, heads, 1, D]
        x = engine.after_attention(lw, x, att.reshape(w, -1))
    batch.token[:w] = engine._logits(engine._rms(x, engine.norm)).float().argmax(dim=-1).tolist()
