"""Root- and path-conditioned heads in the C library: one call per tree level instead of a dozen PyTorch ops.

A level of the decoder's path-conditioned heads (``MedusaDecoder._propose_path``) is small work on few
rows: the root's (and each parent's) embedding through U_j (and P_j), the residual blocks, the
projection onto the draft vocabulary and a top-k. In PyTorch each of those is an op with its own
dispatch and, in bf16, a oneDNN call on one row; the C library does the level in one parallel call
with the forward's own linear layers (AMX tiles where the forward uses them), rounding to bf16 where
PyTorch rounds. Used by the decoder where the C forward runs (bf16 on the CPU) and the heads are
root-conditioned shared-format heads; everywhere else the PyTorch path stays.
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
    top-k rows of the projection and its top-1 softmax probability (what the gate reads)."""

    def __init__(self, heads: MedusaHeads, engine, projection: torch.Tensor, depth: int, topk: int):
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

