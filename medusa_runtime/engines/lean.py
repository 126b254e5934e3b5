"""The lean engine: Llama-family models (Llama, SmolLM, Mistral without sliding window, ...) on flat fused weights.

q/k/v in one matmul, gate/up in one matmul, a KV cache preallocated once per call as one tensor per side
``[layers, kv_heads, T, head_dim]``, the tree mask written into a prebuilt window, compaction as one gather over
all layers at once. Same maths as transformers' Llama (float32 RoPE tables, RMSNorm in float32), checked against
it in the tests. In bf16 on a CPU with AVX-512 BF16, decode steps (one row or a tree) run as one call of a C
forward (kernels/lean_cpu.c: fused element-wise stages, its own GEMV, attention over the cache); there a tree row
is bit-for-bit the one-row step of the same token, so bf16 Medusa decoding equals the runtime's bf16 plain
decoding. The prompt's forward runs there too, in chunks of causal rows (``PREFILL_CHUNK``): it is compute-bound,
and the C forward's bf16 dot products outrun oneDNN's bf16 linear there (docs/runtime.md). Only on the AMX tile
path does the prompt stay on PyTorch (oneDNN, which runs it on the tile unit too; the two were not compared). ``lean-torch`` keeps every forward on PyTorch. With Q4_1 weights (``LoadedModel.weights``,
``--weights q4_1``) every forward runs on the C forward, its linear layers reading GGUF Q4_1 blocks and its logits
projection Q8_0 ones (kernels/q4_1.py). On CUDA the
lean engine's decode steps have every shape fixed (graphs.py: attention over the whole cache under a mask built on
the device) and each is captured once as a CUDA graph and replayed; ``lean-static`` runs those fixed-shape steps
eagerly, on any device (the check of their maths on a CPU).

``tree`` is ``None`` for causal rows (prefill, plain decoding) or the tree's ``[N, N]`` bool
ancestor mask (row i may see column j).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medusa_runtime import kernels
from medusa_runtime.engines.base import DecodeStep, EngineError
from medusa_runtime.engines.graphs import CacheStorage, bucket, graphs_enabled, one_row, storage_for
from medusa_runtime.engines.logit_screen import build_screen
from medusa_runtime.kernels import hugepages, q4_1
from medusa_runtime.kernels.packing import pack_all, pack_for
from medusa_runtime.model import LoadedModel, cpu_bf16_kernels


class _StepBuffers:
    """One ``lean_decode`` (or ``lean_decode_rows``) state: the call's constant struct, the tensors it points into,
    and the step's outputs (``rows`` rows at most), with their views per row count built once. ``cache``: the one
    cache a ``lean_decode`` step writes; None for batched steps, whose sequences bring their own caches of at most
    ``capacity`` positions."""

    def __init__(self, engine: LeanEngine, cache: LeanCache | None, rows: int, threads: int, capacity: int = 0):
        lib, hsz, h, kv, d = engine.lib, engine.embed.shape[1], engine.num_heads, engine.kv_heads, engine.head_dim
        inter, vocab, amx = engine.intermediate, engine.lm_head.shape[0], int(engine.amx)
        capacity = cache.capacity if cache is not None else capacity
        self.rows, self.threads, self.capacity = rows, threads, capacity
        self.work = torch.empty(lib.lean_decode_work_size(rows, hsz, h, kv, d, inter, amx), dtype=engine.dtype)
        self.scratch = torch.empty(lib.lean_scratch_size(threads, rows, h, capacity, amx), dtype=torch.float32)
        self.xv = torch.empty(lib.lean_amx_scratch_size(rows, max(hsz, inter, h * d)) if amx else 0, dtype=engine.dtype)
        self.hidden = torch.empty(rows, hsz, dtype=engine.dtype)
        self.logits = torch.empty(rows, vocab, dtype=torch.float32)
        self.pred = torch.empty(rows, dtype=torch.int64)
        self.pred_np = self.pred.numpy()
        # held: the struct points into them: the engine (its layer table, packed weights, embeddings), its RoPE
        # tables of now (it may build longer ones for a later cache), the cache's keys and values
        keys, values = (cache.keys, cache.values) if cache is not None else (None, None)
        self.keep = (engine, engine._cos, engine._sin, keys, values, engine.logit_screen)
        self.rope = engine._cos  # the RoPE table the struct reads (an engine builds longer ones as asked)
        self.model = kernels.LeanModel(
            ctypes.cast(engine._layer_table, ctypes.POINTER(kernels.LeanLayer)), len(engine.layers), hsz, h, kv, d,
            inter, vocab, engine.eps, engine.norm.data_ptr(), engine.embed.data_ptr(),
            None if engine.q4_1 else engine._logits_kernel.packed.data_ptr(), engine._cos.data_ptr(), engine._sin.data_ptr(),
            engine._cos.shape[0], capacity, threads, amx, None if keys is None else keys.data_ptr(),
            None if values is None else values.data_ptr(),
            self.work.data_ptr(), self.xv.data_ptr() if amx else None, self.scratch.data_ptr(),
            *(engine.logit_screen.pointers() if engine.logit_screen is not None else (None,) * 5),
            engine._logits_kernel.blocks.data_ptr() if engine.q4_1 else None)
        self.ref = ctypes.byref(self.model)
        self.out = (self.hidden.data_ptr(), self.logits.data_ptr(), self.pred.data_ptr())
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def view(self, n: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """(logits [n, V], hidden [n, H], hidden's rows) as views, built on first use."""
        hit = self.views.get(n)
        if hit is None:
            hidden = self.hidden[:n]
            hit = self.views[n] = (self.logits[:n], hidden, tuple(hidden.unbind(0)))
        return hit


@dataclass
class LeanCache:
    """Keys and values of every layer, preallocated: ``[layers, kv_heads, capacity, head_dim]``.

    ``visible`` is the attention-mask window for tree rows: ``[max_nodes, capacity]`` bool, all True
    except while a tree is being verified, when its ancestor mask is written at the tree's columns.
    """

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor
    native: _StepBuffers | None = None  # the C decode step's buffers for this cache (LeanEngine.decode_step)
    storage: CacheStorage | None = None  # a static cache's pooled tensors and captured steps (graphs.py)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]


def _packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked linears on a CPU: in bf16 they stream weights at ~1.5x the rate of ``F.linear`` (which
    re-lays out the weight on every call), unless oneDNN has no bf16 kernels here (AVX2 only: the reorder refuses
    bf16 without AVX-512 or AVX-NE-CONVERT); in float32 they are faster than MKL's GEMV for one row and, packed for
    ``PACK_ROWS`` rows, give each row the same result whatever the row count (see ``_Linear``). CUDA keeps
    ``F.linear``."""
    mkldnn = torch.ops.mkldnn
    if device.type != "cpu" or not (hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_kernels())


PREFILL_CHUNK = 64  # prompt rows per C call (the work buffers stay bounded by it)

# the row count float32 weights are packed for: oneDNN then runs every row count through one blocking, so a row's
# result does not depend on how many rows share the call (packed for one row, one row alone rounds otherwise than
# two); batched decoding relies on it (a request's tokens are the same alone and in any batch)
PACK_ROWS = 64


class _KernelLinear:
    """``y = x W^T`` [M, out] for a fixed bf16 weight W [out, in], by the C library on a packed copy of W
    (AVX-512 blocks of 4 rows, or AMX tiles): bf16 output, or float32 unrounded (``out_kind`` OUT_F32, the
    logits)."""

    __slots__ = ("weight", "lib", "amx", "packed", "kind", "_xv")

    def __init__(self, weight: torch.Tensor, lib, amx: bool = False, out_kind: int = kernels.OUT_BF16,
                 packed: torch.Tensor | None = None):
        self.weight, self.lib, self.amx = weight.detach().contiguous(), lib, amx
        self.packed = pack_for(lib, self.weight, amx) if packed is None else packed  # packed: pack_for's of weight
        self.kind, self._xv = out_kind, torch.empty(0, dtype=torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, (out, width) = x.shape[0], self.weight.shape
        if x.dim() != 2 or x.shape[1] != width or x.dtype != self.weight.dtype or x.device.type != "cpu":
            raise EngineError(f"expected a CPU {self.weight.dtype} input [M, {width}], got {x.dtype} {list(x.shape)}")
        y = torch.empty(rows, out, dtype=torch.float32 if self.kind == kernels.OUT_F32 else self.weight.dtype)
        threads = torch.get_num_threads()
        if not self.amx:
            self.lib.lean_linear(self.packed.data_ptr(), x.data_ptr(), rows, out, width, y.data_ptr(), None,
                                 self.kind, threads)
            return y
        need = self.lib.lean_amx_scratch_size(rows, width)
        if self._xv.numel() < need:
            self._xv = torch.empty(need, dtype=torch.bfloat16)
        if self.lib.lean_linear_amx(self.packed.data_ptr(), x.data_ptr(), rows, out, width, y.data_ptr(), None,
                                    self.kind, self._xv.data_ptr(), threads):
            raise EngineError("the AMX tile unit is unavailable in this process")
        return y


class _Q8Linear:
    """``y = x W^T`` [M, out] float32 for a weight held as Q8_0 blocks (the logits projection beside Q4_1 layers),
    by the C library: the rows quantised per block of 32, integer block sums (see lean_cpu.c)."""

    __slots__ = ("blocks", "out", "width", "lib", "_q8")

    def __init__(self, blocks: torch.Tensor, width: int, lib):
        """blocks: the GGUF's [out, width / 32 * 34], held repacked for the kernel (q4_1.pack)."""
        self.blocks, self.out, self.width, self.lib = q4_1.pack(lib, blocks, width), blocks.shape[0], width, lib
        self._q8 = torch.empty(0, dtype=torch.uint8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.dim() != 2 or x.shape[1] != self.width or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise EngineError(f"expected a CPU bfloat16 input [M, {self.width}], got {x.dtype} {list(x.shape)}")
        rows, out = x.shape[0], self.out
        if self._q8.numel() < (need := self.lib.lean_q8_scratch_bytes(rows, self.width)):
            self._q8 = torch.empty(need, dtype=torch.uint8)
        y = torch.empty(rows, out, dtype=torch.float32)
        self.lib.lean_linear_q8_0(self.blocks.data_ptr(), x.data_ptr(), rows, out, self.width, y.data_ptr(),
                                  self._q8.data_ptr(), torch.get_num_threads())
        return y


class _Linear:
    """``y = x W^T`` for a fixed weight W [out, in], prepacked for oneDNN when that pays."""

    __slots__ = ("weight", "packed")

    def __init__(self, weight: torch.Tensor, pack: bool):
        self.weight = weight.detach().contiguous()
        rows = PACK_ROWS if self.weight.dtype == torch.float32 else 1
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


@dataclass(frozen=True)
class _Layer:
    ln1: torch.Tensor  # [H] input RMSNorm weight
    qkv: _Linear  # [(heads + 2 kv_heads) * D, H]: q, k, v projections stacked
    o: _Linear  # [H, heads * D]
    ln2: torch.Tensor  # [H] post-attention RMSNorm weight
    gate_up: _Linear  # [2 I, H]: gate and up projections stacked
    down: _Linear  # [H, I]


def lean_support(loaded: LoadedModel) -> str | None:
    """None when the lean engine can run this model, else why not."""
    cfg = loaded.model.config
    if getattr(cfg, "model_type", "") not in ("llama", "mistral"):
        return f"model type {getattr(cfg, 'model_type', '?')!r} is not Llama-family"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"RoPE scaling {rope.get('rope_type')!r}"
    if getattr(loaded.model, "peft_config", None):
        return "PEFT adapters attached (merge them first)"
    return None


def _fuse(layer, pack: bool) -> _Layer:
    a, m = layer.self_attn, layer.mlp
    return _Layer(ln1=layer.input_layernorm.weight.detach(),
                  qkv=_Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), pack),
                  o=_Linear(a.o_proj.weight, pack), ln2=layer.post_attention_layernorm.weight.detach(),
                  gate_up=_Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), pack),
                  down=_Linear(m.down_proj.weight, pack))


# fused weights per model, shared by all its engines (a profile builds one decoder per tree size);
# keyed by the parameters' version counters too, so a model trained in place gets fresh copies
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the same weights in the C library's layouts


def _kernel_weights(model, layers, lm_head: torch.Tensor, lib, amx: bool, quantized: bool = False):
    """(per layer (qkv, o, gate_up, down) packed, the lm_head's logits projection, the greedy steps' int8 screen
    of the lm_head or None) in the layout of the C library's path (AMX tiles or AVX-512 blocks of 4 rows), once
    per model and path. The tile path has no screen: its logits round otherwise than the screen's exact
    candidates. ``quantized``: the layers' Q4_1 blocks instead (``q4_1.layer_blocks``: the GGUF's where the model
    has one), the lm_head's Q8_0 blocks, no screen."""
    stamp = sum(p._version for p in model.parameters())
    key = "q4_1" if quantized else amx
    hit = _PACKED.get(model, {}).get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    with torch.no_grad():
        if quantized:
            gguf = getattr(model, "medusa_gguf", None)  # set by load_model for a packaged model
            mats = [(w.qkv.weight, w.o.weight, w.gate_up.weight, w.down.weight) for w in layers]
            widths = [tuple(m.shape[1] for m in ms) for ms in mats]
            packed = (tuple(q4_1.pack_layers(lib, q4_1.layer_blocks(gguf, mats, model.config), widths)),
                      _Q8Linear(q4_1.output_blocks(gguf, lm_head), lm_head.shape[1], lib), None)
        else:
            flat = pack_all(lib, [lin.weight for w in layers for lin in (w.qkv, w.o, w.gate_up, w.down)] + [lm_head],
                            amx)
            packed = (tuple(tuple(flat[4 * i:4 * i + 4]) for i in range(len(layers))),
                      _KernelLinear(lm_head, lib, amx=amx, out_kind=kernels.OUT_F32, packed=flat[-1]),
                      None if amx else build_screen(lm_head))
    _PACKED.setdefault(model, {})[key] = (stamp, packed)
    return packed


def _table_row(w: _Layer, mats: tuple[int, ...], q4: bool) -> kernels.LeanLayer:
    """A layer's addresses for the C forward: its norms, and its (qkv, o, gate_up, down) as packed bf16 or, with
    ``q4``, as Q4_1 blocks."""
    qkv, o, gate_up, down = mats
    if q4:
        return kernels.LeanLayer(w.ln1.data_ptr(), None, None, w.ln2.data_ptr(), None, None, qkv, o, gate_up, down)
    return kernels.LeanLayer(w.ln1.data_ptr(), qkv, o, w.ln2.data_ptr(), gate_up, down)


def _fused_weights(model, pack: bool):
    stamp = (pack, sum(p._version for p in model.parameters()))
    hit = _FUSED.get(model)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    inner = model.model
    with torch.no_grad():
        lm_head = model.get_output_embeddings().weight.detach()
        weights = (inner.embed_tokens.weight.detach(), inner.norm.weight.detach(), lm_head,
                   _Linear(lm_head, pack), tuple(_fuse(layer, pack) for layer in inner.layers))
    _FUSED[model] = (stamp, weights)
    return weights


class LeanEngine:
    """A Llama forward on fused weights and a preallocated cache. Shares the model's tensors where it can."""

    name = "lean"

    def __init__(self, loaded: LoadedModel, max_nodes: int = 1, use_kernels: bool | None = None,
                 static_steps: bool | None = None, graphs: bool | None = None):
        """``use_kernels``: decode steps (one row, or a tree) through the C forward of kernels/lean_cpu.c;
        None = where it pays (bf16 on a CPU with AVX-512 BF16 and a C compiler), False = PyTorch only.
        ``static_steps``: decode steps with every shape fixed (graphs.py), captured as CUDA graphs on CUDA and
        run eagerly elsewhere; None = on CUDA. ``graphs``: the static steps (and the heads) replayed from CUDA
        graphs; None = where ``graphs.graphs_enabled`` (CUDA, unless MEDUSA_CUDA_GRAPHS=0), False = eagerly."""
        why = lean_support(loaded)
        if why:
            raise EngineError(f"the lean engine cannot run {loaded.name}: {why}; use engine 'hf'")
        self.q4_1 = loaded.weights == "q4_1"  # the layers' linear weights as Q4_1 blocks, on the C forward only
        if self.q4_1 and (use_kernels is False or static_steps):
            raise EngineError("Q4_1 weights run on the C forward only (engine lean, not lean-torch or lean-static)")
        if self.q4_1:
            use_kernels = True
        model, cfg = loaded.model, loaded.model.config
        self.device, self.dtype = loaded.device, loaded.dtype
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_nodes = max(1, max_nodes)
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.packed = _packing_available(self.device, self.dtype)
        self.embed, self.norm, self.lm_head, self._logits, self.layers = _fused_weights(model, self.packed)
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        if static_steps and use_kernels:
            raise EngineError("static steps and the C forward exclude each other")
        self.lib = None if static_steps else self._kernel_library(use_kernels)
        # linear layers on AMX tiles (packed bf16 weights); Q4_1 layers have their own kernel
        self.amx = self.lib is not None and not self.q4_1 and kernels.amx_path()
        if static_steps is None:  # where a GPU would otherwise spend the step launching kernels
            static_steps = self.lib is None and (self.device.type == "cuda" or graphs_enabled(self.device))
        self.static = static_steps
        self.graphs = self.static and (graphs_enabled(self.device) if graphs is None else graphs)
        self._model = weakref.ref(model)  # the static caches' pool is per model
        self.logit_screen = None  # the greedy steps' int8 screen of the logits (below, with the C forward)
        if self.lib is not None:  # the layers' packed weight addresses, once; the tensors are shared via _PACKED
            packed, self._logits_kernel, self.logit_screen = _kernel_weights(model, self.layers, self.lm_head,
                                                                              self.lib, self.amx, self.q4_1)
            self._packed = packed  # held here too: the table below points into them, and the model may go first
            mats = [tuple(t.data_ptr() for t in p) for p in packed]
            self._layer_table = (kernels.LeanLayer * len(self.layers))(*[
                _table_row(w, m, self.q4_1) for w, m in zip(self.layers, mats)])
            self.intermediate = self.layers[0].down.weight.shape[1]
            self._work = self._scratch = self._xv = torch.empty(0)
            self._rows_buffers: _StepBuffers | None = None  # decode_rows' buffers, grown as asked

    def _kernel_library(self, wanted: bool | None):
        if wanted is None:  # where it pays
            return None if _c_forward_blocker(self.device, self.dtype) else kernels.load()
        if not wanted:
            return None
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            raise EngineError(f"the C forward {_BF16_CPU_ONLY}")
        lib = kernels.load()
        if lib is None:
            raise EngineError(f"the C forward is unavailable: {kernels.unavailable_reason()}")
        return lib

    @property
    def uses_kernels(self) -> bool:
        return self.lib is not None

    # -------------------------------------------------------------- buffers

    def _rope(self, length: int) -> None:
        """cos/sin tables [length, D] computed in float32 as transformers does, then cast to the dtype."""
        if length <= self._rope_len:
            return
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float().to(self.device) / d))
        freqs = torch.outer(torch.arange(length, device=self.device).float(), inv_freq)  # [T, D/2]
        table = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        self._cos, self._sin = table.cos().to(self.dtype), table.sin().to(self.dtype)
        # rotate_half(x) sin = roll(x, D/2) * [-sin_lo, sin_hi]: the sign moves into the table (exact)
        half = d // 2
        self._sin = torch.cat([-self._sin[:, :half], self._sin[:, half:]], dim=-1)
        self._rope_len = length

    def new_cache(self, capacity: int) -> LeanCache:
        """An empty cache of ``capacity`` positions; with static steps a pooled one of ``bucket(capacity)``
        positions, free since its last user was dropped, whose captured steps it keeps."""
        storage = None
        if self.static:
            capacity = bucket(capacity)
            storage = storage_for(self._model(), capacity, self._kv_tensors, self)
            keys, values = storage.keys, storage.values
        else:
            keys, values = self._kv_tensors(capacity)
        self._rope(capacity)
        visible = torch.ones(self.max_nodes, capacity, dtype=torch.bool, device=self.device)
        cache = LeanCache(keys, values, visible, storage=storage)
        if storage is not None:
            storage.user = weakref.ref(cache)
        return cache

    def _kv_tensors(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed keys and values [layers, kv_heads, capacity, head_dim]; plain tensors even when made in
        inference mode (a pooled cache is written by in-place ops in and out of it)."""
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        with torch.inference_mode(False):
            return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device))

    # -------------------------------------------------------------- the forward

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in float32, cast back, then scale. F.rms_norm without a weight
        # does the first two (in float32 for half inputs, one rounding) in one call
        return weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)

    def forward(self, ids: torch.Tensor, start: int, cache: LeanCache, tree: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n] written at cache slots start..start+n-1 -> logits [n or 1, V] float32, hidden [n or 1, H].

        ``positions`` [n] are the RoPE positions (default: the slots); tree rows pass ``start + depth``.
        """
        n = ids.shape[0]
        end = start + n
        if end > cache.capacity:
            raise EngineError(f"cache of {cache.capacity} positions cannot take {end}")
        self._rope(cache.capacity)  # positions never exceed the slots; no-op once the table is long enough
        if self.lib is not None and (tree is not None or n == 1):
            return self._kernel_forward(ids, start, end, positions, cache, tree, last_only)
        if self.lib is not None and not self.amx:  # the prompt (Q4_1 models never take the tile path): in chunks
            return self._kernel_prefill(ids, start, cache, positions, last_only)
        if positions is None:
            cos, sin = self._cos[start:end], self._sin[start:end]
        else:
            cos, sin = self._cos[positions], self._sin[positions]
        cos, sin = cos[:, None], sin[:, None]  # [n, 1, D], broadcast over heads
        mask, causal = None, False
        if tree is not None:  # past columns stay True; the tree's own columns get its ancestor mask
            if n > cache.visible.shape[0]:  # a cache made for smaller trees (shared between decoders)
                cache.visible = torch.ones(n, cache.capacity, dtype=torch.bool, device=self.device)
            window = cache.visible[:n, :end]
            window[:, start:] = tree
            mask = window
        elif n > 1:
            if start != 0:
                raise EngineError("causal multi-token forwards are only supported from an empty cache")
            causal = True
        try:
            hidden = self._layers(ids, cos, sin, cache.keys, cache.values, mask, causal, start=start)
        finally:
            if mask is not None:
                cache.visible[:n, start:end] = True
        if last_only:
            hidden = hidden[-1:]
        return self._logits(hidden).float(), hidden

    def _kernel_forward(self, ids, start, end, positions, cache, tree, last_only):
        """The decode forward in one call of the C library (same maths as _layers; see lean_cpu.c)."""
        n, hsz, threads = ids.shape[0], self.embed.shape[1], torch.get_num_threads()
        h, kv, d, inter = self.num_heads, self.kv_heads, self.head_dim, self.intermediate
        x = F.embedding(ids, self.embed)  # [n, H], becomes the residual stream
        pos = (torch.arange(start, end) if positions is None else positions).to(torch.int64).contiguous()
        # the C code indexes with these unchecked: refuse what PyTorch indexing would refuse
        if pos.shape != (n,) or (positions is not None and not 0 <= int(pos.min()) <= int(pos.max()) < self._rope_len):
            raise EngineError(f"positions must be {n} values in [0, {self._rope_len})")
        if tree is not None and tuple(tree.shape) != (n, n):
            raise EngineError(f"the tree mask must be [{n}, {n}], got {list(tree.shape)}")
        need = self.lib.lean_forward_work_size(n, hsz, h, kv, d, inter, int(self.amx))
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=self.dtype)
        # attention: three heads' softmax rows, their weights and a row's tree slots per thread; with the tile path
        # every query's q . k
        need_sc = self.lib.lean_scratch_size(threads, n, h, cache.capacity, int(self.amx))
        if self._scratch.numel() < need_sc:
            self._scratch = torch.empty(need_sc, dtype=torch.float32)
        mask = None if tree is None else tree.to(torch.bool).contiguous()  # [n, n] bytes
        if self.amx and self._xv.numel() < (need_xv := self.lib.lean_amx_scratch_size(n, max(hsz, inter, h * d))):
            self._xv = torch.empty(need_xv, dtype=torch.bfloat16)  # the rows in the tile layout, per linear
        hidden = torch.empty(n, hsz, dtype=self.dtype)
        rc = self.lib.lean_forward(
            self._layer_table, len(self.layers), hsz, h, kv, d, inter, self.eps, self.norm.data_ptr(),
            x.data_ptr(), n, pos.data_ptr(), start, cache.keys.data_ptr(), cache.values.data_ptr(), cache.capacity,
            None if mask is None else mask.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(),
            self._work.data_ptr(), self._scratch.data_ptr(), hidden.data_ptr(), threads, int(self.amx),
            self._xv.data_ptr() if self.amx else None)
        if rc != 0:
            raise EngineError(f"the C forward cannot run head_dim {d} (at most 256)" if rc == -1 else
                              "the AMX tile unit is unavailable in this process")
        if last_only:
            hidden = hidden[-1:]
        return self._logits_kernel(hidden), hidden  # logits [n, V] float32, unrounded

    def _kernel_prefill(self, ids, start, cache, positions, last_only):
        """Causal rows through the C forward, PREFILL_CHUNK at a time (the work buffers stay bounded)."""
        outs = []
        for at in range(0, ids.shape[0], PREFILL_CHUNK):
            piece = ids[at:at + PREFILL_CHUNK]
            pos = None if positions is None else positions[at:at + PREFILL_CHUNK]
            last = last_only and at + PREFILL_CHUNK >= ids.shape[0]
            if last_only and not last:  # an earlier chunk's rows fill the cache only: no logits needed
                self._kernel_forward(piece, start + at, start + at + piece.shape[0], pos, cache, None, True)
                continue
            outs.append(self._kernel_forward(piece, start + at, start + at + piece.shape[0], pos, cache, None, last))
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    @property
    def fused_steps(self) -> bool:
        """Whether ``decode_step`` runs here (the C forward, or the static steps)."""
        return self.lib is not None or self.static

    def _static_step(self, ids: torch.Tensor, start: int, cache: LeanCache, tree: torch.Tensor | None,
                     offsets: torch.Tensor | None, argmax_only: bool) -> DecodeStep:
        """``decode_step`` as a fixed-shape step of graphs.py, found (or captured) for this cache's storage and
        this layout; its outputs are the step's own buffers, overwritten by its next replay."""
        n = ids.shape[0]
        if cache.storage is None:
            raise EngineError("static steps need a cache from this engine's new_cache")
        if start + n > cache.capacity:
            raise EngineError(f"cache of {cache.capacity} positions cannot take {start + n}")
        if tree is None:
            tree, offsets = one_row(self.device) if n == 1 else (None, None)
        if tree is None or offsets is None or tuple(tree.shape) != (n, n) or tuple(offsets.shape) != (n,) or \
                tree.dtype != torch.bool or offsets.dtype != torch.int64:
            raise EngineError(f"a static step of {n} rows needs its bool [{n}, {n}] tree mask and int64 [{n}] offsets")
        self._rope(cache.capacity)  # no-op unless the cache came from an engine with longer tables
        hidden, logits, pred = cache.storage.step(self, tree, offsets)(ids, start)
        return DecodeStep(None if argmax_only else logits, hidden, pred.tolist(), hidden)

    def decode_step(self, ids: torch.Tensor, start: int, cache: LeanCache, tree: torch.Tensor | None = None,
                    offsets: torch.Tensor | None = None, argmax_only: bool = False) -> DecodeStep:
        """A decode step in one call of the C library: ids [n] (int64) at cache slots start.., RoPE positions
        start + offsets (int64 [n]; None: the slots), ``tree`` the [n, n] bool ancestor mask (None: causal rows)
        -> logits, hidden, each row's argmax: the values ``forward`` gives for the same rows, with the embedding,
        the logits and the argmax in the same call (no tensor op between the forward's pieces). The outputs are
        views of buffers the cache keeps, overwritten by its next step. ``argmax_only``: the step's logits are None
        and ``pred`` the same argmax, taken through the int8 screen of the lm_head (``logit_screen``) where the
        engine has one."""
        if self.static:
            return self._static_step(ids, start, cache, tree, offsets, argmax_only)
        if self.lib is None:
            raise EngineError("decode_step needs the C forward (bf16 on a CPU with the kernels) or static steps")
        n = ids.shape[0]
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or ids.device.type != "cpu":
            raise EngineError(f"ids must be a contiguous int64 CPU vector, got {ids.dtype} {list(ids.shape)}")
        if tree is not None and (tree.dtype != torch.bool or tuple(tree.shape) != (n, n) or not tree.is_contiguous()):
            raise EngineError(f"the tree mask must be a contiguous bool [{n}, {n}], got {tree.dtype} {list(tree.shape)}")
        if offsets is not None and (offsets.dtype != torch.int64 or tuple(offsets.shape) != (n,)
                                    or not offsets.is_contiguous()):
            raise EngineError(f"offsets must be {n} contiguous int64 values")
        buf, threads = cache.native, torch.get_num_threads()
        if buf is None or buf.rows < n or buf.threads != threads:
            self._rope(cache.capacity)  # this engine's tables may be shorter (the cache made by another engine)
            buf = cache.native = _StepBuffers(self, cache, max(n, self.max_nodes, buf.rows if buf else 0), threads)
        hidden, logits, pred = buf.out
        rc = self.lib.lean_decode(buf.ref, ids.data_ptr(), n, None if offsets is None else offsets.data_ptr(), start,
                                  None if tree is None else tree.data_ptr(), hidden, logits, pred, int(argmax_only))
        if rc:
            raise EngineError(_DECODE_ERRORS.get(rc, f"the C decode step failed (code {rc})"))
        logits_n, hidden_n, rows = buf.view(n)
        return DecodeStep(None if argmax_only else logits_n, hidden_n, buf.pred_np[:n].tolist(), rows)

    def decode_rows(self, seqs: Sequence, positions: torch.Tensor, argmax_only: bool = False) -> DecodeStep:
        """A batched step in one call of the C library (``lean_decode_rows``): the rows of ``seqs`` (engines.rows'
        ``Seq``: ids, first slot, own cache and tree mask), one sequence after another, at RoPE ``positions``
        (int64 [rows]) -> what each sequence's own ``decode_step`` gives its rows: logits, hidden, each row's
        argmax (through the int8 screen with ``argmax_only``, where it takes the rows). The outputs are views of
        buffers the engine keeps, overwritten by its next batched step."""
        if self.lib is None:
            raise EngineError("decode_rows needs the C forward (bf16 on a CPU with the kernels)")
        ids = torch.cat([s.ids for s in seqs])
        n, cap, threads = ids.shape[0], max(s.cache.capacity for s in seqs), torch.get_num_threads()
        buf = self._rows_buffers
        if buf is None or buf.rows < n or buf.capacity < cap or buf.threads != threads or buf.rope is not self._cos:
            buf = self._rows_buffers = _StepBuffers(self, None, max(n, buf.rows if buf else 0), threads,
                                                    max(cap, buf.capacity if buf else 0))
        masks = [None if s.tree is None else s.tree.to(torch.bool).contiguous() for s in seqs]  # [n, n] bytes each
        table = (kernels.LeanSeq * len(seqs))(*[
            kernels.LeanSeq(s.ids.shape[0], s.start, s.cache.capacity, s.cache.keys.data_ptr(),
                            s.cache.values.data_ptr(), None if m is None else m.data_ptr()) for s, m in zip(seqs, masks)])
        positions = positions.contiguous()
        hidden, logits, pred = buf.out
        rc = self.lib.lean_decode_rows(buf.ref, ids.data_ptr(), n, positions.data_ptr(),
                                       ctypes.cast(table, ctypes.POINTER(kernels.LeanSeq)), len(seqs), hidden, logits,
                                       pred, int(argmax_only))
        if rc:
            raise EngineError(_DECODE_ERRORS.get(rc, f"the C batched step failed (code {rc})"))
        logits_n, hidden_n, rows = buf.view(n)
        return DecodeStep(None if argmax_only else logits_n, hidden_n, buf.pred_np[:n].tolist(), rows)

    def _layers(self, ids, cos, sin, keys, values, mask, causal=False, start=0, slots=None) -> torch.Tensor:
        """The layers on ids [n] -> final-normed hidden [n, H]: each layer's keys/values written at cache slots
        start..start+n-1 and attention over slots ..start+n-1; with ``slots`` (an int64 tensor [n], the static
        step of graphs.py) written there by index and attention over the whole capacity under ``mask``."""
        n = ids.shape[0]
        end = keys.shape[2] if slots is not None else start + n
        bias = None if causal else self.grouped_bias(mask)  # once for all layers
        x = F.embedding(ids, self.embed)  # [n, H]
        for i, w in enumerate(self.layers):
            q, k, v = self.attention_inputs(w, x, cos, sin)
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv, n, D]
            if slots is None:
                keys[i, :, start:end] = k
                values[i, :, start:end] = v
            else:
                keys[i].index_copy_(1, slots, k)
                values[i].index_copy_(1, slots, v)
            past_k, past_v = keys[i: i + 1, :, :end], values[i: i + 1, :, :end]  # [1, kv, T, D]
            if causal:  # a prompt into an empty cache: flash attention takes the query heads as they are
                att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], past_k, past_v, is_causal=True,
                                                     enable_gqa=True)[0].transpose(0, 1)  # [n, heads, D]
            else:
                att = self.grouped_attention(q, past_k, past_v, bias)
            x = self.after_attention(w, x, att.reshape(n, -1))
        return self._rms(x, self.norm)

    def grouped_bias(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The additive mask [g * n, T] of ``grouped_attention`` for a bool mask [n, T] (True: visible), rows in
        the grouped queries' order (head r of a group, then row): 0 where visible, -inf elsewhere."""
        if mask is None:
            return None
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return bias.repeat(self.num_heads // self.kv_heads, 1)

    def grouped_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """q [n, heads, D] against keys and values [1, kv_heads, T, D] -> [n, heads, D]. Query head h reads kv head
        h // g (g = heads / kv_heads, transformers' repeat_kv), so each kv head's g query heads go in as g * n rows of
        one attention: no copy of the cache per query head (what enable_gqa costs with a mask, in the math kernel),
        and a mask (``grouped_bias``) leaves the fused kernels open."""
        n, kv, d = q.shape[0], self.kv_heads, self.head_dim
        g = self.num_heads // kv
        grouped = q.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(1, kv, g * n, d)  # [1, kv, (r, row), D]
        att = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias)  # [1, kv, g * n, D]
        return att.view(kv, g, n, d).permute(2, 0, 1, 3)  # [n, kv, g, D] = [n, heads, D]

    def attention_inputs(self, w: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q [n, heads, D], k and v [n, kv_heads, D] for rows x [n, H], RoPE applied (cos, sin [n, 1, D])."""
        n, h, kv, d = x.shape[0], self.num_heads, self.kv_heads, self.head_dim
        qkv = w.qkv(self._rms(x, w.ln1)).view(n, h + 2 * kv, d)
        qk = qkv[:, : h + kv]  # RoPE on q and k together: x cos + rotate_half(x) sin (sign in the table)
        qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
        return qk[:, :h], qk[:, h:], qkv[:, h + kv:]

    def after_attention(self, w: _Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The rest of a layer: x [n, H] plus the output projection of att [n, heads * D], then the MLP block."""
        x = x + w.o(att)
        gate, up = w.gate_up(self._rms(x, w.ln2)).chunk(2, dim=-1)
        return x + w.down(F.silu(gate) * up)

    def compact(self, cache: LeanCache, start: int, path: Sequence[int]) -> None:
        """Move the accepted nodes' keys/values to slots start.. in one gather over all layers (one C call where
        the C forward runs: no tensor ops between two forwards)."""
        if list(path) == list(range(len(path))):
            return  # already in place; later slots are overwritten by the next forward
        if self.lib is not None and cache.keys.is_contiguous() and cache.values.is_contiguous():
            layers, kv, cap, d = cache.keys.shape
            self.lib.lean_compact(cache.keys.data_ptr(), cache.values.data_ptr(), layers * kv, cap,
                                  d * cache.keys.element_size(), start, (ctypes.c_int64 * len(path))(*path), len(path))
            return
        idx = torch.tensor([start + p for p in path], device=cache.keys.device)
        end = start + len(path)
        cache.keys[:, :, start:end] = cache.keys.index_select(2, idx)
        cache.values[:, :, start:end] = cache.values.index_select(2, idx)

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head

    def projector(self, weight: torch.Tensor) -> _Linear | _KernelLinear:
        """``x [M, in] -> x W^T [M, out]`` for a fixed weight [out, in]: the C library where the C forward
        runs (on AMX tiles where it runs there), else prepacked like the model's own."""
        if self.lib is not None:
            return _KernelLinear(weight, self.lib, amx=self.amx)
        return self._logits if weight is self.lm_head else _Linear(weight, self.packed)


_BF16_CPU_ONLY = "runs bfloat16 on the CPU only"
_DECODE_ERRORS = {-1: "the C forward cannot run a head_dim over 256", -2: "the AMX tile unit is unavailable in this process",
                  -3: "a token id is outside the vocabulary", -4: "a position is outside the RoPE table or the cache",
                  -5: "the sequences' rows do not add up to the step's"}


def _c_forward_blocker(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the lean engine would not take the C forward by default (None: it would)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"it {_BF16_CPU_ONLY}"
    if kernels.load() is None:
        return kernels.unavailable_reason()
    if not kernels.fast_path():
        return "this CPU lacks AVX-512 BF16: the PyTorch path is faster"
    return None


def c_forward_status(loaded: LoadedModel) -> str:
    """One line: would this model's decode steps run on the C forward (engine auto/lean), and if not, why."""
    why = lean_support(loaded)
    if why:
        return f"no (transformers' engine: {why})"
    if loaded.weights == "q4_1":  # its only path, whatever the CPU's vector extensions
        return (f"yes (Q4_1 layers and a Q8_0 logits projection as integer block sums against int8 activations, "
                f"by {kernels.int8_dot_path()})" if kernels.load() is not None else f"no ({kernels.unavailable_reason()})")
    why = _c_forward_blocker(loaded.device, loaded.dtype)
    if why:
        return f"no ({why})"
    if kernels.amx_path():
        return f"yes (AMX-BF16 tiles, packed weights in {hugepages.describe()})"
    return (f"yes (AVX-512 BF16, packed weights in {hugepages.describe()}; greedy steps take their argmax through "
            "an int8 screen of the logits projection)")
