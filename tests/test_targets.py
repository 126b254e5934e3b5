"""Targets: the search ranges over what the deployment target runs, the bench's final tree.json carries the
configuration with its heads and prediction, and ``medusa-bench export --target`` writes what the engine
loads or refuses, in one line, what it cannot run.

TensorRT-LLM's limits are checked against its own source: ``tensorrt_llm/runtime/generation.py``
(``_init_medusa``: ``len(medusa_choices) <= max_draft_tokens``), ``tensorrt_llm/runtime/medusa_utils.py``
(``_medusa_setup(choices, num_medusa_heads)``: every path padded to ``num_medusa_heads``, so no path is
deeper), ``tensorrt_llm/models/medusa/config.py`` (``MedusaConfig``: ``num_medusa_heads``,
``num_medusa_layers``, ``max_draft_len`` 63; ``num_medusa_heads`` read from the heads folder's
``config.json`` or the speculative config, ``medusa_num_layers`` from ``config.json``) and
``tensorrt_llm/models/medusa/weight.py`` (``load_medusa_hf``: for each of ``num_medusa_heads`` heads and
``num_medusa_layers`` layers ``{h}.{l}.linear.weight|bias``, then the head's ``{h}.{L}.weight``, from
``medusa_lm_head.pt`` or else ``medusa_lm_head.safetensors``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from bench.stages.deploy import TRTLLM_OPTIONS, heads_reference
from treesearch.deploy import write_final
from treesearch.replay import Decoding, predict_decoding
from treesearch.search import SearchConfig, TreeObjective, run_search, write_search
from treesearch.targets import TARGETS, is_chain, refusals
from treesearch.tree import make_tree, tree_to_json, write_json_atomic

from .conftest import tiny_llama
from .test_calibration import _heads_that_guess
from .test_workload_replay import _profile, _rollouts, _stats


@pytest.fixture(scope="module")
def fitted():
    """Rollouts of a tiny model whose heads guess well, with rollout tokens (so configurations are searched)."""
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=4, seed=1)
    texts, ranks = _rollouts(loaded, heads, 6, 50, 6)
    return _stats(texts, ranks, 4, 6), _profile()


def _trials(tmp_path, stats, latency, target, trials=25):
    cfg = SearchConfig(budget=16, trials=trials, storage=f"sqlite:///{tmp_path / f'{target}.db'}",
                       study_name=target, target=target)
    return cfg, run_search(stats, cfg, latency, show_progress=False)


@pytest.mark.parametrize("target", ["vllm", "tgi"])
def test_a_chain_target_searches_chains_only_and_finds_the_best_by_brute_force(tmp_path, fitted, target):
    stats, latency = fitted
    cfg, res = _trials(tmp_path, stats, latency, target)
    assert res.space == "configurations"
    for row in res.history:
        assert row["lookup"] == 0 and row["gate"] == 0.0
    study_trees = _trial_trees(tmp_path, target)
    assert study_trees and all(t is None or is_chain(t) for t in study_trees)
    # brute force: plain decoding and every chain, each replayed on the same rollouts and priced
    speed = {None: predict_decoding(Decoding(), stats, latency).speedup}
    for n in range(1, stats.num_heads + 1):
        speed[n] = predict_decoding(Decoding(make_tree([[0] * d for d in range(1, n + 1)])), stats, latency).speedup
    got = None if res.best.tree is None else len(res.best.tree.paths)
    assert speed[got] == pytest.approx(max(speed.values())) and res.best.speedup == pytest.approx(max(speed.values()))
    assert res.optimum.tree is not None and is_chain(res.optimum.tree.as_lists())  # the "optimum" row, a chain too
    obj = json.loads(write_search(res, stats, cfg, tmp_path / "t.json", latency_file="latency.json").read_text())
    assert obj["target"] == target and is_chain(obj["medusa_choices"])
    assert f"not {TARGETS[target].engine}'s" in obj["cost_model"]


def _trial_trees(tmp_path, target):
    return _trial_trees_named(tmp_path / f"{target}.db", target)


def test_trtllm_target_caps_trees_at_its_draft_limit_without_lookup_or_gate(tmp_path, fitted):
    stats, latency = fitted
    objective = TreeObjective(stats, SearchConfig(budget=100, target="trtllm"), latency)
    assert objective.budget == TARGETS["trtllm"].max_nodes == 63 and objective.max_lookup == 0
    _, res = _trials(tmp_path, stats, latency, "trtllm")
    assert all(r["lookup"] == 0 and r["gate"] == 0.0 for r in res.history)
    trees = [t for t in _trial_trees(tmp_path, "trtllm") if t]
    assert trees and any(not is_chain(t) for t in trees)  # trees, not only chains
    assert all(len(t) <= 16 and max(map(len, t)) <= stats.num_heads for t in trees)


def test_own_target_keeps_the_whole_space_and_unknown_targets_fail():
    with pytest.raises(ValueError, match="unknown target 'sglang'"):
        SearchConfig(budget=4, target="sglang")
    with pytest.raises(ValueError, match="greedy"):
        SearchConfig(budget=4, target="vllm", accept="typical")
    own = TARGETS["own"]
    assert refusals(own, [[0], [1], [0, 0]], lookup=4, gate=0.3, conditioning="path") == []


def test_refusals_name_each_part_the_target_cannot_run():
    tree = [[0], [1], [0, 0]]
    got = refusals(TARGETS["vllm"], tree, lookup=3, gate=0.2, conditioning="path")
    assert got[0] == "a prompt-lookup chain of 3 tokens" and got[1] == "a confidence gate (0.2)"
    assert got[2].startswith("path-conditioned heads") and got[3].startswith("a tree of 3 nodes")
    assert refusals(TARGETS["vllm"], [[0], [0, 0]]) == []
    big = [[0]] + [[0, r] for r in range(70)]
    assert any("71 draft nodes" in r for r in refusals(TARGETS["trtllm"], big))
    assert refusals(TARGETS["trtllm"], [[0], [0, 0], [0, 0, 0]], num_heads=2) == ["a tree 3 levels deep on 2 heads"]
    assert refusals(TARGETS["tgi"], [[0], [0, 0]], conditioning="root")[0].startswith("root-conditioned heads")


def test_final_tree_json_predicts_its_configuration_with_intervals(tmp_path, fitted):
    stats, latency = fitted
    cfg, res = _trials(tmp_path, stats, latency, "vllm", trials=12)
    search = write_search(res, stats, cfg, tmp_path / "search.json")
    heads = {"name": "unconditioned", "digest": "x", "num_heads": 4, "conditioning": "none"}
    final = json.loads(write_final(search, stats, latency, heads, tmp_path / "tree.json", ["a", "b"]).read_text())
    assert final["schema"] == "medusa-tree/2" and final["target"] == "vllm" and final["heads"] == heads
    conf = final["configuration"]
    assert conf["uses_heads"] and is_chain(conf["medusa_choices"]) and conf["lookup"] == 0 and conf["gate"] == 0
    pred = predict_decoding(Decoding(make_tree(conf["medusa_choices"])), stats, latency)
    p = final["prediction"]
    assert p["tau"] == pytest.approx(pred.tau, abs=1e-6) and p["speedup_vs_plain"] == pytest.approx(pred.speedup, abs=1e-6)
    assert p["tau_ci"][0] <= p["tau"] <= p["tau_ci"][1] and p["tau_ci"][0] < p["tau_ci"][1]
    assert p["speedup_vs_plain_ci"][0] <= p["speedup_vs_plain"] <= p["speedup_vs_plain_ci"][1]
    assert p["rollouts"] == len(stats.rollouts) and final["fitted_on"] == {"questions": 2, "ids": ["a", "b"]}


def _tree_file(tmp_path, choices, heads: str, lookup=0, gate=0.0, target="own") -> Path:
    from medusa_runtime.heads.medusa import shipped_heads_dir

    tree = make_tree(choices, name="final")
    conf = {"config": "t", "uses_heads": True, "medusa_choices": tree.as_lists(), "tree_nodes": len(choices),
            "lookup": lookup, "gate": gate}
    obj = tree_to_json(tree, target=target, configuration=conf, heads=heads_reference(shipped_heads_dir(heads)))
    return write_json_atomic(tmp_path / f"tree-{heads}-{lookup}.json", obj)


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "bench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("target,engine", [("vllm", "vLLM"), ("trtllm", "TensorRT-LLM"),
                                           ("tgi", "text-generation-inference")])
def test_export_refuses_in_one_line_what_the_target_cannot_run(tmp_path, target, engine):
    tree = _tree_file(tmp_path, [[0], [0, 0]], "default", lookup=4)
    proc = _cli("export", "--tree", tree, "--target", target, "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"medusa-bench: error: {engine} cannot run")
    assert "a prompt-lookup chain of 4 tokens" in lines[0] and "path-conditioned heads" in lines[0]
    assert not (tmp_path / "out").exists()


def test_export_refuses_heads_that_changed_since_the_search(tmp_path):
    tree = _tree_file(tmp_path, [[0], [0, 0]], "unconditioned")
    obj = json.loads(tree.read_text())
    obj["heads"]["digest"] = "0" * 16
    tree.write_text(json.dumps(obj))
    proc = _cli("export", "--tree", tree, "--target", "vllm", "--out", tmp_path / "out")
    assert proc.returncode == 2 and "differ from the ones the configuration was searched with" in proc.stderr


def test_vllm_export_of_a_final_tree_is_a_folder_vllms_loader_reads(tmp_path):
    from .test_serving import _vllm_config_parse, _vllm_expected_params

    tree = _tree_file(tmp_path, [[0], [0, 0]], "unconditioned", target="vllm")
    out = tmp_path / "vllm"
    proc = _cli("export", "--tree", tree, "--target", "vllm", "--out", out, "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == res["speculative_config"] == {"method": "medusa", "model": str(out.resolve()),
                                                 "num_speculative_tokens": 2}
    cfg = _vllm_config_parse(json.loads((out / "config.json").read_text()))
    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == _vllm_expected_params(cfg)
    assert "--speculative-config" in res["command"]


def test_trtllm_export_holds_what_its_loader_reads_with_the_heads_count_not_the_depth(tmp_path):
    from medusa_runtime.heads.medusa import load_heads
    from medusa_runtime.model import load_model

    tree = _tree_file(tmp_path, [[0], [1], [0, 0]], "unconditioned", target="trtllm")
    out = tmp_path / "trt"
    proc = _cli("export", "--tree", tree, "--target", "trtllm", "--out", out, "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / TRTLLM_OPTIONS).read_text())["speculative_config"]
    assert spec["decoding_type"] == "Medusa" and spec["medusa_choices"] == [[0], [1], [0, 0]]
    assert spec["max_draft_len"] == 3  # draft tokens = tree nodes (generation.py's num_draft_tokens)
    assert spec["num_medusa_heads"] == 4  # the checkpoint's heads, though the tree is 2 deep
    assert spec["speculative_model"] == str(out.resolve())
    cfg = json.loads((out / "config.json").read_text())
    heads_n, layers = cfg["num_medusa_heads"], cfg["medusa_num_layers"]
    assert (heads_n, layers) == (4, 1) and cfg["medusa_num_heads"] == 4
    sd = load_file(str(out / "medusa_lm_head.safetensors"))
    # load_medusa_hf, per head: the layers' linear weight and bias, then the head's own projection [V, H]
    loaded = load_model("default", "float32", "cpu", log=lambda m: None)
    shipped = load_heads(Path(heads_reference_path("unconditioned")), loaded.hidden_size, loaded.vocab_size)
    shipped.set_draft_vocab(None)  # the engine scores the whole vocabulary
    lm = loaded.model.get_output_embeddings()
    torch.manual_seed(0)
    for hidden in torch.randn(4, loaded.hidden_size):
        drafts = []
        for h in range(heads_n):
            x = hidden
            for j in range(layers):  # MedusaLayer: x + SiLU(linear(x))
                x = x + F.silu(F.linear(x, sd[f"{h}.{j}.linear.weight"], sd[f"{h}.{j}.linear.bias"]))
            drafts.append(int((x @ sd[f"{h}.{layers}.weight"].T).argmax()))
        assert drafts == shipped(hidden, lm).argmax(-1).tolist()


def heads_reference_path(name: str) -> str:
    from medusa_runtime.heads.medusa import shipped_heads_dir

    return str(shipped_heads_dir(name))


def test_export_without_target_keeps_printing_and_out_needs_a_target(tmp_path):
    proc = _cli("export", "--tree", "chain:2", "--format", "vllm")
    assert proc.returncode == 0 and json.loads(proc.stdout)["num_speculative_tokens"] == 2
    proc = _cli("export", "--tree", "chain:2", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "name its --target" in proc.stderr
    proc = _cli("export", "--tree", "chain:2", "--format", "trtllm-config")
    assert proc.returncode == 2 and "num_medusa_heads is the heads checkpoint's head count" in proc.stderr


def test_engine_step_costs_price_the_chains_and_the_best_is_tau_over_cost(tmp_path, fitted):
    """Priced with an engines run's measured step costs (report.json's step_cost_vs_engine_plain), a chain of k
    runs tau_k / cost_k times the engine's plain decoding: the search's pick is that ratio's argmax."""
    stats, latency = fitted
    costs = {1: 1.05, 2: 1.9, 3: 1.2}  # chain 4 unmeasured: never picked
    report = {"configs": [{"config": "vllm plain", "engine": "vllm", "speculative": None},
                          *({"config": f"vllm medusa chain:{k}", "engine": "vllm", "speculative": "medusa",
                             "draft_tokens": k, "step_cost_vs_engine_plain": c} for k, c in costs.items())]}
    path = write_json_atomic(tmp_path / "report.json", report)
    cfg = SearchConfig(budget=16, trials=12, storage=f"sqlite:///{tmp_path / 'e.db'}", study_name="e", target="vllm",
                       engine_costs=str(path))
    res = run_search(stats, cfg, latency, show_progress=False)
    want = {k: predict_decoding(Decoding(make_tree([[0] * d for d in range(1, k + 1)])), stats, latency).tau / c
            for k, c in costs.items()}
    want[0] = 1.0  # no heads: the engine's plain decoding
    got = 0 if res.best.tree is None else len(res.best.tree.paths)
    assert got == max(want, key=want.get) and res.best.speedup == pytest.approx(want[got])
    assert all(t is None or len(t) in costs for t in _trial_trees_named(tmp_path / "e.db", "e"))
    obj = json.loads(write_search(res, stats, cfg, tmp_path / "t.json", latency_file="l.json").read_text())
    assert obj["cost_model"].startswith("vLLM's measured step costs") and "chain of 2: 1.900" in obj["cost_model"]
    with pytest.raises(ValueError, match="engine step costs price chains"):
        SearchConfig(budget=4, target="trtllm", engine_costs=str(path))
    empty = write_json_atomic(tmp_path / "empty.json", {"configs": []})
    with pytest.raises(ValueError, match="holds no measured step cost of vLLM"):
        TreeObjective(stats, SearchConfig(budget=4, target="vllm", engine_costs=str(empty)), latency)


def _trial_trees_named(db, name):
    import optuna

    study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    return [t.user_attrs["medusa_choices"] for t in study.trials if t.state.name == "COMPLETE"]


def test_own_target_deploys_the_recommendation_even_without_heads(tmp_path, fitted):
    """For this runtime the final configuration is the search's recommendation; when that is no heads (plain
    decoding with a lookup chain), the export serves it with --heads none instead of refusing."""
    stats, latency = fitted
    cfg = SearchConfig(budget=4, trials=6, storage=f"sqlite:///{tmp_path / 'o.db'}", study_name="o")
    res = run_search(stats, cfg, latency, show_progress=False)
    search = write_search(res, stats, cfg, tmp_path / "s.json", latency_file="l.json")
    obj = json.loads(search.read_text())
    obj["recommended"] = {"config": "plain +lookup4", "uses_heads": False, "lookup": 4, "gate": 0.0,
                          "medusa_choices": None}
    write_json_atomic(search, obj)
    heads = heads_reference(heads_reference_path("default"))
    final = json.loads(write_final(search, stats, latency, heads, tmp_path / "tree.json").read_text())
    assert final["configuration"] == {"config": "plain +lookup4", "uses_heads": False, "medusa_choices": None,
                                      "tree_nodes": None, "lookup": 4, "gate": 0.0}
    pred = predict_decoding(Decoding(None, 4), stats, latency)
    assert final["prediction"]["speedup_vs_plain"] == pytest.approx(pred.speedup, abs=1e-6)
    proc = _cli("export", "--tree", tmp_path / "tree.json", "--target", "own", "--out", tmp_path / "own")
    assert proc.returncode == 0 and "medusa-bench serve --heads none --lookup 4" in proc.stdout
    proc = _cli("export", "--tree", tmp_path / "tree.json", "--target", "vllm", "--out", tmp_path / "v")
    assert proc.returncode == 2 and "uses no heads: there is nothing to export to vLLM" in proc.stderr
