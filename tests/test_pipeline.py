"""The main job's options: the user's model, heads, device and dtype reach every stage, bad ones are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import pipeline
from bench.pipeline import BenchOptions, StageCache

from .conftest import fake_stage_runs, search_inputs


def _capture(monkeypatch) -> list:
    """The jobs the pipeline runs, captured instead of run."""
    calls: list = []
    monkeypatch.setattr(pipeline, "run_job", calls.append)
    return calls


def test_retrain_trains_for_the_users_model_on_its_device_and_dtype(tmp_path, monkeypatch):
    calls = _capture(monkeypatch)
    opts = BenchOptions(retrain=True, model="some/model", device="cuda:1", dtype="float16", out=str(tmp_path))
    heads = pipeline.stage_heads(opts, tmp_path, StageCache(tmp_path))
    assert heads == tmp_path / "heads-trained" / "heads"
    (job,) = calls
    assert isinstance(job, pipeline.TrainJob) and job.profile == "quick"
    assert job.model == "some/model" and job.device == "cuda:1" and job.dtype == "float16"
    # another model is another training (the stage key holds the model)
    pipeline.stage_heads(BenchOptions(retrain=True, model="other", device="cuda:1", dtype="float16"), tmp_path,
                         StageCache(tmp_path))
    assert len(calls) == 2


def test_a_heads_folder_is_used_as_given(tmp_path, monkeypatch):
    calls = _capture(monkeypatch)
    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert pipeline.stage_heads(BenchOptions(model="m", heads=str(folder)), tmp_path, StageCache(tmp_path)) == folder
    assert calls == []


@pytest.mark.parametrize("args,message", [
    (["--heads", "/nonexistent"], "--heads /nonexistent: not a heads folder"),
    (["--model", "/some/other/model", "--heads", "default"], "the shipped heads belong to the default model"),
    (["--model", "/some/other/model"], "model not found: /some/other/model"),
    (["--heads", "none", "--retrain"], "--heads none runs without heads"),
    (["--dtype", "int8"], "invalid choice"),
    (["--target", "vllm", "--heads", "medusa1"], "vLLM does not run path-conditioned heads (medusa1)"),
    (["--target", "tgi", "--heads", "none"], "--target tgi picks a configuration with heads"),
    (["--target", "trtllm", "--retrain"], "--retrain trains path-conditioned heads"),
    (["--target", "own", "--engine-costs", "/nonexistent.json"], "no engines session measures this runtime"),
    (["--target", "vllm", "--engine-costs", "/nonexistent.json"], "engines report not found: /nonexistent.json"),
    (["--target", "sglang"], "invalid choice"),
])
def test_bad_main_job_options_give_one_line_and_exit_2(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "bench.pipeline", *args, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr


def test_compare_heads_replay_their_chains_on_their_own_base(tmp_path):
    """--compare-heads: the other set's chains, with plain decoding of its base only where one of the two sets
    carries a Medusa-2 adapter (another base); the same folder twice adds no plain run."""
    import json

    from bench.replay.matrix import compare_configurations

    plain_heads, adapted = tmp_path / "m1", tmp_path / "m2"
    for folder, extra in ((plain_heads, {}), (adapted, {"medusa_base_adapter": {"path": "adapter", "layers": [1],
                                                                                 "base_digest": "x"}})):
        (folder / "adapter").mkdir(parents=True)
        (folder / "adapter" / "adapter_config.json").write_text("{}")
        (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1, **extra}))
    got = compare_configurations(str(plain_heads), adapted, [1, 2])
    assert [c["name"] for c in got] == [f"plain, {plain_heads} base", f"{plain_heads} chain:1", f"{plain_heads} chain:2"]
    assert all(c["heads"] == str(plain_heads) for c in got)
    same = compare_configurations(str(plain_heads), plain_heads, [1])
    assert [c["name"] for c in same] == [f"{plain_heads} chain:1"]
    with pytest.raises(ValueError, match="not a heads folder"):
        compare_configurations(str(tmp_path / "nothing"), adapted, [1])
    other = tmp_path / "m1b"  # a second set on the original base: its chains, but that base's plain run once
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    bases: set[str] = set()
    first = compare_configurations(str(plain_heads), adapted, [1], bases)
    second = compare_configurations(str(other), adapted, [1], bases)
    assert [c["name"] for c in first + second] == [f"plain, {plain_heads} base", f"{plain_heads} chain:1",
                                                   f"{other} chain:1"]


def test_compare_heads_option_resolution():
    from types import SimpleNamespace

    from bench.pipeline import _compare_heads

    shipped = SimpleNamespace(model="default", heads="default", retrain=False)
    assert _compare_heads(["none"], shipped) == ()
    assert _compare_heads(["a", "b", "a"], shipped) == ("a", "b")
    with pytest.raises(ValueError, match="stand alone"):
        _compare_heads(["auto", "a"], shipped)
    assert _compare_heads(["auto"], SimpleNamespace(model="other", heads="x", retrain=False)) == ()
    assert _compare_heads(["auto"], SimpleNamespace(model="default", heads="default", retrain=True)) == ()


def test_folds_option_reaches_the_workload_and_bad_counts_fail_in_one_line(tmp_path, monkeypatch, capsys):
    seen = {}

    class Stop(Exception):
        pass

    def workload(opts, prof, out):
        seen["folds"], seen["tokens"] = prof.folds, prof.max_new_tokens
        raise Stop

    monkeypatch.setattr(pipeline, "stage_heads", lambda opts, out, cache: tmp_path)
    monkeypatch.setattr(pipeline, "stage_workload", workload)
    with pytest.raises(Stop):
        pipeline.main(["--folds", "4", "--out", str(tmp_path / "a")])
    assert seen["folds"] == 4
    with pytest.raises(Stop):
        pipeline.main(["--out", str(tmp_path / "b")])
    assert seen["folds"] == pipeline.PROFILES["quick"].folds == 10
    assert seen["tokens"] == pipeline.PROFILES["quick"].max_new_tokens
    with pytest.raises(Stop):  # FastChat's answer length for its judge
        pipeline.main(["--max-new-tokens", "1024", "--out", str(tmp_path / "d")])
    assert seen["tokens"] == 1024
    assert pipeline.main(["--max-new-tokens", "0", "--out", str(tmp_path / "e")]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    monkeypatch.undo()
    assert pipeline.main(["--folds", "0", "--out", str(tmp_path / "c")]) == 2
    assert "folds must be within" in capsys.readouterr().err


def test_search_studies_are_named_by_the_questions_they_leave_out(tmp_path, monkeypatch):
    """Fold 0 of 2 folds and fold 0 of 4 fit on other questions: with the same statistics and profile they
    must be studies of their own (one name for both made the search refuse the second, as it should); the
    same fold again keeps its name, so a search resumes its study."""
    ran = fake_stage_runs(monkeypatch, pipeline)
    acc, lat = search_inputs(tmp_path)
    prof = pipeline.PROFILES["quick"]
    for n, folds in enumerate(([[1, 2], [3, 4]], [[1], [2], [3], [4]], [[1, 2], [3, 4]])):
        pipeline.stage_search(prof, tmp_path / f"run{n}", StageCache(tmp_path / f"run{n}"), acc, lat, {"folds": folds})
    studies = [job.study for job in ran]
    # per run: two studies per fold (with lookup chains, and heads only), and the typical one
    two, four, again = studies[:5], studies[5:14], studies[14:]
    assert two[0] != four[0] and len(set(two + four)) == len(two + four)
    assert again == two
    heads_only = [job for job in ran[:5] if "heads-only" in job.study]
    assert len(heads_only) == 2 and all(job.lookup == 0 for job in heads_only)
    assert all(job.lookup > 0 for job in ran[:5] if job not in heads_only)


def test_an_engine_target_searches_what_it_runs_with_heads_it_runs(tmp_path, monkeypatch):
    """--target vllm: the shipped unconditioned heads instead of the path-conditioned default, every fold's
    searches and the final one for vLLM (the typical search stays this runtime's)."""
    from medusa_runtime.heads.medusa import shipped_heads_dir

    assert pipeline._target_heads("vllm", "default", False) == "unconditioned"
    assert pipeline._target_heads("own", "default", False) == "default"
    out = tmp_path / "run"
    assert pipeline.stage_heads(BenchOptions(heads="unconditioned", target="vllm"), out, StageCache(out)) \
        == shipped_heads_dir("unconditioned")
    ran = fake_stage_runs(monkeypatch, pipeline)
    acc, lat = search_inputs(tmp_path)
    pipeline.stage_search(pipeline.PROFILES["quick"], out, StageCache(out), acc, lat, {"folds": [[1, 2], [3, 4]]},
                          "vllm")
    assert [job.target for job in ran] == ["vllm"] * 4 + ["own"]
    assert all("-vllm-" in job.study for job in ran[:4])


def test_sampled_configurations_cover_the_typical_front_and_run_on_the_peers(tmp_path):
    """Plain sampling, exact tree sampling and three typical points (least regret, chosen, fastest), each a
    valid runtime configuration on the peers' questions with its samples; without a typical search only
    plain sampling."""
    from bench.replay.matrix import sampled_configurations
    from bench.replay.runner import MethodConfig
    from treesearch.tree import load_tree

    front = [{"medusa_choices": [[0]], "tau": 1.4, "speedup": 1.2, "regret": 0.01, "posterior_threshold": 0.3,
              "posterior_alpha": 0.9},
             {"medusa_choices": [[0], [1], [0, 0]], "tau": 1.8, "speedup": 1.5, "regret": 0.2,
              "posterior_threshold": 0.1, "posterior_alpha": 0.1}]
    typical = tmp_path / "tree-typical.json"
    typical.write_text(json.dumps({"schema": "medusa-tree/1", "name": "t", "medusa_choices": [[0], [0, 0]],
                                   "acceptance": {"posterior_threshold": 0.2, "posterior_alpha": 0.5,
                                                  "pareto": front}}))
    configs = [MethodConfig(**c) for c in sampled_configurations(typical, [81, 90], temperature=0.7, samples=3)]
    assert [c.name for c in configs] == ["plain T0.7", "medusa sample T0.7", "typical T0.7",
                                         "typical T0.7 (least regret)", "typical T0.7 (fastest)"]
    assert all(c.temperature == 0.7 and c.samples == 3 and c.question_ids == (81, 90) for c in configs)
    assert [c.accept for c in configs[1:]] == ["sample", "typical", "typical", "typical"]
    assert load_tree(configs[3].tree).paths == ((0,),) and load_tree(configs[4].tree).num_nodes == 4
    assert (configs[2].posterior_threshold, configs[4].posterior_alpha) == (0.2, 0.1)
    assert [c["name"] for c in sampled_configurations(tmp_path / "missing.json", [81])] == ["plain T0.7"]


def test_main_job_without_heads_measures_plain_decoding_and_prompt_lookup(tmp_path, monkeypatch):
    """--heads none end to end on a small model (a folder, as a user's): no calibration, search or profile;
    plain decoding, its lookup chains, generate and prompt lookup replayed; report.json says nothing was
    predicted; the page opens in the browser; every lossless configuration answers as plain decoding."""
    from bench.report.browser import check_page
    from tests.conftest import tiny_chat_model

    loaded = tiny_chat_model()
    loaded.model.config.max_position_embeddings = 2048  # room for MT-Bench prompts (rotary: no table to resize)
    model = tmp_path / "model"
    loaded.model.save_pretrained(model)
    loaded.tokenizer.save_pretrained(model)
    tiny = pipeline.BenchProfile(8, 2, 1, 8, (1,), 1, 4, 2, 4)
    monkeypatch.setitem(pipeline.PROFILES, "quick", tiny)
    out = tmp_path / "run"
    (out / "judge").mkdir(parents=True)  # an earlier run's judge files in the same folder
    (out / "judge" / "judge_scores.json").write_text("{}")
    (out / "judge" / "judge_cache.jsonl").write_text("")
    pipeline.run(BenchOptions(heads="none", model=str(model), dtype="float32", out=str(out)))
    # without --judge, no earlier scores are reported beside these answers; the judge's cache stays
    assert not (out / "judge" / "judge_scores.json").exists() and (out / "judge" / "judge_cache.jsonl").exists()
    assert not (out / "acceptance.json").exists() and not (out / "latency.json").exists()
    assert set(json.loads((out / "stages.json").read_text())) == {"replay", "quality"}
    rep = json.loads((out / "report.json").read_text())
    names = {c["config"] for c in rep["configs"]}
    assert names == {"generate", "plain", "prompt-lookup", "plain T0.7",
                     *(f"plain +lookup{n}" for n in pipeline.LOOKUPS_WITHOUT_HEADS)}
    assert not any(c["uses_heads"] for c in rep["configs"]) and all(c["predicted_tau"] is None for c in rep["configs"])
    assert rep["verdict"]["predictions"] == 0 and rep["verdict"]["speedup_within_tolerance"] is None
    records = [json.loads(line) for line in (out / "replay" / "records.jsonl").read_text().splitlines()]
    plain = {r["question_id"]: r["token_ids"] for r in records if r["config"] == "plain"}
    assert len(plain) == 8
    for r in records:
        if r["config"].startswith("plain +lookup"):
            assert r["token_ids"] == plain[r["question_id"]]
    assert "No predictions in this run" in (out / "report.html").read_text()
    assert not (out / "plots" / "training_curves.png").exists()  # the shipped heads' training: not this run's
    check = check_page(out / "report.html")
    assert check.ok, (check.errors, check.broken)



def test_each_fold_replays_its_heads_only_pick_on_its_own_questions(tmp_path):
    """Medusa alone in the matrix: per fold, the heads-only search's tree (and gate) with no lookup chain, on that
    fold's questions, beside the fold's configuration pick (which may draft a lookup chain)."""
    from bench.replay.matrix import replay_configurations
    from bench.replay.runner import MethodConfig
    from treesearch.stats import AcceptanceStats, marginal_from_rollouts, save_stats
    from treesearch.tree import load_tree, make_tree, save_tree

    rollouts = (((0, 1), (0, -1), (1, 0)),)
    acc = save_stats(AcceptanceStats(marginal_from_rollouts(rollouts, 2, 3), rollouts, (), {"model": "m"}),
                     tmp_path / "acceptance.json")
    folds = [[1, 2], [3, 4]]
    picks, heads_only = [], []
    for f in range(2):
        picks.append(save_tree(make_tree([[0]]), tmp_path / f"fold-{f}.json", decoding={"lookup": 6, "gate": 0.0}))
        heads_only.append(save_tree(make_tree([[0], [1], [0, 0]][: 2 + f]), tmp_path / f"fold-{f}-heads-only.json",
                                    decoding={"lookup": 0, "gate": 0.05 * f}))
    workload = {"peers": [1, 3], "folds": folds}
    configs = replay_configurations(acc, picks, workload, heads_only=heads_only)
    mine = [MethodConfig(**c) for c in configs if c["name"] == "searched, heads only"]
    assert [c.question_ids for c in mine] == [(1, 2), (3, 4)]
    assert all(c.method == "medusa" and c.lookup_tokens == 0 for c in mine)
    assert [load_tree(c.tree).num_nodes - 1 for c in mine] == [2, 3] and [c.gate for c in mine] == [0.0, 0.05]
    searched = [c for c in configs if c["name"] == "searched"]
    assert [c["lookup_tokens"] for c in searched] == [6, 6]
    assert not [c for c in replay_configurations(acc, picks, workload) if c["name"] == "searched, heads only"]


def test_searches_side_by_side_write_what_they_write_in_turn(tmp_path, monkeypatch, capsys):
    """The pipeline's searches in worker processes (MEDUSA_BENCH_WORKERS): the same tree files as run one after
    another here, each recorded as done; a second pass finds them all cached and starts no process."""
    from bench.stages.cache import StageCache
    from bench.stages.jobs import SearchJob
    from treesearch.stats import ACCEPTANCE_SCHEMA

    from .test_treesearch import vicuna_7b_marginal

    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "m", "marginal": vicuna_7b_marginal().tolist()}))
    results = {}
    for workers in ("3", "1"):
        out = tmp_path / f"workers-{workers}"
        stages = [(f"search-{b}", SearchJob(acceptance=str(acc), budget=b, trials=8, storage=f"sqlite:///{out / 'db'}",
                                            study=f"s{b}", out=str(out / f"{b}.json"), quiet=True),
                   [out / f"{b}.json"]) for b in (6, 10, 14)]
        out.mkdir()
        monkeypatch.setenv("MEDUSA_BENCH_WORKERS", workers)
        pipeline._cached_many(StageCache(out), stages)
        printed = capsys.readouterr().out
        assert ("running in 3 processes" in printed) == (workers == "3")
        results[workers] = [{k: v for k, v in json.loads((out / f"{b}.json").read_text()).items()
                             if k in ("medusa_choices", "predicted_tau", "node_budget")} for b in (6, 10, 14)]
        assert set(json.loads((out / "stages.json").read_text())) == {"search-6", "search-10", "search-14"}
        pipeline._cached_many(StageCache(out), stages)
        assert capsys.readouterr().out.count("cached") == 3
    assert results["3"] == results["1"]
    assert [r["node_budget"] for r in results["1"]] == [6, 10, 14]


def test_a_failing_search_among_side_by_side_ones_stops_the_stage(tmp_path, monkeypatch):
    from bench.stages.cache import StageCache
    from bench.stages.jobs import SearchJob

    monkeypatch.setenv("MEDUSA_BENCH_WORKERS", "2")
    stages = [(f"search-{i}", SearchJob(acceptance=str(tmp_path / "missing.json"), budget=6, trials=4,
                                        storage=f"sqlite:///{tmp_path / 'db'}", study=f"s{i}",
                                        out=str(tmp_path / f"{i}.json"), quiet=True), [tmp_path / f"{i}.json"])
              for i in range(3)]
    with pytest.raises((OSError, ValueError)):
        pipeline._cached_many(StageCache(tmp_path), stages)
    assert not (tmp_path / "stages.json").exists()  # nothing recorded as done
