"""Turn a :class:`treesearch.tree.Tree` into the index tensors the decode loop needs (one pure function).

Node 0 is the root (the base model's next token); node i >= 1 is ``tree.paths[i-1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treesearch.tree import Tree, check_fits


@dataclass(frozen=True)
class TreeBuffers:
    """Index tensors for one tree, built once and reused every step."""

    num_nodes: int  # N = nodes incl. root
    depth: int  # deepest level below the root
    topk: int  # candidates taken per head
    attn_mask: torch.Tensor  # [N, N] bool: node i may attend node j (j is i or an ancestor of i)
    position_offsets: torch.Tensor  # [N] long: depth of each node, added to the current length
    candidate_index: torch.Tensor  # [N] long: index into [root_token, head0 top-k, head1 top-k, ...]
    parent: torch.Tensor  # [N] long: parent node (-1 for the root)
    retrieve_indices: torch.Tensor  # [L, depth+1] long: node ids of each root-to-leaf path, -1 padded
    children: tuple[tuple[int, ...], ...]  # children of each node, in rank order

    def to(self, device: torch.device | str) -> TreeBuffers:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return TreeBuffers(**moved)


def build_tree_buffers(tree: Tree, num_heads: int, topk: int) -> TreeBuffers:
    """Pure: the same tree always gives the same buffers. Raises TreeError if it does not fit."""
    check_fits(tree, num_heads, topk)
    paths = [()] + list(tree.paths)  # official order: parents always precede children
    index = {p: i for i, p in enumerate(paths)}
    n = len(paths)

    mask = torch.zeros(n, n, dtype=torch.bool)
    parent = torch.full((n,), -1, dtype=torch.long)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(paths):
        for d in range(len(p) + 1):  # every prefix of p is an ancestor (the empty prefix is the root)
            mask[i, index[p[:d]]] = True
        if p:
            parent[i] = index[p[:-1]]
            children[index[p[:-1]]].append(i)

    offsets = torch.tensor([len(p) for p in paths], dtype=torch.long)
    # depth-d node with last rank r reads head (d-1)'s rank-r token: flat slot 1 + (d-1)*topk + r
    cand = torch.tensor([0] + [1 + (len(p) - 1) * topk + p[-1] for p in paths[1:]], dtype=torch.long)

    leaves = [i for i in range(n) if not children[i]]
    depth = tree.depth
    retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        p = paths[leaf]
        for d in range(len(p) + 1):
            retrieve[row, d] = index[p[:d]]

    # children sorted by rank, so acceptance tries rank 0 first
    ordered = tuple(tuple(sorted(c, key=lambda j: paths[j][-1])) for c in children)
    return TreeBuffers(n, depth, topk, mask, offsets, cand, parent, retrieve, ordered)


def plain_buffers() -> TreeBuffers:
    """The degenerate tree of plain decoding: the root alone."""
    one = torch.ones(1, 1, dtype=torch.bool)
    zero = torch.zeros(1, dtype=torch.long)
    return TreeBuffers(1, 0, 0, one, zero, zero, torch.full((1,), -1, dtype=torch.long),
                       torch.zeros(1, 1, dtype=torch.long), ((),))
