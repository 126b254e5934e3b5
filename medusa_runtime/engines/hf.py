"""The transformers engine: any causal LM through its own forward, a ``DynamicCache`` and a 4D float mask.

The reference: slow per step, but it runs every architecture transformers runs. It answers the three calls
the decode loop makes (``new_cache``, ``forward``, ``compact``) as the lean engine does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from medusa_runtime.engines.base import EngineError
from medusa_runtime.model import LoadedModel


class HFEngine:
    """transformers' own forward and ``DynamicCache`` (every architecture).

    Models with sliding-window layers (Gemma 2/3, Mistral with a window, ...) keep every position in every layer's
    cache (a sliding layer of transformers' cache would drop old entries, which the tree's compaction indexes by
    position) and get their tree mask per layer type: a sliding layer's row at position p also hides the cached
    positions at or below p - window, as transformers' own sliding mask does."""

    name = "hf"

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        cfg = self.model.config
        self.layer_types = tuple(getattr(cfg, "layer_types", None) or ())
        self.window = getattr(cfg, "sliding_window", None) if "sliding_attention" in self.layer_types else None
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise EngineError(f"layer types {sorted(unknown)} have no tree mask here (full and sliding attention only)")

    def new_cache(self, capacity: int) -> DynamicCache:
        # with sliding layers: a full cache everywhere (transformers masks the window itself in plain steps)
        return DynamicCache() if self.window else DynamicCache(config=self.model.config)

    def tree_mask(self, tree: torch.Tensor, start: int, positions: torch.Tensor) -> torch.Tensor | dict:
        """The additive mask of a tree forward: [1, 1, n, start + n], past columns visible and tree columns by
        ancestry; with sliding layers a dict by layer type, the sliding one also hiding past columns j <= p - window
        for a row at position p (tree columns are a node's ancestors, always within the window)."""
        n = tree.shape[0]
        neg = torch.finfo(self.dtype).min
        bias = torch.zeros(n, start + n, dtype=self.dtype, device=self.device)
        bias[:, start:].masked_fill_(~tree, neg)
        if not self.window:
            return bias[None, None]
        past = torch.arange(start, device=self.device)  # cached positions (compaction keeps index = position)
        outside = past[None, :] <= positions[:, None] - self.window  # [n, start]
        sliding = bias.clone()
        sliding[:, :start].masked_fill_(outside, neg)
        return {"full_attention": bias[None, None], "sliding_attention": sliding[None, None]}

    def forward(self, ids: torch.Tensor, start: int, cache: DynamicCache, tree: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n] at ``start`` (or explicit ``positions`` [n]) -> logits [n, V] float32, hidden [n, H]."""
        n = ids.shape[0]
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        mask = None if tree is None else self.tree_mask(tree, start, positions)
        # the last position as an index tensor, not the int 1: transformers slices the int case to a strided view,
        # on which the lm_head runs as a batched matmul over a transposed copy of its weight (1.1 s a prefill for
        # Gemma 3's 262k x 640 head; 0.08 s through the index)
        keep = torch.tensor([n - 1], device=self.device) if last_only else 0
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                         past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=keep)
        hidden = out.hidden_states[-1][0]  # last layer, final norm applied: [n, H]
        if last_only:
            hidden = hidden[-1:]
        return out.logits[0].float(), hidden

    @staticmethod
    def compact(cache: DynamicCache, start: int, path: Sequence[int]) -> None:
        """Keep the cache's first ``start`` entries plus the accepted tree nodes, in order."""
        n_keep = start + len(path)
        contiguous = list(path) == list(range(len(path)))
        idx = None
        for layer in cache.layers:
            if not contiguous:
                if idx is None:
                    idx = torch.tensor([start + p for p in path], device=layer.keys.device)
                # move accepted rows into place, then drop the rest: [B, heads, seq, dim]
                layer.keys[:, :, start:n_keep] = layer.keys.index_select(2, idx)
                layer.values[:, :, start:n_keep] = layer.values.index_select(2, idx)
            layer.keys = layer.keys[:, :, :n_keep]
            layer.values = layer.values[:, :, :n_keep]

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @staticmethod
    def projector(weight: torch.Tensor):
        """``x [M, in] -> x W^T [M, out]`` for a fixed weight [out, in]."""
        return lambda x: F.linear(x, weight)
