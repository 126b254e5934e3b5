"""The batch-size schedule (treesearch/schedule.py): batched step costs in closed form, the pick per batch size
against brute force for chain targets, ranges merged and contiguous, and what tree.json carries."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from treesearch.cost import profile_from_json, profile_to_json
from treesearch.replay import Decoding, ReplayResult, RolloutReplay, configuration_json, decoding_of_json, replay
from treesearch.schedule import (
    candidates,
    check_schedule,
    decoding_at,
    on_prompts,
    prefixes,
    schedule_json,
    search_schedule,
    throughput_on_prompts,
)
from treesearch.search import SearchConfig, run_search, write_search
from treesearch.stats import StatsError
from treesearch.targets import TARGETS
from treesearch.tree import chain, load_tree, make_tree, tree_from_json

from .conftest import tiny_llama
from .test_calibration import _heads_that_guess
from .test_workload_replay import _profile, _rollouts, _stats

SIZES = (1, 2, 4, 8, 16)
NODES = (1, 2, 3, 4, 5, 8, 16)


def _batched(per_row_ms: float = 1.0):
    """A profile whose batched step costs 10 ms plus ``per_row_ms`` per verified row (batch x nodes)."""
    table = tuple(tuple(10.0 + per_row_ms * b * n for n in NODES) for b in SIZES)
    return replace(_profile(), batch_sizes=SIZES, batch_nodes=NODES, batch_step_ms=table, batch_context=100)


@pytest.fixture(scope="module")
def fitted():
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=4, seed=1)
    texts, ranks = _rollouts(loaded, heads, 6, 50, 6)
    return _stats(texts, ranks, 4, 6)


def test_batched_step_costs_interpolate_in_nodes_and_batch_and_follow_the_context():
    prof = _batched()
    assert prof.batch_step(4, 3) == pytest.approx(22.0)
    assert prof.batch_step(4, 6) == pytest.approx(10 + 4 * 6)  # between measured nodes 5 and 8
    assert prof.batch_step(3, 2) == pytest.approx(16.0)  # between batch 2 (14) and 4 (18)
    assert prof.batch_step(20, 2) == pytest.approx(10 + 40)  # beyond 16: the last segment extended
    assert prof.batch_step(4, 20) == pytest.approx(10 + 80)  # beyond 16 nodes too
    # each row's attention moves with its context as its own verify does: + B * (verify(n, c) - verify(n, 100))
    assert prof.batch_step(4, 3, 300) == pytest.approx(22.0 + 4 * (prof.verify(3, 300) - prof.verify(3, 100)))
    # the fewest rows measured at >= 2 x the one-row step (11 ms): 4 x 3 = 12 rows (22 ms); 2 x 5 rows cost 20
    assert prof.compute_bound_rows == 12
    back = profile_from_json(json.loads(json.dumps(profile_to_json(prof))))
    assert back == prof and profile_to_json(back)["compute_bound_rows"] == 12
    bad = profile_to_json(prof) | {"batch_sizes": [2, 4, 8, 16, 32]}
    with pytest.raises(StatsError, match="batch_sizes"):
        profile_from_json(bad)
    served = replace(prof, serving_chunk_ms=0.25, serving_step_ms=1.5)
    assert profile_from_json(json.loads(json.dumps(profile_to_json(served)))) == served
    assert served.serving(4) == pytest.approx(2.5) and prof.serving(4) == 0.0
    assert profile_from_json({k: v for k, v in profile_to_json(prof).items()
                              if k not in ("serving_chunk_ms", "serving_step_ms")}) == prof
    for name in ("serving_chunk_ms", "serving_step_ms"):
        with pytest.raises(StatsError, match=name):
            profile_from_json(profile_to_json(prof) | {name: -1.0})
    with pytest.raises(StatsError, match="profile again with --batch-sizes"):
        _profile().batch_step(2, 2)


def _brute_force(stats, latency, batch: int, depth: int, chunk_ms: float, step_ms: float) -> float:
    """Output tokens/s of plain decoding (depth 0) or chain:depth at ``batch``, step by step: each step of a
    request costs a whole batched step of its verified nodes plus serving it (``step_ms``, and a chunk streamed to
    each of the ``batch`` requests), and about ``batch`` prefills join during it."""
    dec = Decoding(chain(depth)) if depth else Decoding()
    tokens = total_ms = 0.0
    for r in replay(dec, stats).rollouts:
        tokens += r.tokens
        total_ms += batch * latency.prefill(r.prompt_tokens)
        for nodes, context in zip(r.verified, r.contexts):
            assert nodes == 1 + (depth if depth else 0)
            total_ms += latency.batch_step(batch, nodes, context) + step_ms + batch * chunk_ms
    return 1000.0 * batch * tokens / total_ms


@pytest.mark.parametrize(("chunk_ms", "step_ms"), [(0.0, 0.0), (0.3, 0.0), (0.3, 1.2)])
@pytest.mark.parametrize("target", ["vllm", "tgi"])
def test_a_chain_targets_pick_at_each_batch_size_is_the_brute_force_best(fitted, target, chunk_ms, step_ms):
    """With and without a cost for serving each step (which makes steps that commit more tokens relatively
    cheaper)."""
    stats = fitted  # these heads' chains commit ~1.05 tokens a step
    latency = replace(_batched(per_row_ms=0.05), serving_chunk_ms=chunk_ms, serving_step_ms=step_ms)
    options = candidates(TARGETS[target], stats.num_heads)
    assert [o.tree.name if o.tree else "plain" for o in options] == ["plain"] + [f"chain:{k}" for k in range(1, 5)]
    ranges = search_schedule(stats, latency, SIZES, options)
    picks = {}
    for r in ranges:
        assert r.predictions[0].batch == r.first  # the range's prediction is at its first size
        assert {p.batch for p in r.predictions} == {r.first} | {b for b in SIZES if r.first <= b <= r.last}
        for b in range(r.first, r.last + 1):
            picks[b] = (r.decoding, next((p for p in r.predictions if p.batch == b), None))
    assert sorted(picks) == list(range(1, 17))
    for b in range(1, 17):  # every live batch size, the unprofiled ones on interpolated steps
        speeds = {k: _brute_force(stats, latency, b, k, chunk_ms, step_ms) for k in range(stats.num_heads + 1)}
        dec, pred = picks[b]
        got = len(dec.tree.paths) if dec.tree is not None else 0
        assert speeds[got] == pytest.approx(max(speeds.values())), (b, speeds)
        if pred is None:
            continue
        assert pred.output_tokens_per_s == pytest.approx(speeds[got])
        assert pred.speedup_vs_plain == pytest.approx(speeds[got] / speeds[0])
        lo, hi = pred.output_tokens_per_s_ci
        assert lo * (1 - 1e-9) <= pred.output_tokens_per_s <= hi * (1 + 1e-9)
    # the step turns compute-bound as rows grow: a chain pays at batch 1, plain decoding wins at 16
    assert picks[1][0].tree is not None and picks[16][0].tree is None
    # ranges: ascending, contiguous from 1 to the largest size, adjacent picks merged
    assert ranges[0].first == 1 and ranges[-1].last == 16
    assert all(a.last + 1 == b.first and a.decoding is not b.decoding for a, b in zip(ranges, ranges[1:]))
    sched = check_schedule(schedule_json(ranges))
    assert decoding_at(sched, 1)["config"] == picks[1][0].label and decoding_at(sched, 100)["config"] == "plain"


def test_rollouts_move_onto_other_prompts_and_stop_at_the_token_cap():
    """on_prompts in closed form: one rollout (1 token from the prefill, then steps committing 2, 1, 3) on prompts
    of 20 and 5 tokens, capped at 4 tokens: two steps kept, contexts moved by the prompts' difference."""
    r = RolloutReplay("a", (2, 1, 3), 7, 0.0, (3, 3, 3), (10, 12, 13), 10)
    got = on_prompts(ReplayResult(Decoding(chain(2)), (r,)), [20, 5], max_new_tokens=4)
    assert [(x.prompt_tokens, x.contexts, x.verified, x.accept_lengths, x.tokens) for x in got.rollouts] == [
        (20, (20, 22), (3, 3), (2, 1), 4), (5, (5, 7), (3, 3), (2, 1), 4)]
    assert on_prompts(ReplayResult(Decoding(), (r,)), [10]).rollouts[0] == replace(r, id="a@10")


@pytest.mark.parametrize("depth", [0, 2])
def test_throughput_on_other_prompts_prices_every_rollout_on_every_prompt(fitted, depth):
    """Against a brute force that prices each (rollout, prompt) pair step by step: B prefills of the prompt and,
    per step, a batched step at the moved context plus serving it; the configuration goes through tree.json."""
    latency = replace(_batched(per_row_ms=0.05), serving_chunk_ms=0.2, serving_step_ms=1.0)
    dec = decoding_of_json(json.loads(json.dumps(configuration_json(Decoding(chain(depth)) if depth else Decoding()))))
    prompts, cap, batch = [7, 30, 64], 20, 4
    tokens = total_ms = 0.0
    for r in replay(dec, stats := fitted).rollouts:
        for p in prompts:
            made = r.tokens - sum(r.accept_lengths)
            total_ms += batch * latency.prefill(p)
            for n, nodes, context in zip(r.accept_lengths, r.verified, r.contexts):
                if made >= cap:
                    break
                made += n
                total_ms += latency.batch_step(batch, nodes, context - r.prompt_tokens + p) + 1.0 + batch * 0.2
            tokens += min(r.tokens, cap)
    assert throughput_on_prompts(stats, latency, dec, batch, prompts, cap) == pytest.approx(
        1000.0 * batch * tokens / total_ms)


def test_trtllm_chooses_among_prefixes_of_its_tree_within_its_limit():
    tree = load_tree("mc_sim_7b_63")
    pre = prefixes(tree, 10)
    assert [len(t.paths) for t in pre] == list(range(1, 11))
    assert all(t.paths == tree.paths[:len(t.paths)] for t in pre)  # what shortening the draft verifies
    options = candidates(TARGETS["trtllm"], 4, make_tree(tree.paths[:70]))
    assert options[0].tree is None and max(len(o.tree.paths) for o in options[1:]) == 63
    own = candidates(TARGETS["own"], 3, chain(2), Decoding(chain(2), lookup=4))
    assert [o.label for o in own] == ["plain", "tree chain:2[:1]", "tree chain:2[:2]", "tree chain:3",
                                      "tree chain:2 +lookup4"]  # chain:1 and chain:2 priced once


def test_gated_chains_are_priced_with_the_heads_a_closed_gate_still_runs(fitted):
    """The own target also chooses the heads' chains behind confidence gates. A step whose gate verified the root
    alone costs the batch's plain step plus the heads' first level (which the gate reads); a step that drafted
    costs the batched step of its nodes. Against a brute force over the replayed steps: the predicted throughput
    at every batch size, and the pick, the best of every candidate so priced."""
    from treesearch.schedule import SCHEDULE_GATES, request_latencies

    stats = fitted
    assert stats.has_gate
    latency = replace(_batched(per_row_ms=0.05), serving_chunk_ms=0.2, serving_step_ms=1.0)
    options = candidates(TARGETS["own"], stats.num_heads, gates=SCHEDULE_GATES)
    gated = [o for o in options if o.gate]
    assert len(gated) == stats.num_heads * len(SCHEDULE_GATES) and all(o.lookup == 0 for o in gated)
    assert not any(o.gate for o in candidates(TARGETS["vllm"], stats.num_heads, gates=SCHEDULE_GATES))
    assert not any(o.gate for o in candidates(TARGETS["trtllm"], 4, chain(2), gates=SCHEDULE_GATES))
    heads_ms = latency.heads_time(chain(1))
    assert heads_ms > 0

    def brute(dec, b):
        tokens = total = 0.0
        for r in replay(dec, stats).rollouts:
            tokens += r.tokens
            total += b * latency.prefill(r.prompt_tokens)
            for nodes, context in zip(r.verified, r.contexts):
                total += latency.batch_step(b, nodes, context) + 1.0 + b * 0.2
                total += heads_ms if dec.gate and nodes == 1 else 0.0
        return 1000.0 * b * tokens / total

    closed = 0
    for dec in gated[:3]:
        res = replay(dec, stats)
        closed += sum(n == 1 for r in res.rollouts for n in r.verified)
        got = request_latencies(res, latency, 4)
        assert 1000.0 * 4 * sum(r.tokens for r in res.rollouts) / sum(got) == pytest.approx(brute(dec, 4))
    assert closed  # the gates closed on some steps: their heads are priced
    ranges = search_schedule(stats, latency, SIZES, options)
    for r in ranges:
        for b in range(r.first, r.last + 1):
            speeds = [brute(o, b) for o in options]
            assert brute(r.decoding, b) == pytest.approx(max(speeds)), b


def test_search_writes_the_schedule_into_tree_json_and_old_files_still_read(tmp_path, fitted):
    stats, latency = fitted, _batched(per_row_ms=0.05)
    cfg = SearchConfig(budget=8, trials=12, storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s",
                       target="vllm")
    res = run_search(stats, cfg, latency, show_progress=False)
    sched = schedule_json(search_schedule(stats, latency, SIZES, candidates(TARGETS["vllm"], stats.num_heads)))
    obj = json.loads(write_search(res, stats, cfg, tmp_path / "t.json", latency_file="l.json",
                                  schedule=sched).read_text())
    assert obj["schema"] == "medusa-tree/2" and obj["schedule"] == sched
    assert obj["medusa_choices"] == res.best_with_heads.tree.as_lists()  # batch 1's reading place is kept
    first = obj["schedule"][0]
    assert first["batch"][0] == 1 and set(first["prediction"]) >= {
        "output_tokens_per_s", "output_tokens_per_s_ci", "speedup_vs_plain", "speedup_vs_plain_ci", "by_batch"}
    old = {"schema": "medusa-tree/1", "medusa_choices": [[0], [0, 0]]}
    assert tree_from_json(old).paths == ((0,), (0, 0))
    with pytest.raises(StatsError, match="contiguously"):
        check_schedule([{"batch": [1, 2], "configuration": {"config": "plain"}},
                        {"batch": [4, 8], "configuration": {"config": "plain"}}])
    wide = {"config": "wide", "medusa_choices": [[0], [1], [1, 0]], "lookup": 0}  # no [0, 0]: no top-1 chain
    for conf, why in (({**wide, "gate": 0.5}, "top-1 chain"), ({**wide, "lookup": -1}, "lookup tokens"),
                      ({"config": "plain", "gate": 0.5}, "needs a heads tree"),
                      ({"config": "bad", "medusa_choices": [[0, 0]]}, "")):
        with pytest.raises(StatsError, match="batch sizes 2-16: .*" + why):  # as the search checks its own
            check_schedule([{"batch": [1, 1], "configuration": wide}, {"batch": [2, 16], "configuration": conf}])


def _scheduled_file(tmp_path, ranges, heads="unconditioned", target="vllm"):
    """A final tree.json (batch 1's configuration on top) with a schedule of ``(first, last, choices)``."""
    from bench.stages.deploy import heads_reference
    from medusa_runtime.heads.medusa import shipped_heads_dir
    from treesearch.tree import tree_to_json, write_json_atomic

    def conf(choices):
        return {"config": "plain" if not choices else f"tree {len(choices)}", "uses_heads": bool(choices),
                "medusa_choices": choices or None, "tree_nodes": len(choices) if choices else None, "lookup": 0,
                "gate": 0.0}

    top = next(c for _, _, c in ranges if c)
    obj = tree_to_json(make_tree(top, name="final"), target=target, configuration=conf(top),
                       heads=heads_reference(shipped_heads_dir(heads)),
                       schedule=[{"batch": [a, b], "configuration": conf(c), "prediction": {}} for a, b, c in ranges])
    return write_json_atomic(tmp_path / f"tree-{target}.json", obj)


def test_vllm_export_refuses_a_schedule_that_switches_the_draft_length_and_keeps_one_that_does_not(tmp_path):
    """vLLM 0.32's Medusa drafter asserts one draft length at every step (vllm/v1/spec_decode/medusa.py,
    MedusaProposer.propose; the engines test shows the engine failing on a switching schedule): a schedule
    whose ranges ask for different chain lengths is refused in one line naming them; one chain at every batch
    size is the fixed configuration."""
    from .test_targets import _cli

    tree = _scheduled_file(tmp_path, [(1, 1, [[0], [0, 0], [0, 0, 0]]), (2, 7, [[0]]), (8, 16, [])])
    proc = _cli("export", "--tree", tree, "--target", "vllm", "--out", tmp_path / "vllm")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "MedusaProposer" in proc.stderr and "(1-1: 3, 2-7: 1, 8-16: 0)" in proc.stderr
    assert not (tmp_path / "vllm").exists()
    same = _scheduled_file(tmp_path, [(1, 3, [[0], [0, 0]]), (4, 16, [[0], [0, 0]])])
    out = tmp_path / "same"
    proc = _cli("export", "--tree", same, "--target", "vllm", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec["num_speculative_tokens"] == 2 and "num_speculative_tokens_per_batch_size" not in spec
    # a tree in any range is refused in one line, naming the range
    bad = _scheduled_file(tmp_path, [(1, 3, [[0], [0, 0]]), (4, 16, [[0], [1]])])
    proc = _cli("export", "--tree", bad, "--target", "vllm", "--out", tmp_path / "bad")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "batch sizes 4-16: vLLM cannot run a tree of 2 nodes" in proc.stderr


def test_trtllm_export_writes_draft_len_schedule_as_its_llm_args_validator_reads_it(tmp_path):
    """tensorrt_llm/llmapi/llm_args.py (DecodingBaseConfig.validate_draft_len_schedule_and_sort): a dict of batch
    size thresholds to draft lengths >= 0, holding batch 1, whose entry equals max_draft_len."""
    from bench.stages.deploy import TRTLLM_OPTIONS

    from .test_targets import _cli

    big = [[0], [1], [0, 0], [2], [0, 1]]
    tree = _scheduled_file(tmp_path, [(1, 3, big), (4, 7, big[:2]), (8, 16, [])], target="trtllm")
    out = tmp_path / "trt"
    proc = _cli("export", "--tree", tree, "--target", "trtllm", "--out", out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / TRTLLM_OPTIONS).read_text())["speculative_config"]
    schedule = {int(k): v for k, v in spec["draft_len_schedule"].items()}
    assert schedule == {1: 5, 4: 2, 8: 0}
    assert 1 in schedule and schedule[1] == spec["max_draft_len"] == len(spec["medusa_choices"])
    assert all(b >= 1 and d >= 0 for b, d in schedule.items())
    # a range whose tree is not a prefix of batch 1's cannot be a shortened draft
    bad = _scheduled_file(tmp_path, [(1, 3, big), (4, 16, [[0], [0, 0]])], target="trtllm")
    proc = _cli("export", "--tree", bad, "--target", "trtllm", "--out", tmp_path / "bad", "--dtype", "float32")
    assert proc.returncode == 2 and "is not a prefix of batch 1's" in proc.stderr
    chains = _scheduled_file(tmp_path, [(1, 1, [[0]]), (2, 16, [])], target="tgi")
    proc = _cli("export", "--tree", chains, "--target", "tgi", "--out", tmp_path / "tgi")
    assert proc.returncode == 2 and "cannot run a schedule" in proc.stderr
