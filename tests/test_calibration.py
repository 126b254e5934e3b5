"""Calibration: rank vectors against brute force, and replay predicting the runtime's accept lengths."""

from __future__ import annotations

import random

import pytest
import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads
from medusa_runtime.measure.calibrate import rank_vectors
from medusa_runtime.measure.profile import ProfileConfig, profile_latency
from treesearch.stats import tau_step_walk
from treesearch.tree import load_tree

from .conftest import hf_greedy, tiny_llama
from .test_tree import random_tree


def _heads_that_guess(loaded, k=3, seed=0):
    """Random official-format heads seeded near the base lm_head, so their guesses are sometimes right."""
    heads = MedusaHeads(HeadsConfig(k, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=False))
    heads.init_projection_from(loaded.model.get_output_embeddings())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].linear.weight.copy_(torch.randn(blocks[0].linear.weight.shape, generator=g) * 0.3)
    return heads


def test_rank_vectors_against_brute_force():
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded)
    prompt = [3, 1, 4, 1, 5]
    rollout = hf_greedy(loaded, prompt, 20)
    got = rank_vectors(loaded, heads, prompt, rollout, topk=6)
    assert len(got) == len(rollout) - 1
    lm = loaded.model.get_output_embeddings()
    for i in range(len(rollout) - 1):
        ids = torch.tensor([prompt + rollout[:i]])  # position i = the state of y_i (y_0 = last prompt token)
        h = loaded.model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        logits = heads(h, lm)  # [K, V]
        for j in range(heads.num_heads):
            target_index = i + j + 1
            if target_index >= len(rollout):
                assert got[i][j] == -1
                continue
            top = torch.topk(logits[j], 6).indices.tolist()
            want = top.index(rollout[target_index]) if rollout[target_index] in top else -1
            assert got[i][j] == want, (i, j)
    assert any(r >= 0 for v in got for r in v)  # the test exercises hits, not only misses


def _path_heads_that_guess(loaded, k=5, seed=0):
    """Random path-conditioned heads (shared lm_head) whose guesses depend strongly on the parent."""
    heads = MedusaHeads(HeadsConfig(k, 1, loaded.hidden_size, loaded.vocab_size, shared_lm_head=True,
                                    root_conditioned=True, path_conditioned=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        heads.parent_weight.mul_(10)
    return heads


@pytest.mark.parametrize("kind", ["official", "path"])
@pytest.mark.parametrize("tree_name", ["chain:3", "random", "vicuna_7b_stage2"])
def test_replay_walk_predicts_runtime_accept_lengths(tree_name, kind):
    """On the same prompt, greedy Medusa follows the rollout, so the walk replays it exactly (with
    path-conditioned heads too: calibration feeds them the rollout's tokens as roots and parents)."""
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=5, seed=1) if kind == "official" else _path_heads_that_guess(loaded)
    tree = random_tree(random.Random(1), 20, 3, 4) if tree_name == "random" else load_tree(tree_name)
    topk = max(10, tree.max_rank + 1)
    n = 60
    lengths_pred, lengths_run = [], []
    for seed in range(3):
        rng = random.Random(seed)
        prompt = [rng.randrange(32) for _ in range(6)]
        rollout = hf_greedy(loaded, prompt, n)
        ranks = rank_vectors(loaded, heads, prompt, rollout, topk)
        walk = tau_step_walk(tree, [ranks])
        res = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(max_new_tokens=n, topk=topk)).generate(prompt)
        assert res.token_ids == rollout
        lengths_pred += list(walk.accept_lengths)
        lengths_run += res.stats.accept_lengths
    assert lengths_pred == lengths_run
    assert max(lengths_run) >= 2


def test_profile_smoke():
    loaded = tiny_llama()
    heads = _heads_that_guess(loaded, k=4)
    prof = profile_latency(loaded, heads, ProfileConfig(nodes=(1, 4, 16), contexts=(16, 32), repeats=2, warmup=1,
                                                        loop_nodes=(4, 16)), progress=False)
    assert len(prof.verify_ms) == 2 and all(len(r) == 3 for r in prof.verify_ms)
    assert all(x > 0 for r in prof.verify_ms for x in r) and len(prof.plain_ms) == 2
    assert prof.heads_ms > 0 and prof.meta["machine"]["cpu_count"]
    # heads timed for every tree size, the 16-node time doubling as heads_ms
    assert prof.heads_nodes == (4, 16) and all(x > 0 for x in prof.heads_by_nodes_ms)
    assert prof.heads_ms == prof.heads_by_nodes_ms[1] == prof.heads(16)
    # the plain step is the 1-node forward of the same rounds plus the rest of a real plain step
    assert all(p > row[0] for p, row in zip(prof.plain_ms, prof.verify_ms))
    # bookkeeping per verified size (the plain step's rest first), prefill per prompt length, lookup drafting, and
    # the heads' fit over shapes (a 3-level chain scores 3 rows, as the shapes' fit predicts it)
    assert prof.bookkeeping_nodes == (1, 4, 16) and all(x > 0 for x in prof.bookkeeping_by_nodes_ms)
    assert prof.prefill_tokens == (16, 32) and all(x > 0 for x in prof.prefill_ms) and prof.lookup_ms > 0
    assert len(prof.heads_fit) == 3 and prof.heads_time(load_tree("chain:3")) > 0
    # what a typical-acceptance step adds, by verified nodes (plain sampling's draw at 1)
    assert prof.sampling_nodes == (1, 4, 16) and all(x >= 0 for x in prof.sampling_extra_ms)
    assert list(prof.sampling_extra_ms) == sorted(prof.sampling_extra_ms)  # more parents never cost less
    # the plain loop of each timed round against that round's own copy-bandwidth floor
    floor = prof.meta["bandwidth_floor"]
    assert floor["rounds"] == 3 and floor["context"] == 32  # max(3, repeats) timed rounds and floor["bandwidth_gbs"] > 0
    lo, hi = floor["plain_over_floor_95"]
    assert lo <= floor["plain_over_floor"] <= hi and floor["floor_ms"] > 0


def test_sampling_extra_is_made_non_decreasing_as_isotonic_regression_does():
    """The profile's monotone fit of what sampling adds per size against scipy's isotonic regression."""
    import numpy as np
    from scipy.optimize import isotonic_regression

    from medusa_runtime.measure.profile import _non_decreasing

    assert _non_decreasing(np.array([1.0, 3.0, 2.0, 4.0])).tolist() == [1.0, 2.5, 2.5, 4.0]
    rng = np.random.default_rng(0)
    for _ in range(20):
        row = np.sort(rng.uniform(10, 60, 12)) + rng.normal(0, 3, 12)  # a rising curve with noise
        np.testing.assert_allclose(_non_decreasing(row), isotonic_regression(row).x, rtol=1e-12)


def test_in_loop_verify_prices_sizes_by_ratios_of_means_unbiased_under_independent_noise():
    """A looped size's price against the closed form: the plain loop's level times mean(size) / mean(plain).
    Simulated rounds with each piece's own noise (no shared spells, as measured in replays: the plain loop
    varies ~19 %, a 64-node loop ~8 %, correlation ~0): over 400 simulated profiles the ratio of means misses
    the ratio of the true means (what a replay's totals measure: lognormal means 8 e^(0.19^2/2) and
    72 e^(0.08^2/2)) by < 0.5 % on average, where the rounds' own central ratio (the estimator it replaced)
    overshoots it by > 1.5 % (the skew of its noisy denominator); contexts scale by the ratio of the tight means."""
    import numpy as np

    from medusa_runtime.measure.profile import LoopTimes, _central, _in_loop_verify

    cfg = ProfileConfig(nodes=(1, 64), contexts=(100, 200), loop_nodes=(64,))
    rng = np.random.default_rng(0)
    ours, per_round = [], []
    for _ in range(400):
        plain = 8.0 * rng.lognormal(0.0, 0.19, 40)  # [rounds] ms
        big = 72.0 * rng.lognormal(0.0, 0.08, 40)
        tight = np.stack([np.stack([plain, big]), np.stack([plain * 1.1, big * 1.2])])  # [contexts, nodes, rounds]
        loops = [LoopTimes(0, 0, _central(list(v)), 0, 0, tuple(v)) for v in (plain, big)]
        table = _in_loop_verify(tight, cfg, 100, [1, 64], loops)
        level = _central(list(plain))
        assert table[0][0] == pytest.approx(level)
        assert table[0][1] == pytest.approx(level * big.mean() / plain.mean())
        assert table[1][1] == pytest.approx(table[0][1] * 1.2)  # the context's own tight ratio, no noise here
        ours.append(table[0][1] / level)
        per_round.append(_central(list(big / plain)))
    truth = 72.0 * np.exp(0.08 ** 2 / 2) / (8.0 * np.exp(0.19 ** 2 / 2))
    assert abs(np.mean(ours) / truth - 1) < 0.005
    assert np.mean(per_round) / truth - 1 > 0.015


def test_in_loop_verify_prices_every_looped_context_from_its_own_loops():
    """A context with its own loops (plain decoding and sizes) is priced from them, as the middle one is: its
    plain loop's level, a looped size's ratio of means to it, an unlooped size through the nearest looped
    one and the tight ratio between the two at that context; a context without loops still scales from the
    middle one by the tight ratio between contexts (tight ratios: the interquartile mean of the rounds' ratios, so
    one stalled forward does not move them). Closed forms on random rounds; with the per-context loops
    dropped, the looped context falls back to the scaling (a different number here, where the tight
    forwards' context ratio was drawn unlike the loops')."""
    import numpy as np

    from medusa_runtime.measure.profile import LoopTimes, _central, _in_loop_verify

    cfg = ProfileConfig(nodes=(1, 2, 4, 8), contexts=(50, 100, 400), loop_nodes=(2, 4, 8))
    rng = np.random.default_rng(1)
    rounds = 30

    def loop(ms: float) -> LoopTimes:
        v = ms * rng.lognormal(0.0, 0.1, rounds)
        return LoopTimes(0, 0, _central(list(v)), 0, 0, tuple(v))

    mid = [loop(6.0), loop(6.1), loop(6.5), loop(7.5)]  # sizes 1, 2, 4, 8 at context 100
    far = [loop(6.6), loop(6.8), loop(7.4)]  # sizes 1, 2, 4 at context 400
    tight = rng.uniform(5.0, 9.0, (3, 4, rounds))  # [contexts, nodes, rounds]
    table = _in_loop_verify(tight, cfg, 100, [1, 2, 4, 8], mid, {400: ([1, 2, 4], far)})
    means = {k: np.mean(v.verify_rounds) for k, v in zip((1, 2, 4), far)}
    level = _central(list(far[0].verify_rounds))
    assert table[2][0] == pytest.approx(level)
    assert table[2][1] == pytest.approx(level * means[2] / means[1])
    assert table[2][2] == pytest.approx(level * means[4] / means[1])
    assert table[2][3] == pytest.approx(level * means[4] / means[1] * _central(list(tight[2, 3] / tight[2, 2])))
    mid_level = _central(list(mid[0].verify_rounds))
    assert table[1][3] == pytest.approx(mid_level * np.mean(mid[3].verify_rounds) / np.mean(mid[0].verify_rounds))
    for j in range(4):  # context 50 has no loops: the middle row times the tight ratio between the contexts
        assert table[0][j] == pytest.approx(table[1][j] * _central(list(tight[0, j] / tight[1, j])))
    scaled = _in_loop_verify(tight, cfg, 100, [1, 2, 4, 8], mid)
    assert scaled[1] == pytest.approx(table[1])
    assert scaled[2][0] == pytest.approx(table[1][0] * _central(list(tight[2, 0] / tight[1, 0])))
    assert scaled[2][0] != pytest.approx(table[2][0])
    # a tight forward stalled once (10x its time) in one of the rounds leaves the prices where they were: the
    # ratio of means over the rounds would have moved the 8-node price at 400 by a third
    stalled = tight.copy()
    stalled[2, 2, 0] *= 10
    again = _in_loop_verify(stalled, cfg, 100, [1, 2, 4, 8], mid, {400: ([1, 2, 4], far)})
    assert again[2][3] == pytest.approx(table[2][3], rel=0.05)
    assert abs(tight[2, 3].mean() / stalled[2, 2].mean() / (tight[2, 3].mean() / tight[2, 2].mean()) - 1) > 0.2
