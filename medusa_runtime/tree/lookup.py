"""Prompt lookup as a candidate source beside the heads: an n-gram match against the text so far.

The drafts come from ``treesearch.ngram`` (pure Python, shared with the replay of rollouts): the
tokens that followed the most recent earlier occurrence of the text's last n tokens become a
chain of draft nodes hung under the tree's root, after the heads' nodes, and are verified in the
same forward pass. With no match the step verifies the heads' tree alone (the chain's nodes are the
last ones of the tree, so every shorter tree is a prefix of the full one: same mask, same offsets).
"""

from __future__ import annotations

import torch

from medusa_runtime.tree.buffers import TreeBuffers
from treesearch.ngram import LookupConfig, NgramIndex

__all__ = ["LookupConfig", "NgramIndex", "with_lookup_chain"]


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
