"""Acceptance rules: unit checks on crafted logits and chi-square tests of exact sampling on a tiny model."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from medusa_runtime.decoding import acceptance, decode
from medusa_runtime.decoding.acceptance import AcceptConfig, accept_greedy, accept_sample, accept_typical, warp
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.tree.buffers import build_tree_buffers
from medusa_runtime.tree.lookup import LookupConfig, with_lookup_chain
from treesearch.tree import make_tree

from .conftest import tiny_llama

# root; children (0,), (1,); grandchild (0, 0)
TREE = make_tree([[0], [1], [0, 0]])


def _buffers():
    return build_tree_buffers(TREE, num_heads=2, topk=2)


def test_greedy_takes_longest_matching_path():
    buf = _buffers()
    vocab = 6
    logits = torch.zeros(4, vocab)
    tokens = torch.tensor([5, 2, 3, 4])  # root=5, (0,)=2, (1,)=3, (0,0)=4
    logits[0, 3] = 9  # after the root the model wants 3: node (1,) matches, node (0,) not
    logits[2, 1] = 9  # after node (1,) the model wants 1
    acc = accept_greedy(tokens, logits, buf)
    assert acc.path == [0, 2] and acc.next_token == 1
    logits[0] = 0
    logits[0, 2] = 9  # now (0,) matches, and after it (0,0)=4 matches too
    logits[1, 4] = 9
    logits[3, 0] = 9
    acc = accept_greedy(tokens, logits, buf)
    assert acc.path == [0, 1, 3] and acc.next_token == 0


def _brute_force_greedy(tokens: list[int], pred: list[int], parent: list[int]) -> int:
    """Length of the longest root-to-node path whose nodes all equal their parent's argmax (all paths tried)."""
    best = 1
    for node in range(len(tokens)):
        path = [node]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        if all(tokens[n] == pred[parent[n]] for n in path[:-1]):
            best = max(best, len(path))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_greedy_walk_matches_brute_force_on_random_trees_with_lookup(seed):
    """Random trees, a lookup chain beside them and a tiny vocabulary (so that the lookup draft often
    repeats a head's candidate under the same parent): the accepted path is as long as the longest
    matching path found by enumerating every node, every accepted node matches, and the next token is
    the argmax after the path's last node."""
    rng = np.random.default_rng(seed)
    paths = {(int(rng.integers(0, 3)),)}
    while len(paths) < int(rng.integers(2, 12)):
        base = list(paths)[int(rng.integers(0, len(paths)))]
        if len(base) < 4:
            paths.add((*base, int(rng.integers(0, 3))))
    heads_buf = build_tree_buffers(make_tree([list(p) for p in paths]), num_heads=4, topk=3)
    buf = with_lookup_chain(heads_buf, int(rng.integers(0, 4)), heads_buf.depth)
    vocab = 3
    tokens = torch.as_tensor(rng.integers(0, vocab, buf.num_nodes))
    logits = torch.as_tensor(rng.normal(size=(buf.num_nodes, vocab)))
    acc = accept_greedy(tokens, logits, buf)
    pred, parent = logits.argmax(-1).tolist(), buf.parent.tolist()
    assert len(acc.path) == _brute_force_greedy(tokens.tolist(), pred, parent)
    assert acc.path[0] == 0 and all(parent[b] == a for a, b in zip(acc.path, acc.path[1:]))
    assert all(int(tokens[n]) == pred[parent[n]] for n in acc.path[1:])
    assert acc.next_token == pred[acc.path[-1]]


def test_typical_threshold_rule():
    buf = _buffers()
    tokens = torch.tensor([0, 1, 2, 3])
    logits = torch.full((4, 4), -10.0)
    logits[0, 1], logits[0, 2] = 1.0, 0.9  # after the root both children are likely
    logits[1, 3] = 5.0
    cfg = AcceptConfig(rule="typical", temperature=1.0, posterior_threshold=0.09, posterior_alpha=0.3)
    acc = accept_typical(tokens, logits, buf, cfg, torch.Generator().manual_seed(0))
    # both depth-1 nodes pass; the longer path through (0,) -> (0,0) wins
    assert acc.path == [0, 1, 3]
    probs = torch.softmax(logits, -1)
    h = -(probs * probs.log()).sum(-1)
    thr = torch.minimum(torch.tensor(0.09), 0.3 * torch.exp(-h))
    assert probs[0, 1] > thr[0] and probs[1, 3] > thr[1]
    strict = AcceptConfig(rule="typical", temperature=1.0, posterior_threshold=0.99, posterior_alpha=10.0)
    # epsilon 0.99 with a large delta: p = 0.52 after the root no longer passes
    assert accept_typical(tokens, logits, buf, strict, torch.Generator().manual_seed(0)).path == [0]
    none_pass = AcceptConfig(rule="typical", temperature=1.0, posterior_threshold=1.0, posterior_alpha=1e9)
    assert accept_typical(tokens, logits, buf, none_pass, torch.Generator().manual_seed(0)).path == [0]


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = warp(logits, AcceptConfig(rule="sample", temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = warp(logits, AcceptConfig(rule="sample", temperature=1.0, top_p=0.7))  # 0.5 + 0.3 crosses 0.7
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = warp(logits, AcceptConfig(rule="sample", temperature=1.0, top_p=0.85))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def _draws_depth1(residual: bool, n: int, seed: int = 0) -> np.ndarray:
    """Token emitted after the root by accept_sample, n times, on fixed logits."""
    buf = _buffers()
    target = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(target).repeat(4, 1)
    tokens = torch.tensor([3, 0, 1, 2])  # both top guesses proposed as siblings
    cfg = AcceptConfig(rule="sample", temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(4)
    for _ in range(n):
        acc = accept_sample(tokens, logits, buf, cfg, gen, residual=residual)
        first = int(tokens[acc.path[1]]) if len(acc.path) > 1 else acc.next_token
        counts[first] += 1
    return counts


def test_sample_rule_unit_distribution():
    n = 4000
    expected = np.array([0.4, 0.3, 0.2, 0.1]) * n
    assert chisquare(_draws_depth1(True, n), expected).pvalue > 1e-3
    assert chisquare(_draws_depth1(False, n), expected).pvalue < 1e-6


def _tiny_sampling_setup():
    loaded = tiny_llama(vocab=8, seed=4)
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    return loaded, heads, [1, 6, 3]


def _model_target_second_token(loaded, prompt, temperature):
    """Exact P(second new token) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), from full forwards."""
    with torch.no_grad():
        p1 = torch.softmax(loaded.model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        batch = torch.tensor([prompt + [t] for t in range(loaded.vocab_size)])
        p2 = torch.softmax(loaded.model(batch).logits[:, -1] / temperature, -1)  # [V, V]
    p1, p2 = p1.double(), p2.double()
    joint = (p1[:, None] * p2).sum(0)
    return (joint / joint.sum()).numpy(), (p1 / p1.sum()).numpy()


def _sample_counts(loaded, heads, prompt, n, temperature, lookup=0):
    cfg = AcceptConfig(rule="sample", temperature=temperature)
    dec = MedusaDecoder(loaded, heads, make_tree([[0], [1], [2], [0, 0], [1, 0]]), cfg,
                        DecodeConfig(max_new_tokens=3, topk=3, seed=123,
                                     lookup=LookupConfig(num_tokens=lookup, min_ngram=1)))
    first, second = np.zeros(loaded.vocab_size), np.zeros(loaded.vocab_size)
    accepted = 0
    for _ in range(n):
        res = dec.generate(prompt)
        first[res.token_ids[0]] += 1
        second[res.token_ids[1]] += 1
        accepted += res.stats.accept_lengths[0] > 1
    return first, second, accepted


@pytest.mark.parametrize("residual,lookup", [(True, 0), (False, 0), (True, 2)])
def test_sample_rule_preserves_model_distribution(monkeypatch, residual, lookup):
    """Chi-square over the second new token (the first one decided by tree rejection sampling);
    with ``lookup`` a prompt-lookup chain is a further deterministic sibling under the root."""
    loaded, heads, prompt = _tiny_sampling_setup()
    temperature = 1.5
    if not residual:  # the deliberately wrong rule: resample from p instead of the residual
        wrong = functools.partial(acceptance.accept_sample, residual=False)
        monkeypatch.setattr(decode, "accept",
                            lambda t, lg, b, c, g=None, pred=None: wrong(t, lg, b, c, g))
    n = 3000
    target2, target1 = _model_target_second_token(loaded, prompt, temperature)
    first, second, accepted = _sample_counts(loaded, heads, prompt, n, temperature, lookup)
    assert accepted > n * 0.2  # the tree really proposed tokens that were accepted
    assert chisquare(first, target1 * n).pvalue > 1e-3  # prefill draw, no rejection involved
    p = chisquare(second, target2 * n).pvalue
    if residual:
        assert p > 1e-3, p
    else:
        assert p < 1e-6, p


def test_one_draw_inverts_the_cdf_exactly_and_never_picks_a_zero():
    """acceptance._sample against the distribution it draws from: chi-square on 40,000 draws over a skewed
    vocabulary with zeros (power: moving 1 % of the mass between the two likeliest tokens is caught at
    p < 1e-3 with probability 0.93 at this n, by the noncentral chi-square), unnormalised input, and the same
    draws from the same seed."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(12, 0.4))
    p[[2, 7]] = 0.0
    probs = torch.tensor(p / p.sum() * 3.0, dtype=torch.float32)  # not normalised on purpose
    gen = torch.Generator().manual_seed(1)
    n = 40_000
    draws = np.array([acceptance._sample(probs, gen) for _ in range(n)])
    counts = np.bincount(draws, minlength=12)
    assert counts[2] == counts[7] == 0
    nz = p > 0
    assert chisquare(counts[nz], (p / p.sum())[nz] * n).pvalue > 1e-3
    gen2 = torch.Generator().manual_seed(1)
    assert [acceptance._sample(probs, gen2) for _ in range(50)] == draws[:50].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_numpys_argmax_ties_nans_and_infinities_included(dtype):
    """argmax_rows (the C library's one pass where it is built) against NumPy's argmax on the float32 values:
    the first of tied maxima, the first NaN, infinities, rows shorter and longer than a vector, 1-5 rows."""
    from medusa_runtime.decoding.acceptance import argmax_rows

    gen = torch.Generator().manual_seed(3)
    for trial in range(400):
        rows, width = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 120, (1,), generator=gen))
        x = torch.randint(-3, 4, (rows, width), generator=gen).to(dtype)  # few values: many ties
        if trial % 5 == 0:
            x.view(-1)[torch.randint(0, rows * width, (2,), generator=gen)] = float("nan")
        if trial % 7 == 0:
            x.view(-1)[torch.randint(0, rows * width, (1,), generator=gen)] = float("inf")
        if trial % 11 == 0:
            x.fill_(float("-inf"))
        assert argmax_rows(x) == np.argmax(x.float().numpy(), axis=-1).tolist()
    x = torch.randn(3, 49152, generator=gen).to(dtype)
    x[1, 40000] = x[1, 7] = 9.0  # a tie far apart: the first wins
    assert argmax_rows(x) == np.argmax(x.float().numpy(), axis=-1).tolist()
    assert argmax_rows(x[:, ::2]) == np.argmax(x[:, ::2].float().numpy(), axis=-1).tolist()  # not contiguous
