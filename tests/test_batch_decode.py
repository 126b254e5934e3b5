"""Batched Medusa decoding (medusa_runtime/decoding/batch.py, engines/rows.py) against each request decoded alone
by the decoder's own loop: the same tokens at batch 1, 4 and 16, in any arrival order, for plain decoding and for
trees, greedy and sampled; and the batched forward's rows against each sequence's own forward, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_runtime import kernels
from medusa_runtime.decoding.acceptance import AcceptConfig, argmax_rows
from medusa_runtime.decoding.batch import BatchDecoder, generate_batched
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.engines.base import EngineError
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.engines.rows import Seq, forward_rows
from medusa_runtime.heads.medusa import resolve_heads
from medusa_runtime.tree.compiler import compile_tree
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.tree import load_tree

from .conftest import tiny_gpt2, tiny_llama


def _prompts(loaded, questions, n):
    return [encode_prompt(loaded, q["turns"][0], chat=True) for q in questions[:n]]


@pytest.mark.parametrize("tree,lookup", [(None, 0), ("chain:3", 0), ("mc_sim_7b_63", 4)])
def test_greedy_tokens_are_the_same_alone_and_in_any_batch(default_model, mt_bench_first_turns, tree, lookup):
    """The default model on the runtime's own path here (float32: PyTorch with oneDNN's packed layers), shipped
    heads: each request's tokens at batch 4 (arrivals reversed) and 16 (shuffled) are those it gets alone."""
    heads = resolve_heads("default", default_model.hidden_size, default_model.vocab_size) if tree else None
    dec = MedusaDecoder(default_model, heads, tree,
                        config=DecodeConfig(max_new_tokens=20, lookup=LookupConfig(lookup)))
    prompts = _prompts(default_model, mt_bench_first_turns[::9], 9)
    alone = [dec.generate(p).token_ids for p in prompts]
    for rows, order in ((4, list(range(9))[::-1]), (16, random.Random(3).sample(range(9), 9))):
        got = generate_batched(dec, [prompts[i] for i in order], 20, rows)
        assert {i: g for i, g in zip(order, got)} == dict(enumerate(alone)), rows
    if tree is not None:  # the tree drafted and accepted: the check is not plain against plain
        assert sum(dec.generate(p).stats.steps for p in prompts) < sum(len(a) for a in alone)


@pytest.mark.parametrize("tree,lookup", [(None, 0), ("chain:3", 4)])
def test_greedy_tokens_on_the_c_forward_are_the_same_alone_and_in_any_batch(default_bf16, mt_bench_first_turns,
                                                                            tree, lookup, monkeypatch):
    """The served path (bf16 on the C forward): a batched step takes each row's argmax in the same call, through
    the int8 screen of the logits where its rows are few (plain decoding at batch 2), from the logits otherwise.
    Each request's tokens at batch 2 and 16 (arrivals shuffled) are those its decoder's own loop gives it alone."""
    monkeypatch.setattr(kernels, "fast_path", lambda: True)  # the C forward even without AVX-512 BF16 (slower)
    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size) if tree else None
    dec = MedusaDecoder(default_bf16, heads, tree, config=DecodeConfig(max_new_tokens=24, lookup=LookupConfig(lookup)))
    assert dec.engine.uses_kernels
    prompts = _prompts(default_bf16, mt_bench_first_turns[1::11], 6)
    alone = [dec.generate(p).token_ids for p in prompts]
    for rows in (2, 16):
        order = random.Random(rows).sample(range(6), 6)
        got = generate_batched(dec, [prompts[i] for i in order], 24, rows)
        assert {i: g for i, g in zip(order, got)} == dict(enumerate(alone)), rows


@pytest.mark.parametrize("tree,gate", [("chain:1", 0.3), ("chain:3", 0.05)])
def test_a_batched_step_drafts_every_row_as_its_own_step_would(default_bf16, mt_bench_first_turns, tree, gate,
                                                               monkeypatch):
    """On the C forward a batched step drafts every row's tree in one call of the heads (NativeHeadLevels.trees),
    gated or not. Each request's drafts are those its own loop makes alone, which its steps show: the same number
    of steps and the same accepted tokens per head, at batch 2 and 16 (arrivals shuffled), and the same tokens."""
    from medusa_runtime.heads.native import NativeHeadLevels

    monkeypatch.setattr(kernels, "fast_path", lambda: True)
    heads = resolve_heads("default", default_bf16.hidden_size, default_bf16.vocab_size)
    dec = MedusaDecoder(default_bf16, heads, tree, config=DecodeConfig(max_new_tokens=24, gate=gate))
    assert dec.native_heads is not None
    calls = []
    trees = NativeHeadLevels.trees
    monkeypatch.setattr(NativeHeadLevels, "trees", lambda self, h, *a, **k: calls.append(len(h)) or trees(self, h, *a, **k))
    prompts = _prompts(default_bf16, mt_bench_first_turns[2::11], 6)
    alone = [dec.generate(p) for p in prompts]
    assert sum(a.stats.steps for a in alone) < sum(len(a.token_ids) for a in alone)  # the heads' drafts accepted
    for rows in (2, 16):
        order = random.Random(rows + 1).sample(range(6), 6)
        batch, got = BatchDecoder(dec, rows), {}
        queue = [(i, prompts[i]) for i in order][::-1]
        while queue or batch.rows:
            while queue and batch.free:
                i, ids = queue.pop()
                batch.admit(i, ids, 24)
            for step in batch.step():
                got.setdefault(step.key, []).extend(step.tokens)
                if step.stop:
                    a = alone[step.key].stats
                    assert (step.stats.steps, step.stats.head_hits) == (a.steps, a.head_hits), (rows, step.key)
        assert {i: got[i] for i in range(6)} == {i: a.token_ids for i, a in enumerate(alone)}
    assert max(calls) >= 6  # the steps drafted their rows together


def _torch_matmul_is_row_invariant() -> bool:
    """Whether PyTorch's float32 linear gives a row the same bits in a call of 1, 4 and 9 rows on this CPU (oneDNN
    picks its kernel, and with it the order of each sum, by the number of rows; on AVX-512 CPUs they differ)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(9, 576, generator=g)
    one = torch.nn.functional.linear(x[:1], w)
    return all(torch.equal(torch.nn.functional.linear(x[:m], w)[:1], one) for m in (4, 9))


def test_rows_of_a_batched_forward_are_each_sequence_alone_bit_for_bit(default_model, default_bf16, monkeypatch):
    """Three sequences (a plain row, a tree, a tree over a longer cache) through one forward: every row's logits and
    hidden state equal those of its sequence's own forward, on the C forward (bf16) always and on the PyTorch path
    (float32) where PyTorch's own float32 linear is row-invariant on this CPU (elsewhere, as on AVX-512 CPUs, whose
    runtime path is the C forward, they agree to float32 rounding), and each cache holds what its own forward
    wrote."""
    monkeypatch.setattr(kernels, "fast_path", lambda: True)  # the C forward even without AVX-512 BF16 (slower)
    buffers = compile_tree(load_tree("chain:3"), 3, 10, 0, 0.0, torch.device("cpu")).variants[0]
    for loaded, kernel in ((default_model, False), (default_bf16, True)):
        engine = LeanEngine(loaded, max_nodes=buffers.num_nodes, use_kernels=kernel)
        assert engine.uses_kernels == kernel
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=g) for n in (5, 9, 30)]
        steps = [torch.randint(0, loaded.vocab_size, (k,), generator=g) for k in (1, 4, 4)]
        alone, batched = [], []
        with torch.inference_mode():
            for own in (alone, batched):
                caches = [engine.new_cache(40) for _ in prompts]
                for p, c in zip(prompts, caches):
                    engine.forward(p, 0, c, last_only=True)
                seqs = [Seq(t, len(p), c) if len(t) == 1 else
                        Seq(t, len(p), c, buffers.attn_mask, len(p) + buffers.position_offsets)
                        for p, t, c in zip(prompts, steps, caches)]
                if own is alone:
                    own.extend((*engine.forward(s.ids, s.start, s.cache, s.tree, s.positions), s.cache) for s in seqs)
                else:
                    out = forward_rows(engine, seqs)
                    logits, hidden = out.logits.clone(), out.hidden.clone()  # the C forward's buffers are reused
                    at = [0, 1, 5, 9]
                    own.extend((logits[a:b], hidden[a:b], s.cache) for a, b, s in zip(at, at[1:], seqs))
                    if kernel:  # each row's argmax comes with the step, also through the int8 screen (5 rows)
                        assert out.pred == argmax_rows(logits)
                        assert forward_rows(engine, seqs[:2], argmax_only=True).pred == argmax_rows(logits[:5])
                    else:
                        assert out.pred is None
        exact = kernel or _torch_matmul_is_row_invariant()
        same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4))
        for (la, ha, ca), (lb, hb, cb), p in zip(alone, batched, prompts):
            assert same(la, lb) and same(ha, hb), (loaded.dtype, len(p))
            assert same(ca.keys[:, :, :len(p) + 4], cb.keys[:, :, :len(p) + 4])


@pytest.mark.parametrize("rule", ["sample", "typical"])
def test_sampled_requests_draw_the_same_tokens_alone_and_in_a_batch(rule):
    """A seeded request's RNG is its own: its sampled tokens are the same alone and beside other requests, with
    greedy requests in the same batch."""
    loaded = tiny_llama(seed=4)
    from .conftest import random_heads

    heads = random_heads(loaded, "none", seed=1)
    cfg = AcceptConfig(rule=rule, temperature=0.9)
    dec = MedusaDecoder(loaded, heads, "chain:3", cfg, DecodeConfig(max_new_tokens=16, seed=11))
    rng = random.Random(5)
    prompts = [[rng.randrange(loaded.vocab_size) for _ in range(rng.randint(2, 20))] for _ in range(5)]
    alone = []
    for p in prompts:
        dec.generator.manual_seed(11)
        alone.append(dec.generate(p).token_ids)
    batch = BatchDecoder(dec, 10)
    for i, p in enumerate(prompts):
        batch.admit(i, p, 16, seed=11)
        batch.admit(f"greedy{i}", p, 16, accept_cfg=AcceptConfig())
    out: dict = {}
    while batch.rows:
        for got in batch.step():
            out.setdefault(got.key, []).extend(got.tokens)
    assert [out[i] for i in range(5)] == alone
    greedy = MedusaDecoder(loaded, heads, "chain:3", AcceptConfig(), DecodeConfig(max_new_tokens=16))
    assert [out[f"greedy{i}"] for i in range(5)] == [greedy.generate(p).token_ids for p in prompts]


def test_a_dropped_request_frees_its_row_and_the_others_go_on():
    loaded = tiny_llama(seed=6)
    dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=12, stop_on_eos=False))
    batch = BatchDecoder(dec, 2)
    batch.admit("a", [1, 2, 3], 12)
    batch.admit("b", [4, 5], 12)
    with pytest.raises(ValueError, match="full"):
        batch.admit("c", [6], 12)
    batch.step()
    assert batch.drop("a") and not batch.drop("a") and batch.free == 1
    batch.admit("c", [6], 12)
    out: dict = {}
    while batch.rows:
        for got in batch.step():
            out.setdefault(got.key, []).extend(got.tokens)
    assert len(out["c"]) == 12 and out["c"] == dec.generate([6]).token_ids
    assert "a" not in out


def test_batched_decoding_refuses_what_it_cannot_run():
    dec = MedusaDecoder(tiny_gpt2(), None, None, config=DecodeConfig(max_new_tokens=4))
    with pytest.raises(EngineError, match="batch of 1"):
        BatchDecoder(dec, 4)
    alone = BatchDecoder(dec, 1)  # transformers' engine: one request at a time, the same loop
    assert generate_batched(dec, [[1, 2, 3]], 4, 1) == [dec.generate([1, 2, 3]).token_ids]
    with pytest.raises(ValueError, match="empty"):
        alone.admit("x", [], 4)
    with pytest.raises(ValueError, match="max_batch"):
        BatchDecoder(dec, 0)


def test_a_schedule_switches_configurations_by_batch_size_without_changing_greedy_tokens(default_model,
                                                                                       mt_bench_first_turns):
    """A schedule of plain decoding at batch 1, chain:3 at 2-3 and mc_sim_7b_63 with a lookup chain from 4 on:
    requests of different lengths leave at different steps, so the live batch crosses every range, and every
    request's tokens are still those plain greedy decoding gives it alone."""
    from medusa_runtime.decoding.batch import Scheduled

    heads = resolve_heads("default", default_model.hidden_size, default_model.vocab_size)
    cfg = DecodeConfig(max_new_tokens=24)
    plain = MedusaDecoder(default_model, None, None, config=cfg)
    chain3 = MedusaDecoder(default_model, heads, "chain:3", config=cfg)
    wide = MedusaDecoder(default_model, heads, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=24,
                                                                                   lookup=LookupConfig(4)))
    prompts = _prompts(default_model, mt_bench_first_turns[1::7], 7)
    lengths = [24, 6, 18, 3, 12, 9, 24]
    alone = [plain.generate(p).token_ids[:n] for p, n in zip(prompts, lengths)]
    batch = BatchDecoder(plain, 5, [Scheduled(1, 1, plain), Scheduled(2, 3, chain3), Scheduled(4, 16, wide)])
    assert batch.decoder_for(1) is plain and batch.decoder_for(3) is chain3 and batch.decoder_for(30) is wide
    queue, out = list(enumerate(prompts))[::-1], {i: [] for i in range(len(prompts))}
    while queue or batch.rows:
        while queue and batch.free:
            i, ids = queue.pop()
            batch.admit(i, ids, lengths[i])
        for got in batch.step():
            out[got.key].extend(got.tokens)
    assert [out[i] for i in range(len(prompts))] == alone
    assert all(batch.steps_by_range), batch.steps_by_range  # every configuration verified some steps
    with pytest.raises(ValueError, match="contiguously from 1"):
        BatchDecoder(plain, 4, [Scheduled(1, 1, plain), Scheduled(3, 8, chain3)])
