"""CUDA graph capture and replay emulated on the CPU, for the default suite (which has no GPU).

A CUDA graph records the kernels a body launches, with their arguments as they were at capture: tensors by
address, every Python value (a slice bound, an index that ``.item()`` turned into an int) as a constant. A
replay runs the same kernels again on whatever those tensors hold then, and writes the same output tensors.
Capture also refuses what would make the host wait for the device (``.item()``, ``nonzero``, a boolean mask
index): the host cannot read a value that does not exist yet.

``emulated_capture`` has the signature of ``medusa_runtime.engines.graphs.capture``. It records the body's aten ops
(below autograd, through a dispatch mode) with the very tensors they took, and each replay runs the recorded
ops again in order, copying each out-of-place result into the tensor recorded for it. So a body that reads a
Python value where it should read a tensor replays the captured value, as on a GPU, and a host read during
capture fails, as on a GPU, where an eager run on the CPU would hide both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# ops that read a device value on the host, or whose output shape depends on values: a capture refuses them
# (in inference mode ``.item()`` reaches the dispatch mode as aten.item, else as _local_scalar_dense)
HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default,
              aten.masked_select.default, aten.equal.default}


class CaptureError(RuntimeError):
    """What ``torch.cuda.graph`` raises for an op that cannot be captured."""


def _host_index(func, args) -> bool:
    """A boolean mask index: its result's shape is the number of True values, read on the host."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS or _host_index(func, args):
            raise CaptureError(f"{func} reads a device value on the host: a CUDA graph cannot capture it")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, tree_flatten(out)[0]))
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class EmulatedGraph:
    """The ops recorded from one run of a body; ``replay`` runs them again over the same tensors."""

    def __init__(self, ops: list[tuple[Any, tuple, dict, list]]):
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = tree_flatten(func(*args, **kwargs))[0]
            for old, new in zip(recorded, fresh):
                if not isinstance(old, torch.Tensor):
                    continue
                if tuple(old.shape) != tuple(new.shape):  # cannot happen on a GPU: the graph's shapes are fixed
                    raise CaptureError(f"{func} changed shape on replay: {list(old.shape)} -> {list(new.shape)}")
                if not _same_memory(old, new):  # a view or an in-place op already wrote the recorded memory
                    old.copy_(new)
        self.replays += 1


def emulated_capture(body: Callable[[], Any], device: torch.device) -> tuple[EmulatedGraph, Any]:
    """``graphs.capture`` on the CPU: a warm-up run, then the recorded run, whose outputs the replays overwrite."""
    body()
    recorder = _Recorder()
    with recorder:
        out = body()
    return EmulatedGraph(recorder.ops), out
