"""Q4_1 weights (medusa_runtime/kernels/q4_1.py, the Q4_1 and Q8_0 products of lean_cpu.c): the blocks against
gguf-py's own quantiser and dequantiser, the GGUF's blocks against transformers' dequantised checkpoint, the C
products against integer-exact references and bit for bit across row counts, and greedy Medusa on Q4_1 against
plain greedy on Q4_1."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from medusa_runtime import kernels
from medusa_runtime.decoding.batch import generate_batched
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.engines import make_engine
from medusa_runtime.engines.base import EngineError
from medusa_runtime.engines.lean import LeanEngine, c_forward_status
from medusa_runtime.heads.adapter import apply_heads_adapter
from medusa_runtime.heads.medusa import heads_folder, resolve_heads
from medusa_runtime.kernels import q4_1
from medusa_runtime.model import SMOLLM2_135M, ModelError, load_model, locate_gguf
from medusa_runtime.tree.lookup import LookupConfig

LIB = kernels.load()
needs_c = pytest.mark.skipif(LIB is None, reason=f"the C forward is unavailable: {kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def default_q4() -> object:
    return load_model("default", "auto", "cpu", log=lambda m: None, weights="q4_1")


def _weights(seed: int, out: int = 40, width: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, width, generator=g) * 0.05
    w[3, :32] = 0.25  # a constant block: d = 0
    w[5] += 1.0  # an offset row: m far from 0
    return w


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_are_gguf_pys_own(seed):
    """quantize / quantize_q8_0 give gguf-py's blocks byte for byte (its reference rules), and dequantize gives
    gguf-py's weights exactly."""
    w = _weights(seed)
    for ours, qtype, back in ((q4_1.quantize, GGMLQuantizationType.Q4_1, q4_1.dequantize),
                              (q4_1.quantize_q8_0, GGMLQuantizationType.Q8_0, q4_1.dequantize_q8_0)):
        ref = quants.quantize(w.numpy(), qtype)
        got = ours(w)
        assert np.array_equal(got.numpy(), ref), qtype
        assert np.array_equal(back(got, w.shape[1]).numpy(), quants.dequantize(ref, qtype)), qtype


def test_gguf_layers_hold_the_weights_transformers_dequantises():
    """The packaged GGUF's Q4_1 blocks, read as the file stores them (q and k rows back in transformers' order),
    dequantise to exactly the float32 checkpoint transformers made from the same file; and its Q8_0 logits
    projection to the tied embedding."""
    loaded = load_model("default", "float32", "cpu", log=lambda m: None)
    gguf = locate_gguf(SMOLLM2_135M, log=lambda m: None)
    layers = q4_1.read_gguf_layers(gguf, loaded.model.config)
    assert len(layers) == loaded.model.config.num_hidden_layers
    for i in (0, len(layers) - 1):
        a, m = loaded.model.model.layers[i].self_attn, loaded.model.model.layers[i].mlp
        ref = (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
               torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight)
        for blocks, w in zip(layers[i], ref):
            assert torch.equal(q4_1.dequantize(blocks, w.shape[1]), w)
    out = q4_1.read_gguf_output(gguf)
    lm = loaded.model.get_output_embeddings().weight
    assert torch.equal(q4_1.dequantize_q8_0(out, lm.shape[1]), lm)
    linear = sum(p.numel() for name, p in loaded.model.model.layers.named_parameters() if name.endswith("proj.weight"))
    assert q4_1.nbytes(layers) * 32 == linear * 20  # 0.625 bytes a weight, against bf16's 2


def _q8_rows(x: torch.Tensor):
    """The activation blocks as lean_cpu.c makes them: per 32, dx = max|x| / 127, qx = round-half-even(x 127 / max)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # a tensor division, as the C divides (PyTorch takes ``127.0 / t`` as ``127 * (1 / t)``, another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xb * inv), amax / 127.0


def _exact_q4_1(blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_b dw dx sum_j q qx + m sx, in float64 from the integer sums (the C sums them in float32)."""
    out, width = blocks.shape[0], x.shape[1]
    b = blocks.reshape(out, width // 32, 20)
    dm = b[..., :4].contiguous().view(torch.float16).double()  # [out, nb, 2]
    q = torch.cat([b[..., 4:] & 0x0F, b[..., 4:] >> 4], -1).double()  # [out, nb, 32]
    qx, dx = _q8_rows(x)
    qx, dx = qx.double(), dx.double()
    isum = torch.einsum("onj,rnj->ron", q, qx)  # exact integers
    sx = dx[..., 0] * qx.sum(-1)  # [r, nb]
    return (isum * dm[None, :, :, 0] * dx[:, None, :, 0]).sum(-1) + (dm[None, :, :, 1] * sx[:, None, :]).sum(-1)


def _exact_q8_0(blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out, width = blocks.shape[0], x.shape[1]
    b = blocks.reshape(out, width // 32, 34)
    d = b[..., :2].contiguous().view(torch.float16).double()[..., 0]
    q = b[..., 2:].contiguous().view(torch.int8).double()
    qx, dx = _q8_rows(x)
    return (torch.einsum("onj,rnj->ron", q, qx.double()) * d[None] * dx.double()[:, None, :, 0]).sum(-1)


def _run(kind: str, blocks: torch.Tensor, x: torch.Tensor, threads: int = 2, lib=None) -> torch.Tensor:
    lib = lib or LIB
    n, width, out = x.shape[0], x.shape[1], blocks.shape[0]
    y = torch.empty(n, out, dtype=torch.float32)
    q8 = torch.empty(lib.lean_q8_scratch_bytes(n, width), dtype=torch.uint8)
    packed = q4_1.pack(lib, blocks, width)  # the kernels' layout: groups of 8 rows
    if kind == "q4_1":
        lib.lean_linear_q4_1(packed.data_ptr(), x.data_ptr(), n, out, width, y.data_ptr(), None, kernels.OUT_F32,
                             q8.data_ptr(), threads)
    else:
        lib.lean_linear_q8_0(packed.data_ptr(), x.data_ptr(), n, out, width, y.data_ptr(), q8.data_ptr(), threads)
    return y


@needs_c
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_c_products_match_integer_exact_sums_and_each_row_alone_bit_for_bit(kind):
    """The C products against the same blocks summed in float64 from exact integer block sums (float32 order
    apart: 1e-5 of the largest output); every row of a call of 1..9 rows (on 1 or 2 threads) equals that row
    alone, bit for bit."""
    w = _weights(2, out=37, width=160)
    blocks = q4_1.quantize(w) if kind == "q4_1" else q4_1.quantize_q8_0(w)
    exact = _exact_q4_1 if kind == "q4_1" else _exact_q8_0
    x = (torch.randn(9, 160, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    x[2, 32:64] = 0  # a zero block: dx = 0
    full = _run(kind, blocks, x)
    ref = exact(blocks, x)
    assert (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for n in range(1, 10):
        for threads in (1, 2):
            part = _run(kind, blocks, x[:n].contiguous(), threads)
            assert torch.equal(part, full[:n]), (n, threads)


@needs_c
def test_int8_products_are_the_same_bits_on_every_instruction_set(tmp_path):
    """The block products by AVX512-VNNI (vpdpbusd), by AVX2 (maddubs and madd) and by the portable loop: builds
    without the newer extensions made here; every output of 1..9 rows equals the native build's bit for bit (the
    integer block sums are exact on every path, and the float32 chain is the same)."""
    builds = {"no-vnni": ("-mno-avx512vnni",), "portable": ("-mno-avx2",)}
    libs = {}
    for name, flags in builds.items():
        target = tmp_path / f"lean_cpu_{name}.so"
        kernels._build(kernels._compiler(), target, extra_flags=flags)
        libs[name] = kernels._declare(ctypes.CDLL(str(target)))
    avx2 = "avx2" in (kernels.cpuinfo_line("flags") or "")
    assert (libs["no-vnni"].lean_int8_dot_path(), libs["portable"].lean_int8_dot_path()) == (int(avx2), 0)
    w = _weights(6, out=45, width=192)
    x = (torch.randn(9, 192, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)
    x[1, :32] = 0
    x[4, 40] = 300.0  # an outlier: its block quantises to +-127 around it
    for kind, blocks in (("q4_1", q4_1.quantize(w)), ("q8_0", q4_1.quantize_q8_0(w))):
        if kind == "q8_0":
            blocks.view(45, 6, 34)[7, 2, 2:] = 0x80  # int8 -128 weights: |q| = 128 as an unsigned byte
        native = _run(kind, blocks, x)
        for name, lib in libs.items():
            for n in (1, 4, 9):
                assert torch.equal(_run(kind, blocks, x[:n].contiguous(), lib=lib), native[:n]), (kind, name, n)


def test_weights_q4_1_refuses_what_it_cannot_run():
    with pytest.raises(ModelError, match="bfloat16 activations"):
        load_model("default", "float32", "cpu", log=lambda m: None, weights="q4_1")
    with pytest.raises(ModelError, match="unknown weights"):
        load_model("default", "auto", "cpu", log=lambda m: None, weights="q3")


@needs_c
def test_q4_1_engine_reads_the_gguf_and_runs_every_forward_on_its_blocks(default_q4):
    """The engine's layers are the GGUF's blocks (no bf16 layer weights in its table), the lm_head the file's
    Q8_0; the prompt's last logits from the chunked prefill equal those of a one-row step at that position."""
    engine = LeanEngine(default_q4, max_nodes=4)
    assert engine.q4_1 and engine.uses_kernels and not engine.amx and engine.logit_screen is None
    assert c_forward_status(default_q4).startswith("yes (Q4_1 layers")  # on any CPU the library builds for
    flags = kernels.cpuinfo_line("flags") or ""
    assert c_forward_status(default_q4).endswith(
        "by AVX512-VNNI (vpdpbusd))" if "avx512_vnni" in flags else "by AVX2 (maddubs))" if "avx2" in flags else "loop)")
    row = engine._layer_table[0]
    assert row.qkv is None and row.down is None and row.qkv_q4 and row.down_q4
    prompt = torch.tensor(encode_prompt(default_q4, "Name three colours. " * 12, chat=True))
    assert len(prompt) > 64  # two prefill chunks
    with torch.inference_mode():
        cache = engine.new_cache(len(prompt) + 4)
        logits, _ = engine.forward(prompt, 0, cache, last_only=True)
        again = engine.new_cache(len(prompt) + 4)
        engine.forward(prompt[:-1], 0, again)
        step = engine.decode_step(prompt[-1:], len(prompt) - 1, again)
    assert torch.equal(logits[-1], step.logits[0])
    with pytest.raises(EngineError, match="C forward only"):
        LeanEngine(default_q4, use_kernels=False)
    for name in ("hf", "lean-torch"):
        with pytest.raises(EngineError, match="C forward only"):
            make_engine(default_q4, name)


@needs_c
@pytest.mark.parametrize("tree,lookup", [("chain:3", 0), ("mc_sim_7b_63", 4)])
def test_q4_1_medusa_equals_q4_1_plain_decoding(default_q4, mt_bench_first_turns, tree, lookup):
    """Greedy Medusa on Q4_1 (shipped heads) is token-exact against plain greedy on Q4_1, alone and in batches."""
    heads = resolve_heads("default", default_q4.hidden_size, default_q4.vocab_size)
    medusa = MedusaDecoder(default_q4, heads, tree, config=DecodeConfig(max_new_tokens=32, lookup=LookupConfig(lookup)))
    plain = MedusaDecoder(default_q4, None, None, config=DecodeConfig(max_new_tokens=32))
    assert medusa.engine.q4_1 and plain.engine.q4_1
    prompts = [encode_prompt(default_q4, q["turns"][0], chat=True) for q in mt_bench_first_turns[::20][:4]]
    alone = [plain.generate(p).token_ids for p in prompts]
    results = [medusa.generate(p) for p in prompts]
    assert [r.token_ids for r in results] == alone
    assert sum(r.stats.steps for r in results) < sum(len(a) for a in alone)  # drafts were accepted
    assert generate_batched(medusa, prompts, 32, 4) == alone


@needs_c
def test_a_q4_1_steps_floor_counts_the_blocks_it_streams(default_q4):
    """The bandwidth floor's bytes for a Q4_1 step: 20 bytes per 32 linear weights, 34 per 32 of the logits
    projection (Q8_0), the norms in bf16; not the dense weights."""
    from medusa_runtime.measure.bandwidth import step_weight_bytes

    engine = LeanEngine(default_q4)
    model = default_q4.model
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if n.endswith("proj.weight"))
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    vocab, width = model.get_output_embeddings().weight.shape
    assert step_weight_bytes(default_q4, engine) == linear * 20 // 32 + vocab * width * 34 // 32 + 2 * norms


@needs_c
def test_a_merged_adapter_keeps_the_files_blocks_for_the_layers_it_leaves(default_q4):
    """The shipped Medusa-2 heads' adapter merged into the base's last layers: those layers' weights are quantised
    (llama.cpp's rule), every other layer keeps the GGUF's own blocks; on the plain base every layer and the
    logits projection are the file's."""
    gguf = locate_gguf(SMOLLM2_135M, log=lambda m: None)
    file_layers = q4_1.read_gguf_layers(gguf, default_q4.model.config)
    def dense(layer):
        return layer.qkv.weight, layer.o.weight, layer.gate_up.weight, layer.down.weight

    def packed(blocks, weight):  # as the engine holds them
        return q4_1.pack(LIB, blocks, weight.shape[1])

    plain = LeanEngine(default_q4)
    assert all(torch.equal(a, packed(b, w)) for ours, theirs, layer in zip(plain._packed, file_layers, plain.layers)
               for a, b, w in zip(ours, theirs, dense(layer)))
    head = default_q4.model.get_output_embeddings().weight
    assert torch.equal(plain._logits_kernel.blocks, packed(q4_1.read_gguf_output(gguf), head))
    merged = apply_heads_adapter(default_q4, heads_folder("default"), log=lambda m: None)
    assert merged.weights == "q4_1"
    engine = LeanEngine(merged)
    kept = []
    for ours, theirs, layer in zip(engine._packed, file_layers, engine.layers):
        for a, b, w in zip(ours, theirs, dense(layer)):
            kept.append(torch.equal(a, packed(b, w)))
            assert kept[-1] or torch.equal(a, packed(q4_1.quantize(w), w))
    assert 0 < sum(not k for k in kept) <= 4 * 8 and sum(kept) >= 4 * 20  # the adapter's few layers only
