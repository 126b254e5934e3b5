"""Replay: interleaved records, resumable after a kill with nothing lost or duplicated; analysis."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from bench.replay import runner
from bench.replay.analyze import greedy_equality, summary, token_agreement
from bench.replay.mtbench import Question, load_questions
from bench.replay.runner import MethodConfig, ReplayConfig, load_records, replay
from medusa_runtime.decoding.lockstep import lockstep
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.model import chat_template_ids

from .conftest import DATA, tiny_chat_model

QUESTIONS = [Question(1, "writing", ("Say hi.", "Again, shorter.")), Question(2, "math", ("1+1?", "And 2+2?")),
             Question(3, "coding", ("Print hello.", "In C."))]
CONFIGS = [MethodConfig("generate", "generate"), MethodConfig("plain", "plain"),
           MethodConfig("medusa chain:2", "medusa", tree="chain:2")]


def test_each_question_runs_the_configurations_in_its_own_seeded_order():
    """No configuration always follows the same neighbour (a heavy run changes the machine's speed for the
    next); the order is a permutation per (question, turn, repeat), reproducible, and differs between them."""
    configs = [MethodConfig(f"c{i}", "plain") for i in range(6)]
    orders = [[c.name for c in runner.run_order(configs, q, t, 0)] for q in range(20) for t in range(2)]
    assert all(sorted(o) == [c.name for c in configs] for o in orders)
    assert len({tuple(o) for o in orders}) > 30  # 40 orders of 720 possible: nearly all distinct
    assert orders == [[c.name for c in runner.run_order(configs, q, t, 0)] for q in range(20) for t in range(2)]
    followers = {o[o.index("c0") + 1] for o in orders if o[-1] != "c0"}
    assert len(followers) >= 4  # c0 is followed by most of the others somewhere


def test_replay_killed_halfway_resumes_without_loss_or_duplicates(tmp_path, monkeypatch):
    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    cfg = ReplayConfig(max_new_tokens=8, turns=2, repeats=1, warmup_tokens=2)
    out = tmp_path / "records.jsonl"
    real = runner.make_runner
    calls = {"n": 0}

    def dying(cfg_, loaded_, heads_, topk=10, shared=None):
        inner = real(cfg_, loaded_, heads_, topk, shared)

        def run(prompt, n, temperature=0.0, seed=None):
            calls["n"] += 1
            if calls["n"] > 3 + 7:  # 3 warm-ups, then 7 records, then the process "dies"
                raise KeyboardInterrupt
            return inner(prompt, n, temperature, seed)

        return run

    monkeypatch.setattr(runner, "make_runner", dying)
    with pytest.raises(KeyboardInterrupt):
        replay(loaded, heads, CONFIGS, QUESTIONS, cfg, out, progress=False)
    partial = load_records(out)
    assert len(partial) == 7
    monkeypatch.setattr(runner, "make_runner", real)
    records = replay(loaded, heads, CONFIGS, QUESTIONS, cfg, out, progress=False)
    on_disk = load_records(out)
    keys = [(r["config"], r["question_id"], r["turn"], r["repeat"]) for r in on_disk]
    assert len(keys) == len(set(keys)) == 3 * 3 * 2 == len(records)
    assert on_disk[:7] == partial  # nothing already written was lost or rewritten
    # interleaved: every configuration within each question (turn) before the next, in that question's order
    first = QUESTIONS[0].question_id
    assert [r["config"] for r in on_disk[:3]] == [c.name for c in runner.run_order(CONFIGS, first, 0, 0)]
    # greedy runtime outputs equal generate's (float32)
    eq = greedy_equality(pd.DataFrame(on_disk), "generate").set_index("config")
    assert (eq["identical_share"] == 1.0).all()
    table = summary(pd.DataFrame(on_disk), ["generate", "plain"])
    overall = table[table["category"] == "overall"].set_index("config")
    assert overall.loc["generate", "speedup_vs_generate"] == pytest.approx(1.0)
    assert set(table["category"]) == {"writing", "math", "coding", "overall"}
    rec = on_disk[0]
    for key in ("config_hash", "category", "new_tokens", "steps", "accept_lengths", "wall_time", "answer", "versions"):
        assert key in rec


def test_lockstep_takes_one_step_of_each_live_run_per_round():
    """Round k takes step k of every run that has one, in an order shuffled per round (seeded); each result is
    handed over as its run finishes, so a failure later loses none that finished."""
    def run(name, n, log, fail=False):
        for i in range(n):
            log.append((name, i))
            yield
        if fail:
            raise RuntimeError("died")
        return name * 2

    lengths = {"a": 3, "b": 1, "c": 5, "d": 3}
    log, finished = [], []
    lockstep({k: run(k, n, log) for k, n in lengths.items()}, "q1", lambda k, v: finished.append((k, v)))
    rounds = [[k for k, i in log if i == r] for r in range(5)]
    assert [i for _, i in log] == sorted(i for _, i in log)  # no run takes step k+1 before all took step k
    assert [sorted(r) for r in rounds] == [["a", "b", "c", "d"]] * 1 + [["a", "c", "d"]] * 2 + [["c"]] * 2
    assert finished[0] == ("b", "bb") and finished[-1] == ("c", "cc") and dict(finished) == {k: k * 2 for k in lengths}
    orders = set()
    for seed in range(20):
        log = []
        lockstep({k: run(k, 2, log) for k in "abcd"}, f"q{seed}", lambda k, v: None)
        orders |= {tuple(k for k, _ in log[:4]), tuple(k for k, _ in log[4:])}
    assert len(orders) > 10  # shuffled per round and per seed (24 orders of 4)
    log, finished = [], []
    with pytest.raises(RuntimeError):
        lockstep({"ok": run("ok", 1, log), "bad": run("bad", 2, log, fail=True)}, "s", lambda k, v: finished.append(k))
    assert finished == ["ok"]


def test_lockstep_replay_equals_sequential_and_resumes_after_a_kill_mid_step(tmp_path, monkeypatch):
    """The runtime's configurations stepped in turn decode exactly what whole answers one after another do
    (greedy and seeded sampling); killed in the middle of a question's steps, the replay keeps what had
    finished and the resumed run records every (configuration, question, turn, repeat) once."""
    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    configs = CONFIGS + [MethodConfig("sampled", "medusa", tree="chain:2", accept="sample", temperature=0.7,
                                      samples=2)]

    def key(r):
        return (r["config"], r["question_id"], r["turn"], r["repeat"])

    def tokens(path):
        return {key(r): r["token_ids"] for r in load_records(path)}

    seq, lock = tmp_path / "seq.jsonl", tmp_path / "lock.jsonl"
    cfg = ReplayConfig(max_new_tokens=8, turns=2, warmup_tokens=2)
    replay(loaded, heads, configs, QUESTIONS, replace(cfg, lockstep=False), seq, progress=False)
    real, steps, trace = runner.make_runner, {"n": 0}, []

    def dying(cfg_, loaded_, heads_, topk=10, shared=None):
        inner = real(cfg_, loaded_, heads_, topk, shared)
        if not isinstance(inner, runner.SteppedRunner):
            return inner

        def wrapped(*a):
            gen = inner.steps(*a)
            while True:
                try:
                    next(gen)
                except StopIteration as done:
                    return done.value
                steps["n"] += 1
                trace.append(cfg_.name)
                if steps["n"] == 60:  # well inside the replay, in the middle of a question's steps: "dies"
                    raise KeyboardInterrupt
                yield

        return runner.SteppedRunner(wrapped)

    monkeypatch.setattr(runner, "make_runner", dying)
    with pytest.raises(KeyboardInterrupt):
        replay(loaded, heads, configs, QUESTIONS, cfg, lock, progress=False)
    partial = load_records(lock)
    assert 0 < len(partial) < len(load_records(seq))
    # stepped in turn: some configuration's steps have another's between them (whole answers never do)
    assert any(a == c != b for a, b, c in zip(trace, trace[1:], trace[2:]))
    monkeypatch.setattr(runner, "make_runner", real)
    replay(loaded, heads, configs, QUESTIONS, cfg, lock, progress=False)
    on_disk = load_records(lock)
    assert on_disk[:len(partial)] == partial
    assert len(on_disk) == len({key(r) for r in on_disk}) == 3 * 2 * 3 + 3 * 2 * 2  # 3 configs once, one twice
    assert tokens(lock) == tokens(seq)


def test_configurations_of_the_same_greedy_decoding_share_one_decoder(tmp_path, monkeypatch):
    """Two names for the same greedy tree (a preset and a file of its paths, as the folds' searched picks often
    are) decode on one decoder: as many decoders are built as without the second, and both record what a
    replay of each alone records; a sampled configuration of the same tree keeps a decoder of its own."""
    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    tree_file = tmp_path / "same.json"
    tree_file.write_text(json.dumps([[0], [0, 0]]))  # a bare list of paths
    again = MethodConfig("same tree, a file", "medusa", tree=str(tree_file))
    sampled = MethodConfig("sampled", "medusa", tree="chain:2", accept="sample", temperature=0.7)
    built = []

    class Counted(runner.MedusaDecoder):
        def __init__(self, *a, **kw):
            built.append(a[3].rule)
            super().__init__(*a, **kw)

    monkeypatch.setattr(runner, "MedusaDecoder", Counted)
    cfg = ReplayConfig(max_new_tokens=8, turns=2, warmup_tokens=2)

    def run(configs, name):
        built.clear()
        records = replay(loaded, heads, configs, QUESTIONS, cfg, tmp_path / f"{name}.jsonl", progress=False)
        return {(r["config"], r["question_id"], r["turn"]): r["token_ids"] for r in records}, list(built)

    both, with_again = run(CONFIGS + [again, sampled], "both")
    alone, without = run(CONFIGS + [sampled], "alone")
    by_itself, _ = run([again], "by-itself")
    assert sorted(with_again) == sorted(without) and with_again.count("sample") == 2  # warm-up and answers
    assert {k: v for k, v in both.items() if k[0] != again.name} == alone
    assert {k: v for k, v in both.items() if k[0] == again.name} == by_itself
    assert all(both[(again.name, q, t)] == both[("medusa chain:2", q, t)] for _, q, t in by_itself)


def test_fastchat_temperature_policy(tmp_path):
    """FastChat's per-category temperatures: writing samples at 0.7, math stays greedy (equal to generate)."""
    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    configs = [MethodConfig("generate", "generate", temperature_policy="fastchat"),
               MethodConfig("plain", "plain", temperature_policy="fastchat"),
               MethodConfig("medusa typical", "medusa", tree="chain:2", accept="typical",
                            temperature_policy="fastchat")]
    records = replay(loaded, heads, configs, QUESTIONS[:2], ReplayConfig(max_new_tokens=12, turns=1, warmup_tokens=2),
                     tmp_path / "r.jsonl", progress=False)
    temps = {(r["config"], r["category"]): r["temperature"] for r in records}
    assert all(temps[(c.name, "writing")] == 0.7 and temps[(c.name, "math")] == 0.0 for c in configs)
    eq = greedy_equality(pd.DataFrame(records), "generate").set_index("config")
    assert (eq["compared"] == 1).all() and (eq["identical_share"] == 1.0).all()  # only the greedy math question
    with pytest.raises(ValueError, match="typical or sample"):
        MethodConfig("m", "medusa", tree="chain:2", temperature_policy="fastchat")
    with pytest.raises(ValueError, match="temperature_policy"):
        MethodConfig("m", "plain", temperature_policy="per-category")


def test_token_agreement_counts_equal_positions_over_the_longer_answer():
    assert token_agreement([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)
    assert token_agreement([1, 2], [1, 2, 3, 4]) == token_agreement([1, 2, 3, 4], [1, 2]) == 0.5
    assert token_agreement([5, 2, 3], [1, 2, 3]) == pytest.approx(2 / 3)  # a chance match after a divergence counts
    assert token_agreement([], []) == 1.0 and token_agreement([7], []) == 0.0


def test_summary_is_ratio_of_totals():
    rows = []
    for cfg, t in (("generate", 2.0), ("fast", 1.0)):
        rows += [{"config": cfg, "category": "a", "new_tokens": 10, "wall_time": t, "steps": 10, "repeat": 0,
                  "question_id": 1, "turn": 0, "token_ids": [1]},
                 {"config": cfg, "category": "b", "new_tokens": 30, "wall_time": 2 * t, "steps": 15, "repeat": 0,
                  "question_id": 2, "turn": 0, "token_ids": [2]}]
    table = summary(pd.DataFrame(rows), ["generate"]).set_index(["config", "category"])
    assert table.loc[("fast", "overall"), "tokens_per_s"] == pytest.approx(40 / 3.0)
    assert table.loc[("fast", "overall"), "speedup_vs_generate"] == pytest.approx((40 / 3.0) / (40 / 6.0))
    assert table.loc[("fast", "b"), "tau"] == pytest.approx(2.0)


def test_question_loading(tmp_path):
    qs = load_questions(DATA / "mt_bench" / "question.jsonl")
    assert len(qs) == 80 and len({q.category for q in qs}) == 8 and all(len(q.turns) == 2 for q in qs)
    assert len(load_questions(DATA / "mt_bench" / "question.jsonl", categories=("math",))) == 10
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 5, "category": "x", "turns": ["a"]}) + "\n")
    assert load_questions(tmp_path / "q.jsonl")[0].turns == ("a",)
    (tmp_path / "bad.jsonl").write_text('{"question_id": 5}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_questions(tmp_path / "bad.jsonl")


def test_records_resume_only_under_the_same_inputs(tmp_path):
    """A replay or speed run into a folder of older records (another runtime revision, heads or tree file)
    moves them aside instead of resuming them, and the profile rounds taken during them with them."""
    import argparse

    from bench.pipeline import StageCache, isolate_records
    from bench.stages.replay import replay_inputs

    heads_dir, tree = tmp_path / "heads", tmp_path / "tree.json"
    heads_dir.mkdir()
    (heads_dir / "config.json").write_text("{}")
    tree.write_text('{"medusa_choices": [[0]]}')
    args = argparse.Namespace(heads=str(heads_dir), model="default", dtype="bfloat16", device="cpu",
                              questions=None, max_new_tokens=64)
    configs = [MethodConfig("medusa t", "medusa", tree=str(tree)), MethodConfig("plain", "plain")]

    def key():
        return StageCache.key_of(replay_inputs(args, configs))

    first = key()
    out = tmp_path / "run"
    isolate_records(out, first)
    (out / "records.jsonl").write_text('{"config": "plain"}\n')
    (out / "profile_rounds.jsonl").write_text('{"question_id": 1}\n')
    isolate_records(out, key())  # same inputs: the records stay to be resumed
    assert (out / "records.jsonl").read_text() == '{"config": "plain"}\n'
    assert (out / "profile_rounds.jsonl").is_file()
    tree.write_text('{"medusa_choices": [[0], [1]]}')  # same path, other tree
    assert key() != first
    (heads_dir / "draft_vocab.json").write_text("[1, 2]")  # same folder, other heads
    changed = key()
    isolate_records(out, changed)
    assert not (out / "records.jsonl").exists() and not (out / "profile_rounds.jsonl").exists()
    assert (out / f"records.{first}.jsonl").read_text() == '{"config": "plain"}\n'
    assert (out / f"profile_rounds.{first}.jsonl").read_text() == '{"question_id": 1}\n'
    assert (out / "inputs.key").read_text().strip() == changed
    args.max_new_tokens = 128
    assert key() != changed


def test_configurations_with_heads_of_their_own_decode_on_the_base_of_those_heads(tiny_examples, tmp_path,
                                                                                    monkeypatch):
    """Two head sets in one interleaved replay: Medusa-2 heads (with their adapter) beside the replay's own.
    Each configuration decodes on its heads' base, its records say which, and the lossless check compares it
    with plain decoding of that same base."""
    from medusa_runtime.heads.adapter import apply_heads_adapter
    from medusa_runtime.heads.medusa import load_heads
    from medusa_runtime.training.medusa2 import train_medusa2_top
    from medusa_runtime.training.train import TrainConfig

    from .conftest import hf_greedy

    monkeypatch.setenv("MEDUSA_BENCH_CACHE", str(tmp_path / "cache"))
    loaded, _, examples, _ = tiny_examples
    cfg = TrainConfig(method="medusa2", num_heads=2, epochs=1, batch_tokens=512, val_fraction=0.0, lora_rank=4,
                      train_layers=1, heads_warmup_ratio=0.0, lr=1e-2, base_lr=5e-3, lm_weight=0.0)
    train_medusa2_top(loaded, examples[:12], cfg, tmp_path / "m2", progress=False, log=lambda m: None)
    folder = str(tmp_path / "m2" / "heads")
    adapted = apply_heads_adapter(loaded, folder, log=lambda m: None)
    variants = {folder: (adapted, load_heads(folder, loaded.hidden_size, loaded.vocab_size))}
    configs = [MethodConfig("plain", "plain"), MethodConfig("medusa chain:2", "medusa", tree="chain:2"),
               MethodConfig("plain, medusa2 base", "plain", heads=folder),
               MethodConfig("medusa2 chain:2", "medusa", tree="chain:2", heads=folder)]
    own = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    rc = ReplayConfig(max_new_tokens=10, turns=1, warmup_tokens=2)
    with pytest.raises(ValueError, match="not given"):
        replay(loaded, own, configs, QUESTIONS, rc, tmp_path / "none.jsonl", progress=False)
    records = replay(loaded, own, configs, QUESTIONS, rc, tmp_path / "r.jsonl", progress=False, variants=variants)
    by = {(r["config"], r["question_id"]): r for r in records}
    for q in QUESTIONS:
        assert by[("medusa2 chain:2", q.question_id)]["model"] == adapted.name != by[("plain", q.question_id)]["model"]
        assert by[("medusa2 chain:2", q.question_id)]["heads"] == folder
        prompt = runner.chat_ids(loaded, q.turns[:1], [])
        assert by[("plain, medusa2 base", q.question_id)]["token_ids"] == hf_greedy(adapted, prompt, 10)
        assert by[("plain", q.question_id)]["token_ids"] == hf_greedy(loaded, prompt, 10)
    eq = greedy_equality(pd.DataFrame(records), "plain").set_index("config")
    assert (eq["identical_share"] == 1.0).all() and (eq["compared"] == len(QUESTIONS)).all()
    assert eq["reference"].to_dict() == {"plain": "plain", "medusa chain:2": "plain", "plain, medusa2 base":
                                         "plain, medusa2 base", "medusa2 chain:2": "plain, medusa2 base"}


def test_sampled_configurations_draw_seeded_samples_that_do_not_depend_on_the_order(tmp_path):
    """samples=3: three answers per (question, turn), each seeded by (question, turn, sample) and recorded; a
    second turn follows its own sample's first answer; the same samples come back whatever ran before them."""
    from bench.replay.runner import sample_seed
    from medusa_runtime.decoding.acceptance import AcceptConfig
    from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder

    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    sampled = MethodConfig("plain T0.8", "plain", temperature=0.8, samples=3)
    rc = ReplayConfig(max_new_tokens=6, turns=2, repeats=1, warmup_tokens=2)
    records = replay(loaded, heads, [CONFIGS[1], sampled], QUESTIONS[:2], rc, tmp_path / "a.jsonl", progress=False)
    mine = [r for r in records if r["config"] == "plain T0.8"]
    assert sorted((r["question_id"], r["turn"], r["repeat"]) for r in mine) == \
        [(q.question_id, t, s) for q in QUESTIONS[:2] for t in range(2) for s in range(3)]
    assert all(r["seed"] == sample_seed(r["question_id"], r["turn"], r["repeat"]) for r in mine)
    assert all(r["seed"] is None for r in records if r["config"] == "plain")
    # the sample, drawn again by hand from its seed: the runtime's plain sampling of that prompt
    by = {(r["question_id"], r["turn"], r["repeat"]): r for r in mine}
    dec = MedusaDecoder(loaded, None, None, AcceptConfig(rule="sample", temperature=0.8),
                        DecodeConfig(max_new_tokens=6, seed=0))
    for (qid, turn, s), r in by.items():
        q = next(x for x in QUESTIONS if x.question_id == qid)
        earlier = [by[(qid, t, s)]["answer"] for t in range(turn)]  # its own sample's first answer
        dec.generator.manual_seed(r["seed"])
        assert dec.generate(runner.chat_ids(loaded, q.turns[: turn + 1], earlier)).token_ids == r["token_ids"]
    assert len({tuple(r["token_ids"]) for r in mine if r["turn"] == 0}) > 2  # the samples differ
    # another neighbour and order: the same samples
    again = replay(loaded, heads, [sampled, CONFIGS[0]], QUESTIONS[:2], rc, tmp_path / "b.jsonl", progress=False)
    assert {(r["question_id"], r["turn"], r["repeat"]): r["token_ids"] for r in again if r["config"] == "plain T0.8"} \
        == {k: r["token_ids"] for k, r in by.items()}


def test_profile_rounds_run_between_questions_and_resume_with_the_replay(tmp_path, monkeypatch):
    """The latency profile taken during a replay: a round of the real profiler (tiny model) before every 2nd
    (question, turn) of the matrix, never inside one; a replay killed halfway and resumed takes each round
    once, on the same (question, turn)s as an uninterrupted one; the rounds make a profile on the given grid."""
    from bench.replay.profile_rounds import RoundsDuringReplay, read_rounds
    from medusa_runtime.measure.profile import ProfileConfig, Profiler

    loaded = tiny_chat_model()
    heads = fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size)
    profiler = Profiler(loaded, heads, ProfileConfig(nodes=(1, 2, 4), contexts=(8, 16), loop_nodes=(2, 4), warmup=1))
    out, rounds_file = tmp_path / "records.jsonl", tmp_path / "profile_rounds.jsonl"
    seen = []  # (question, turn), records on disk when the hook ran

    def hooked(during):
        def between(index, q, t, r):
            seen.append(((q, t), len(load_records(out))))
            during(index, q, t, r)
        return between

    cfg = ReplayConfig(max_new_tokens=6, turns=2, repeats=1, warmup_tokens=2)
    real, calls = runner.make_runner, {"n": 0}

    def dying(cfg_, loaded_, heads_, topk=10, shared=None):
        inner = real(cfg_, loaded_, heads_, topk, shared)

        def run(prompt, n, temperature=0.0, seed=None):
            calls["n"] += 1
            if calls["n"] > 3 + 7:  # 3 warm-ups, 7 records: the third (question, turn) has one record
                raise KeyboardInterrupt
            return inner(prompt, n, temperature, seed)
        return run

    monkeypatch.setattr(runner, "make_runner", dying)
    with pytest.raises(KeyboardInterrupt):
        replay(loaded, heads, CONFIGS, QUESTIONS, cfg, out, progress=False,
               between=hooked(RoundsDuringReplay(rounds_file, profiler, every=2)))
    assert seen == [((1, 0), 0), ((1, 1), 3), ((2, 0), 6)]  # before each (question, turn)'s first record
    assert [(r["question_id"], r["turn"]) for r in read_rounds(rounds_file)] == [(1, 0), (2, 0)]
    monkeypatch.setattr(runner, "make_runner", real)
    during = RoundsDuringReplay(rounds_file, profiler, every=2)
    replay(loaded, heads, CONFIGS, QUESTIONS, cfg, out, progress=False, between=hooked(during))
    rounds = read_rounds(rounds_file)
    assert [(r["question_id"], r["turn"]) for r in rounds] == [(1, 0), (2, 0), (3, 0)]  # every 2nd, once each
    assert len(load_records(out)) == 3 * 3 * 2
    assert all(len(r["tight"]) == 2 * 3 and min(r["tight"]) > 0 and len(r["loops"]) == len(profiler.decoders)
               for r in rounds)
    # plain decoding and the context loop sizes again at the other context (8; the middle one is 16)
    assert [(c, n) for c, n, _ in profiler.context_runs] == [(8, 1), (8, 2), (8, 4)]
    assert all(len(r["context_loops"]) == 3 and all(x[0] > 0 and x[2] > 0 for x in r["context_loops"])
               for r in rounds)
    prof = during.write_profile(tmp_path / "latency-during.json")
    assert prof.nodes == (1, 2, 4) and prof.contexts == (8, 16) and prof.meta["repeats"] == 3
    assert "during the replay" in prof.meta["taken"] and (tmp_path / "latency-during.json").is_file()
    with pytest.raises(ValueError, match=">= 1"):
        RoundsDuringReplay(rounds_file, profiler, every=0)


def test_a_model_without_chat_template_is_prompted_in_the_fallback_format_and_says_so(tmp_path):
    """A base model whose tokenizer has no chat template loads with FastChat's vicuna_v1.1 format (written out
    here by hand), says so when loaded, in describe_model and in every replay record, and replays."""
    from medusa_runtime.model import FALLBACK_CHAT_NAME, describe_model, load_model

    loaded = tiny_chat_model()
    folder = tmp_path / "base"
    loaded.model.config.max_position_embeddings = 2048
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.chat_template = None
    loaded.tokenizer.save_pretrained(folder)
    for f in folder.glob("chat_template*"):
        f.unlink()
    said: list[str] = []
    base = load_model(str(folder), "float32", log=said.append)
    assert any("no chat template" in m for m in said)
    tok = base.tokenizer
    text = tok.decode(chat_template_ids(base, [{"role": "user", "content": "Hi there"},
                                               {"role": "assistant", "content": "Hello"},
                                               {"role": "user", "content": "Bye"}]))
    system = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
              "detailed, and polite answers to the user's questions.")
    assert text == f"{system} USER: Hi there ASSISTANT: Hello{tok.eos_token} USER: Bye ASSISTANT:"
    own = tok.decode(chat_template_ids(base, [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi"}]))
    assert own == "Be brief. USER: Hi ASSISTANT:"
    assert describe_model(base)["chat_template"] == FALLBACK_CHAT_NAME
    records = replay(base, None, [MethodConfig("plain", "plain")], QUESTIONS[:1],
                     ReplayConfig(max_new_tokens=4, turns=2, repeats=1, warmup_tokens=2), tmp_path / "r.jsonl",
                     progress=False)
    assert len(records) == 2 and all(r["chat_template"] == FALLBACK_CHAT_NAME for r in records)
    assert describe_model(tiny_chat_model())["chat_template"] == "the model's own"
