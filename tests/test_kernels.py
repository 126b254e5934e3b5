"""The lean engine's C forward (medusa_runtime/kernels/lean_cpu.c) against independent references:
float32 matrix products, the float32 model, one-row steps (bit for bit) and plain decoding."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_runtime import kernels
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.engines import lean, make_engine
from medusa_runtime.engines.base import EngineError
from medusa_runtime.engines.lean import LeanEngine, c_forward_status
from medusa_runtime.heads.medusa import Int8Projection, resolve_heads
from medusa_runtime.kernels.packing import pack_amx, pack_rows4
from medusa_runtime.model import LoadedModel
from medusa_runtime.tree.buffers import build_tree_buffers
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.tree import load_tree, make_tree

from .conftest import hf_greedy


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = kernels.load()
    assert lib is not None, kernels.unavailable_reason()
    return lib


PATHS = ["avx512", "amx"]  # the C library's two ways to run a linear layer


def _need(path: str) -> None:
    if path == "amx" and not kernels.amx_path():
        pytest.skip("this CPU (or its kernel) offers no AMX-BF16 tile unit")  # the AVX-512 path is tested alike


def _linear(lib, w, x, kind, residual=None, path="avx512"):
    n, out = x.shape[0], w.shape[0]
    y = torch.empty(n, out, dtype=torch.float32 if kind == kernels.OUT_F32 else torch.bfloat16)
    r = None if residual is None else residual.data_ptr()
    if path == "amx":
        packed = pack_amx(lib, w)
        xa = torch.empty(lib.lean_amx_scratch_size(n, w.shape[1]), dtype=torch.bfloat16)
        assert lib.lean_linear_amx(packed.data_ptr(), x.data_ptr(), n, out, w.shape[1], y.data_ptr(), r, kind,
                                   xa.data_ptr(), torch.get_num_threads()) == 0
        return y
    packed = pack_rows4(lib, w)
    lib.lean_linear(packed.data_ptr(), x.data_ptr(), n, out, w.shape[1], y.data_ptr(), r, kind, torch.get_num_threads())
    return y


@pytest.mark.parametrize("k,length", [(k, n) for k in (1, 3, 10, 64) for n in (4096, 4103, 20) if k <= n])
def test_topk_rows_against_a_stable_sort(lib, k, length):
    """The heads' top-k (the C library's, which passes over runs of 16 values none of which beats the k-th best)
    against a stable sort by (value descending, index ascending) of the same bf16 values, on rows full of ties
    (a handful of distinct values), of rising values (every run beats the k-th) and of one lone maximum; the top-1
    probability against a float64 softmax."""
    gen = torch.Generator().manual_seed(k * 10007 + length)
    rows = torch.stack([torch.randint(-4, 4, (length,), generator=gen).float() / 2,
                        torch.randn(length, generator=gen) * 3,
                        torch.arange(length).float() / length,
                        torch.where(torch.arange(length) == length - 3, 5.0, -1.0)]).to(torch.bfloat16).contiguous()
    idx = torch.empty(rows.shape[0], k, dtype=torch.int32)
    top1 = torch.empty(rows.shape[0], dtype=torch.float32)
    assert lib.lean_topk_rows(rows.data_ptr(), rows.shape[0], length, k, idx.data_ptr(), top1.data_ptr()) == 0
    for r, row in enumerate(rows.float().tolist()):
        want = sorted(range(length), key=lambda i: (-row[i], i))[:k]
        assert idx[r].tolist() == want, r
    want_top1 = torch.softmax(rows.double(), -1).amax(-1).float()
    torch.testing.assert_close(top1, want_top1, rtol=1e-5, atol=0)
    assert lib.lean_topk_rows(rows.data_ptr(), 1, length, 65, idx.data_ptr(), top1.data_ptr()) == -3
    assert lib.lean_topk_rows(rows.data_ptr(), 1, 20, 21, idx.data_ptr(), top1.data_ptr()) == -3  # k above the row


@pytest.mark.parametrize("out,width,rows", [(4096, 576, 1), (4097, 577, 5), (33, 64, 16), (16, 4, 3)])
def test_int8_projection_is_the_pytorch_emulation_bit_for_bit(lib, out, width, rows):
    """The C library's int8 projection (VNNI dot products, int32 sums, scales) against heads.Int8Projection, which
    the calibration and the PyTorch decode path score with: equal to the last bit, zero rows included; and both
    within int8 rounding of the float32 product."""
    g = torch.Generator().manual_seed(out + width + rows)
    w = (torch.randn(out, width, generator=g) * 0.05).to(torch.bfloat16)
    w[min(3, out - 1)] = 0  # a row of zeros: scale 0, logits 0
    x = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16)
    if rows > 2:
        x[1] = 0
    emulation = Int8Projection(w)
    q = emulation.q.to(torch.int8).contiguous()
    assert q.abs().max() <= 127 and torch.equal(q.float(), emulation.q)
    packed = torch.empty(lib.lean_i8_packed_size(out, width), dtype=torch.int8)
    lib.lean_pack_i8(q.data_ptr(), out, width, packed.data_ptr())
    scale, sums = emulation.scale.contiguous(), q.sum(-1, dtype=torch.int32).contiguous()
    y = torch.empty(rows, out, dtype=torch.bfloat16)
    xq = torch.empty(rows * ((width + 3) // 4 * 4), dtype=torch.uint8)
    sx = torch.empty(rows)
    lib.lean_linear_i8(packed.data_ptr(), scale.data_ptr(), sums.data_ptr(), x.data_ptr(), rows, out, width,
                       y.data_ptr(), xq.data_ptr(), sx.data_ptr(), torch.get_num_threads())
    want = emulation(x)
    assert torch.equal(y, want)
    exact = x.float() @ w.float().T
    # |error| <= (|x| sum of half-steps of w) + (|w| sum of half-steps of x), per output
    bound = 0.5 * (x.float().abs() @ (emulation.scale[:, None].expand(-1, width)).T
                   + (x.float().abs().amax(-1, keepdim=True) / 127) * w.float().abs().sum(-1)) + 0.02 * exact.abs() + 1e-3
    assert ((want.float() - exact).abs() <= bound).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out,width", [(1, 32), (7, 40), (67, 576), (960, 576), (576, 1536), (100, 100)])
def test_linear_matches_float32_products_and_rows_are_independent(lib, out, width, path):
    _need(path)
    gen = torch.Generator().manual_seed(out * 1000 + width)
    w = torch.randn(out, width, generator=gen).to(torch.bfloat16)
    x = torch.randn(19, width, generator=gen).to(torch.bfloat16)  # 19 rows: blocks of 4 (AVX-512), 16 (AMX) + rest
    got = _linear(lib, w, x, kernels.OUT_F32, path=path)
    want = x.double() @ w.double().T  # the exact products of the bf16 inputs
    scale = x.double().abs() @ w.double().abs().T  # error bound scale of a float32 sum
    assert torch.all((got.double() - want).abs() <= 1e-6 * scale + 1e-30)
    for n in (1, 2, 3, 4, 5, 16, 17):  # any row, in any batch, is the same float as alone
        assert torch.equal(_linear(lib, w, x[:n].contiguous(), kernels.OUT_F32, path=path), got[:n])
    assert torch.equal(_linear(lib, w, x[18:].contiguous(), kernels.OUT_F32, path=path), got[18:])
    # rounded once, to nearest even
    assert torch.equal(_linear(lib, w, x, kernels.OUT_BF16, path=path), got.to(torch.bfloat16))
    r = torch.randn(19, out, generator=gen).to(torch.bfloat16)
    want_r = (r.float() + got.to(torch.bfloat16).float()).to(torch.bfloat16)  # PyTorch's x + linear(h) in bf16
    assert torch.equal(_linear(lib, w, x, kernels.OUT_BF16_RESIDUAL, residual=r.clone(), path=path), want_r)


@pytest.mark.parametrize("path", PATHS)
def test_linear_rounds_nan_to_one_canonical_nan(lib, path):
    """A NaN input gives NaN sums; rounded to bf16 they are c10's canonical quiet NaN (0x7FC0, what the scalar
    rounding writes) in whole blocks of outputs and in the last partial one alike, and every other output is
    PyTorch's rounding of the float32 sum."""
    _need(path)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(7, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    x[1, 5] = float("nan")
    got = _linear(lib, w, x, kernels.OUT_BF16, path=path)
    want = _linear(lib, w, x, kernels.OUT_F32, path=path).to(torch.bfloat16)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2]]).any()
    assert got[1].view(torch.int16).tolist() == [0x7FC0] * 7  # 7 outputs: a block of 4 and a partial one
    assert torch.equal(got[[0, 2]].view(torch.int16), want[[0, 2]].view(torch.int16))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_c_forward_is_as_close_to_float32_as_the_torch_path(default_model, default_bf16):
    """A greedy decode of 12 steps on a real prompt: hidden states and logits of the C forward against the
    float32 model, beside the bf16 PyTorch path's own distance to it (the two differ only by rounding)."""
    prompt = torch.tensor(encode_prompt(default_bf16, "Explain why the sky is blue in two sentences.", chat=True))
    ref = LeanEngine(default_model)
    torch_path = LeanEngine(default_bf16, use_kernels=False)
    c_path = LeanEngine(default_bf16, use_kernels=True)
    assert c_path.uses_kernels and not torch_path.uses_kernels
    caches = [e.new_cache(len(prompt) + 16) for e in (ref, torch_path, c_path)]
    with torch.inference_mode():
        outs = [e.forward(prompt, 0, c, last_only=True) for e, c in zip((ref, torch_path, c_path), caches)]
        tok = outs[0][0][-1].argmax()
        errs_c, errs_t, far_c, same = [], [], [], 0
        for step in range(12):
            pos = len(prompt) + step
            (l32, h32), (_, ht), (lc, hc) = [e.forward(tok[None], pos, c) for e, c in
                                               zip((ref, torch_path, c_path), caches)]
            errs_t.append(_rel(ht, h32))
            errs_c.append(_rel(hc, h32))
            far_c.append(1 - float(F.cosine_similarity(lc[-1], l32[-1], dim=0)))
            same += int(lc[-1].argmax() == l32[-1].argmax())
            tok = l32[-1].argmax()  # all three follow the float32 model's tokens
    # measured: relative hidden error 0.021 (C) vs 0.020 (PyTorch) on average; 1 - cosine of the logits
    # at most 0.0016 (C) vs 0.0004 (PyTorch): small, and quadratic in the error, so only bounded here
    assert max(errs_c) < 0.05 and max(far_c) < 0.005, (errs_c, far_c)
    assert sum(errs_c) <= 1.25 * sum(errs_t) + 1e-3, (errs_c, errs_t)
    assert same >= 10  # greedy choices agree with float32's (bf16 may flip a near-tie)


def test_the_prompt_runs_on_the_c_forward_in_chunks_each_row_its_one_row_step(default_bf16):
    """The prompt's forward (bf16, C forward, not the tile path) runs in chunks of PREFILL_CHUNK causal rows: every
    row's hidden state and cache entries are bit for bit what one-row steps fed the same tokens in turn give, across
    the chunks' seams; and the result stays within rounding of PyTorch's prompt forward (oneDNN)."""
    engine = LeanEngine(default_bf16, use_kernels=True)
    if engine.amx:
        pytest.skip("on the AMX tile path the prompt stays on PyTorch")
    torch_path = LeanEngine(default_bf16, use_kernels=False)
    n = 2 * lean.PREFILL_CHUNK + 9  # three chunks
    prompt = torch.randint(0, default_bf16.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        cache, steps, ref = engine.new_cache(n), engine.new_cache(n), torch_path.new_cache(n)
        logits, hidden = engine.forward(prompt, 0, cache)
        rows = [engine.forward(prompt[i:i + 1], i, steps) for i in range(n)]
        ref_logits, ref_hidden = torch_path.forward(prompt, 0, ref)
    assert hidden.shape == (n, default_bf16.hidden_size) and logits.shape == (n, default_bf16.vocab_size)
    assert torch.equal(hidden, torch.cat([h for _, h in rows]))
    assert torch.equal(logits, torch.cat([lg for lg, _ in rows]))
    assert torch.equal(cache.keys, steps.keys) and torch.equal(cache.values, steps.values)
    assert _rel(hidden, ref_hidden) < 0.05
    assert float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()) >= 0.9


def _path_steps(engine: LeanEngine, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, node: int):
    """(logits, hidden) of the last of the one-row steps along ``node``'s path (its ancestors and itself, in
    order, as the tree ``mask`` has them) after ``prompt``, on a cache of its own."""
    seq = engine.new_cache(len(prompt) + len(tokens))
    engine.forward(prompt, 0, seq, last_only=True)
    for i, a in enumerate(a for a in range(len(tokens)) if mask[node, a]):
        step = engine.forward(tokens[a: a + 1], len(prompt) + i, seq)
    return step


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("nodes", [16, 40])
def test_tree_rows_equal_one_row_steps_bit_for_bit(default_bf16, path, nodes, monkeypatch):
    """Every node of a tree, verified in one pass, gets exactly the logits and hidden state its token gets
    in one-row steps along its path (after the same prompt): the property that makes bf16 Medusa decoding
    equal to bf16 plain decoding. On both paths; 40 nodes take the tile path three blocks of rows."""
    _need(path)
    monkeypatch.setenv(kernels.AMX_SWITCH, "1" if path == "amx" else "0")
    tree = make_tree(load_tree("mc_sim_7b_63").paths[: nodes - 1])
    buffers = build_tree_buffers(tree, 4, 10)
    engine = LeanEngine(default_bf16, max_nodes=buffers.num_nodes, use_kernels=True)
    assert engine.amx == (path == "amx")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, default_bf16.vocab_size, (40,), generator=gen)
    tokens = torch.randint(0, default_bf16.vocab_size, (buffers.num_nodes,), generator=gen)
    with torch.inference_mode():
        cache = engine.new_cache(40 + buffers.num_nodes)
        engine.forward(prompt, 0, cache, last_only=True)
        logits, hidden = engine.forward(tokens, 40, cache, tree=buffers.attn_mask,
                                        positions=40 + buffers.position_offsets)
        for node in range(buffers.num_nodes):
            step_logits, step_hidden = _path_steps(engine, prompt, tokens, buffers.attn_mask, node)
            assert torch.equal(step_hidden[0], hidden[node]) and torch.equal(step_logits[0], logits[node]), node


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4), (6, 1), (5, 1), (3, 1)])
def test_head_groups_tree_rows_equal_one_row_steps_and_stay_close(heads, kv_heads, monkeypatch):
    """Random head_dim-64 Llamas with 2, 1, 6, 5 and 3 query heads per kv head: the attention gives a task up to 3
    heads of one kv head (3, 2 or 1 by the group's size) when a call has a task per thread that way, one head
    otherwise (3 heads over 1 kv head: a one-row step takes one head a task on 2 threads, the 12-node tree 3).
    Each tree row equals its one-row steps bit for bit, and the tree's hidden states are as close to the float32
    model's as the bf16 PyTorch path's are."""
    monkeypatch.setenv(kernels.AMX_SWITCH, "0")  # the tile path takes q . k from the tile unit, not these tasks
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64 * heads, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                      max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    ref = LeanEngine(LoadedModel(model, None, "llama-d64", torch.float32, torch.device("cpu")))
    bf16 = LoadedModel(copy.deepcopy(model).to(torch.bfloat16), None, "llama-d64", torch.bfloat16, torch.device("cpu"))
    tree = make_tree(load_tree("mc_sim_7b_63").paths[:11])
    buffers = build_tree_buffers(tree, 4, 10)
    engines = [LeanEngine(bf16, max_nodes=buffers.num_nodes, use_kernels=k) for k in (True, False)]
    assert engines[0].uses_kernels and not engines[0].amx
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (37,), generator=gen)  # an odd prefix: a pair straddles it and the tree
    tokens = torch.randint(0, 512, (buffers.num_nodes,), generator=gen)
    positions, mask = 37 + buffers.position_offsets, buffers.attn_mask
    hidden = []
    with torch.inference_mode():
        for engine in (engines[0], engines[1], ref):
            cache = engine.new_cache(37 + buffers.num_nodes)
            engine.forward(prompt, 0, cache, last_only=True)
            hidden.append(engine.forward(tokens, 37, cache, tree=mask, positions=positions)[1].float())
        for node in range(buffers.num_nodes):
            step_hidden = _path_steps(engines[0], prompt, tokens, mask, node)[1]
            assert torch.equal(step_hidden[0].float(), hidden[0][node]), node
    err_c, err_t = _rel(hidden[0], hidden[2]), _rel(hidden[1], hidden[2])
    assert err_c <= 1.25 * err_t + 1e-3, (err_c, err_t)


@pytest.mark.parametrize("path", PATHS)
def test_decode_step_is_the_forward_its_logits_and_their_argmax(default_bf16, path, monkeypatch):
    """The one-call decode step (embedding, forward, logits, argmax in the C library) against the engine's own
    forward, the logits projection and argmax_rows, bit for bit: a tree of 40 nodes (three tile blocks on the AMX
    path) and then one row, each into its own cache; the caches' keys and values end up equal too. Two caches
    keep their own outputs (a step of one does not overwrite what the other returned)."""
    from medusa_runtime.decoding.acceptance import argmax_rows

    _need(path)
    monkeypatch.setenv(kernels.AMX_SWITCH, "1" if path == "amx" else "0")
    buffers = build_tree_buffers(make_tree(load_tree("mc_sim_7b_63").paths[:39]), 4, 10)
    engine = LeanEngine(default_bf16, max_nodes=buffers.num_nodes, use_kernels=True)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, default_bf16.vocab_size, (37,), generator=gen)
    tokens = torch.randint(0, default_bf16.vocab_size, (buffers.num_nodes,), generator=gen)
    with torch.inference_mode():
        ref, fused = engine.new_cache(80), engine.new_cache(80)
        for cache in (ref, fused):
            engine.forward(prompt, 0, cache, last_only=True)
        logits, hidden = engine.forward(tokens, 37, ref, tree=buffers.attn_mask, positions=37 + buffers.position_offsets)
        step = engine.decode_step(tokens, 37, fused, buffers.attn_mask, buffers.position_offsets)
        assert torch.equal(step.logits, logits) and torch.equal(step.hidden, hidden)
        assert step.pred == argmax_rows(logits) and all(torch.equal(r, h) for r, h in zip(step.rows, hidden))
        assert torch.equal(ref.keys[:, :, :77], fused.keys[:, :, :77])
        assert torch.equal(ref.values[:, :, :77], fused.values[:, :, :77])
        kept = step.logits.clone()
        one = engine.decode_step(tokens[3:4], 37, ref)  # the other cache's step
        assert torch.equal(step.logits, kept)
        logits, hidden = engine.forward(tokens[3:4], 37, fused)
        assert torch.equal(one.logits, logits) and torch.equal(one.hidden, hidden)
        assert one.pred == argmax_rows(logits) and len(one.rows) == 1


def test_decode_step_refuses_what_it_would_index_out_of_bounds(default_bf16):
    engine = LeanEngine(default_bf16, max_nodes=4, use_kernels=True)
    cache = engine.new_cache(16)
    with torch.inference_mode():
        engine.forward(torch.tensor([1, 2, 3]), 0, cache)
        with pytest.raises(EngineError, match="outside the vocabulary"):
            engine.decode_step(torch.tensor([default_bf16.vocab_size]), 3, cache)
        with pytest.raises(EngineError, match="outside the RoPE table or the cache"):
            engine.decode_step(torch.tensor([5, 6]), 15, cache)
        with pytest.raises(EngineError, match="outside the RoPE table or the cache"):
            engine.decode_step(torch.tensor([5, 6]), 3, cache, torch.ones(2, 2, dtype=torch.bool),
                               torch.tensor([0, 10 ** 6]))
        with pytest.raises(EngineError, match="tree mask must be"):
            engine.decode_step(torch.tensor([5, 6]), 3, cache, torch.ones(3, 3, dtype=torch.bool))
        with pytest.raises(EngineError, match="int64"):
            engine.decode_step(torch.tensor([5, 6], dtype=torch.int32), 3, cache)


def test_decode_loop_with_and_without_the_fused_step_gives_the_same_tokens(default_bf16, mt_bench_first_turns,
                                                                          monkeypatch):
    """The decode loop on the one-call step and on forward + argmax (the path engines without it take): the same
    tokens, plain and with a tree."""
    monkeypatch.setattr(kernels, "fast_path", lambda: True)  # the C forward even where it does not pay (no AVX-512)
    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size)
    prompt = encode_prompt(default_bf16, mt_bench_first_turns[3]["turns"][0], chat=True)
    for h, tree in ((None, None), (heads, "mc_sim_7b_63")):
        fused = MedusaDecoder(default_bf16, h, tree, config=DecodeConfig(max_new_tokens=24))
        unfused = MedusaDecoder(default_bf16, h, tree, config=DecodeConfig(max_new_tokens=24))
        unfused._fused = False
        assert fused._fused
        assert fused.generate(prompt).token_ids == unfused.generate(prompt).token_ids


def test_engine_outlives_the_loaded_model_it_was_made_from(default_bf16):
    """make_engine(load_model(...)) keeps no other reference to the model: the engine must hold the packed
    weights its C layer table points into (it once read freed memory once the model was collected)."""
    import gc

    from medusa_runtime.model import load_model

    engine = LeanEngine(load_model("default", "bfloat16", log=lambda m: None), use_kernels=True)
    gc.collect()
    ref = LeanEngine(default_bf16, use_kernels=True)
    prompt = torch.tensor(encode_prompt(default_bf16, "Name three colours.", chat=True))
    with torch.inference_mode():
        outs = []
        for e in (engine, ref):
            cache = e.new_cache(len(prompt) + 4)
            e.forward(prompt, 0, cache, last_only=True)
            trash = [torch.full((1 << 20,), 7.0) for _ in range(64)]  # reuse whatever was freed
            outs.append(e.forward(prompt[-1:], len(prompt), cache))
            del trash
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("tree,lookup", [("chain:3", 0), ("mc_sim_7b_63", 0), ("chain:3", 4)])
def test_bf16_medusa_equals_bf16_plain_decoding(default_bf16, mt_bench_first_turns, tree, lookup, monkeypatch):
    """With the C forward, bf16 Medusa greedy decoding (shipped heads) is token-exact against the
    runtime's bf16 plain decoding, on MT-Bench first turns of three categories."""
    monkeypatch.setattr(kernels, "fast_path", lambda: True)  # the C forward even without AVX-512 BF16 (slower)
    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size)
    cfg = DecodeConfig(max_new_tokens=32, lookup=LookupConfig(lookup))
    medusa = MedusaDecoder(default_bf16, heads, tree, config=cfg)
    plain = MedusaDecoder(default_bf16, None, None, config=DecodeConfig(max_new_tokens=32))
    assert medusa.engine.uses_kernels and plain.engine.uses_kernels
    accepted = 0
    for q in (mt_bench_first_turns[0], mt_bench_first_turns[25], mt_bench_first_turns[60]):
        prompt = encode_prompt(default_bf16, q["turns"][0], chat=True)
        res = medusa.generate(prompt)
        assert res.token_ids == plain.generate(prompt).token_ids, q["question_id"]
        accepted += res.stats.steps < len(res.token_ids)
    assert accepted >= 1  # the trees did accept drafts (else the check is plain vs plain)


def test_torch_path_plain_decoding_is_what_generate_does_in_bf16(default_bf16):
    """The lean engine's PyTorch path mirrors transformers' ops one by one: bf16 plain decoding on it
    equals generate exactly (the C forward rounds its own way and is checked against float32 above)."""
    prompt = encode_prompt(default_bf16, "Name three primary colors.", chat=True)
    res = MedusaDecoder(default_bf16, None, None,
                        config=DecodeConfig(max_new_tokens=16, engine="lean-torch")).generate(prompt)
    assert res.token_ids == hf_greedy(default_bf16, prompt, 16)


def test_c_forward_refuses_what_it_would_index_out_of_bounds(default_bf16):
    engine = LeanEngine(default_bf16, max_nodes=4, use_kernels=True)
    cache = engine.new_cache(16)
    tokens = torch.tensor([5, 6])
    with torch.inference_mode():
        engine.forward(torch.tensor([1, 2, 3]), 0, cache)
        with pytest.raises(EngineError, match="positions must be 2 values in"):
            engine.forward(tokens, 3, cache, tree=torch.ones(2, 2, dtype=torch.bool), positions=torch.tensor([3, 99]))
        with pytest.raises(EngineError, match="tree mask must be"):
            engine.forward(tokens, 3, cache, tree=torch.ones(3, 3, dtype=torch.bool))
        with pytest.raises(EngineError, match="expected a CPU"):
            engine.projector(engine.lm_head)(torch.zeros(1, 7, dtype=torch.bfloat16))


def test_engine_choices_and_switch(default_model, default_bf16, monkeypatch, tmp_path):
    assert c_forward_status(default_bf16).startswith("yes" if kernels.fast_path() else "no")
    assert c_forward_status(default_model) == "no (it runs bfloat16 on the CPU only)"
    assert make_engine(default_bf16, "lean-torch").uses_kernels is False
    assert make_engine(default_bf16, "lean").uses_kernels is kernels.fast_path()
    assert make_engine(default_model, "lean").uses_kernels is False  # float32 stays on PyTorch
    with pytest.raises(EngineError, match="bfloat16 on the CPU only"):
        LeanEngine(default_model, use_kernels=True)
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert kernels.load() is None and "MEDUSA_LEAN_KERNELS=0" in kernels.unavailable_reason()
    assert make_engine(default_bf16, "lean").uses_kernels is False
    assert c_forward_status(default_bf16) == "no (disabled by MEDUSA_LEAN_KERNELS=0)"
    with pytest.raises(EngineError, match="unavailable: disabled"):
        LeanEngine(default_bf16, use_kernels=True)


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.load() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and not built[0].name.startswith(".")  # no temp left
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_state", {})
    assert kernels.load() is not None and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_library_path", lambda cc: tmp_path / "kernels" / "other.so")
    assert kernels.load() is None and "build failed" in kernels.unavailable_reason()


def test_portable_build_without_avx512_bf16(default_bf16, tmp_path, monkeypatch):
    """The scalar fallback (CPUs without AVX-512 BF16): the same results up to summation order, and
    tree rows still bit-for-bit their one-row steps."""
    target = tmp_path / "lean_cpu_portable.so"
    kernels._build(kernels._compiler(), target, extra_flags=("-mno-avx512bf16",))
    portable = kernels._declare(ctypes.CDLL(str(target)))
    assert portable.lean_has_avx512bf16() == 0
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(67, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 200, generator=gen).to(torch.bfloat16)
    got = _linear(portable, w, x, kernels.OUT_F32)
    scale = x.double().abs() @ w.double().abs().T
    assert torch.all((got.double() - x.double() @ w.double().T).abs() <= 1e-6 * scale)

    fast = LeanEngine(default_bf16, max_nodes=4, use_kernels=True)
    monkeypatch.setattr(kernels, "_state", {"lib": portable, "why": None})
    slow = LeanEngine(default_bf16, max_nodes=4, use_kernels=True)
    prompt = torch.randint(0, default_bf16.vocab_size, (24,), generator=gen)
    tokens = torch.randint(0, default_bf16.vocab_size, (3,), generator=gen)
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    with torch.inference_mode():
        outs = []
        for engine in (fast, slow):
            cache = engine.new_cache(32)
            engine.forward(prompt, 0, cache, last_only=True)
            outs.append(engine.forward(tokens, 24, cache, tree=chain, positions=torch.arange(24, 27)))
        assert _rel(outs[1][1], outs[0][1]) < 0.02  # hidden states: the two builds differ only in rounding
        seq = slow.new_cache(32)
        slow.forward(prompt, 0, seq, last_only=True)
        for i in range(3):
            _, h = slow.forward(tokens[i: i + 1], 24 + i, seq)
            assert torch.equal(h[0], outs[1][1][i])


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_both_pass_shapes_give_the_same_bits(default_bf16, tmp_path, monkeypatch, rows):
    """Up to 4 rows in one pass over each weight block (the default) or in passes of 1-2 rows (SPLIT_PASSES, Zen
    4's tuning): the build this CPU does not get is built here too, and a verify forward of 2, 3 and 4 rows
    through it returns exactly the default build's logits and hidden states (each output is summed in one
    order)."""
    split = "-DSPLIT_PASSES=1" in kernels.tuning_flags()
    target = tmp_path / "lean_cpu_other_pass.so"
    kernels._build(kernels._compiler(), target, extra_flags=(f"-DSPLIT_PASSES={0 if split else 1}",))
    other = kernels._declare(ctypes.CDLL(str(target)))
    ours = LeanEngine(default_bf16, max_nodes=rows, use_kernels=True)
    monkeypatch.setattr(kernels, "_state", {"lib": other, "why": None})
    theirs = LeanEngine(default_bf16, max_nodes=rows, use_kernels=True)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, default_bf16.vocab_size, (30,), generator=gen)
    tokens = torch.randint(0, default_bf16.vocab_size, (rows,), generator=gen)
    chain = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    outs = []
    with torch.inference_mode():
        for engine in (ours, theirs):
            cache = engine.new_cache(30 + rows)
            engine.forward(prompt, 0, cache, last_only=True)
            outs.append(engine.forward(tokens, 30, cache, tree=chain, positions=torch.arange(30, 30 + rows)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("path", PATHS)
def test_native_head_levels_match_the_pytorch_heads(default_bf16, path, monkeypatch):
    """The C library's tree level of the shipped (path-conditioned) heads against the same level through
    PyTorch's ops (conditioned_state, the projection, topk): the same candidates up to near-ties of bf16
    logits, the same top-1 probability up to rounding; and decoding with it stays plain decoding."""
    _need(path)
    monkeypatch.setenv(kernels.AMX_SWITCH, "1" if path == "amx" else "0")
    from medusa_runtime.heads.native import NativeHeadLevels

    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size).to(torch.bfloat16)
    engine = LeanEngine(default_bf16, use_kernels=True)
    weight = heads.projection(engine.lm_head_weight(), heads.num_heads)
    native = NativeHeadLevels(heads, engine, weight, heads.num_heads, 10)
    embed = default_bf16.model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(7)
    agree = total = 0
    with torch.inference_mode():
        for _ in range(6):
            prompt = torch.randint(0, default_bf16.vocab_size, (24,), generator=gen)
            cache = engine.new_cache(32)
            _, hidden = engine.forward(prompt, 0, cache, last_only=True)
            root = embed[int(torch.randint(0, default_bf16.vocab_size, (1,), generator=gen))]
            for j in range(heads.num_heads):
                parents = None if j == 0 else embed[torch.randint(0, default_bf16.vocab_size, (3,), generator=gen)]
                top, top1 = native.level(j, hidden[0], root, parents)
                states = heads.conditioned_state(j, hidden[0], root, parents).reshape(-1, heads.config.hidden_size)
                assert heads.config.projection_int8  # the shipped heads score their draft projection in int8
                logits = heads.draft_logits(states[:, None], engine.lm_head_weight())[:, 0].float()  # [rows, S]
                want = torch.topk(logits, 10, dim=-1).indices
                agree += sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top, want))
                total += want.numel()
                torch.testing.assert_close(top1, torch.softmax(logits, -1).amax(-1), rtol=0.05, atol=1e-3)
    assert agree / total >= 0.9, agree / total


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tree_spec", ["chain:4", "mc_sim_7b_63"])
def test_native_tree_is_its_levels_composed_and_stops_at_the_gate(default_bf16, path, tree_spec, monkeypatch):
    """The whole tree in one call of the C library (lean_heads_tree) against the decoder's former loop over its
    levels (one lean_heads_level call each, the parents' embeddings gathered and the candidates mapped to tokens
    and placed in PyTorch): the same tokens at every node and the same top-1 chain, bit for bit; with a gate, it
    computes the levels up to the first whose chain product fails (treesearch.replay.gated_depth's rule) and
    those levels' tokens are unchanged."""
    _need(path)
    monkeypatch.setenv(kernels.AMX_SWITCH, "1" if path == "amx" else "0")
    from medusa_runtime.decoding.decode import path_plan
    from medusa_runtime.heads.native import HeadsNativeError, NativeHeadLevels
    from treesearch.replay import gated_depth

    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size).to(torch.bfloat16)
    tree = load_tree(tree_spec)
    assert tree.depth <= heads.num_heads
    engine = LeanEngine(default_bf16, use_kernels=True)
    weight = heads.projection(engine.lm_head_weight(), tree.depth)
    plan = path_plan(tree)
    embed = default_bf16.model.get_input_embeddings().weight
    draft = heads.draft_vocab
    assert draft is not None  # the shipped heads score a draft vocabulary: rows are mapped to tokens
    native = NativeHeadLevels(heads, engine, weight, tree.depth, 10, plan, embed, draft)
    gen = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for _ in range(4):
            prompt = torch.randint(0, default_bf16.vocab_size, (20,), generator=gen)
            _, hidden = engine.forward(prompt, 0, engine.new_cache(24), last_only=True)
            root = int(torch.randint(0, default_bf16.vocab_size, (1,), generator=gen))
            want = torch.full((len(tree.paths) + 1,), -1, dtype=torch.long)
            want[0] = root
            chain = []
            for j, level in enumerate(plan):
                parents = embed[want[level.parents]] if j > 0 else None
                top, top1 = native.level(j, hidden[0], embed[root], parents)
                chain.append(float(top1[0]))
                want[level.children] = draft[top][level.child_parent, level.child_rank]
            got, got_chain = native.tree(hidden[0], root)
            assert torch.equal(got, want) and got_chain == chain
            level_of = torch.tensor([0] + [len(p) for p in tree.paths])
            for gate in (chain[0] * 1.01, chain[0] * chain[1] * 0.999, 1e-9):
                cut = gated_depth(chain, tree.depth, gate)
                got, got_chain = native.tree(hidden[0], root, gate)
                assert got_chain == chain[:min(tree.depth, cut + 1)]
                keep = level_of <= cut
                assert torch.equal(got[keep], want[keep])
        with pytest.raises(HeadsNativeError, match="outside the vocabulary"):
            native.tree(hidden[0], default_bf16.vocab_size)


@pytest.mark.parametrize("tree_spec", ["chain:1", "chain:4", "mc_sim_7b_63"])
def test_native_trees_of_many_requests_are_each_requests_own_tree(default_bf16, tree_spec):
    """lean_heads_trees drafts R requests' trees in one call (a batched step's rows, the heads' weights read once):
    each request's tokens and top-1 chain equal its own lean_heads_tree call bit for bit, with and without a gate
    (a request the gate stops takes no part in deeper levels; the others go on), roots inside and outside the draft
    vocabulary alike."""
    from medusa_runtime.decoding.decode import path_plan
    from medusa_runtime.heads.native import HeadsNativeError, NativeHeadLevels

    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size).to(torch.bfloat16)
    tree = load_tree(tree_spec)
    engine = LeanEngine(default_bf16, use_kernels=True)
    embed = default_bf16.model.get_input_embeddings().weight
    native = NativeHeadLevels(heads, engine, heads.projection(engine.lm_head_weight(), tree.depth), tree.depth, 10,
                              path_plan(tree), embed, heads.draft_vocab)
    gen = torch.Generator().manual_seed(5)
    in_draft = set(heads.draft_vocab.tolist())
    level_of = torch.tensor([0] + [len(p) for p in tree.paths])
    with torch.inference_mode():
        hidden = torch.stack([engine.forward(torch.randint(0, default_bf16.vocab_size, (16,), generator=gen), 0,
                                             engine.new_cache(20), last_only=True)[1][0] for _ in range(7)])
        roots = [int(t) for t in torch.randint(0, default_bf16.vocab_size, (5,), generator=gen)]
        roots += [int(heads.draft_vocab[3]), next(t for t in range(default_bf16.vocab_size) if t not in in_draft)]
        alone = [native.tree(hidden[r], roots[r]) for r in range(7)]
        chains = [c for _, c in alone]
        gates = (0.0, sorted(c[0] for c in chains)[3])  # the second: some requests stop at level 1, some go on
        if tree.depth > 1:
            gates += (sorted(c[0] * c[1] for c in chains)[2],)
        for gate in gates:
            nodes, got = native.trees(hidden, roots, gate)
            cuts = set()
            for r in range(7):
                want, want_chain = native.tree(hidden[r], roots[r], gate)
                assert got[r] == want_chain, (gate, r)
                keep = level_of <= len(want_chain)
                assert torch.equal(nodes[r][keep], want[keep]), (gate, r)
                cuts.add(len(want_chain))
            assert gate == 0.0 or tree.depth == 1 or len(cuts) > 1  # the gate cut requests at different levels
        with pytest.raises(HeadsNativeError, match="outside the vocabulary"):
            native.trees(hidden[:2], [1, default_bf16.vocab_size])


def test_native_tree_follows_the_thread_count_and_refuses_bad_inputs(default_bf16):
    """The tree call's struct is built once with the thread count of then: a later torch.set_num_threads is
    followed (the same tokens and chain with 1 thread as with 2: no output depends on how the work is shared out),
    a float32 hidden state is taken as its bf16 rounding, and a wrongly shaped ``out`` is refused in one line."""
    from medusa_runtime.decoding.decode import path_plan
    from medusa_runtime.heads.native import HeadsNativeError, NativeHeadLevels

    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size).to(torch.bfloat16)
    tree = load_tree("mc_sim_7b_63")
    engine = LeanEngine(default_bf16, use_kernels=True)
    embed = default_bf16.model.get_input_embeddings().weight
    native = NativeHeadLevels(heads, engine, heads.projection(engine.lm_head_weight(), tree.depth), tree.depth, 10,
                              path_plan(tree), embed, heads.draft_vocab)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        _, hidden = engine.forward(torch.arange(100, 120), 0, engine.new_cache(24), last_only=True)
        try:
            torch.set_num_threads(2)
            two, chain_two = native.tree(hidden[0], 4321)
            torch.set_num_threads(1)
            one, chain_one = native.tree(hidden[0], 4321)
            assert native._tree[0].nthreads == 1
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two) and chain_one == chain_two
        widened, chain_widened = native.tree(hidden[0].float(), 4321)
        assert torch.equal(widened, two) and chain_widened == chain_two
        with pytest.raises(HeadsNativeError, match="out must be a contiguous int64"):
            native.tree(hidden[0], 4321, out=torch.empty(len(tree.paths), dtype=torch.long))


def test_decode_step_on_a_cache_another_engine_made(default_bf16):
    """A profile verifies every tree size on one cache that a plain decoder made: an engine whose own RoPE tables
    were never grown to that cache still steps on it, as its forward does."""
    plain = LeanEngine(default_bf16, use_kernels=True)
    other = LeanEngine(default_bf16, max_nodes=4, use_kernels=True)
    prompt = torch.arange(100, 140)
    with torch.inference_mode():
        cache, ref = plain.new_cache(48), plain.new_cache(48)
        plain.forward(prompt, 0, cache, last_only=True)
        plain.forward(prompt, 0, ref, last_only=True)
        mask = torch.tril(torch.ones(4, 4, dtype=torch.bool))
        step = other.decode_step(torch.tensor([7, 8, 9, 10]), 40, cache, mask, torch.arange(4))
        logits, _ = plain.forward(torch.tensor([7, 8, 9, 10]), 40, ref, tree=mask, positions=40 + torch.arange(4))
    assert torch.equal(step.logits, logits)
