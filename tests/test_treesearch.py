"""treesearch: estimators, the exact optimum against brute force, the Optuna study, exporters, bad input."""

from __future__ import annotations

import csv
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import optuna
import pytest
import sqlalchemy

from bench.cli import main
from treesearch.cost import LATENCY_SCHEMA, LatencyProfile, load_profile, predict, profile_from_json, save_profile
from treesearch.export import export_tree
from treesearch.optimal import (
    Constraints,
    IndependentModel,
    JointModel,
    expected_depth,
    greedy_grown_tree,
    optimal_tree,
)
from treesearch.search import _setup_lock, make_storage
from treesearch.stats import (
    ACCEPTANCE_SCHEMA,
    AcceptanceStats,
    StatsError,
    decode_ranks,
    encode_ranks,
    load_stats,
    marginal_from_rollouts,
    marginal_from_topk_accuracy,
    save_stats,
    stats_from_json,
    tau_independent,
    tau_position_average,
    tau_step_walk,
)
from treesearch.tree import load_tree, make_tree

from .conftest import DATA


def vicuna_7b_marginal() -> np.ndarray:
    """Official Medusa Vicuna-7B head top-1..5 training accuracies -> per-rank probabilities."""
    with (DATA / "medusa" / "medusa_acc.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    row = next(r for r in rows if r["Name"] == "7b")
    acc = [[float(row[f"train/medusa{j}_top{k}"]) for k in range(1, 6)] for j in range(5)]
    return marginal_from_topk_accuracy(acc)


def synthetic_rollouts(seed: int, sequences: int = 30, length: int = 60, heads: int = 3, topk: int = 4):
    """Correlated rank vectors: a head is more likely right when the previous one was."""
    rng = random.Random(seed)
    out = []
    for _ in range(sequences):
        seq = []
        for _ in range(length):
            ranks, ok = [], True
            for j in range(heads):
                p_hit = (0.7 if ok else 0.2) * (0.8 ** j)
                if rng.random() < p_hit:
                    ranks.append(min(int(rng.expovariate(1.2)), topk - 1))
                else:
                    ranks.append(-1)
                ok = ranks[-1] == 0
            seq.append(tuple(ranks))
        out.append(tuple(seq))
    return tuple(out)


def all_prefix_closed(universe, n):
    for subset in itertools.combinations(universe, n):
        s = set(subset)
        if all(len(p) == 1 or p[:-1] in s for p in s):
            yield s


@pytest.mark.parametrize("source", ["independent", "joint"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_top_n_is_exactly_optimal_against_brute_force(source, n):
    rng = np.random.default_rng(n)
    if source == "independent":
        m = rng.dirichlet(np.ones(4), size=2)[:, :3]  # 2 heads, 3 ranks, rows sum < 1
        model = IndependentModel(m)
    else:
        model = JointModel(synthetic_rollouts(n, sequences=5, length=40, heads=2, topk=3))
    universe = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    best = max(sum(model.prob(p) for p in s) for s in all_prefix_closed(universe, n))
    tree, tau = optimal_tree(model, n)
    assert tree.num_nodes - 1 == n
    assert tau == pytest.approx(1 + best, abs=1e-12)
    assert tau == pytest.approx(1 + expected_depth(tree, model), abs=1e-12)


def test_must_show_vicuna_optimum_beats_mc_sim(tmp_path, capsys):
    m = vicuna_7b_marginal()
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "vicuna-7b-v1.3 (official accuracies)",
                               "marginal": m.tolist()}))
    out = tmp_path / "tree.json"
    code = main(["search", "--acceptance", str(acc), "--budget", "63", "--objective", "tau", "--trials", "12",
                 "--storage", f"sqlite:///{tmp_path / 'study.db'}", "--study", "vicuna", "--out", str(out),
                 "--quiet"])
    assert code == 0
    tree_json = json.loads(out.read_text())
    assert tree_json["schema"] == "medusa-tree/2" and tree_json["num_nodes"] == 64
    assert tree_json["predicted_tau"] == pytest.approx(2.3845, abs=5e-5)
    mc_sim = tau_independent(load_tree("mc_sim_7b_63"), m)
    assert mc_sim == pytest.approx(2.34, abs=5e-3)
    assert tree_json["predicted_tau"] > mc_sim
    tree = load_tree(str(out))
    assert tau_independent(tree, m) == pytest.approx(tree_json["predicted_tau"], abs=1e-6)
    # the official greedy growth reaches the same optimum under independence
    grown = greedy_grown_tree(IndependentModel(m), 63, max_depth=5, topk=5)
    assert tau_independent(grown, m) == pytest.approx(2.3845, abs=5e-5)
    printed = capsys.readouterr().out
    assert "exact optimum" in printed and "mc_sim_7b_63" in printed


def test_estimators_agree_and_walk_replays_the_decoder():
    rollouts = synthetic_rollouts(0)
    tree = make_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    joint = JointModel(rollouts)
    assert tau_position_average(tree, rollouts) == pytest.approx(1 + expected_depth(tree, joint))
    # walk by hand: a step at t commits 1 + depth(t) tokens and jumps past them
    paths = set(tree.paths)
    lengths = []
    for seq in rollouts:
        t = 0
        while t < len(seq):
            d = 0
            while d < len(seq[t]) and seq[t][d] >= 0 and tuple(seq[t][: d + 1]) in paths:
                d += 1
            lengths.append(1 + d)
            t += lengths[-1]
    walk = tau_step_walk(tree, rollouts)
    assert list(walk.accept_lengths) == lengths and walk.tau == pytest.approx(np.mean(lengths))
    # independence ignores the correlation built into the rollouts, so it underestimates here
    marginal = marginal_from_rollouts(rollouts, 3, 4)
    assert tau_independent(tree, marginal) < tau_position_average(tree, rollouts)


def test_step_walk_interval_is_a_bootstrap_over_whole_rollouts():
    """The interval equals a direct percentile bootstrap (resample rollouts, pool their tokens and
    steps), holds the point estimate, collapses for identical rollouts and widens with fewer of them."""
    from treesearch.stats import step_walk_interval

    rollouts = synthetic_rollouts(7)
    tree = make_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    lo, hi = step_walk_interval(tree, rollouts, reps=500, seed=3)
    # reference: the same resampling drawn the same way, one resample at a time
    per = [tau_step_walk(tree, [seq]) for seq in rollouts]
    draws = np.random.default_rng(3).integers(0, len(per), size=(500, len(per)))
    taus = sorted(sum(per[i].tokens for i in row) / sum(per[i].steps for i in row) for row in draws)
    assert (lo, hi) == pytest.approx(tuple(np.quantile(taus, [0.025, 0.975])), abs=1e-12)
    point = tau_step_walk(tree, rollouts).tau
    assert lo < point < hi and min(w.tau for w in per) <= lo and hi <= max(w.tau for w in per)
    same = step_walk_interval(tree, [rollouts[0]] * 5)
    assert same == pytest.approx((per[0].tau, per[0].tau), abs=1e-12)
    few = step_walk_interval(tree, rollouts[:3], reps=500, seed=3)
    assert few[1] - few[0] > hi - lo
    with pytest.raises(StatsError):
        step_walk_interval(tree, [], reps=10)
    with pytest.raises(StatsError):
        step_walk_interval(tree, rollouts, level=1.0)


def test_calibrate_table_prints_each_trees_interval():
    from bench.stages.measure import format_replay_rows, replay_rows

    rollouts = synthetic_rollouts(8)
    stats = AcceptanceStats(marginal_from_rollouts(rollouts, 3, 4), rollouts, rollouts[:5], {"model": "m"})
    rows = [r.split("|")[1:-1] for r in format_replay_rows(replay_rows(stats)).splitlines()[2:]]
    assert [r[0].strip() for r in rows] == ["chain:3", "optimal-16", "optimal-32", "optimal-64"]
    for r in rows:
        tau = float(r[2])
        lo, hi = (float(x) for x in r[3].split("-"))
        assert lo <= tau <= hi and float(r[4]) > 1


def test_search_scores_joint_trees_by_the_step_walk(tmp_path):
    """With rollouts, every trial's tau is the step walk the decoder realises, not the position average."""
    from treesearch.search import SearchConfig, run_search

    rollouts = synthetic_rollouts(3)
    stats = AcceptanceStats(marginal_from_rollouts(rollouts, 3, 4), rollouts, (), {"model": "m"})
    res = run_search(stats, SearchConfig(budget=12, trials=8, objective="tau", storage=f"sqlite:///{tmp_path / 's.db'}"),
                     show_progress=False)
    for score in (res.best, res.optimum):
        assert score.tau == pytest.approx(tau_step_walk(score.tree, rollouts).tau, abs=1e-12)
        assert score.tau < tau_position_average(score.tree, rollouts)  # acceptance comes in runs here
    assert res.best.tau >= res.optimum.tau


def test_constraints_limit_depth_and_ranks():
    m = vicuna_7b_marginal()
    tree, _ = optimal_tree(IndependentModel(m), 30, Constraints(max_depth=2, rank_caps=(3, 2)))
    assert tree.depth <= 2 and all(p[0] < 3 for p in tree.paths) and all(p[1] < 2 for p in tree.paths if len(p) > 1)


def test_stats_file_roundtrip_and_bad_files(tmp_path):
    rollouts = synthetic_rollouts(1, sequences=4, length=10)
    stats = AcceptanceStats(marginal_from_rollouts(rollouts, 3, 4), rollouts, rollouts[:1], {"model": "m"})
    path = save_stats(stats, tmp_path / "a.json")
    again = load_stats(path)
    assert again.rollouts == rollouts and again.heldout == rollouts[:1] and again.meta["model"] == "m"
    assert len(again.sha256) == 64
    assert decode_ranks(encode_ranks([0, 11, -1])) == [0, 11, -1]
    bad = {
        "outside": ({"schema": ACCEPTANCE_SCHEMA, "marginal": [[1.2, 0.0]]}, "outside"),
        "sum": ({"schema": ACCEPTANCE_SCHEMA, "marginal": [[0.6, 0.5]]}, "sums to"),
        "schema": ({"schema": "x/1", "marginal": [[0.1]]}, "schema"),
        "rollouts": ({"schema": ACCEPTANCE_SCHEMA, "marginal": [[0.1, 0.1]], "rollouts": ["0?"]}, "characters"),
    }
    for obj, msg in bad.values():
        with pytest.raises(StatsError, match=msg):
            stats_from_json(obj)


def _latency(model: str = "m") -> LatencyProfile:
    nodes = (1, 2, 4, 8, 16, 32, 64)
    return LatencyProfile(nodes, (128,), (tuple(30 + 0.5 * n for n in nodes),), (30.0,), 2.0, 1.0,
                          {"model": model, "dtype": "bfloat16", "device": "cpu"})


def test_cost_model_closed_form():
    prof = _latency()
    pred = predict(prof, tau=2.0, num_nodes=16)
    step = 2.0 + (30 + 8.0) + 1.0
    assert pred.step_ms == pytest.approx(step) and pred.speedup == pytest.approx((2.0 / step) / (1 / 30.0))
    assert prof.verify(12) == pytest.approx(30 + 6.0)  # linear interpolation between 8 and 16


def test_cost_model_heads_time_by_tree_size(tmp_path):
    """Heads timed per tree size (path-conditioned heads grow with the parents): step = heads(n) + verify(n)
    + bookkeeping, heads interpolated between the timed sizes and held flat outside; the JSON round-trips."""
    prof = replace(_latency(), heads_nodes=(4, 16, 64), heads_by_nodes_ms=(1.0, 3.0, 7.0))
    assert [prof.heads(n) for n in (2, 4, 10, 16, 40, 64, 200)] == pytest.approx([1.0, 1.0, 2.0, 3.0, 5.0, 7.0, 7.0])
    assert predict(prof, tau=2.0, num_nodes=10).step_ms == pytest.approx(2.0 + (30 + 5.0) + 1.0)
    assert prof.step_ms(1) == pytest.approx(30.0)  # the plain step has no heads
    back = load_profile(save_profile(prof, tmp_path / "lat.json"))
    assert back == prof and back.heads(40) == pytest.approx(5.0)
    # an older file without the per-size points keeps the one heads_ms for every tree
    obj = json.loads((tmp_path / "lat.json").read_text())
    for key in ("heads_nodes", "heads_by_nodes_ms"):
        del obj[key]
    assert profile_from_json(obj).heads(40) == pytest.approx(2.0)
    for bad in ({"heads_nodes": [16, 4]}, {"heads_nodes": [4]}, {"heads_nodes": [1, 4, 16]},
                {"heads_by_nodes_ms": [1.0, -1.0, 2.0]}):
        with pytest.raises(StatsError, match="heads_nodes"):
            profile_from_json({**obj, "heads_nodes": [4, 16, 64], "heads_by_nodes_ms": [1.0, 3.0, 7.0], **bad})


def test_cost_model_prices_what_sampling_adds_to_a_step_only_for_sampled_steps(tmp_path):
    """A typical-acceptance step pays the profile's sampling extra (interpolated by verified nodes); a greedy one
    does not; two profiles average it; the JSON round-trips, and an older file without it counts 0."""
    from treesearch.cost import mean_profile

    prof = replace(_latency(), sampling_nodes=(1, 4, 16), sampling_extra_ms=(0.2, 0.6, 1.8))
    greedy, sampled = predict(prof, 2.0, 10), predict(prof, 2.0, 10, sampled=True)
    assert sampled.step_ms == pytest.approx(greedy.step_ms + 1.2) and sampled.speedup < greedy.speedup
    assert prof.sampling_extra(64) == pytest.approx(1.8) and prof.sampling_extra(1) == pytest.approx(0.2)
    back = load_profile(save_profile(prof, tmp_path / "lat.json"))
    assert back == prof
    other = replace(prof, sampling_extra_ms=(0.4, 1.0, 2.2))
    assert mean_profile([prof, other]).sampling_extra_ms == pytest.approx((0.3, 0.8, 2.0))
    obj = json.loads((tmp_path / "lat.json").read_text())
    for key in ("sampling_nodes", "sampling_extra_ms"):
        del obj[key]
    old = profile_from_json(obj)
    assert old.sampling_extra(8) == 0.0 and predict(old, 2.0, 10, sampled=True).step_ms == greedy.step_ms
    with pytest.raises(StatsError, match="sampling_nodes"):
        profile_from_json({**obj, "sampling_nodes": [4, 1], "sampling_extra_ms": [1.0, 0.5]})


def test_search_speedup_objective_prefers_smaller_trees(tmp_path):
    m = vicuna_7b_marginal()
    acc = tmp_path / "a.json"
    acc.write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "m", "marginal": m.tolist()}))
    lat = save_profile(_latency(), tmp_path / "lat.json")
    out = tmp_path / "t.json"
    assert main(["search", "--acceptance", str(acc), "--latency", str(lat), "--budget", "63", "--trials", "40",
                 "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(out), "--quiet"]) == 0
    obj = json.loads(out.read_text())
    # with verify cost growing 0.5 ms a node, the fastest tree is smaller than the budget allows
    assert obj["predicted_speedup"] > predict(_latency(), tau_independent(load_tree("mc_sim_7b_63"), m), 64).speedup
    assert obj["num_nodes"] < 64 and obj["search"]["objective"] == "speedup"


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"marginal": [[1.5, 0.1]]}, "outside [0, 1]"),
        ({"marginal": [[0.7, 0.6]]}, "sums to"),
        ({"schema": "nope"}, "schema"),
    ],
)
def test_search_cli_bad_statistics(tmp_path, capsys, patch, message):
    obj = {"schema": ACCEPTANCE_SCHEMA, "marginal": [[0.5, 0.1]], **patch}
    (tmp_path / "a.json").write_text(json.dumps(obj))
    code = main(["search", "--acceptance", str(tmp_path / "a.json"), "--budget", "4", "--quiet",
                 "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "t.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


def test_search_cli_budget_and_latency_errors(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "m", "marginal": [[0.5]]}))
    base = ["search", "--acceptance", str(tmp_path / "a.json"), "--quiet", "--out", str(tmp_path / "t.json"),
            "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    assert main(base + ["--budget", "0"]) == 2
    assert "budget must be >= 1" in capsys.readouterr().err
    lat = save_profile(_latency(model="another-model"), tmp_path / "lat.json")
    assert main(base + ["--budget", "3", "--latency", str(lat)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another-model" in err[0]
    bad = tmp_path / "lat_bad.json"
    bad.write_text(json.dumps({"schema": LATENCY_SCHEMA, "nodes": [4, 2], "contexts": [1], "verify_ms": [[1, 1]],
                               "plain_ms": [1], "heads_ms": 0}))
    assert main(base + ["--budget", "3", "--latency", str(bad)]) == 2
    assert "ascending" in capsys.readouterr().err


def _worker(tmp_path, trials, study="shared", extra=()):
    acc = tmp_path / "a.json"
    if not acc.exists():
        acc.write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "m",
                                   "marginal": vicuna_7b_marginal().tolist()}))
    cmd = [sys.executable, "-m", "bench.cli", "search", "--acceptance", str(acc), "--budget", "40", "--trials",
           str(trials), "--storage", f"sqlite:///{tmp_path / 'shared.db'}", "--study", study, "--quiet",
           "--out", str(tmp_path / f"tree-{os.getpid()}-{time.monotonic_ns()}.json"), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_workers_share_one_sqlite_study(tmp_path):
    workers = [_worker(tmp_path, 30), _worker(tmp_path, 30)]
    outs = [w.communicate(timeout=300) for w in workers]
    for w, (_out, err) in zip(workers, outs):
        assert w.returncode == 0, err
        assert "Traceback" not in err
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{tmp_path / 'shared.db'}")
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 30
    assert optuna.trial.TrialState.FAIL not in states and optuna.trial.TrialState.RUNNING not in states
    numbers = [t.number for t in study.trials]
    assert len(numbers) == len(set(numbers))


def test_killed_search_resumes(tmp_path):
    # a slow study (many trials) killed after a few are recorded
    w = _worker(tmp_path, 5000, study="resume")
    try:
        db = tmp_path / "shared.db"
        deadline = time.time() + 300
        done = 0
        while time.time() < deadline:
            time.sleep(0.5)
            if db.exists():
                try:  # the worker may still be creating the study, or hold the write lock for a moment;
                    # opening the storage creates its schema when missing: under the workers' setup lock
                    with _setup_lock(f"sqlite:///{db}"):
                        storage = make_storage(f"sqlite:///{db}")
                    s = optuna.load_study(study_name="resume", storage=storage)
                    done = len(s.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
                except (KeyError, sqlalchemy.exc.OperationalError):
                    continue
                if done >= 5:
                    break
    finally:  # never leave the worker running, whatever failed
        w.send_signal(signal.SIGKILL)
        w.communicate()
    assert done >= 5
    before = len(optuna.load_study(study_name="resume", storage=f"sqlite:///{db}").trials)
    again = _worker(tmp_path, before + 10, study="resume")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    study = optuna.load_study(study_name="resume", storage=f"sqlite:///{db}")
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) >= before + 10 - 1  # the killed worker's running trial is failed, not counted


def test_exporters():
    tree = make_tree([[0], [0, 0], [1]], name="small")
    assert export_tree(tree, "python") == "small = [[0], [1], [0, 0]]"
    assert export_tree(tree, "trtllm") == '--medusa_choices="[[0], [1], [0, 0]]"'
    assert json.loads(export_tree(make_tree([[0], [0, 0]]), "vllm")) == {"method": "medusa", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="unknown export format"):
        export_tree(tree, "onnx")
