"""Whole configurations replayed on rollouts (heads tree, lookup chain, gate jointly) against the decoder,
the cost model priced per step, and cross-fitting that never reads a fold's own rollouts."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.replay.mtbench import Question
from bench.replay.runner import MethodConfig
from bench.replay.workload import check_disjoint, fold_stats, make_folds, predict_configs
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.measure.calibrate import rollout_statistics
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.cost import LatencyProfile
from treesearch.ngram import NgramIndex
from treesearch.replay import Decoding, gated_depth, replay, replay_rollout
from treesearch.stats import AcceptanceStats, RolloutText, StatsError, load_stats, marginal_from_rollouts, save_stats
from treesearch.tree import load_tree, make_tree

from .conftest import hf_greedy, tiny_llama
from .test_calibration import _heads_that_guess, _path_heads_that_guess


def _rollouts(loaded, heads, n_prompts: int, n: int, topk: int, seed: int = 0):
    """Greedy rollouts of prompts that repeat a phrase (so that lookup drafts hit), with their statistics."""
    texts, ranks = [], []
    for i in range(n_prompts):
        rng = random.Random(seed * 100 + i)
        phrase = [rng.randrange(loaded.vocab_size) for _ in range(5)]
        prompt = phrase * 3 + [rng.randrange(loaded.vocab_size) for _ in range(3)]
        rollout = hf_greedy(loaded, prompt, n)
        st = rollout_statistics(loaded, heads, prompt, rollout, topk)
        texts.append(RolloutText(str(i), tuple(prompt), tuple(rollout), st.gate))
        ranks.append(tuple(st.ranks))
    return texts, ranks


def _stats(texts, ranks, k, topk) -> AcceptanceStats:
    return AcceptanceStats(marginal_from_rollouts(ranks, k, topk), tuple(ranks), (), {"model": "tiny"}, "x",
                           texts=tuple(texts))


def _gate_between(texts) -> float:
    """A gate that drops the whole tree at most steps but not all: a high quantile of head 0's top-1
    probability, so some steps whose first level was accepted lose it."""
    return float(np.quantile(np.concatenate([t.gate[:, 0] for t in texts if t.positions]), 0.7))


@pytest.mark.parametrize("kind", ["official", "path"])
def test_joint_replay_equals_the_decoder_step_by_step(kind):
    """float32: for every configuration (no heads or a tree; lookup 0..5; gate off or on) the replay's
    accept lengths are the decoder's, step for step, on the same prompts."""
    loaded = tiny_llama(vocab=32, seed=2)
    k, topk, n = 4, 6, 50
    heads = _heads_that_guess(loaded, k=k, seed=1) if kind == "official" else _path_heads_that_guess(loaded, k=k)
    texts, ranks = _rollouts(loaded, heads, 4, n, topk)
    stats = _stats(texts, ranks, k, topk)
    tree = make_tree([[0], [1], [0, 0], [0, 1], [2], [0, 0, 0], [1, 0], [0, 0, 0, 0]], name="t")
    gate = _gate_between(texts)
    configs = [Decoding(None, 0), Decoding(None, 4), Decoding(tree, 0), Decoding(tree, 3), Decoding(tree, 5),
               Decoding(tree, 0, gate), Decoding(tree, 4, gate), Decoding(load_tree("chain:2"), 2)]
    seen_gate_cut = seen_lookup_win = False
    for dec in configs:
        res = replay(dec, stats)
        for text, rr in zip(texts, res.rollouts):
            cfg = DecodeConfig(max_new_tokens=n, topk=topk, lookup=LookupConfig(dec.lookup), gate=dec.gate)
            run = MedusaDecoder(loaded, heads if dec.tree else None, dec.tree, config=cfg).generate(list(text.prompt))
            assert run.token_ids == list(text.output)
            assert list(rr.accept_lengths) == run.stats.accept_lengths, (dec.label, text.id)
        if dec.gate:
            ungated = replay(replace(dec, gate=0.0), stats)
            seen_gate_cut |= res.steps > ungated.steps
        if dec.lookup and dec.tree is not None:
            seen_lookup_win |= res.tau > replay(replace(dec, lookup=0), stats).tau
    assert seen_gate_cut and seen_lookup_win  # the fixture really exercises the gate and the lookup chain


def test_replay_walk_by_hand():
    """A rollout written out by hand: rank vectors, drafts and gate, the steps counted on paper."""
    # prompt 7 8 9 7 8; output y1..y8 = 9 7 8 9 5 6 5 6
    text = RolloutText("q", (7, 8, 9, 7, 8), (9, 7, 8, 9, 5, 6, 5, 6),
                       np.array([[0.9, 0.2]] * 7, dtype=np.float32))
    ranks = [(0, 0), (-1, -1), (0, -1), (1, -1), (-1, -1), (-1, -1), (-1, -1)]
    tree = make_tree([[0], [0, 0], [1]])
    # t=0: heads accept 2 (ranks (0, 0)); draft after "8 9" (root 9): trigram "7 8 9" seen at the start ->
    # "7 8" = y2 y3: lookup 2 as well. Commit 3 (y1..y3), t = 3.
    # t=3: ranks (1, -1) -> depth 1 (path [1]); draft after root y4 = 9: "7 8 9" -> "7 8" vs y5 y6 = 5 6: 0.
    # Commit 2, t = 5. t=5: nothing; commit 1, t = 6. t=6: nothing; commit 1, t = 7 = positions: stop.
    res = replay_rollout(Decoding(tree, 2), text, ranks)
    assert res.accept_lengths == (3, 2, 1, 1)
    # the gate at 0.5 cuts level 2 (0.9 * 0.2 < 0.5): t=0 heads 1 but lookup 2 -> still 3
    assert replay_rollout(Decoding(tree, 2, 0.5), text, ranks).accept_lengths == (3, 2, 1, 1)
    assert replay_rollout(Decoding(tree, 0, 0.5), text, ranks).accept_lengths == (2, 2, 1, 1, 1)
    assert replay_rollout(Decoding(None, 0), text, ranks).accept_lengths == (1,) * 7
    assert [gated_depth(np.array([0.9, 0.2], np.float32), 2, g) for g in (0.1, 0.5, 0.95)] == [2, 1, 0]
    with pytest.raises(StatsError, match="top-1 chain"):
        Decoding(make_tree([[1], [1, 0]]), 0, 0.3)
    with pytest.raises(StatsError, match="heads tree"):
        Decoding(None, 2, 0.3)


def test_drafts_are_the_decoders_own():
    """The runtime's lookup module drafts with the very index the replay uses."""
    from medusa_runtime.tree import lookup

    assert lookup.NgramIndex is NgramIndex


def _profile(contexts=(100, 300)) -> LatencyProfile:
    nodes = (1, 2, 4, 8, 16)
    verify = tuple(tuple(10.0 + 0.01 * c + 0.5 * n for n in nodes) for c in contexts)
    return LatencyProfile(nodes, contexts, verify, tuple(11.0 + 0.01 * c for c in contexts), 1.0, 0.5,
                          {"model": "tiny"}, (2, 16), (0.8, 2.0), (1, 2, 16), (0.4, 0.6, 1.0), (10, 100),
                          (5.0, 14.0), 0.05)


def test_cost_model_by_context_and_replay_time_closed_form():
    prof = _profile()
    assert prof.verify(4, 200) == pytest.approx(10 + 2.0 + 2.0)  # linear between contexts 100 and 300
    assert prof.verify(4, 500) == pytest.approx(10 + 5.0 + 2.0)  # the last segment extended
    assert prof.verify(4, 50) == pytest.approx(10 + 1.0 + 2.0)  # held at the shortest context
    assert prof.plain(200) == pytest.approx(13.0)
    assert prof.prefill(55) == pytest.approx(9.5) and prof.prefill(200) == pytest.approx(24.0)
    assert prof.bookkeeping(9) == pytest.approx(0.8)
    # step = heads(tree) + verify(verified) + bookkeeping(verified) [+ lookup]; plain = plain(context) [+ lookup]
    assert prof.step_ms(5, 200, heads_ms=1.5, lookup=True) == pytest.approx(
        1.5 + prof.verify(5, 200) + prof.bookkeeping(5) + 0.05)
    assert prof.step_ms(1, 200, heads_ms=0, lookup=True) == pytest.approx(13.05)
    assert prof.step_ms(3, 200, heads_ms=0) == pytest.approx(prof.verify(3, 200) + prof.bookkeeping(3))
    # heads by tree shape: a 3-node chain scores two levels, a 3-node fan one
    fit = replace(prof, heads_fit=(0.2, 0.5, 0.1), heads_path_conditioned=True)
    fan, chain3 = make_tree([[0], [1]]), load_tree("chain:2")
    assert fit.heads_time(fan) == pytest.approx(0.2 + 0.5 + 0.1) and fit.heads_time(chain3) == pytest.approx(1.4)
    wide = make_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]])  # parents: root, [0], [1], [0, 0]
    assert fit.heads_time(wide) == pytest.approx(0.2 + 3 * 0.5 + 4 * 0.1)
    text = RolloutText("q", (1,) * 20, (2, 3, 2, 3, 2), None)
    ranks = [(0,), (-1,), (0,), (-1,)]
    tree = make_tree([[0]])
    res = replay_rollout(Decoding(tree), text, ranks, prof)  # steps at t = 0 (2 tokens), 2 (2 tokens): contexts 20, 22
    want = prof.prefill(20) + prof.step_ms(2, 20) + prof.step_ms(2, 22)
    assert res.accept_lengths == (2, 2) and res.time_ms == pytest.approx(want)


def test_texts_round_trip_and_are_checked(tmp_path):
    texts = (RolloutText("a", (1, 2), (3, 4, 5), np.array([[0.5, 0.25], [0.125, 1.0]], np.float32)),)
    stats = AcceptanceStats(np.array([[0.5, 0.0], [0.0, 0.5]]), (((0, -1), (1, 0)),), (), {"model": "m"}, "",
                            texts=texts)
    back = load_stats(save_stats(stats, tmp_path / "acc.json"))
    assert back.texts[0].output == (3, 4, 5) and np.array_equal(back.texts[0].gate, texts[0].gate)
    import json

    obj = json.loads((tmp_path / "acc.json").read_text())
    from treesearch.stats import stats_from_json

    bad_gate = json.loads(json.dumps(obj))
    bad_gate["texts"]["rollouts"][0]["output"] = [3, 4]
    with pytest.raises(StatsError, match="gate holds 4 values, expected 1 x 2"):
        stats_from_json(bad_gate)
    del obj["texts"]["rollouts"][0]["gate"]
    obj["texts"]["rollouts"][0]["output"] = [3, 4]
    with pytest.raises(StatsError, match="position for position"):
        stats_from_json(obj)


def _questions(n: int) -> list[Question]:
    cats = ["a", "b", "c", "d"]
    return [Question(i, cats[i % 4], (f"question {i}",)) for i in range(n)]


def test_cross_fitting_never_reads_a_folds_own_rollouts():
    """By construction: each fold's statistics hold no rollout of its questions, and poisoning a fold's own
    rollouts (every guess right) leaves the fold's predictions unchanged while it moves the other folds'."""
    qs = _questions(24)
    replayed = qs[:12]
    folds = make_folds(replayed, 3, seed=1)
    assert sorted(i for f in folds for i in f) == [q.question_id for q in replayed]
    assert all({q.category for q in replayed if q.question_id in f} == {"a", "b", "c", "d"} for f in folds)

    def stats_for(poison: set[int]):
        texts, ranks = [], []
        for q in qs:
            rng = random.Random(q.question_id)  # each question's rollout its own draw: poisoning one moves no other
            out = tuple(rng.randrange(50) for _ in range(30))
            r = tuple((0, 0) if q.question_id in poison else (rng.choice([0, -1]), rng.choice([0, 1, -1]))
                      for _ in range(29))
            texts.append(RolloutText(str(q.question_id), (1, 2, 3), out, None))
            ranks.append(r)
        return _stats(texts, ranks, 2, 3)

    clean = stats_for(set())
    poisoned = stats_for(set(folds[0]))
    per_clean, per_poison = fold_stats(clean, folds), fold_stats(poisoned, folds)
    for fold, st in zip(folds, per_clean):
        assert not {t.id for t in st.texts} & {str(i) for i in fold}
        assert len(st.texts) == 24 - len(fold)
    configs = [MethodConfig("medusa chain:2", "medusa", tree="chain:2"), MethodConfig("plain +lookup4", "plain",
                                                                                     lookup_tokens=4)]
    prof = _profile()
    a = predict_configs(configs, per_clean, folds, prof)
    b = predict_configs(configs, per_poison, folds, prof)
    fa, fb = a["medusa chain:2"].folds, b["medusa chain:2"].folds
    assert fa[0].tau == fb[0].tau and fa[0].speedup == fb[0].speedup  # fold 0 never saw its own poisoned rollouts
    assert fb[1].tau > fa[1].tau and fb[2].tau > fa[2].tau  # the other folds did
    # a configuration restricted to one fold's questions is predicted on that fold only
    only = MethodConfig("searched", "medusa", tree="chain:1", question_ids=folds[2])
    pred = predict_configs([only], per_clean, folds, prof)["searched"]
    assert [f.fold for f in pred.folds] == [2] and not pred.complete  # one fold: shown, not checked
    assert a["medusa chain:2"].complete  # every replayed question: checked


def test_calibration_overlapping_the_replayed_questions_is_refused():
    qs = _questions(6)
    check_disjoint(["something else", "question 10"], qs, allow_overlap=False)
    with pytest.raises(ValueError, match="--allow-overlap"):
        check_disjoint(["question 3 ", "x"], qs, allow_overlap=False)
    check_disjoint(["question 3"], qs, allow_overlap=True)


@torch.no_grad()
def test_gate_probabilities_follow_the_top1_chain():
    """Calibration's gate array: head j conditioned on head j-1's own top-1 guess (not the true token)."""
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _path_heads_that_guess(loaded, k=3)
    prompt = [3, 1, 4, 1, 5]
    rollout = hf_greedy(loaded, prompt, 12)
    st = rollout_statistics(loaded, heads, prompt, rollout, 5)
    embed = loaded.model.get_input_embeddings()
    lm = loaded.model.get_output_embeddings().weight
    for i in range(len(rollout) - 1):
        h = loaded.model(torch.tensor([prompt + rollout[:i]]), output_hidden_states=True).hidden_states[-1][0, -1]
        root = embed(torch.tensor(rollout[i]))
        parent, want = None, []
        for j in range(3):
            state = heads.conditioned_state(j, h, root, None if j == 0 else embed(parent))
            p = torch.softmax(state @ lm.T, -1)
            want.append(float(p.max()))
            parent = p.argmax()
        np.testing.assert_allclose(st.gate[i], want, rtol=1e-5)


def _records(speeds: dict[str, float], questions=range(6), taus: dict[str, list[int]] | None = None) -> list[dict]:
    """Replay records with closed-form numbers: 100 tokens per question, time = 100 / speed * (1 + q / 10)."""
    rows = []
    for name, speed in speeds.items():
        method = "plain" if name.startswith("plain") else "medusa"
        for q in questions:
            lengths = (taus or {}).get(name, [1] * 99)
            rows.append({"config": name, "method": method, "question_id": q, "category": "c", "turn": 0, "repeat": 0,
                         "new_tokens": 100, "wall_time": 100 / speed * (1 + q / 10), "steps": len(lengths),
                         "accept_lengths": lengths, "temperature": 0.0, "token_ids": [q, 1, 2]})
    return rows


def test_scorecard_measures_paired_speedups_and_writes_report_json(tmp_path):
    import json

    import pandas as pd

    from bench.replay.workload import ConfigPrediction, FoldPrediction
    from bench.report.scorecard import REPORT_SCHEMA, scorecard, verdict, write_report

    speeds = {"plain": 20.0, "plain +lookup4": 22.0, "medusa chain:1": 25.0, "searched": 24.5}
    df = pd.DataFrame(_records(speeds, taus={"medusa chain:1": [2, 1] * 33, "searched": [2, 2, 1] * 22}))
    configs = [MethodConfig("plain", "plain"), MethodConfig("plain +lookup4", "plain", lookup_tokens=4),
               MethodConfig("medusa chain:1", "medusa", tree="chain:1"),
               MethodConfig("searched", "medusa", tree="chain:2", question_ids=(0, 1, 2)),
               MethodConfig("searched", "medusa", tree="chain:2", question_ids=(3, 4, 5))]
    fold = FoldPrediction(0, 6, 1.55, 1.2, (1.5, 1.6), 5000)
    preds = {"medusa chain:1": ConfigPrediction("medusa chain:1", 1.55, 1.2, (fold,))}
    card = scorecard(df, configs, preds).set_index("config")
    # every question takes the same share longer under plain: the paired interval collapses onto the point
    assert card.loc["medusa chain:1", "speedup_vs_plain"] == pytest.approx(1.25)
    assert card.loc["medusa chain:1", "speedup_vs_plain_ci"] == pytest.approx((1.25, 1.25))
    assert card.loc["medusa chain:1", "tau"] == pytest.approx(1.5) and card.loc["searched", "tau"] == pytest.approx(5 / 3)
    assert card.loc["medusa chain:1", "tau_error"] == pytest.approx(1.55 / 1.5 - 1)
    assert card.loc["medusa chain:1", "speedup_error"] == pytest.approx(1.2 / 1.25 - 1)
    assert card.loc["plain +lookup4", "lookup"] == 4 and not card.loc["plain +lookup4", "uses_heads"]
    assert card.loc["searched", "tree_nodes"] == 2 and card.loc["searched", "searched"]
    summary = verdict(card.reset_index())
    assert summary["fastest"] == "medusa chain:1" and summary["searched_vs_fastest"] == pytest.approx(24.5 / 25)
    assert not summary["searched_is_fastest"] and summary["predictions"] == 1
    # tau predicted 3.3 % high: outside the 3 % tolerance; speed-up 4 % low: inside the 5 % one
    assert not summary["tau_within_tolerance"] and summary["speedup_within_tolerance"]
    assert summary["worst_tau_error"] == pytest.approx(1.55 / 1.5 - 1)
    # Medusa alone: the fastest greedy configuration with the main heads and no lookup chain
    assert summary["fastest_heads_only"] == "medusa chain:1"
    assert summary["fastest_heads_only_speedup"] == pytest.approx(1.25)
    with_lookup = card.reset_index()
    row = with_lookup["config"] == "plain +lookup4"  # heads and a lookup chain, faster: not Medusa alone
    with_lookup.loc[row, ["uses_heads", "speedup_vs_plain"]] = [True, 2.0]
    assert verdict(with_lookup)["fastest_heads_only"] == "medusa chain:1"
    path = write_report(card.reset_index(), summary, {"questions": {"replayed": [0, 1]}}, tmp_path / "report.json")
    obj = json.loads(path.read_text())
    assert obj["schema"] == REPORT_SCHEMA and obj["questions"] == {"replayed": [0, 1]}
    names = {"config", "uses_heads", "lookup", "tree_nodes", "tokens_per_s", "tau", "speedup_vs_plain",
             "speedup_vs_plain_ci", "predicted_tau", "predicted_speedup_vs_plain", "searched", "identical_to_plain"}
    assert all(names <= set(c) for c in obj["configs"])
    plain = next(c for c in obj["configs"] if c["config"] == "plain")
    assert plain["predicted_tau"] is None and plain["speedup_vs_plain"] == 1.0 and plain["identical_to_plain"] == 1.0


def test_replayed_questions_are_a_seeded_sample_spread_over_categories():
    from bench.replay.workload import sample_over_categories

    qs = [Question(i, "abc"[i % 3] if i < 60 else "d", (f"q{i}",)) for i in range(70)]  # d: 10 questions
    picked = sample_over_categories(qs, 12)
    assert picked == sample_over_categories(qs, 12)  # seeded
    assert len({q.question_id for q in picked}) == 12 and all(q in qs for q in picked)
    assert sorted(q.category for q in picked) == sorted("aaabbbcccddd")  # as even as the categories allow
    assert [q.question_id for q in picked] != [q.question_id for q in qs[:12]]  # not the first questions
    assert len(sample_over_categories(qs, 100)) == 70


def test_mean_profile_is_the_elementwise_mean_and_refuses_other_grids():
    """Profiles before and after a replay average field by field; every priced step is then the mean of the two
    (the cost model is linear in the profile's times), and profiles on different grids are refused."""
    from dataclasses import replace

    from treesearch.cost import mean_profile
    from treesearch.stats import StatsError

    a = _profile()
    b = replace(a, verify_ms=tuple(tuple(2 * x for x in r) for r in a.verify_ms), plain_ms=(20.0, 30.0),
                bookkeeping_by_nodes_ms=(1.0, 1.0, 1.0), prefill_ms=(6.0, 20.0), lookup_ms=0.15)
    m = mean_profile([a, b])
    for n, c in ((1, 100), (4, 200), (16, 500)):
        assert m.verify(n, c) == pytest.approx((a.verify(n, c) + b.verify(n, c)) / 2)
    assert m.plain(200) == pytest.approx((a.plain(200) + b.plain(200)) / 2)
    assert m.bookkeeping(9) == pytest.approx((a.bookkeeping(9) + b.bookkeeping(9)) / 2)
    assert m.prefill(55) == pytest.approx((a.prefill(55) + b.prefill(55)) / 2)
    assert m.lookup_ms == pytest.approx(0.1) and m.meta["averaged_profiles"] == 2 and m.meta["model"] == "tiny"
    assert mean_profile([a]) == a
    with pytest.raises(StatsError, match="different grids"):
        mean_profile([a, _profile(contexts=(100, 400))])
