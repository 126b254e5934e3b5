"""Decode loop on tiny random models built here: tree attention vs sequential forwards, greedy equality."""

from __future__ import annotations

import random
import time

import pytest
import torch

from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import fresh_heads
from treesearch.tree import load_tree

from .conftest import OracleHeads, hf_greedy, tiny_gemma3, tiny_gpt2, tiny_llama
from .test_tree import random_tree

# model x engine: the lean engine runs Llama-family models, transformers' engine runs everything
# (gemma3: sliding-window layers, whose window every test sequence runs past)
# (llama-lean-static: the fixed-shape steps that CUDA graphs capture, run eagerly)
VARIANTS = {"llama-lean": (tiny_llama, "lean"), "llama-lean-static": (tiny_llama, "lean-static"),
            "llama-hf": (tiny_llama, "hf"), "gpt2-hf": (tiny_gpt2, "hf"), "gemma3-hf": (tiny_gemma3, "hf")}


def make(variant):
    build, engine = VARIANTS[variant]
    return build(), engine


def tree_logits_vs_sequential(loaded, tree, prompt, tokens, engine="auto"):
    """Logits of every tree node from one verify pass, and from running each root-to-node path alone."""
    heads = fresh_heads(tree.depth, 1, loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=tree.max_rank + 1, engine=engine))
    cache = dec.new_cache(len(prompt) + tree.num_nodes)
    with torch.no_grad():
        dec.prefill(torch.tensor(prompt), cache)
        tree_logits, _ = dec.verify(tokens, len(prompt), cache)
        paths = [()] + list(tree.paths)
        seq_logits = []
        for i in range(len(paths)):
            # tokens along the root-to-node path: the root, then each ancestor in depth order
            nodes = [j for j in range(len(paths)) if paths[i][: len(paths[j])] == paths[j]]
            nodes.sort(key=lambda j: len(paths[j]))
            ids = torch.tensor([prompt + tokens[nodes].tolist()])
            seq_logits.append(loaded.model(ids).logits[0, -1].float())
    return tree_logits, torch.stack(seq_logits)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "random"])
def test_tree_attention_equals_sequential(variant, tree_name):
    loaded, engine = make(variant)
    rng = random.Random(3)
    tree = random_tree(rng, 25, 4, 4) if tree_name == "random" else load_tree(tree_name)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(11)]
    tokens = torch.tensor([rng.randrange(loaded.vocab_size) for _ in range(tree.num_nodes)])
    tree_logits, seq_logits = tree_logits_vs_sequential(loaded, tree, prompt, tokens, engine)
    assert tree_logits.shape == seq_logits.shape == (tree.num_nodes, loaded.vocab_size)
    torch.testing.assert_close(tree_logits, seq_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_hf_generate_with_oracle_heads(variant, seed):
    """Random trees and oracle heads: multi-token paths and cache compaction, still exact."""
    loaded, engine = make(variant)
    rng = random.Random(100 + seed)
    n = 48
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(rng.randint(3, 12))]
    ref = hf_greedy(loaded, prompt, n)
    tree = random_tree(rng, rng.randint(4, 30), max_depth=4, max_rank=3)
    oracle = OracleHeads(loaded, prompt + ref, num_heads=4, topk=8, max_rank=3, miss=0.15, seed=seed)
    dec = MedusaDecoder(loaded, oracle, tree, config=DecodeConfig(max_new_tokens=n, topk=8, engine=engine))
    res = dec.generate(prompt)
    assert res.token_ids == ref
    assert res.stats.new_tokens == n and res.stats.stop_reason == "max_new_tokens"
    # the oracle makes long paths happen, so the loop committed several tokens per step
    assert max(res.stats.accept_lengths) >= 2
    assert sum(res.stats.accept_lengths) + 1 >= n  # every token but the pending root came from a step


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_perfect_oracle_on_chain_accepts_full_depth(variant):
    loaded, engine = make(variant)
    prompt = [5, 9, 2, 33]
    ref = hf_greedy(loaded, prompt, 41)
    oracle = OracleHeads(loaded, prompt + ref, num_heads=4, topk=4, max_rank=0, miss=0.0)
    dec = MedusaDecoder(loaded, oracle, "chain:4", config=DecodeConfig(max_new_tokens=41, topk=4, engine=engine))
    res = dec.generate(prompt)
    assert res.token_ids == ref
    # every step commits root + 4 accepted nodes = 5 tokens: 8 steps for 40 tokens + the last root
    assert res.stats.accept_lengths == [5] * 8
    assert res.stats.head_acceptance == [1.0] * 4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eos_inside_accepted_path(variant):
    loaded, engine = make(variant)
    prompt = [1, 2, 3, 4, 5]
    ref = hf_greedy(loaded, prompt, 40)
    # make the 13th generated token the EOS (its first occurrence), so the stop lands inside a path
    k = next(i for i in range(12, 40) if ref[i] not in ref[:i])
    eos = ref[k]
    loaded.model.generation_config.eos_token_id = eos
    expected = hf_greedy(loaded, prompt, 40)
    assert expected == ref[: k + 1]
    oracle = OracleHeads(loaded, prompt + ref, num_heads=4, topk=4, max_rank=0, miss=0.0)
    dec = MedusaDecoder(loaded, oracle, "chain:4", config=DecodeConfig(max_new_tokens=40, topk=4, engine=engine))
    res = dec.generate(prompt)
    assert res.token_ids == expected and res.stats.stop_reason == "eos"
    assert res.stats.accept_lengths[-1] >= 2 or k % 5 == 0  # EOS arrived inside a multi-token path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plain_and_fresh_heads_equal_generate(variant):
    loaded, engine = make(variant)
    prompt = [7, 7, 3]
    ref = hf_greedy(loaded, prompt, 30)
    plain = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=30, engine=engine)).generate(prompt)
    assert plain.token_ids == ref and plain.stats.tau == 1.0 and plain.stats.steps == 29
    heads = fresh_heads(4, 1, loaded.hidden_size, loaded.vocab_size)
    medusa = MedusaDecoder(loaded, heads, "mc_sim_7b_63", config=DecodeConfig(max_new_tokens=30, engine=engine)).generate(prompt)
    assert medusa.token_ids == ref


def test_stepped_generate_equals_generate_and_counts_only_its_own_time():
    """generate_steps pauses after the prefill and after every step; driven with sleeps between the resumes it
    decodes exactly what generate does (greedy, and sampled under the same seed), and the sleeps are not in
    its time."""
    loaded = tiny_llama()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    for accept in (AcceptConfig(), AcceptConfig(rule="sample", temperature=0.9)):
        dec = MedusaDecoder(loaded, heads, "chain:2", accept, DecodeConfig(max_new_tokens=20, seed=3))
        whole = dec.generate([5, 9, 2])
        dec.generator.manual_seed(3)
        run, pauses, sleep = dec.generate_steps([5, 9, 2]), 0, 0.01
        t0 = time.perf_counter()
        while True:
            try:
                next(run)
            except StopIteration as done:
                stepped = done.value
                break
            pauses += 1
            time.sleep(sleep)
        elapsed = time.perf_counter() - t0
        assert stepped.token_ids == whole.token_ids and stepped.stats.accept_lengths == whole.stats.accept_lengths
        assert pauses == stepped.stats.steps + 1  # after the prefill, then after each step
        st = stepped.stats
        assert st.time_prefill + st.time_heads + st.time_verify + st.time_bookkeeping <= st.time_total
        assert st.time_total <= elapsed - 0.9 * sleep * pauses  # time.sleep sleeps at least its argument


def test_context_limit_stops_cleanly():
    loaded = tiny_llama(max_pos=40)
    prompt = list(range(30))
    heads = fresh_heads(4, 1, loaded.hidden_size, loaded.vocab_size)
    res = MedusaDecoder(loaded, heads, "chain:4", config=DecodeConfig(max_new_tokens=100)).generate(prompt)
    assert res.stats.stop_reason == "context"
    assert len(prompt) + res.stats.new_tokens <= 40
    assert res.token_ids == hf_greedy(loaded, prompt, res.stats.new_tokens)


def test_tree_must_fit_heads():
    loaded = tiny_llama()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    with pytest.raises(ValueError, match="levels deep"):
        MedusaDecoder(loaded, heads, "mc_sim_7b_63")
    with pytest.raises(ValueError, match="top-5"):
        MedusaDecoder(loaded, fresh_heads(4, 1, 64, 64), "mc_sim_7b_63", config=DecodeConfig(topk=5))


def test_typical_threshold_extremes():
    loaded = tiny_llama()
    heads = fresh_heads(4, 1, loaded.hidden_size, loaded.vocab_size)
    prompt = [3, 1, 4, 1, 5]
    tree = load_tree("mc_sim_7b_63")
    # epsilon -> 0: every proposed candidate passes, so each step takes a deepest path of the tree
    loose = AcceptConfig(rule="typical", temperature=1.0, posterior_threshold=1e-30, posterior_alpha=1e-30)
    res = MedusaDecoder(loaded, heads, tree, loose, DecodeConfig(max_new_tokens=41, seed=0)).generate(prompt)
    assert res.stats.accept_lengths == [tree.depth + 1] * 8
    # threshold 1 (epsilon = 1, delta large): nothing passes, one token per step
    strict = AcceptConfig(rule="typical", temperature=1.0, posterior_threshold=1.0, posterior_alpha=1e9)
    res = MedusaDecoder(loaded, heads, tree, strict, DecodeConfig(max_new_tokens=20, seed=0)).generate(prompt)
    assert res.stats.accept_lengths == [1] * 19 and res.stats.tau == 1.0
