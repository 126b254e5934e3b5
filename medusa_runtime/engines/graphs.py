"""Decode steps with every shape fixed, so that a GPU runs each one as a single CUDA graph.

Eagerly, a decode step of the default model is some six hundred small kernels (30 layers of norms, RoPE, four
matmuls, attention, residuals) and a GPU spends the step launching them, not streaming the weights. A CUDA
graph records the kernels once and replays them with one launch, but it replays fixed shapes and fixed
addresses. So a static step:

* reads its inputs from tensors of its own: the rows' token ids ``ids [n]`` and the first free cache slot
  ``start`` (a 0-d tensor written before each replay, not a Python int baked into the graph);
* writes keys and values at slots ``start + arange(n)`` by ``index_copy_`` and attends over the whole cache
  ``[.., capacity, ..]`` under a mask built on the device from ``start``::

      rel = arange(capacity) - start                 # [C]: column relative to the first row's slot
      visible[i, c] = rel[c] < 0                     # the past, every row
                    | (0 <= rel[c] < n  and  tree[i, rel[c]])   # the rows' own columns, by ancestry

  so a row never sees a slot that is not yet written (capacity beyond start + n);
* writes its outputs (hidden [n, H], logits [n, V] float32, each row's argmax [n]) into tensors that the
  replays reuse: they are valid until the next step of the same cache and layout.

The caches a graphed engine hands out come from a pool per model (``capacity`` rounded up to a power of two)
and keep their steps, keyed by the layout's values, so a graph captured in one generate is replayed in the next,
and by any later decoder of the same tree. The same step runs eagerly on any device (engine ``lean-static``):
that is how the tests check its maths on a CPU.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

R = TypeVar("R")

MIN_CAPACITY = 256  # the smallest pooled cache (positions)
GRAPHS_SWITCH = "MEDUSA_CUDA_GRAPHS"  # "0": static steps run eagerly on CUDA too


def graphs_enabled(device: torch.device) -> bool:
    """Whether static steps on ``device`` are captured as CUDA graphs: on CUDA, unless MEDUSA_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get(GRAPHS_SWITCH, "1") != "0"


def bucket(capacity: int) -> int:
    """The pooled capacity for a request: the next power of two, at least MIN_CAPACITY (attention over the whole
    cache then costs at most twice what the request needs)."""
    return max(MIN_CAPACITY, 1 << max(0, capacity - 1).bit_length())


@dataclass(eq=False)
class CacheStorage:
    """A static cache's tensors and the steps captured on them; ``user`` is the cache that holds it now."""

    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor
    steps: dict = field(default_factory=dict)  # (weights' id, graphs, ids of tree mask and offsets) -> step
    user: weakref.ref | None = None
    owner: weakref.ref | None = None  # the engine that took it last (its steps are here)

    @property
    def free(self) -> bool:
        return self.user is None or self.user() is None

    def step(self, engine, tree: torch.Tensor, offsets: torch.Tensor) -> StaticStep:
        """The step of this layout on this storage, made on first use and kept as long as the storage. The key holds
        the layout's values (``layout_key``), so a later decoder of the same tree replays the graph an earlier one
        captured; and the engine's weights (the step holds its engine, so the id is never a later tuple's) with
        whether it replays graphs (lean and lean-static engines may share a storage)."""
        key = (id(engine.layers), engine.graphs, layout_key(tree, offsets))
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = StaticStep(engine, self, tree.clone(), offsets.clone(), graph=engine.graphs)
        return step


# (id of a tree mask, id of its offsets) -> the layout's values, while both tensors live
_LAYOUTS: dict[tuple[int, int], tuple[int, bytes, bytes]] = {}


def layout_key(tree: torch.Tensor, offsets: torch.Tensor) -> tuple[int, bytes, bytes]:
    """A layout by value: rows, the [n, n] mask's bytes, the offsets' bytes. Read from the device once per pair of
    tensors (a decoder's layouts live as long as the decoder), not on every step."""
    ids = (id(tree), id(offsets))
    key = _LAYOUTS.get(ids)
    if key is None:
        key = _LAYOUTS[ids] = (tree.shape[0], tree.cpu().numpy().tobytes(), offsets.cpu().numpy().tobytes())
        for tensor in (tree, offsets):
            weakref.finalize(tensor, _LAYOUTS.pop, ids, None)
    return key


# per model: the static caches made for it (a profile builds dozens of decoders, each its own engine, on one model)
_POOL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_ONE_ROW: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def one_row(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain decoding's layout: one row that sees itself ([1, 1] True), at offset 0; one pair per device."""
    if device not in _ONE_ROW:
        with torch.inference_mode(False):
            _ONE_ROW[device] = (torch.ones(1, 1, dtype=torch.bool, device=device),
                                torch.zeros(1, dtype=torch.long, device=device))
    return _ONE_ROW[device]


def storage_for(model: torch.nn.Module, capacity: int, make: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                engine) -> CacheStorage:
    """A free pooled storage of exactly ``capacity`` positions for ``model``, or a new one from ``make``. The one
    ``engine`` took last comes first: its steps are captured there already (runs in lockstep hold a cache each,
    and each would otherwise capture its layouts again on every storage it happened to get)."""
    pool = _POOL.setdefault(model, [])
    free = [s for s in pool if s.free and s.keys.shape[2] == capacity]
    storage = next((s for s in free if s.owner is not None and s.owner() is engine), None) or \
        next((s for s in free if s.owner is None or s.owner() is None), None) or (free[0] if free else None)
    if storage is None:
        storage = CacheStorage(*make(capacity))
        pool.append(storage)
    storage.owner = weakref.ref(engine)
    return storage


class StaticStep:
    """One decode step of ``n`` rows on one cache storage and one tree layout (``tree`` [n, n] bool ancestor mask,
    ``offsets`` [n] RoPE offsets from ``start``), run eagerly or replayed from a CUDA graph.

    ``engine`` is a LeanEngine: its ``_layers`` (the same layer maths as every other lean forward) with the cache
    written at ``slots`` and attention over the whole capacity."""

    def __init__(self, engine, storage: CacheStorage, tree: torch.Tensor, offsets: torch.Tensor, graph: bool):
        n, capacity, dev = tree.shape[0], storage.keys.shape[2], engine.device
        self.engine, self.storage, self.tree, self.offsets = engine, storage, tree, offsets
        self.cos, self.sin = engine._cos, engine._sin  # held: the engine may build longer tables later
        with torch.inference_mode(False):  # written in place before each run, in inference mode or out of it
            self.ids = torch.zeros(n, dtype=torch.long, device=dev)
            self.start = torch.zeros((), dtype=torch.long, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.cols = torch.arange(capacity, device=dev)
        self.capture = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _body(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [n, H], logits [n, V] float32, argmax [n]: every shape fixed, every input read from a tensor."""
        n = self.rows.shape[0]
        positions = self.start + self.offsets  # [n]
        rel = self.cols - self.start  # [C]
        own = (rel >= 0) & (rel < n)
        mask = (rel < 0) | (self.tree[:, rel.clamp(0, n - 1)] & own)  # [n, C]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [n, 1, D]
        keys, values = self.storage.keys, self.storage.values
        hidden = self.engine._layers(self.ids, cos, sin, keys, values, mask, slots=self.start + self.rows)
        logits = self.engine._logits(hidden).float()
        return hidden, logits, logits.argmax(dim=-1)

    def __call__(self, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.ids.copy_(ids, non_blocking=True)
        self.start.fill_(start)
        if not self.capture:
            return self._body()
        if self.graph is None:  # the warm-up computes this very step: the same keys and values to the same slots
            self.graph, self.out = capture(self._body, self.engine.device)
        self.graph.replay()
        return self.out


def capture(body: Callable[[], R], device: torch.device) -> tuple[torch.cuda.CUDAGraph, R]:
    """``body`` (which reads and writes only tensors that outlive the graph) captured as a CUDA graph, and the
    outputs its replays overwrite. It runs once for real first, on a side stream, as capture requires (cuBLAS
    workspaces, the allocator's blocks): so the inputs must already hold the values of the first replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out
