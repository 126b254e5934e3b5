"""One place where a tree becomes everything the decode loop runs on it.

A decoder with heads verifies, at each step, one of several layouts of the same tree: the full tree plus a
prompt-lookup chain of 0..L draft tokens (as many as the step's lookup found), and with a confidence gate
the tree cut below the deepest level whose top-1 chain is sure enough. ``compile_tree`` builds them all once
(validated once); ``path_plan`` gives the per-level plan that path-conditioned heads score parents by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from medusa_runtime.tree.buffers import TreeBuffers, build_tree_buffers, plain_buffers
from medusa_runtime.tree.lookup import with_lookup_chain
from treesearch.tree import Tree, make_tree


@dataclass(frozen=True)
class PathLevel:
    """Tree level d (d >= 1) for path-conditioned heads: head d-1 runs once per parent node of level d-1."""

    parents: torch.Tensor  # [P] long: node ids at level d-1 that have children, in node order
    children: torch.Tensor  # [C] long: node ids at level d
    child_parent: torch.Tensor  # [C] long: each child's parent as an index into ``parents``
    child_rank: torch.Tensor  # [C] long: each child's rank in its parent's top-k

    def to(self, device: torch.device | str) -> PathLevel:
        return PathLevel(*(t.to(device) for t in (self.parents, self.children, self.child_parent, self.child_rank)))


def path_plan(tree: Tree) -> list[PathLevel]:
    """Per level of ``tree``: its parents and children, node ids as in :func:`build_tree_buffers`."""
    paths = [()] + list(tree.paths)
    index = {p: i for i, p in enumerate(paths)}
    plan = []
    for d in range(1, tree.depth + 1):
        level = [p for p in paths if len(p) == d]
        parents = sorted({index[p[:-1]] for p in level})
        slot = {node: i for i, node in enumerate(parents)}
        plan.append(PathLevel(torch.tensor(parents), torch.tensor([index[p] for p in level]),
                              torch.tensor([slot[index[p[:-1]]] for p in level]), torch.tensor([p[-1] for p in level])))
    return plan


@dataclass(frozen=True)
class CompiledTree:
    """The layouts a decoder verifies, on its device."""

    variants: list[TreeBuffers]  # [k]: the tree plus a lookup chain of k tokens, k = 0..L (each a prefix of [L])
    gated: list[list[TreeBuffers]] | None  # [d][k]: the tree cut below level d (d = 0..depth), with k lookup tokens

    @property
    def full(self) -> TreeBuffers:
        """The largest layout: the whole tree and the longest lookup chain (what the cache must hold room for)."""
        return self.variants[-1]


def compile_tree(tree: Tree | None, num_heads: int, topk: int, lookup_tokens: int = 0, gate: float = 0.0,
                 device: torch.device | str = "cpu") -> CompiledTree:
    """Every layout of ``tree`` (None: plain decoding, the root alone) for heads of ``num_heads`` heads taking
    ``topk`` candidates each. Raises ``TreeError`` if the tree does not fit the heads, ``ValueError`` if a gate
    is asked for a tree without the top-1 chain it reads."""
    base = plain_buffers() if tree is None else build_tree_buffers(tree, num_heads, topk)
    heads_depth = base.depth

    def with_lookup(buffers: TreeBuffers) -> list[TreeBuffers]:
        return [with_lookup_chain(buffers, k, heads_depth).to(device) for k in range(lookup_tokens + 1)]

    def cut(depth: int) -> TreeBuffers:
        """The tree's levels 1..depth (the root alone for 0); the same candidate slots as the full tree."""
        if depth == 0:  # the root alone; topk kept so that lookup slots sit after all heads' candidates
            return replace(plain_buffers(), topk=topk)
        return build_tree_buffers(make_tree([p for p in tree.paths if len(p) <= depth], name=f"{tree.name}[:{depth}]"),
                                  num_heads, topk)

    variants = with_lookup(base)
    gated = None
    if gate > 0 and tree is not None:
        if any((0,) * d not in set(tree.paths) for d in range(1, tree.depth + 1)):
            raise ValueError(f"the gate reads the heads' top-1 chain: tree '{tree.name}' must hold [0], [0, 0], ... "
                             "to its depth")
        gated = [with_lookup(cut(d)) for d in range(heads_depth)] + [variants]
    return CompiledTree(variants, gated)
