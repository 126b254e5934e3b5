"""The bandwidth floor: the median's distribution-free interval against the binomial closed form, the per-round
floor ratios against hand computation, and the copy probe against the bytes it moves."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binom

from medusa_runtime.measure.bandwidth import (
    FloorProbe,
    floor_line,
    floor_pairs,
    floor_summary,
    generate_kv_bytes,
    kv_bytes_per_position,
    median_interval,
    pairs_summary,
    weight_bytes,
)

from .conftest import tiny_llama


@pytest.mark.parametrize("n", [6, 9, 24, 40, 101])
def test_median_interval_is_the_narrowest_symmetric_pair_with_95_percent_coverage(n):
    xs = [float(i) for i in range(1, n + 1)]  # x_(i) = i, so the interval names the order statistics
    lo, hi = median_interval(xs[::-1])  # order of the input does not matter
    r, s = int(lo), int(hi)
    assert s == n + 1 - r  # symmetric
    cover = binom.cdf(n - r, n, 0.5) - binom.cdf(r - 1, n, 0.5)  # P(r <= B <= n - r)
    assert cover >= 0.95
    if r < (n + 1) // 2:  # one rank narrower would fall short
        assert binom.cdf(n - r - 1, n, 0.5) - binom.cdf(r, n, 0.5) < 0.95


def test_median_interval_of_too_few_values_is_their_range():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)  # n = 5: even the range covers 93.75 %


def test_floor_summary_compares_each_round_with_its_own_bandwidth():
    weights = 270_000_000
    plain = [9.0, 6.0, 7.5]
    bw = [30.0, 45.0, 0.0]  # the last round had no probe
    got = floor_summary(weights, plain, bw)
    floors = [weights / (b * 1e9) * 1000 for b in bw[:2]]  # 9.0 and 6.0 ms
    assert got["rounds"] == 2 and got["floor_ms"] == pytest.approx(sum(floors) / 2)
    assert got["plain_over_floor"] == pytest.approx(1.0)  # both rounds ran exactly at their floor
    assert got["bandwidth_gbs"] == pytest.approx(37.5) and got["plain_ms"] == pytest.approx(7.5)
    assert floor_summary(weights, [1.0], [0.0]) == {}
    with_kv = floor_summary(weights, plain, bw, kv=30_000_000)  # 300 MB a step in all: floors 10 and 6.67 ms
    assert with_kv["plain_over_floor"] == pytest.approx((0.9 + 0.9) / 2)
    assert with_kv["plain_over_weights_floor"] == pytest.approx(1.0) and with_kv["kv_bytes"] == 30_000_000
    lo, hi = with_kv["plain_over_floor_95"]
    assert lo == pytest.approx(0.9) and hi == pytest.approx(0.9)


def test_kv_bytes_are_every_layers_keys_and_values_at_the_mean_context():
    loaded = tiny_llama()
    cfg = loaded.model.config
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) \
        * loaded.model.model.embed_tokens.weight.element_size()
    assert kv_bytes_per_position(loaded) == per_position
    # a plain decoder's cache after a generate: positions = prompt + new - 1 (the last token is never forwarded)
    from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder

    dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=5, stop_on_eos=False))
    cache = dec.new_cache(20)
    dec.prefill(torch.arange(7), cache)
    assert (cache.keys.numel() + cache.values.numel()) * cache.keys.element_size() == per_position * 20
    assert generate_kv_bytes(loaded, 7, 5) == round(per_position * 9.5)


def test_weight_bytes_counts_tied_tensors_once_and_the_probe_moves_its_bytes():
    loaded = tiny_llama()
    params = {p.data_ptr(): p.numel() * p.element_size() for p in loaded.model.parameters()}
    assert weight_bytes(loaded) == sum(params.values())
    probe = FloorProbe(nbytes=8 << 20)
    assert probe.gbs(repeats=3) > 0 and bool((probe.dst == 1).all())


def test_pairs_take_the_harmonic_mean_of_their_probes_and_floor_pairs_time_a_plain_generate():
    weights = 300_000_000
    got = pairs_summary(weights, [(10.0, 20.0, 60.0)])  # floors 15 and 5 ms: their mean 10 ms, at 30 GB/s
    assert got["bandwidth_gbs"] == pytest.approx(30.0) and got["floor_ms"] == pytest.approx(10.0)
    assert got["plain_over_floor"] == pytest.approx(1.0)
    summary = floor_pairs(tiny_llama(), rounds=3, prompt_tokens=16, new_tokens=4)
    assert summary["rounds"] == 3 and summary["context"] == 16 and summary["plain_ms"] > 0
    lo, hi = summary["plain_over_floor_95"]
    assert lo <= summary["plain_over_floor"] <= hi
    assert summary["kv_bytes"] == generate_kv_bytes(tiny_llama(), 16, 4)
    assert summary["plain_over_floor"] < summary["plain_over_weights_floor"]  # more bytes, a later floor
    assert "x its bandwidth floor" in floor_line(summary) and "the weights' alone" in floor_line(summary)
