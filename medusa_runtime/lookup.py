"""Prompt lookup as a candidate source beside the heads: an n-gram match against the text so far.

The last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up among earlier
positions of prompt + output; the tokens that followed the most recent earlier occurrence become a
chain of draft nodes hung under the tree's root, after the heads' nodes, and are verified in the
same forward pass. With no match the step verifies the heads' tree alone (the chain's nodes are the
last ones of the tree, so every shorter tree is a prefix of the full one: same mask, same offsets).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree_buffers import TreeBuffers


@dataclass(frozen=True)
class LookupConfig:
    num_tokens: int = 0  # draft tokens from prompt lookup per step (0: off)
    max_ngram: int = 3  # longest suffix tried first
    min_ngram: int = 2  # shortest suffix still trusted

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"lookup tokens must be >= 0, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


class NgramIndex:
    """Latest earlier occurrence of every n-gram (n in [min, max]) of a growing token sequence.

    ``index[gram] = e`` means ``tokens[e - n:e] == gram`` and ``e < len(tokens)``: at least one
    token followed it. Updates are incremental: O(max_ngram) dictionary writes per new token.
    """

    def __init__(self, cfg: LookupConfig, tokens: list[int] | None = None):
        self.cfg = cfg
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        if tokens:
            self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        for tok in new:
            end = len(self.tokens)  # n-grams ending here now have a follower: `tok`
            for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
                if end >= n:
                    self.index[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(tok)

    def draft(self, suffix_extra: int | None = None) -> list[int]:
        """Up to ``num_tokens`` tokens predicted to follow the sequence (plus ``suffix_extra``)."""
        seq = self.tokens if suffix_extra is None else self.tokens + [suffix_extra]
        last = len(self.tokens)  # with suffix_extra, the n-gram ending here has a follower but is not indexed yet
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            gram = seq[len(seq) - n:]
            if suffix_extra is not None and last >= n and self.tokens[last - n:] == gram:
                end = last
            else:
                end = self.index.get(tuple(gram))
            if end is not None and end < len(seq):
                return seq[end:end + self.cfg.num_tokens]
        return []


def with_lookup_chain(buffers: TreeBuffers, length: int, heads_depth: int) -> TreeBuffers:
    """The tree plus a chain of ``length`` lookup nodes under the root, appended as the last nodes.

    Their candidate slots follow the heads' ones: ``1 + heads_depth * topk + j`` in the flat vector
    ``[root, head0 top-k, ..., head(depth-1) top-k, lookup_0, ..., lookup_(length-1)]``.
    """
    if length == 0:
        return buffers
    n0, n = buffers.num_nodes, buffers.num_nodes + length
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:n0, :n0] = buffers.attn_mask.cpu()
    for j in range(length):  # chain node j sees the root and chain nodes 0..j
        mask[n0 + j, 0] = True
        mask[n0 + j, n0:n0 + j + 1] = True
    offsets = torch.cat([buffers.position_offsets.cpu(), torch.arange(1, length + 1)])
    base = 1 + heads_depth * buffers.topk
    cand = torch.cat([buffers.candidate_index.cpu(), base + torch.arange(length)])
    parent = torch.cat([buffers.parent.cpu(), torch.tensor([0] + list(range(n0, n - 1)))])
    depth = max(buffers.depth, length)
    old = buffers.retrieve_indices.cpu()
    retrieve = torch.full((old.shape[0] + 1, depth + 1), -1, dtype=torch.long)
    retrieve[:-1, : old.shape[1]] = old
    retrieve[-1] = torch.tensor([0] + list(range(n0, n)) + [-1] * (depth - length))
    children = list(buffers.children)
    children[0] = children[0] + (n0,)
    children += [(n0 + j + 1,) for j in range(length - 1)] + [()]
    # depth = the deepest path, lookup chain included (the context check and per-depth statistics use it);
    # the heads' own depth stays the tree's
    return TreeBuffers(n, depth, buffers.topk, mask, offsets, cand, parent, retrieve, tuple(children))
