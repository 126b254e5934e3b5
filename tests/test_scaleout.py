"""Scale-out on a real PostgreSQL server (started here from the system's binaries, tests/pgserver.py):
search workers sharing one study, one killed mid-trial and one joining late; the replay matrix split over
three workers on two named machines, one killed mid-unit and restarted, merged into one set of records that
equals a single-worker replay's, reported per machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import optuna
import pytest

from bench.replay.mtbench import load_questions
from medusa_runtime.heads.medusa import fresh_heads, save_heads
from treesearch.stats import ACCEPTANCE_SCHEMA

from .conftest import tiny_chat_model
from .pgserver import postgres_server
from .test_treesearch import vicuna_7b_marginal

STATE = optuna.trial.TrialState

# a search worker whose trials take a while (the real objective, then a pause), so that one can be killed in one
SEARCH_WORKER = """
import json, sys, time
from treesearch import search
from treesearch.stats import load_stats

real = search.TreeObjective.__call__

def slow(self, trial):
    value = real(self, trial)
    time.sleep(float(sys.argv[4]))
    return value

search.TreeObjective.__call__ = slow
cfg = search.SearchConfig(budget=40, trials=int(sys.argv[3]), objective="tau", storage=sys.argv[2], study_name=sys.argv[5],
                          heartbeat=1, grace=2)
result = search.run_search(load_stats(sys.argv[1]), cfg, show_progress=False)
print(json.dumps({"complete": result.trials_complete}))
"""


@pytest.fixture(scope="module")
def pg():
    """The server .ci/run started (``MEDUSA_TEST_POSTGRES``), else one started here for these tests."""
    if os.environ.get("MEDUSA_TEST_POSTGRES"):
        yield os.environ["MEDUSA_TEST_POSTGRES"]
        return
    with postgres_server() as url:
        yield url


def _study(url: str, name: str, timeout: float = 120) -> optuna.Study:
    """The study once some worker has created it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return optuna.load_study(study_name=name, storage=url)
        except KeyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _kill_while_running(proc: subprocess.Popen, study: optuna.Study, after_complete: int = 0,
                        timeout: float = 240, max_age: float = 0.15) -> int:
    """SIGKILL ``proc`` while a trial it claimed (its ``worker`` attribute names the pid) is RUNNING and started
    less than ``max_age`` seconds ago (so it cannot finish between this look and the kill: a search trial here
    runs >= 0.4 s, a replay unit seconds; a trial seen near its end once completed first); that trial's number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trials = study.get_trials(deepcopy=False)
        now = datetime.now()
        mine = [t for t in trials if t.state == STATE.RUNNING and str(t.user_attrs.get("worker", "")).endswith(
            f":{proc.pid}") and t.datetime_start is not None and (now - t.datetime_start).total_seconds() < max_age]
        if mine and sum(t.state == STATE.COMPLETE for t in trials) >= after_complete:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            return mine[0].number
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the worker never ran a trial")


def _reap(procs: list[subprocess.Popen]) -> None:
    """Never leave a worker running (or its pipes open), whatever failed."""
    for p in procs:
        if p.returncode is None:
            p.kill()
            p.communicate()


def test_four_search_workers_on_postgres_one_killed_mid_trial_one_late(pg, tmp_path):
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"schema": ACCEPTANCE_SCHEMA, "model": "m", "marginal": vicuna_7b_marginal().tolist()}))
    script = tmp_path / "worker.py"
    script.write_text(SEARCH_WORKER)
    target, name = 40, f"search-{uuid.uuid4().hex[:8]}"

    def start():
        return subprocess.Popen([sys.executable, str(script), str(acc), pg, str(target), "0.4", name],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    workers = [start() for _ in range(4)]  # started together on an empty database: they race to create it
    try:
        study = _study(pg, name)
        killed = _kill_while_running(workers[0], study, after_complete=3)
        workers.append(start())  # joins late
        outs = [w.communicate(timeout=300) for w in workers[1:]]
    finally:
        _reap(workers)
    for w, (out, err) in zip(workers[1:], outs):
        assert w.returncode == 0, err[-2000:]
        assert json.loads(out.splitlines()[-1])["complete"] >= target
    trials = optuna.load_study(study_name=name, storage=pg).trials
    by_number = {t.number: t for t in trials}
    complete = [t for t in trials if t.state == STATE.COMPLETE]
    # the target reached; at most one trial over it per worker that was mid-trial when it was reached
    assert target <= len(complete) <= target + 4
    assert not [t for t in trials if t.state in (STATE.RUNNING, STATE.WAITING)]
    # the killed worker's trial was failed by the heartbeat check and run again, with its parameters, to the end
    # (a trial killed while it was still suggesting has some of them: the retry keeps those, suggests the rest)
    assert by_number[killed].state == STATE.FAIL
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1 and retries[0].state == STATE.COMPLETE
    assert by_number[killed].params.items() <= retries[0].params.items()
    assert [t.number for t in trials if t.state == STATE.FAIL] == [killed]  # nothing else failed
    # the seed trials were enqueued once (the first worker's create_study won; the others waited for its mark)
    study = optuna.load_study(study_name=name, storage=pg)
    seeds = [t.user_attrs["seed"] for t in trials if "seed" in t.user_attrs and "failed_trial" not in t.system_attrs]
    assert sorted(seeds) == list(range(study.user_attrs["seeded"])) and len(seeds) == 2  # the optimum, mc_sim
    assert study.metric_names == ["tau"]
    # every worker ran trials, the late one too
    ran = {str(t.user_attrs.get("worker")).rsplit(":", 1)[-1] for t in complete}
    assert str(workers[4].pid) in ran and len(ran & {str(w.pid) for w in workers[1:]}) >= 3


def _replay_cmd(model: Path, heads: Path, cfg: Path, qfile: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.cli", "replay", "--config", str(cfg), "--model", str(model), "--heads",
            str(heads), "--dtype", "float32", "--questions", str(qfile), "--max-new-tokens", "24", "--repeats", "2",
            "--out", str(out), "--json", *extra]


def test_replay_split_over_three_workers_one_killed_equals_one_worker(pg, tmp_path):
    loaded = tiny_chat_model()
    model, heads = tmp_path / "model", tmp_path / "heads"
    loaded.model.save_pretrained(model)
    loaded.tokenizer.save_pretrained(model)
    save_heads(fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size), heads)
    picked = load_questions(log=lambda m: None)[:9]
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": q.question_id, "category": q.category,
                                         "turns": list(q.turns)}) + "\n" for q in picked))
    cfg = tmp_path / "matrix.json"
    cfg.write_text(json.dumps({"turns": 2, "configurations": [
        {"name": "plain", "method": "plain"}, {"name": "medusa chain:2", "method": "medusa", "tree": "chain:2"},
        {"name": "plain T0.7", "method": "plain", "temperature": 0.7}]}))
    ref = subprocess.run(_replay_cmd(model, heads, cfg, qfile, tmp_path / "one"), capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    name = f"replay-{uuid.uuid4().hex[:8]}"
    shared = ("--storage", pg, "--study-name", name, "--heartbeat", "1", "--grace-period", "2")

    def start(machine: str) -> subprocess.Popen:
        return subprocess.Popen(_replay_cmd(model, heads, cfg, qfile, tmp_path / "split", *shared, "--machine",
                                            machine), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    workers = [start("m-a"), start("m-a"), start("m-b")]
    try:
        killed = _kill_while_running(workers[0], _study(pg, name), timeout=400)
        workers.append(start("m-a"))  # the killed worker restarted
        outs = [w.communicate(timeout=600) for w in workers[1:]]
    finally:
        _reap(workers)
    for w, (_out, err) in zip(workers[1:], outs):
        assert w.returncode == 0, err[-2000:]
    one = [json.loads(line) for line in (tmp_path / "one" / "records.jsonl").read_text().splitlines()]
    merged = [json.loads(line) for line in (tmp_path / "split" / "records.jsonl").read_text().splitlines()]

    def key(r: dict) -> tuple:
        return r["config"], r["question_id"], r["turn"], r["repeat"]

    # every (question, configuration, turn, repeat) exactly once, with the single worker's token ids
    assert len(merged) == len({key(r) for r in merged}) == len(one) == 9 * 2 * (2 + 2 + 2)
    assert {key(r): r["token_ids"] for r in merged} == {key(r): r["token_ids"] for r in one}
    # a question's configurations were timed on one machine; both machines took part
    machine_of = {}
    for r in merged:
        assert machine_of.setdefault(r["question_id"], r["machine"]) == r["machine"]
    assert set(machine_of.values()) == {"m-a", "m-b"}
    # the queue: the killed worker's unit failed and was done again, each unit completed once
    trials = optuna.load_study(study_name=name, storage=pg).trials
    assert [t.state for t in trials if t.number == killed] == [STATE.FAIL]
    assert sorted(t.user_attrs["unit"] for t in trials if t.state == STATE.COMPLETE) == list(range(9))
    assert any(t.system_attrs.get("failed_trial") == killed and t.state == STATE.COMPLETE for t in trials)
    # summaries per machine, never one over both
    for m in ("m-a", "m-b"):
        assert (tmp_path / "split" / "machines" / m / "summary.csv").is_file()
    assert not (tmp_path / "split" / "summary.csv").exists()
    from bench.report.build import report

    run = tmp_path / "run"
    (run / "replay").mkdir(parents=True)
    (run / "replay" / "records.jsonl").write_text((tmp_path / "split" / "records.jsonl").read_text())
    written = report(run)
    assert written and all("machines" in p.parts for p in written)
    for m in ("m-a", "m-b"):
        mine = (run / "machines" / m / "replay" / "records.jsonl").read_text().splitlines()
        assert mine and all(json.loads(line)["machine"] == m for line in mine)


def test_the_documented_postgresql_url_binds_the_installed_driver(monkeypatch):
    """``postgresql://`` (as README and --help spell it) goes to psycopg 3, which the postgres extra brings, or to
    psycopg2 where only that is installed; without either, one line says what to install."""
    import importlib.util

    from treesearch.search import storage_url

    assert storage_url("sqlite:///x.db") == "sqlite:///x.db"
    assert storage_url("postgresql+psycopg2://u@h/d") == "postgresql+psycopg2://u@h/d"  # an explicit driver stays
    assert storage_url("postgresql://u@h:5/d") == "postgresql+psycopg://u@h:5/d"  # the extra's driver, installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else object())
    assert storage_url("postgres://u@h/d") == "postgresql+psycopg2://u@h/d"  # only psycopg2 there
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=r"pip install 'medusa-bench\[postgres\]'"):
        storage_url("postgresql://u@h/d")
