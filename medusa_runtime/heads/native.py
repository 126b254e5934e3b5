"""Root- and path-conditioned heads in the C library: a whole tree's candidates in one call instead of a
dozen PyTorch ops per level.

A level of the decoder's path-conditioned heads (``drafter.PathDrafter``) is small work on few
rows: the root's (and each parent's) embedding through U_j (and P_j), the residual blocks, the
projection onto the draft vocabulary and a top-k. In PyTorch each of those is an op with its own
dispatch and, in bf16, a oneDNN call on one row; the C library does the level in one parallel call
with the forward's AVX-512 linear layers (also where the forward runs on AMX tiles: for a few rows the
dot-product path is faster), rounding to bf16 where PyTorch rounds, and ``tree`` runs every level in one
call (parents' embeddings gathered, rows mapped to tokens and placed at their nodes in C: right after a
forward each Python or tensor op runs on cold caches).

What a tree step reads is what it costs (right after a verify forward every byte comes from DRAM), so
``tree`` reads the root's and the parents' terms (bf16(e U^T), bf16(e P^T)) from tables over the draft
vocabulary built here once by the same linear layer (bit for bit the rows it would compute; roots outside
the draft vocabulary are computed), and heads whose config asks for it score the draft projection in
int8 (``heads.Int8Projection``): half its bytes, which stay in L2 between levels where a core's L2 holds
its half (2 MB a core; from L3 with 1 MB); together the two halve a tree step
(docs/reports/heads-bytes.md). A step's call passes five values to a struct built once
(``kernels.LeanTreeCall``): right after a verify forward each Python and ctypes operation runs on cold
caches, so a long argument list costs more than the call's C work (docs/reports/heads-call.md).
Used by the decoder where the C forward runs (bf16 on the CPU) and the heads are root-conditioned
shared-format heads; everywhere else the PyTorch path stays.
"""

from __future__ import annotations

import ctypes

import torch

from medusa_runtime import kernels
from medusa_runtime.heads.medusa import Int8Projection, MedusaHeads
from medusa_runtime.kernels import hugepages
from medusa_runtime.kernels.packing import pack_all, pack_for

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
        # the heads' few rows on the AVX-512 dot-product path, also where the forward runs on AMX tiles: for a
        # handful of rows the tile unit's set-up costs more than it saves (docs/reports/heads-bytes.md)
        self.lib, self.amx, self.topk = engine.lib, False, topk
        dtype = torch.bfloat16

        def prep(w: torch.Tensor) -> torch.Tensor:  # the layout the C call reads (AMX tiles or AVX-512 blocks)
            return pack_for(self.lib, w.detach().to(dtype).contiguous(), self.amx)

        self.hidden_size = heads.config.hidden_size
        self.vocab = projection.shape[0]
        if heads.config.projection_int8:  # int8 rows in the dot-product layout, their scales and sums
            i8 = Int8Projection(projection)
            q = i8.q.to(torch.int8).contiguous()
            size = self.lib.lean_i8_packed_size(*q.shape)  # read at every tree level: in 2 MiB pages (see pack_all)
            self.projection = hugepages.huge_buffer(size).view(torch.int8)
            self.lib.lean_pack_i8(q.data_ptr(), q.shape[0], q.shape[1], self.projection.data_ptr())
            scale, sums = i8.scale.float().contiguous(), q.sum(-1, dtype=torch.int32).contiguous()
            self._keep: list[torch.Tensor] = [self.projection, scale, sums]  # every tensor the structs point into
            self.proj = kernels.LeanProj(self.projection.data_ptr(), scale.data_ptr(), sums.data_ptr())
        else:
            self.projection = prep(projection)  # [S, H]
            self._keep = [self.projection]
            self.proj = kernels.LeanProj(self.projection.data_ptr(), None, None)
        self.heads = []
        self._conditioning = []  # per head: its packed U and P (None for head 0), for the draft vocabulary's tables
        layers = heads.config.num_layers
        packed_blocks = pack_all(self.lib, [heads.blocks[j][level].linear.weight.detach().to(dtype).contiguous()
                                            for j in range(depth) for level in range(layers)], self.amx)
        for j in range(depth):
            blocks = [heads.blocks[j][level].linear for level in range(layers)]
            ws = packed_blocks[j * layers:(j + 1) * layers]
            bs = [b.bias.detach().to(dtype).contiguous() for b in blocks]
            root = prep(heads.root_weight[j])
            parent = prep(heads.parent_weight[j - 1]) if heads.path_conditioned and j > 0 else None
            self._keep += ws + bs + [root] + ([parent] if parent is not None else [])
            self._conditioning.append((root, parent))
            pad = [None] * (MAX_BLOCKS - len(ws))
            self.heads.append(kernels.LeanHead(root.data_ptr(), None if parent is None else parent.data_ptr(),
                                               (ctypes.c_void_p * MAX_BLOCKS)(*[w.data_ptr() for w in ws], *pad),
                                               (ctypes.c_void_p * MAX_BLOCKS)(*[b.data_ptr() for b in bs], *pad)))
        self.blocks = heads.config.num_layers
        self._work = torch.empty(0, dtype=dtype)
        self._heads = (kernels.LeanHead * depth)(*self.heads)
        self._tree = None if plan is None else self._tree_plan(plan, embed, draft_ids)

    def _linear(self, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] bf16 through a packed [H, H] weight by the C library's own linear layer (the one the levels
        use: each output row depends on its input row alone, so a row computed here is the row a level computes)."""
        n, h = x.shape
        y = torch.empty(n, h, dtype=torch.bfloat16)
        self.lib.lean_linear(packed.data_ptr(), x.data_ptr(), n, h, h, y.data_ptr(), None, kernels.OUT_BF16,
                             torch.get_num_threads())
        return y

    def _tables(self, embed: torch.Tensor, draft_ids: torch.Tensor) -> None:
        """Each head's root term bf16(e U^T) (and parent term bf16(e P^T)) for every token of the draft vocabulary,
        [S, H] each (4.7 MB per table for the shipped heads): a tree step reads a row instead of U and P. Roots
        outside the draft vocabulary are computed as before."""
        rows = embed[draft_ids].contiguous()  # [S, H]
        for j, (root, parent) in enumerate(self._conditioning):
            tables = [self._linear(root, rows), None if parent is None else self._linear(parent, rows)]
            self._keep += [t for t in tables if t is not None]
            self._heads[j].root_table = tables[0].data_ptr()
            self._heads[j].parent_table = None if tables[1] is None else tables[1].data_ptr()
        self._draft_row = torch.full((embed.shape[0],), -1, dtype=torch.int32)  # token -> its row (C reads the root's)
        self._draft_row[draft_ids] = torch.arange(draft_ids.numel(), dtype=torch.int32)

    def _tree_plan(self, plan: list, embed: torch.Tensor, draft_ids: torch.Tensor | None):
        """The C struct of a tree's calls (kernels.LeanTreeCall: levels, weights, scratch), the tensors it points
        into kept alive here; returns (the struct, its address, node count, embedding rows)."""
        if embed is None or embed.dtype != torch.bfloat16:
            raise HeadsNativeError("native heads: a whole tree needs the model's bf16 input embeddings")
        self._draft_row = None
        if draft_ids is not None:
            self._tables(embed, draft_ids.to(torch.int64))
        embed = embed.contiguous()
        draft = None if draft_ids is None else draft_ids.to(torch.int64).contiguous()
        keep = [embed] + ([] if draft is None else [draft])
        levels = []
        for j, lv in enumerate(plan):
            arrays = [t.to(torch.int64).contiguous() for t in (lv.parents, lv.children, lv.child_parent, lv.child_rank)]
            keep += arrays
            parents = 0 if j == 0 else arrays[0].numel()  # level 1's only parent is the root: no gather
            levels.append(kernels.LeanLevel(parents, arrays[0].data_ptr(), arrays[1].numel(),
                                            *(a.data_ptr() for a in arrays[1:])))
        widest = max(1, *(lv.parents for lv in levels))
        work = torch.empty(self.lib.lean_heads_tree_work_size(self.hidden_size, self.vocab, widest, self.topk),
                           dtype=torch.bfloat16)
        nodes = 1 + sum(lv.children for lv in levels)
        rows = torch.empty(nodes + widest, dtype=torch.int32)  # each node's draft row, a level's parents' rows
        self._levels = (kernels.LeanLevel * len(levels))(*levels)
        self._chain = (ctypes.c_float * len(levels))()  # each level's top-1 probability, written by the call
        self._keep += keep + [work, rows] + ([] if self._draft_row is None else [self._draft_row])
        call = kernels.LeanTreeCall(self._heads, self._levels, len(levels), self.blocks, self.hidden_size, self.vocab,
                                    ctypes.pointer(self.proj), embed.data_ptr(), embed.shape[0],
                                    None if draft is None else draft.data_ptr(),
                                    None if self._draft_row is None else self._draft_row.data_ptr(), rows.data_ptr(),
                                    self.topk, ctypes.addressof(self._chain), work.data_ptr(), int(self.amx),
                                    torch.get_num_threads())
        self._threads = call.nthreads
        return call, ctypes.addressof(call), nodes, embed.shape[0]

    def tree(self, hidden: torch.Tensor, root: int, gate: float = 0.0, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, list[float]]:
        """hidden [H] and the root token -> the tree's tokens [N] in node order and the top-1 chain's per-level
        probabilities. With ``gate`` > 0 the levels stop after the first whose chain product is below it (the
        tokens of deeper levels are then left unset: the decoder's gated cut does not verify them). ``out``: an
        int64 [N] tensor to write the tokens into (a decode loop's own, so that a step allocates nothing).

        A decoder calls this right after a verify forward, when every Python and tensor operation runs on cold
        caches (~5-20 us each): the call passes five values and checks what it must with few operations."""
        call, address, n, vocab = self._tree
        if not 0 <= root < vocab:  # the C code indexes the embeddings with it
            raise HeadsNativeError(f"native heads: root token {root} is outside the vocabulary ({vocab})")
        if out is None:
            nodes = torch.empty(n, dtype=torch.long)
        elif out.dtype != torch.long or out.shape != (n,) or not out.is_contiguous():
            raise HeadsNativeError(f"native heads: out must be a contiguous int64 [{n}], got {out.dtype} {list(out.shape)}")
        else:
            nodes = out
        if hidden.dtype != torch.bfloat16 or hidden.shape != (self.hidden_size,) or not hidden.is_contiguous():
            hidden = hidden.to(torch.bfloat16).contiguous().view(self.hidden_size)
        threads = torch.get_num_threads()
        if threads != self._threads:
            call.nthreads = self._threads = threads
        done = self.lib.lean_heads_tree(address, hidden.data_ptr(), root, gate, nodes.data_ptr())
        if done < 0:
            raise HeadsNativeError(f"native heads: the C library refused the tree (code {done})")
        return nodes, self._chain[:done]

    def trees(self, hidden: torch.Tensor, roots: list[int], gate: float = 0.0, out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[list[float]]]:
        """``tree`` for R requests in one call (a batched step's rows, ``lean_heads_trees``): hidden [R, H] and
        their roots -> tokens [R, N] in node order and each request's top-1 chain, as ``tree`` gives each alone
        (the heads' weights are read once for all of them). ``out``: an int64 [R, N] tensor to write into."""
        call, address, n, vocab = self._tree
        reqs = len(roots)
        if hidden.shape != (reqs, self.hidden_size):
            raise HeadsNativeError(f"native heads: hidden must be [{reqs}, {self.hidden_size}], got {list(hidden.shape)}")
        if any(not 0 <= r < vocab for r in roots):
            raise HeadsNativeError(f"native heads: a root token is outside the vocabulary ({vocab})")
        if hidden.dtype != torch.bfloat16 or not hidden.is_contiguous():
            hidden = hidden.to(torch.bfloat16).contiguous()
        nodes = torch.empty(reqs, n, dtype=torch.long) if out is None else out
        if nodes.dtype != torch.long or nodes.shape != (reqs, n) or not nodes.is_contiguous():
            raise HeadsNativeError(f"native heads: out must be a contiguous int64 [{reqs}, {n}]")
        bufs = self._trees_buffers(reqs)
        roots_t, chains, done, work, rows = bufs
        roots_t[:reqs] = torch.as_tensor(roots, dtype=torch.long)
        threads = torch.get_num_threads()
        if threads != self._threads:
            call.nthreads = self._threads = threads
        rc = self.lib.lean_heads_trees(address, reqs, hidden.data_ptr(), roots_t.data_ptr(), gate, nodes.data_ptr(),
                                       chains.data_ptr(), done.data_ptr(), work.data_ptr(), rows.data_ptr())
        if rc < 0:
            raise HeadsNativeError(f"native heads: the C library refused the trees (code {rc})")
        got = chains[:reqs].tolist()
        return nodes, [c[:d] for c, d in zip(got, done[:reqs].tolist())]

    def _trees_buffers(self, reqs: int) -> tuple[torch.Tensor, ...]:
        """``trees``' roots, chains [R, depth], levels done, work and scratch, kept and grown to the most requests
        seen (a step allocates nothing once they are)."""
        have = getattr(self, "_trees_bufs", None)
        if have is None or have[0].numel() < reqs:
            call, _, n, _ = self._tree
            widest = max(1, *(call.levels[d].parents for d in range(call.depth)))
            size = self.lib.lean_heads_trees_work_size(self.hidden_size, self.vocab, widest, self.topk, reqs)
            have = self._trees_bufs = (torch.empty(reqs, dtype=torch.long),
                                       torch.zeros(reqs, call.depth, dtype=torch.float32),
                                       torch.zeros(reqs, dtype=torch.int32), torch.empty(size, dtype=torch.bfloat16),
                                       torch.empty(reqs * (n + widest + 3), dtype=torch.int32))
        return have

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
                                       ctypes.byref(self.proj), hidden.data_ptr(), root_e.data_ptr(),
                                       None if parents is None else parents.data_ptr(), 0 if parents is None else rows,
                                       self.topk, top.data_ptr(), top1.data_ptr(), self._work.data_ptr(),
                                       int(self.amx), torch.get_num_threads())
        if rc:
            raise HeadsNativeError(f"native heads: the C library refused the level (code {rc})")
        return top.long(), top1

