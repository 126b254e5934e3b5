"""The learning curve: its log-linear fit against closed forms, and the command end to end on the real default
model (tiny sizes): each point's figures are the calibration's own, the prefixes nest, a rerun resumes."""

from __future__ import annotations

import json
import math

import pytest

from bench.cli import main
from bench.replay.suites import load_suite, write_questions
from bench.report.learning_curve import curve_fits, curve_table, log_fit, point_row
from treesearch.stats import load_stats


def test_the_fit_recovers_a_log_linear_curve_and_where_it_meets_the_target():
    tokens = [1e5, 3e5, 1e6]
    fit = log_fit(tokens, [0.3 + 0.05 * math.log10(t / 1e5) for t in tokens], target=0.4)
    assert fit["per_10x"] == pytest.approx(0.05) and fit["tokens_at_target"] == pytest.approx(1e7, rel=1e-3)
    flat = log_fit(tokens, [0.3, 0.29, 0.28], target=0.5)
    assert flat["per_10x"] < 0 and flat["tokens_at_target"] is None
    assert log_fit([1e5], [0.3], 0.5)["per_10x"] is None
    slow = log_fit(tokens, [0.3, 0.3001, 0.3002], target=2.5)  # 1e4 decades away: out of reach, no overflow
    assert slow["per_10x"] > 0 and slow["tokens_at_target"] is None
    assert "does not reach 2.5 within 1e15 tokens" in curve_table({"points": [], "fits": {"tau32": slow}})


def test_the_last_pair_shows_a_bend_the_overall_fit_averages_away():
    rows = [{"train_tokens": t, "head0_top1": y, "tau32": 1.0 + y} for t, y in ((1e4, 0.2), (1e5, 0.3), (1e6, 0.35))]
    fits = curve_fits(rows)
    assert fits["head0_top1"]["per_10x"] == pytest.approx(0.075)
    pair = fits["head0_top1"]["last_pair"]
    assert pair["per_10x"] == pytest.approx(0.05) and pair["tokens_at_target"] == pytest.approx(1e9, rel=1e-3)
    assert "Between the two largest sets alone: +0.050 per tenfold data, reaching 0.5 near 1.0e+09 tokens." in \
        curve_table({"points": [], "fits": fits})
    assert "last_pair" not in curve_fits(rows[:2])["tau32"]


def test_a_point_reads_tau_of_the_best_32_node_tree():
    training = {"examples": {"train": 10, "train_tokens": 1234}, "steps": 7, "train_seconds": 3.21}
    trees = [{"tree": "chain:4", "tau": 1.2, "tau_interval": (1.1, 1.3)},
             {"tree": "optimal-32", "tau": 1.7, "tau_interval": (1.6, 1.8)},
             {"tree": "chain:2", "tau": 1.3, "tau_interval": (1.25, 1.35)}]
    row = point_row(50, training, [[0.4, 0.9], [0.2, 0.6]], trees)
    assert row["tau32"] == 1.7 and row["tau32_interval"] == [1.6, 1.8] and row["tau_chain2"] == 1.3
    assert row["head0_top1"] == 0.4 and row["head_top1"] == [0.4, 0.2] and row["train_tokens"] == 1234
    table = curve_table({"points": [row], "fits": {}})
    assert "| 50 | 10 | 1,234 | 7 | 3 | 0.400 | 0.200 | 1.300 | 1.700 (1.600-1.800) |" in table


def test_the_command_trains_nested_sets_measures_each_and_resumes(tmp_path, capsys):
    questions = write_questions(tmp_path / "q.jsonl", load_suite("mt-bench", log=lambda m: None)[:3])
    out = tmp_path / "curve"
    argv = ["learning-curve", "--points", "6", "3", "--epochs", "1", "--max-new-tokens", "8", "--eval-tokens", "6",
            "--num-heads", "2", "--questions", str(questions), "--out", str(out), "--json"]
    assert main(argv) == 0
    curve = json.loads((out / "learning_curve.json").read_text())
    assert curve["schema"] == "medusa-learning-curve/1" and [p["prompts"] for p in curve["points"]] == [3, 6]
    small, large = curve["points"]
    assert small["train_tokens"] < large["train_tokens"] and small["examples"] < large["examples"]
    for row in curve["points"]:
        stats = load_stats(out / f"prompts-{row['prompts']}" / "acceptance.json")
        assert row["head0_top1"] == pytest.approx(float(stats.marginal[0, 0]), abs=1e-4)
        # a two-token chain commits 1 + (head 0's top guess right) + (and head 1's) tokens a step, walked along
        # each rollout's ranks
        steps = tokens = 0
        for ranks in stats.rollouts:
            t = 0
            while t < len(ranks):
                depth = 0 if ranks[t][0] != 0 else 1 if ranks[t][1] != 0 else 2
                steps, tokens, t = steps + 1, tokens + 1 + depth, t + 1 + depth
        assert row["tau_chain2"] == pytest.approx(tokens / steps, abs=1e-4)
        assert len(stats.rollouts) == 3
        training = json.loads((out / f"prompts-{row['prompts']}" / "training.json").read_text())
        assert row["train_tokens"] == training["examples"]["train_tokens"]
        assert training["data"]["prompts"] == row["prompts"]
    # the smaller set's prompts are the larger one's first prompts: its replies are all in the same store
    stores = {json.loads((out / f"prompts-{n}" / "training.json").read_text())["data"]["cache"] for n in (3, 6)}
    assert len(stores) == 1
    assert (out / "learning_curve.md").read_text().count("\n| ") == 2 and (out / "learning_curve.png").is_file()
    capsys.readouterr()

    assert main(argv) == 2 and "--resume continues it" in capsys.readouterr().err
    stamp = (out / "prompts-6" / "training.json").stat().st_mtime_ns
    (out / "prompts-6" / "acceptance.json").unlink()  # a run stopped before its last measurement
    assert main([*argv, "--resume"]) == 0
    assert (out / "prompts-6" / "training.json").stat().st_mtime_ns == stamp  # trained once
    assert json.loads((out / "learning_curve.json").read_text())["points"] == curve["points"]
    capsys.readouterr()
    assert main([*argv, "--lr", "0.01", "--resume"]) == 2 and "another recipe" in capsys.readouterr().err
    # a resumed curve may add a point: the others are kept as measured
    more = [*argv, "--resume"]
    more[more.index("--points") + 1:more.index("--points") + 3] = ["4"]
    assert main(more) == 0
    grown = json.loads((out / "learning_curve.json").read_text())
    assert [p["prompts"] for p in grown["points"]] == [3, 4, 6]
    assert [grown["points"][0], grown["points"][2]] == curve["points"]
    assert main([*argv[:-1], "--prompts", "5"]) == 2 and "do not apply" in capsys.readouterr().err
    assert main([*argv, "--points", "99999", "--resume"]) == 2 and "exceeds the" in capsys.readouterr().err
