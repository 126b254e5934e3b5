"""Root- and path-conditioned heads in the C library: a whole tree's candidates in one call instead of a
dozen PyTorch ops per level.

A level of the decoder's path-conditioned heads (``drafter.PathDrafter``) is small work on few
rows: the root's (and each parent's) embedding through U_j (and P_j), the residual blocks, the
projection onto the draft vocabulary and a top-k. In PyTorch each of those is an op with its own
dispatch and, in bf16, a oneDNN call on one row; the C library does the level in one parallel call
with the forward's own linear layers (AMX tiles where the forward uses them), rounding to bf16 where
PyTorch rounds, and ``tree`` runs every level in one call (parents' embeddings gathered, rows mapped to
tokens and placed at their nodes in C: right after a forward each Python or tensor op runs on cold caches).
Used by the decoder where the C forward runs (bf16 on the CPU) and the heads are root-conditioned
shared-format heads; everywhere else the PyTorch path stays.
"""

from __future__ import annotations

import ctypes

import torch

from . import kernels
from .engine import pack_for
from .heads import MedusaHeads

MAX_BLOCKS = kernels.HEAD_MAX_BLOCKS


class HeadsNativeError(ValueError):
    """Heads the C library cannot run, with a one-line reason."""


def native_support(heads: MedusaHeads, engine) -> str | None:
    """None when the C library can run these heads' levels beside this engine, else why not."""
    if getattr(engine, "lib", None) is None:
        return "the engine's decode steps are not on the C forward"
    if not heads.root_conditioned or heads.proj is not None:
        return "only root-conditioned heads of the shared format"
    if not 1 <= heads.config.num_layers <= MAX_BLOCKS:
        return f"1..{MAX_BLOCKS} residual blocks per head"
    return None


class NativeHeadLevels:
    """The heads' tree levels in the C library: ``level(j, hidden, root_e, parents_e)`` returns each row's
    top-k rows of the projection and its top-1 softmax probability (what the gate reads); ``tree(hidden, root)``
    lays out a whole tree's candidates in one call (the levels of ``plan``, see ``tree_compiler.path_plan``)."""

    def __init__(self, heads: MedusaHeads, engine, projection: torch.Tensor, depth: int, topk: int,
                 plan: list | None = None, embed: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None):
        why = native_support(heads, engine)
        if why:
            raise HeadsNativeError(f"native heads: {why}")
        self.lib, self.amx, self.topk = engine.lib, engine.amx, topk
        dtype = torch.bfloat16

        def prep(w: torch.Tensor) -> torch.Tensor:  # the layout the C call reads (AMX tiles or AVX-512 blocks)
            return pack_for(self.lib, w.detach().to(dtype).contiguous(), self.amx)

        self.hidden_size = heads.config.hidden_size
        self.projection = prep(projection)  # [S, H]
        self.vocab = projection.shape[0]
        self._keep: list[torch.Tensor] = [self.projection]  # every tensor the structs point into
        self.heads = []
        for j in range(depth):
            blocks = [heads.blocks[j][level].linear for level in range(heads.config.num_layers)]
            ws = [prep(b.weight) for b in blocks]
            bs = [b.bias.detach().to(dtype).contiguous() for b in blocks]
            root = prep(heads.root_weight[j])
            parent = prep(heads.parent_weight[j - 1]) if heads.path_conditioned and j > 0 else None
            self._keep += ws + bs + [root] + ([parent] if parent is not None else [])
            pad = [None] * (MAX_BLOCKS - len(ws))
            self.heads.append(kernels.LeanHead(root.data_ptr(), None if parent is None else parent.data_ptr(),
                                               (ctypes.c_void_p * MAX_BLOCKS)(*[w.data_ptr() for w in ws], *pad),
                                               (ctypes.c_void_p * MAX_BLOCKS)(*[b.data_ptr() for b in bs], *pad)))
        self.blocks = heads.config.num_layers
        self._work = torch.empty(0, dtype=dtype)
        self._heads = (kernels.LeanHead * depth)(*self.heads)
        self._tree = None if plan is None else self._tree_plan(plan, embed, draft_ids)

    def _tree_plan(self, plan: list, embed: torch.Tensor, draft_ids: torch.Tensor | None):
        """The C structs of a tree's levels, and the tensors they point into (kept alive here)."""
        if embed is None or embed.dtype != torch.bfloat16:
            raise HeadsNativeError("native heads: a whole tree needs the model's bf16 input embeddings")
        keep = [embed.contiguous()] + ([] if draft_ids is None else [draft_ids.to(torch.int64).contiguous()])
        levels = []
        for j, lv in enumerate(plan):
            arrays = [t.to(torch.int64).contiguous() for t in (lv.parents, lv.children, lv.child_parent, lv.child_rank)]
            keep += arrays
            parents = 0 if j == 0 else arrays[0].numel()  # level 1's only parent is the root: no gather
            levels.append(kernels.LeanLevel(parents, arrays[0].data_ptr(), arrays[1].numel(),
                                            *(a.data_ptr() for a in arrays[1:])))
        self._keep += keep
        widest = max(1, *(lv.parents for lv in levels))
        work = torch.empty(self.lib.lean_heads_tree_work_size(self.hidden_size, self.vocab, widest, self.topk),
                           dtype=torch.bfloat16)
        nodes = 1 + sum(lv.children for lv in levels)
        return ((kernels.LeanLevel * len(levels))(*levels), len(levels), keep[0],
                None if draft_ids is None else keep[1], work, nodes)

    def tree(self, hidden: torch.Tensor, root: int, gate: float = 0.0) -> tuple[torch.Tensor, list[float]]:
        """hidden [H] and the root token -> the tree's tokens [N] in node order and the top-1 chain's per-level
        probabilities. With ``gate`` > 0 the levels stop after the first whose chain product is below it (the
        tokens of deeper levels are then left unset: the decoder's gated cut does not verify them)."""
        levels, depth, embed, draft, work, n = self._tree
        if not 0 <= root < embed.shape[0]:  # the C code indexes the embeddings with it unchecked
            raise HeadsNativeError(f"native heads: root token {root} is outside the vocabulary ({embed.shape[0]})")
        nodes = torch.empty(n, dtype=torch.long)
        chain = (ctypes.c_float * depth)()
        hidden = hidden.contiguous()
        done = self.lib.lean_heads_tree(self._heads, levels, depth, self.blocks, self.hidden_size, self.vocab,
                                        self.projection.data_ptr(), embed.data_ptr(),
                                        None if draft is None else draft.data_ptr(), hidden.data_ptr(), root,
                                        self.topk, gate, nodes.data_ptr(), chain, work.data_ptr(), int(self.amx),
                                        torch.get_num_threads())
        if done < 0:
            raise HeadsNativeError(f"native heads: the C library refused the tree (code {done})")
        return nodes, chain[:done]

    def level(self, j: int, hidden: torch.Tensor, root_e: torch.Tensor, parents_e: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [H], root_e [H], parents_e [P, H] or None (level 0) -> (top [rows, k] long, top1 [rows] float)."""
        rows = 1 if parents_e is None else parents_e.shape[0]
        need = self.lib.lean_heads_work_size(self.hidden_size, self.vocab, 0 if parents_e is None else rows)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.bfloat16)
        top = torch.empty(rows, self.topk, dtype=torch.int32)
        top1 = torch.empty(rows, dtype=torch.float32)
        hidden, root_e = hidden.contiguous(), root_e.contiguous()
        parents = None if parents_e is None else parents_e.contiguous()
        rc = self.lib.lean_heads_level(ctypes.byref(self.heads[j]), self.blocks, self.hidden_size, self.vocab,
                                       self.projection.data_ptr(), hidden.data_ptr(), root_e.data_ptr(),
                                       None if parents is None else parents.data_ptr(), 0 if parents is None else rows,
                                       self.topk, top.data_ptr(), top1.data_ptr(), self._work.data_ptr(),
                                       int(self.amx), torch.get_num_threads())
        if rc:
            raise HeadsNativeError(f"native heads: the C library refused the level (code {rc})")
        return top.long(), top1

