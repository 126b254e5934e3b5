"""GGUF Q4_1 weights for the C forward's linear layers, and Q8_0 for its logits projection: read from the GGUF as
it stores them, or made from float weights by llama.cpp's rules where a model came as plain weights (or its file
holds another type).

A Q4_1 block holds 32 weights ``w_j = d q_j + m`` (``q_j`` in 0..15, ``d`` and ``m`` fp16) in 20 bytes: ``d``,
``m``, then 16 bytes whose low nibbles are ``q_0..q_15`` and high nibbles ``q_16..q_31``. A weight ``[out, in]`` is
held as uint8 ``[out, in / 32 * 20]``, its rows' blocks one after another, as the file stores it. A Q8_0 block
holds 32 weights ``w_j = d q_j`` (``q_j`` int8, ``d`` fp16) in 34 bytes, ``[out, in / 32 * 34]``. The C kernels
read either repacked by groups of 8 rows (:func:`pack`: the same bytes, another order; see lean_cpu.c).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader  # the GGUF reader transformers' own GGUF loading uses

from medusa_runtime.kernels import hugepages

BLOCK = 32  # weights per block
BLOCK_BYTES = 20  # d (fp16), m (fp16), 16 bytes of nibbles
GGUF_Q4_1, GGUF_Q8_0 = 3, 8  # GGMLQuantizationType
Q8_0_BYTES = 34  # d (fp16), 32 int8


class QuantError(ValueError):
    """A weight that cannot be held (or read) as Q4_1."""


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """A float weight ``[out, in]`` (``in`` a multiple of 32) -> its Q4_1 blocks ``[out, in / 32 * 20]`` uint8, by
    llama.cpp's reference rule: per block ``d = (max - min) / 15``, ``m = min``, ``q = min(15, trunc((w - m) / d
    + 0.5))`` (``1 / d`` taken first, 0 where ``d`` is 0)."""
    out, width = _shape(weight)
    w = weight.detach().to(torch.float32).cpu().reshape(out, width // BLOCK, BLOCK)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((w - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    scales = torch.cat([d, lo], dim=-1).to(torch.float16).view(torch.uint8)  # [out, nb, 4]: d, m
    return torch.cat([scales, nibbles], dim=-1).reshape(out, -1).contiguous()


def dequantize(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """Q4_1 blocks ``[out, width / 32 * 20]`` -> the float32 weight ``[out, width]`` they hold (``d q + m``)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, width // BLOCK, BLOCK_BYTES)
    scales = b[..., :4].contiguous().view(torch.float16).to(torch.float32)  # [out, nb, 2]
    nibbles = b[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.float32)
    return (scales[..., :1] * q + scales[..., 1:]).reshape(out, width)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight ``[out, in]`` -> its Q8_0 blocks ``[out, in / 32 * 34]`` uint8, by llama.cpp's reference rule:
    per block ``d = max|w| / 127``, ``q = round(w / d)`` (``1 / d`` taken first, 0 where ``d`` is 0; halves away
    from zero)."""
    out, width = _shape(weight)
    w = weight.detach().to(torch.float32).cpu().reshape(out, width // BLOCK, BLOCK)
    d = w.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = w * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8).view(torch.uint8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q], dim=-1).reshape(out, -1).contiguous()


def dequantize_q8_0(blocks: torch.Tensor, width: int) -> torch.Tensor:
    """Q8_0 blocks ``[out, width / 32 * 34]`` -> the float32 weight they hold (``d q``)."""
    b = blocks.reshape(blocks.shape[0], width // BLOCK, Q8_0_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).to(torch.float32)
    return (d * b[..., 2:].contiguous().view(torch.int8).to(torch.float32)).reshape(blocks.shape[0], width)


def read_gguf_output(path: str | Path) -> torch.Tensor | None:
    """The logits projection's Q8_0 blocks from a GGUF (``output.weight``, else the tied ``token_embd.weight``), or
    None where the file stores it in another type."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None or int(t.tensor_type) != GGUF_Q8_0:
        return None
    return torch.from_numpy(np.array(t.data))  # a copy: the reader maps the file read-only


def _shape(weight: torch.Tensor) -> tuple[int, int]:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise QuantError(f"a Q4_1 weight needs [out, in] with in a multiple of {BLOCK}, got {list(weight.shape)}")
    return int(weight.shape[0]), int(weight.shape[1])


def _unpermute_rows(blocks: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two RoPE halves of q and k rows; transformers' GGUF loader
    (``reverse_permute_weights``) undoes it. The same row order here: head h's row 2i + s comes from row
    h * D + s * D / 2 + i."""
    rows = blocks.shape[0]
    half = rows // heads // 2
    order = np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
    return blocks[order]


def read_gguf_layers(path: str | Path, config) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, (qkv, o, gate_up, down) as Q4_1 blocks read from a GGUF of a Llama-family model: q, k, v stacked
    (rows in transformers' order), gate and up stacked, as the lean engine fuses them. A linear layer the file
    stores in any other type is refused."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def blocks(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise QuantError(f"{Path(path).name} has no tensor {name}")
        if int(t.tensor_type) != GGUF_Q4_1:
            raise QuantError(f"{Path(path).name} stores {name} as {t.tensor_type.name}, not Q4_1")
        return np.asarray(t.data)

    layers = []
    for i in range(config.num_hidden_layers):
        q = _unpermute_rows(blocks(f"blk.{i}.attn_q.weight"), heads)
        k = _unpermute_rows(blocks(f"blk.{i}.attn_k.weight"), kv_heads)
        parts = ([q, k, blocks(f"blk.{i}.attn_v.weight")], [blocks(f"blk.{i}.attn_output.weight")],
                 [blocks(f"blk.{i}.ffn_gate.weight"), blocks(f"blk.{i}.ffn_up.weight")],
                 [blocks(f"blk.{i}.ffn_down.weight")])
        layers.append(tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(p))) for p in parts))
    return layers


def layer_blocks(gguf: str | Path | None, layer_weights, config) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's fused (qkv, o, gate_up, down) as Q4_1 blocks: the GGUF's own where the model came from one
    and the weight is still what they hold (in its dtype, exactly), else the weight quantised by llama.cpp's
    rule: a base with a Medusa-2 adapter merged into its last layers, or trained in place, keeps the file's
    blocks for every other layer."""
    from_file = read_gguf_layers(gguf, config) if gguf is not None else [None] * len(layer_weights)
    return [tuple(_kept(b, w, dequantize, quantize) for b, w in zip(blocks or (None,) * 4, ws))
            for blocks, ws in zip(from_file, layer_weights)]


def output_blocks(gguf: str | Path | None, lm_head: torch.Tensor) -> torch.Tensor:
    """The logits projection as Q8_0: the GGUF's own blocks where there is one that stores them so and
    ``lm_head`` is still what they hold, else ``lm_head`` quantised."""
    blocks = read_gguf_output(gguf) if gguf is not None else None
    return _kept(blocks, lm_head, dequantize_q8_0, quantize_q8_0)


def _kept(blocks: torch.Tensor | None, weight: torch.Tensor, back, make) -> torch.Tensor:
    """``blocks`` where they hold ``weight`` (dequantised, then cast to its dtype), else ``make(weight)``."""
    if blocks is not None and blocks.shape[0] == weight.shape[0] and torch.equal(
            back(blocks, weight.shape[1]).to(weight.dtype), weight.detach().cpu()):
        return blocks
    return make(weight)


def nbytes(layers) -> int:
    """Bytes a step streams from these blocks (every layer's four weights)."""
    return sum(t.numel() for ws in layers for t in ws)


def pack(lib, blocks: torch.Tensor, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF blocks [rows, width / 32 * bytes] (Q4_1 or Q8_0, told by their bytes a row) -> the C kernels' layout,
    groups of 8 rows (zero padded), as uint8 [packed_bytes], into ``out`` when given."""
    rows, q4, size = _packing(lib, blocks, width)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    if out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous():
        raise QuantError(f"packed blocks need {size} contiguous bytes, got {out.dtype} {list(out.shape)}")
    blocks = blocks.contiguous()
    (lib.lean_pack_q4_1 if q4 else lib.lean_pack_q8_0)(blocks.data_ptr(), rows, width, out.data_ptr())
    return out


def pack_layers(lib, layers: list[tuple[torch.Tensor, ...]], widths: list[tuple[int, ...]]
                ) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's blocks packed (:func:`pack`), side by side in one buffer the system may back with 2 MiB pages
    (a step streams them all)."""
    flat = [(b, w) for bs, ws in zip(layers, widths) for b, w in zip(bs, ws)]
    sizes = [_packing(lib, b, w)[2] for b, w in flat]
    outs = hugepages.carve(hugepages.huge_buffer(hugepages.carved_bytes(sizes, torch.uint8)), sizes, torch.uint8)
    packed = [pack(lib, b, w, o) for (b, w), o in zip(flat, outs)]
    counts = [len(bs) for bs in layers]
    return [tuple(packed[sum(counts[:i]):sum(counts[:i + 1])]) for i in range(len(layers))]


def _packing(lib, blocks: torch.Tensor, width: int) -> tuple[int, bool, int]:
    """(rows, whether Q4_1, the packed bytes) of GGUF blocks of a weight ``width`` wide."""
    if width % BLOCK or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise QuantError(f"expected uint8 blocks [rows, bytes] of a width that is a multiple of {BLOCK}")
    rows, row_bytes = blocks.shape
    if row_bytes not in (width // BLOCK * BLOCK_BYTES, width // BLOCK * Q8_0_BYTES):
        raise QuantError(f"{row_bytes} bytes a row are neither Q4_1 nor Q8_0 blocks of {width} weights")
    q4 = row_bytes == width // BLOCK * BLOCK_BYTES
    return rows, q4, (lib.lean_q4_1_packed_bytes if q4 else lib.lean_q8_0_packed_bytes)(rows, width)
