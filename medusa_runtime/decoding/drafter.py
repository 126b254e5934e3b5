"""Drafters: what turns a step's hidden state into the heads' candidates, so that the decode loop never looks
inside the heads. ``make_drafter`` picks the one for the heads at hand:

- ``StackedDrafter``: heads of the shared format (root-conditioned or not), every head the tree reads in one
  batched matmul per residual level, projected onto the heads' draft vocabulary (else the whole vocabulary)
  through the engine's own linear layer; ``top`` gives each head's top-k tokens.
- ``PathDrafter``: path-conditioned heads score each tree level's parents, so their candidates come as the
  tree's tokens in node order (``nodes``): a whole tree in one C call where the C forward runs, else PyTorch
  level by level.
- ``ModuleDrafter``: any module with the heads' call signature ``heads(hidden, lm_head[, root_embedding])``.
- ``GraphedDrafter``: a stacked or path drafter replayed from a CUDA graph, where the engine replays its steps so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from medusa_runtime.engines import graphs
from medusa_runtime.heads.medusa import Int8Projection, MedusaHeads
from medusa_runtime.heads.native import NativeHeadLevels, native_support
from medusa_runtime.tree.compiler import PathLevel, path_plan
from treesearch.tree import Tree


def row(table: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an int or a 0-d tensor. A tensor is read on the device: indexing with a 0-d tensor
    reads it on the host (``.item()``), which a CUDA graph cannot capture, and would replay as a constant."""
    if isinstance(index, torch.Tensor):
        return table.index_select(0, index.reshape(1).to(table.device))[0]
    return table[index]


class Drafter:
    """The heads' candidates for one step. ``in_node_order``: ``nodes`` gives the tree's tokens directly;
    otherwise ``top`` gives each head's top-k and the decoder lays them out with the tree's buffers."""

    in_node_order = False

    def top(self, hidden: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [H], the root token -> each head's top-k token ids [depth, topk] and its logits [depth, S]
        (what a confidence gate reads)."""
        raise NotImplementedError

    def nodes(self, hidden: torch.Tensor, root: int, gate: float, out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[float]]:
        """hidden [H], the root token -> the tree's tokens [N] in node order and the top-1 chain's per-level
        probabilities (only with ``gate`` > 0, whose cut may leave deeper levels unset); ``out``: an int64 [N]
        tensor the tokens may be written into (a drafter may also return a tensor of its own)."""
        raise NotImplementedError


class ModuleDrafter(Drafter):
    """Any module called as the heads are: ``heads(hidden, lm_head)`` (or with the root's input embedding,
    for a module that says it is root-conditioned) -> logits [K, V]."""

    def __init__(self, heads: nn.Module, model: nn.Module, depth: int, topk: int):
        self.heads, self.model, self.depth, self.topk = heads, model, depth, topk
        self.embed = model.get_input_embeddings().weight.detach() if getattr(heads, "root_conditioned", False) else None

    def top(self, hidden: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        lm_head = self.model.get_output_embeddings()
        if self.embed is not None:
            logits = self.heads(hidden, lm_head, self.embed[root])[: self.depth]
        else:
            logits = self.heads(hidden, lm_head)[: self.depth]
        return torch.topk(logits, self.topk, dim=-1).indices, logits


class StackedDrafter(Drafter):
    """Shared-format heads, batched: [depth] heads as one stack of residual blocks (``MedusaHeads.stacked_blocks``)."""

    def __init__(self, heads: MedusaHeads, model: nn.Module, engine, depth: int, topk: int, draft_vocab: bool,
                 device: torch.device):
        self.heads, self.depth, self.topk = heads, depth, topk
        self.levels = heads.stacked_blocks(depth)  # per residual level: W [depth, H, H], b [depth, 1, H]
        # root-conditioned heads: the input embeddings and U^T [depth, H, H] (the root's term in block 0)
        self.embed = self.root_weight = None
        if heads.root_conditioned:
            self.embed = model.get_input_embeddings().weight.detach()
            self.root_weight = heads.root_weight.detach()[:depth].transpose(1, 2).contiguous()
        use_vocab = draft_vocab and heads.draft_vocab is not None
        self.draft_ids = heads.draft_vocab.to(device) if use_vocab else None  # [S]: row -> token id
        # the vocabulary projection, built (and prepacked) once: [S, H] shared, or [depth, S, H] per head
        self.weight = heads.projection(engine.lm_head_weight(), depth, use_draft_vocab=use_vocab)
        if heads.config.projection_int8:  # scored as the C library scores it (heads.Int8Projection)
            self.project = Int8Projection(self.weight)
        else:
            self.project = (engine.projector(self.weight) if self.weight.dim() == 2 else
                            lambda states: torch.einsum("kh,kvh->kv", states, self.weight))  # [depth, S]

    def top(self, hidden: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        root_embedding = None if self.embed is None else row(self.embed, root)  # [H]: the root's input embedding
        states = hidden.expand(self.depth, 1, -1)  # [depth, 1, H]: the same state into every head
        for level, (weight, bias) in enumerate(self.levels):  # one batched matmul per residual level
            if level == 0 and root_embedding is not None:  # + U_j e inside the first block's activation
                bias = bias + root_embedding[None].to(bias.dtype) @ self.root_weight  # [depth, 1, H]
            states = states + F.silu(torch.baddbmm(bias, states, weight))
        logits = self.project(states[:, 0])  # [depth, S]: S the draft vocabulary's size (else V)
        top = torch.topk(logits, self.topk, dim=-1).indices  # [depth, topk]
        if self.draft_ids is not None:
            top = self.draft_ids[top]  # rows of the draft vocabulary -> token ids
        return top, logits


class PathDrafter(StackedDrafter):
    """Path-conditioned heads: head j scores each parent node of tree level j (``tree_compiler.path_plan``)."""

    in_node_order = True

    def __init__(self, heads: MedusaHeads, model: nn.Module, engine, depth: int, topk: int, draft_vocab: bool,
                 device: torch.device, plan: list[PathLevel], num_nodes: int, native: bool = True):
        super().__init__(heads, model, engine, depth, topk, draft_vocab, device)
        self.plan, self.num_nodes, self.device = plan, num_nodes, device
        self.native = None
        if native and native_support(heads, engine) is None:  # the whole tree in one call of the C library
            self.native = NativeHeadLevels(heads, engine, self.weight, depth, topk, plan, self.embed, self.draft_ids)

    def nodes(self, hidden: torch.Tensor, root: int, gate: float, out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[float]]:
        if self.native is not None:  # with a gate it stops at the first level the cut drops
            return self.native.tree(hidden, root, gate, out)
        return self.nodes_torch(hidden, root, gate)

    def nodes_torch(self, hidden: torch.Tensor, root: int, gate: float) -> tuple[torch.Tensor, list[float]]:
        """The same through PyTorch's ops, level by level."""
        embed, topk = self.embed, self.topk
        root_embedding = row(embed, root)  # [H]
        nodes = torch.empty(self.num_nodes, dtype=torch.long, device=self.device)
        nodes[0] = root
        chain = []
        for j, level in enumerate(self.plan):  # level j + 1 of the tree, scored by head j
            parents = embed[nodes[level.parents]] if j > 0 else None  # [P, H] (head 0's parent is the root)
            states = self.heads.conditioned_state(j, hidden, root_embedding, parents)  # [P, H] ([H] for head 0)
            logits = self.project(states.reshape(-1, states.shape[-1]))  # [P, S]
            top = torch.topk(logits, topk, dim=-1).indices  # [P, topk]
            if gate > 0:
                chain.append(float(torch.softmax(logits[0].float(), dim=-1).amax()))
            if self.draft_ids is not None:
                top = self.draft_ids[top]
            nodes[level.children] = top[level.child_parent, level.child_rank]
        return nodes, chain


class GraphedDrafter(Drafter):
    """A stacked or path drafter's PyTorch ops on CUDA, captured once as a CUDA graph and replayed: the step's
    hidden state and root token are copied into tensors of its own first, and its outputs are overwritten by the
    next replay. Gated steps go to the drafter itself (a gate reads probabilities on the host between levels)."""

    def __init__(self, inner: StackedDrafter, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.inner, self.in_node_order, self.device = inner, inner.in_node_order, device
        with torch.inference_mode(False):  # written in place before each replay, in inference mode or out of it
            self.hidden = torch.zeros(hidden_size, dtype=dtype, device=device)
            self.root = torch.zeros((), dtype=torch.long, device=device)
        self.graph = self.out = None

    def _replay(self, hidden: torch.Tensor, root: int, body):
        self.hidden.copy_(hidden)
        self.root.fill_(root)
        if self.graph is None:
            self.graph, self.out = graphs.capture(body, self.device)
        self.graph.replay()
        return self.out

    def top(self, hidden: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._replay(hidden, root, lambda: self.inner.top(self.hidden, self.root))

    def nodes(self, hidden: torch.Tensor, root: int, gate: float, out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[float]]:
        if gate > 0:
            return self.inner.nodes_torch(hidden, root, gate)
        return self._replay(hidden, root, lambda: self.inner.nodes_torch(self.hidden, self.root, 0.0)[0]), []


def make_drafter(heads: nn.Module, model: nn.Module, engine, tree: Tree, topk: int, device: torch.device,
                 draft_vocab: bool = True, native: bool = True) -> Drafter:
    """The drafter for these heads on ``tree`` (``draft_vocab``: score the heads' draft vocabulary where they
    carry one; ``native``: path-conditioned heads in the C library where the engine runs the C forward)."""
    path = getattr(heads, "path_conditioned", False)
    if not isinstance(heads, MedusaHeads):
        if path:
            raise TypeError("path-conditioned decoding needs MedusaHeads")
        return ModuleDrafter(heads, model, tree.depth, topk)
    if path:
        plan = [level.to(device) for level in path_plan(tree)]
        drafter = PathDrafter(heads, model, engine, tree.depth, topk, draft_vocab, device, plan, tree.num_nodes, native)
    else:
        drafter = StackedDrafter(heads, model, engine, tree.depth, topk, draft_vocab, device)
    if getattr(engine, "graphs", False):  # the engine replays CUDA graphs of its steps: the heads' ops too
        return GraphedDrafter(drafter, heads.config.hidden_size, engine.dtype, device)
    return drafter
