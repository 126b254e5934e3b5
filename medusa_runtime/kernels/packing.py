"""Weights repacked into the layouts the C forward streams: AVX-512 blocks of 4 output rows, or AMX tiles,
optionally side by side in one buffer the system may back with 2 MiB pages."""

from __future__ import annotations

import torch

from medusa_runtime.kernels import hugepages


class PackError(ValueError):
    """An output buffer that cannot hold a packed weight."""


def packed_size(lib, shape, amx: bool) -> int:
    """bf16 elements of a weight of ``shape`` [out, in] packed for the C library's path (see :func:`pack_for`)."""
    return (lib.lean_amx_packed_size if amx else lib.lean_rows4_packed_size)(*shape)


def pack_amx(lib, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 weight [out, in] repacked into the tile layout of the C library's AMX path (zero padded), into
    ``out`` (bf16, :func:`packed_size` elements) when given."""
    weight = weight.detach().contiguous()
    packed = _packed_out(out, lib.lean_amx_packed_size(*weight.shape))
    lib.lean_pack_amx(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def pack_rows4(lib, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A bf16 weight [out, in] repacked into the C library's AVX-512 layout: blocks of 4 output rows, their
    values per 32 inputs side by side (zero padded), so that a block streams as one contiguous run; into ``out``
    when given, as :func:`pack_amx`."""
    weight = weight.detach().contiguous()
    packed = _packed_out(out, lib.lean_rows4_packed_size(*weight.shape))
    lib.lean_pack_rows4(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def _packed_out(out: torch.Tensor | None, size: int) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=torch.bfloat16)
    if out.dtype != torch.bfloat16 or out.dim() != 1 or out.numel() != size or not out.is_contiguous():
        raise PackError(f"a packed weight needs {size} contiguous bf16 elements, got {out.dtype} {list(out.shape)}")
    return out


def pack_for(lib, weight: torch.Tensor, amx: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight in the layout of the C library's path that runs it (AMX tiles or AVX-512 blocks)."""
    return pack_amx(lib, weight, out) if amx else pack_rows4(lib, weight, out)


def pack_all(lib, weights: list[torch.Tensor], amx: bool) -> list[torch.Tensor]:
    """The weights packed as :func:`pack_for`, side by side in one buffer the system may back with 2 MiB pages
    (kernels.hugepages: a step streams them all, so TLB misses and prefetch stops at 4 KiB page boundaries
    would cost every step)."""
    sizes = [packed_size(lib, w.shape, amx) for w in weights]
    outs = hugepages.carve(hugepages.huge_buffer(hugepages.carved_bytes(sizes, torch.bfloat16)), sizes, torch.bfloat16)
    return [pack_for(lib, w, amx, out) for w, out in zip(weights, outs)]
