"""Prompt-lookup branch: n-gram index vs brute force, buffer prefixes, exactness through the decode loop."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.tree.buffers import build_tree_buffers, plain_buffers
from medusa_runtime.tree.lookup import LookupConfig, NgramIndex, with_lookup_chain
from treesearch.tree import load_tree

from .conftest import OracleHeads, hf_greedy
from .test_decode_tiny import VARIANTS, make


def brute_force_draft(seq: list[int], cfg: LookupConfig) -> list[int]:
    """Longest trusted suffix first; among its earlier occurrences the latest; the tokens after it."""
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if len(seq) < n:
            continue
        suffix = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):  # occurrence seq[end-n:end], needs a follower
            if seq[end - n:end] == suffix:
                return seq[end:end + cfg.num_tokens]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_matches_brute_force(seed):
    rng = random.Random(seed)
    cfg = LookupConfig(num_tokens=rng.randint(1, 6), max_ngram=rng.randint(2, 4), min_ngram=1 + seed % 2)
    seq = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
    index = NgramIndex(cfg, list(seq))
    for _ in range(60):
        root = rng.randrange(5)
        assert index.draft(root) == brute_force_draft(seq + [root], cfg)
        new = [root] + [rng.randrange(5) for _ in range(rng.randint(0, 3))]
        index.extend(new)
        seq += new
        assert index.draft() == brute_force_draft(seq, cfg)


def test_lookup_config_is_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(num_tokens=3, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match=">= 0"):
        LookupConfig(num_tokens=-1)


def test_chain_buffers_are_prefixes_and_well_formed():
    tree = load_tree("mc_sim_7b_63")
    base = build_tree_buffers(tree, 5, 10)
    full = with_lookup_chain(base, 6, tree.depth)
    assert full.num_nodes == base.num_nodes + 6 and full.depth == 6
    for k in range(7):
        part = with_lookup_chain(base, k, tree.depth)
        n = part.num_nodes
        assert torch.equal(part.attn_mask, full.attn_mask[:n, :n])
        assert torch.equal(part.position_offsets, full.position_offsets[:n])
        assert torch.equal(part.candidate_index, full.candidate_index[:n])
    # chain node j: parent is the previous chain node (the root for j = 0), depth j + 1,
    # sees exactly the root and chain nodes 0..j, reads slot 1 + heads_depth * topk + j
    n0 = base.num_nodes
    for j in range(6):
        node = n0 + j
        assert int(full.parent[node]) == (0 if j == 0 else node - 1)
        assert int(full.position_offsets[node]) == j + 1
        assert full.attn_mask[node].nonzero().flatten().tolist() == [0] + list(range(n0, node + 1))
        assert int(full.candidate_index[node]) == 1 + tree.depth * 10 + j
    assert full.retrieve_indices[-1].tolist() == [0] + list(range(n0, n0 + 6))
    plain = with_lookup_chain(plain_buffers(), 3, 0)
    assert plain.candidate_index.tolist() == [0, 1, 2, 3] and plain.parent.tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tree_with_chain_logits_equal_sequential(variant):
    """A tree plus a lookup chain, verified in one pass, against each node's path run alone."""
    loaded, engine = make(variant)
    tree = load_tree("mc_sim_7b_63")
    rng = random.Random(5)
    prompt = [rng.randrange(loaded.vocab_size) for _ in range(9)]
    heads = fresh_heads(tree.depth, 1, loaded.hidden_size, loaded.vocab_size)
    cfg = DecodeConfig(topk=tree.max_rank + 1, engine=engine, lookup=LookupConfig(num_tokens=4))
    dec = MedusaDecoder(loaded, heads, tree, config=cfg)
    buffers = dec.variants[4]
    tokens = torch.tensor([rng.randrange(loaded.vocab_size) for _ in range(buffers.num_nodes)])
    cache = dec.new_cache(len(prompt) + buffers.num_nodes)
    with torch.no_grad():
        dec.prefill(torch.tensor(prompt), cache)
        tree_logits, _ = dec.verify(tokens, len(prompt), cache, buffers)
        for node in range(buffers.num_nodes):
            path = [i for i in range(buffers.num_nodes) if buffers.attn_mask[node, i]]
            ids = torch.tensor([prompt + tokens[path].tolist()])
            ref = loaded.model(ids).logits[0, -1].float()
            torch.testing.assert_close(tree_logits[node], ref, atol=2e-4, rtol=1e-4)


def expected_lookup_lengths(prompt: list[int], ref: list[int], n: int, cfg: LookupConfig) -> list[int]:
    """Tokens per step of greedy plain decoding with a lookup chain, simulated from generate's output."""
    lengths, out_len, pos = [], 0, 0  # ref[pos] is the pending root
    while out_len + 1 < n:
        draft = brute_force_draft(prompt + ref[: pos + 1], cfg)
        m = 0
        while m < len(draft) and pos + 1 + m < len(ref) and draft[m] == ref[pos + 1 + m]:
            m += 1
        k = min(1 + m, n - out_len)
        lengths.append(k)
        out_len += k
        pos += 1 + m
    return lengths


def repeating_case(variant: str, seed: int, n: int = 40):
    """A model, its engine, a prompt repeating a random 6-token phrase, and generate's n tokens after it."""
    loaded, engine = make(variant)
    rng = random.Random(seed)
    phrase = [rng.randrange(loaded.vocab_size) for _ in range(6)]
    prompt = phrase * 4 + phrase[:3]
    return loaded, engine, prompt, hf_greedy(loaded, prompt, n)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plain_lookup_accepts_exactly_the_matching_drafts(variant):
    """Plain decoding + lookup: same tokens as generate, and per step exactly the draft prefix generate agrees with."""
    n = 40
    loaded, engine, prompt, ref = repeating_case(variant, 11, n)
    look = LookupConfig(num_tokens=5, min_ngram=1)
    res = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=n, engine=engine, lookup=look)
                        ).generate(prompt)
    assert res.token_ids == ref
    expected = expected_lookup_lengths(prompt, ref, n, look)
    assert max(expected) >= 2  # the fixture really exercises accepted drafts
    assert res.stats.accept_lengths == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_heads_plus_lookup_equal_generate(variant):
    n = 40
    loaded, engine, prompt, ref = repeating_case(variant, 12, n)
    heads = OracleHeads(loaded, prompt + ref, num_heads=3, topk=4, max_rank=2, miss=0.5, seed=1)
    cfg = DecodeConfig(max_new_tokens=n, topk=4, engine=engine, lookup=LookupConfig(num_tokens=5, min_ngram=1))
    res = MedusaDecoder(loaded, heads, load_tree("chain:2"), config=cfg).generate(prompt)
    assert res.token_ids == ref
    assert max(res.stats.accept_lengths) >= 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_confidence_gate_is_exact_and_bounded(variant):
    """The gate only drops levels: outputs stay generate's; gate 1 is plain + lookup step for step."""
    n = 40
    loaded, engine, prompt, ref = repeating_case(variant, 12, n)
    look = LookupConfig(num_tokens=5, min_ngram=1)

    def oracle():  # the oracle draws from its own RNG: a fresh one per run keeps runs comparable
        return OracleHeads(loaded, prompt + ref, num_heads=3, topk=4, max_rank=2, miss=0.5, seed=1)

    runs = {}
    for gate in (0.0, 0.3, 1.0):
        cfg = DecodeConfig(max_new_tokens=n, topk=4, engine=engine, lookup=look, gate=gate)
        runs[gate] = MedusaDecoder(loaded, oracle(), load_tree("chain:3"), config=cfg).generate(prompt)
        assert runs[gate].token_ids == ref
    plain = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=n, engine=engine, lookup=look)
                          ).generate(prompt)
    # random heads never reach probability 1: at gate 1 every step is the root plus the lookup chain
    weak = fresh_heads(3, 1, loaded.hidden_size, loaded.vocab_size)
    cfg = DecodeConfig(max_new_tokens=n, topk=4, engine=engine, lookup=look, gate=1.0)
    gated = MedusaDecoder(loaded, weak, load_tree("chain:3"), config=cfg).generate(prompt)
    assert gated.token_ids == ref and gated.stats.accept_lengths == plain.stats.accept_lengths
    full = MedusaDecoder(loaded, oracle(), load_tree("chain:3"),
                         config=DecodeConfig(max_new_tokens=n, topk=4, engine=engine, lookup=look)).generate(prompt)
    assert runs[0.0].stats.accept_lengths == full.stats.accept_lengths


def test_gated_depth_against_direct_products():
    loaded, _, _, _ = repeating_case("llama-lean", 3, 4)
    heads = fresh_heads(3, 1, loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, load_tree("chain:3"), config=DecodeConfig(topk=4, gate=0.2))
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(3, loaded.vocab_size, generator=g) * 4
        p = torch.softmax(logits, -1).max(-1).values.tolist()
        want = 0
        prod = 1.0
        for pj in p:
            prod *= pj
            if prod < 0.2:
                break
            want += 1
        assert dec._gated_depth(logits) == want
    with pytest.raises(ValueError, match="gate"):
        DecodeConfig(gate=1.5)
