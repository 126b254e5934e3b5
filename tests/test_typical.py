"""Typical acceptance in calibration and search: arrays against sequential forwards, replay against
brute force, the JSON round trip, and the Optuna study's Pareto front."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from medusa_runtime.measure.calibrate import CalibrationConfig, calibrate, rollout_statistics
from medusa_runtime.model import software_versions
from medusa_runtime.prompts import Prompt
from treesearch.search import SearchConfig, run_search
from treesearch.stats import AcceptanceStats, StatsError, load_stats, marginal_from_rollouts, save_stats
from treesearch.tree import load_tree
from treesearch.typical import TypicalParams, TypicalSeq, TypicalStats, typical_walk

from .conftest import hf_greedy, tiny_llama
from .test_calibration import _heads_that_guess
from .test_tree import random_tree


def test_typical_arrays_against_sequential_forwards():
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=3)
    prompt, temperature, topk = [3, 1, 4, 1, 5], 0.7, 5
    rollout = hf_greedy(loaded, prompt, 16)
    seq = rollout_statistics(loaded, heads, prompt, rollout, topk, temperature).typical
    m = len(rollout)
    lm = loaded.model.get_output_embeddings()
    with torch.no_grad():
        for q in range(m):  # the base distribution that predicts rollout token q
            logits = loaded.model(torch.tensor([prompt + rollout[:q]])).logits[0, -1]
            lp = torch.log_softmax(logits / temperature, dim=-1)
            assert seq.entropy[q] == pytest.approx(float(-(lp.exp() * lp).sum()), abs=1e-4)
            assert seq.greedy_logp[q] == pytest.approx(float(lp.max()), abs=1e-4)
        for i in range(m - 1):
            h = loaded.model(torch.tensor([prompt + rollout[:i]]), output_hidden_states=True).hidden_states[-1][0, -1]
            guesses = heads(h, lm)  # [K, V]
            for j in range(heads.num_heads):
                q = i + j + 1
                top = torch.topk(guesses[j], topk).indices
                if q >= m:
                    assert np.all(np.isneginf(seq.logp[i, j]))
                    continue
                logits = loaded.model(torch.tensor([prompt + rollout[:q]])).logits[0, -1]
                want = torch.log_softmax(logits / temperature, dim=-1)[top]
                np.testing.assert_allclose(seq.logp[i, j], want.numpy(), atol=1e-4)


def random_typical(seed: int, sequences: int = 4, length: int = 40, heads: int = 3, topk: int = 4) -> list[TypicalSeq]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sequences):
        m = length
        logp = -rng.exponential(1.5, size=(m - 1, heads, topk)).astype(np.float32)
        q = np.arange(m - 1)[:, None] + np.arange(heads)[None, :] + 1
        logp[q >= m] = -np.inf
        out.append(TypicalSeq(logp, rng.uniform(0, 4, m).astype(np.float32),
                              -rng.exponential(0.5, m).astype(np.float32)))
    return out


def brute_force_walk(tree, seqs, eps: float, delta: float) -> tuple[float, float, float]:
    """Independent reference: enumerate the tree's paths at every step, test each node by the formula."""
    steps = tokens = 0
    regret = sampled = 0.0
    for seq in seqs:
        n = seq.logp.shape[0]
        t = 0
        while t < n:
            best, best_key = (), (0, 0.0)
            for path in tree.paths:
                lps, ok = [], True
                for j, r in enumerate(path):
                    q = t + j + 1
                    lp = float(seq.logp[t, j, r])
                    h = float(seq.entropy[min(q, n)])
                    if not lp > math.log(min(eps, delta * math.exp(-h))):
                        ok = False
                        break
                    lps.append(lp)
                key = (len(path), sum(lps))
                if ok and key > best_key:
                    best, best_key = path, key
            steps += 1
            tokens += 1 + len(best)
            regret += sum(float(seq.greedy_logp[t + j + 1] - seq.logp[t, j, r]) for j, r in enumerate(best))
            sampled += float(seq.greedy_logp[t]) + float(seq.entropy[t])  # this step's root was a sample
            t += 1 + len(best)
    return tokens / steps, regret / tokens, sampled / tokens


@pytest.mark.parametrize("tree_name", ["chain:3", "random", "vicuna_7b_stage2"])
@pytest.mark.parametrize("eps,delta", [(0.09, 0.3), (0.3, 0.05), (0.02, 0.9)])
def test_typical_replay_against_brute_force(tree_name, eps, delta):
    heads = 5 if tree_name == "vicuna_7b_stage2" else 3
    tree = random_tree(random.Random(3), 15, 3, 4) if tree_name == "random" else load_tree(tree_name)
    topk = max(4, tree.max_rank + 1)
    seqs = random_typical(1, heads=heads, topk=topk)
    got = typical_walk(tree, seqs, TypicalParams(eps, delta))
    tau, regret, sampled = brute_force_walk(tree, seqs, eps, delta)
    assert got.tau == pytest.approx(tau) and got.regret == pytest.approx(regret, abs=1e-9)
    assert got.sampling_regret == pytest.approx(sampled, rel=1e-6) and got.total_regret > got.regret
    assert got.tau > 1.0  # the cases accept something


def test_looser_thresholds_accept_more_per_position():
    from treesearch.typical import accepted_per_position

    tree = load_tree("vicuna_7b_stage2")
    seq = random_typical(2, heads=5, topk=tree.max_rank + 1)[0]
    strict, _, _ = accepted_per_position(seq, tree, TypicalParams(0.3, 0.9))
    loose, _, _ = accepted_per_position(seq, tree, TypicalParams(0.05, 0.05))
    assert (loose >= strict).all() and (loose > strict).any()


def _stats_with_typical(seed: int = 0, heads: int = 3, topk: int = 4) -> AcceptanceStats:
    seqs = random_typical(seed, sequences=6, heads=heads, topk=topk)
    rng = random.Random(seed)
    ranks = tuple(tuple(tuple(rng.choice([-1, 0, 0, 1]) for _ in range(heads)) for _ in range(s.logp.shape[0]))
                  for s in seqs)
    fit, held = ranks[:4], ranks[4:]
    return AcceptanceStats(marginal_from_rollouts(fit, heads, topk), fit, held, {"model": "m"},
                           typical=TypicalStats(0.7, tuple(seqs[:4]), tuple(seqs[4:])))


def test_typical_json_round_trip_and_bad_files(tmp_path):
    stats = _stats_with_typical()
    path = save_stats(stats, tmp_path / "a.json")
    back = load_stats(path)
    tree = load_tree("chain:3")
    a = typical_walk(tree, stats.typical.rollouts, TypicalParams())
    b = typical_walk(tree, back.typical.rollouts, TypicalParams())
    assert back.typical.temperature == 0.7 and len(back.typical.heldout) == 2
    assert b.tau == pytest.approx(a.tau, rel=0.05) and b.regret == pytest.approx(a.regret, rel=0.05, abs=1e-3)
    import json

    obj = json.loads(path.read_text())
    obj["typical"]["rollouts"][0]["positions"] += 1
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(StatsError, match="holds .* values"):
        load_stats(tmp_path / "bad.json")
    obj = json.loads(path.read_text())
    obj["typical"]["rollouts"] = obj["typical"]["rollouts"][:3]
    (tmp_path / "bad.json").write_text(json.dumps(obj))
    with pytest.raises(StatsError, match="do not match"):
        load_stats(tmp_path / "bad.json")
    with pytest.raises(StatsError, match="thresholds"):
        TypicalParams(0.0, 0.3)


def test_typical_search_pareto_front(tmp_path):
    stats = _stats_with_typical(seed=4)
    cfg = SearchConfig(budget=12, trials=30, storage=f"sqlite:///{tmp_path / 's.db'}", study_name="typ",
                       accept="typical", max_regret=0.5, baseline="")
    result = run_search(stats, cfg, show_progress=False)
    rows = result.history
    assert len(rows) == 30 and all(r["regret"] is not None for r in rows)
    # the front is exactly the non-dominated trials (brute force over all trials)
    pts = [(r["tau"], -r["regret"]) for r in rows]
    nondominated = {p for p in pts if not any(o[0] >= p[0] and o[1] >= p[1] and o != p for o in pts)}
    assert {(round(s.tau, 9), round(-s.regret, 9)) for s in result.pareto} == \
        {(round(a, 9), round(b, 9)) for a, b in nondominated}
    # the pick: the fastest trial within the quality floor, and its scores replay exactly
    within = [r for r in rows if r["regret"] <= cfg.max_regret]
    assert result.best.regret <= cfg.max_regret
    assert result.best.tau == pytest.approx(max(r["tau"] for r in within))
    again = typical_walk(result.best.tree, stats.typical.rollouts, result.best.typical)
    assert again.tau == pytest.approx(result.best.tau)
    # a greedy-only acceptance file cannot run a typical search
    plain = AcceptanceStats(stats.marginal, stats.rollouts, stats.heldout, {"model": "m"})
    with pytest.raises(StatsError, match="typical statistics"):
        run_search(plain, SearchConfig(budget=4, trials=2, storage=f"sqlite:///{tmp_path / 'p.db'}",
                                       accept="typical"), show_progress=False)


def test_calibrate_stores_typical_arrays_for_the_search(tmp_path):
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=3)
    rng = random.Random(0)
    prompts = [Prompt((" ".join(str(rng.randrange(9)) for _ in range(5)),), "math") for _ in range(5)]

    class Tok:  # digits as tokens, no chat template
        chat_template = None
        pad_token_id = 0
        eos_token_id = None

        def __call__(self, text, **_):
            return {"input_ids": [int(c) + 1 for c in text.split()]}

    loaded = type(loaded)(loaded.model, Tok(), loaded.name, loaded.dtype, loaded.device)
    stats = calibrate(loaded, heads, prompts, CalibrationConfig(max_new_tokens=12, topk=4, heldout_fraction=0.4,
                                                                typical_temperature=0.8), progress=False)
    assert stats.typical is not None and len(stats.typical.rollouts) == len(stats.rollouts) == 3
    assert [s.logp.shape[0] for s in stats.typical.rollouts] == [len(r) for r in stats.rollouts]
    back = load_stats(save_stats(stats, tmp_path / "a.json"))
    import transformers

    assert back.meta["versions"]["torch"] == torch.__version__
    assert back.meta["versions"]["transformers"] == transformers.__version__
    assert back.meta["versions"] == software_versions()  # the same record as the replay's
    res = run_search(back, SearchConfig(budget=6, trials=6, storage=f"sqlite:///{tmp_path / 's.db'}",
                                        accept="typical", baseline=""), show_progress=False)
    assert res.best.typical is not None and res.best.regret >= 0 and res.pareto


def test_search_cli_typical_writes_thresholds_and_pareto_plot(tmp_path, capsys):
    import json

    from bench.cli import main
    from bench.report.build import typical_section

    acc = save_stats(_stats_with_typical(seed=5), tmp_path / "a.json")
    out = tmp_path / "tree-typical.json"
    assert main(["search", "--acceptance", str(acc), "--budget", "8", "--trials", "12", "--accept", "typical",
                 "--max-regret", "0.4", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--out", str(out),
                 "--plots", str(tmp_path / "plots"), "--quiet", "--baseline", ""]) == 0
    obj = json.loads(out.read_text())
    rule = obj["acceptance"]
    assert rule["rule"] == "typical" and rule["temperature"] == 0.7 and rule["pareto"]
    params = TypicalParams(rule["posterior_threshold"], rule["posterior_alpha"])
    replay = typical_walk(load_tree(str(out)), load_stats(acc).typical.rollouts, params)
    assert replay.tau == pytest.approx(obj["predicted_tau"], abs=1e-6)
    assert (tmp_path / "plots" / "pareto_typical.png").is_file()
    assert "| Pareto 0 |" in capsys.readouterr().out
    assert "epsilon" in typical_section(tmp_path)
