"""The load stage: its figures against closed forms, llama.cpp's build fallback against a binary that faults,
``medusa-bench load`` end to end on the default model (two servers, two concurrencies, load.json checked), and what
serving costs a step (bench.load.serving) in closed form and as the profile measures it."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import brentq, nnls

from bench.cli import build_parser
from bench.cli import main as cli_main
from bench.engines import EngineError, llamacpp
from bench.load.client import LoadPlan, RequestRecord
from bench.load.prediction import ON_CALIBRATION, ON_REQUESTS, schedule_predictor
from bench.load.serving import ServingRun, fit_overhead
from bench.load.step_costs import StepsDuringLoad, grid_upto, rows_per_request
from bench.load.summary import HEADS_BASE_PLAIN, SCHEMA, load_row, paired_speedup, percentiles_ms, stops_paying
from bench.replay.suites import load_suite
from bench.report.load import load_frame, load_section, prediction_sentences, stop_sentences
from bench.stages.jobs import ProfileJob
from bench.stages.load import Measured
from medusa_runtime.model import chat_template_ids, load_model
from treesearch.cost import LatencyProfile, load_profile, save_profile
from treesearch.replay import Decoding, configuration_json, replay
from treesearch.schedule import request_latencies, throughput_on_prompts
from treesearch.stats import load_stats, save_stats
from treesearch.tree import chain

from .conftest import tiny_llama
from .test_calibration import _heads_that_guess
from .test_schedule import _batched
from .test_workload_replay import _rollouts, _stats


def _rec(key: str, tokens: int, latency: float, chunks: int = 4) -> RequestRecord:
    r = RequestRecord(key, ok=True, sent=10.0, ended=10.0 + latency, tokens=tokens, text=f"t{key}")
    r.chunks = list(np.linspace(10.1, 10.0 + latency, chunks))
    return r


def test_rows_follow_their_definitions():
    recs = [_rec(str(i), 10 + i, 1.0 + 0.5 * i) for i in range(6)]
    row = load_row("chain:2", "own", 4, recs, {"0": "t0", "1": "other"}, {"steps": 10, "accepted": {1: 6, 2: 2}})
    assert row["output_tokens_per_s"] == pytest.approx(4 * sum(r.tokens for r in recs) / sum(r.latency for r in recs))
    lo, hi = row["output_tokens_per_s_ci"]
    assert lo <= row["output_tokens_per_s"] <= hi
    assert row["per_request_tokens_per_s"] == pytest.approx(np.median([r.tokens / r.latency for r in recs]))
    assert row["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert row["accepted_per_step"] == pytest.approx(0.8) and row["accepted_per_position"] == [0.6, 0.2]
    assert row["identical_to_plain"] == pytest.approx(1 / 6)  # one of six replies equals its reference
    p = percentiles_ms([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["ci"]["p50"][0] <= 50.5 <= p["ci"]["p50"][1]
    failed = load_row("plain", "own", 1, [RequestRecord("x", error="APIError: boom")])
    assert failed["failed"] == 1 and "output_tokens_per_s" not in failed


def _sse_server(drop: int):
    """A loopback HTTP server that closes each of its first ``drop`` connections as soon as a request arrives (no
    reply), then answers every request with a two-chunk completion stream; returns (base URL, stop, connections)."""
    import asyncio
    import threading

    seen = {"connections": 0}
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in (
        {"id": "x", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": "hi", "finish_reason": None}]},
        {"id": "x", "object": "text_completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})) + "data: [DONE]\n\n"

    async def handle(reader, writer):
        seen["connections"] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        if seen["connections"] > drop:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                         + body.encode())
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def shut():
        server.close()
        await server.wait_closed()

    def stop():
        asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()

    return f"http://127.0.0.1:{port}/v1", stop, seen


def test_a_connection_dropped_before_any_reply_is_replaced_once_and_counted():
    """The load client against a server that drops connections unanswered: one drop, the request is sent again on
    a new connection and succeeds with reconnects 1 (load_row sums them); two drops in a row, it fails."""
    from bench.load.client import LoadRequest, run_load_sync

    req = [LoadRequest("q", [1, 2, 3], 4)]
    for drop, ok, reconnects in ((0, True, 0), (1, True, 1), (2, False, 1)):
        url, stop, seen = _sse_server(drop)
        try:
            (rec,) = run_load_sync(url, "m", req, LoadPlan(concurrency=1, timeout_s=10))
        finally:
            stop()
        assert (rec.ok, rec.reconnects, seen["connections"]) == (ok, reconnects, 1 + reconnects), (drop, rec)
        assert rec.text == ("hi" if ok else "") and (ok or "APIConnectionError" in rec.error)
        assert load_row("plain", "llama.cpp", 1, [rec])["reconnects"] == reconnects


def test_speedup_pairs_questions_and_says_where_it_stops_paying():
    plain = [_rec(str(i), 20, 2.0) for i in range(8)]
    fast = [_rec(str(i), 20, 1.0) for i in range(8)]
    assert paired_speedup(fast, plain)[0] == pytest.approx(2.0)
    assert paired_speedup(fast, plain)[1] == pytest.approx([2.0, 2.0])  # no spread: every question the same
    rows = [{"config": "m", "engine": "own", "concurrency": c, "speedup_vs_plain": s, "speedup_vs_plain_ci": ci}
            for c, s, ci in ((1, 1.5, [1.3, 1.7]), (4, 0.97, [0.9, 1.02]), (16, 0.8, [0.7, 0.9]))]
    assert stops_paying(rows) == {"m": {"engine": "own", "stops_paying_at": 4, "certain": False}}
    with pytest.raises(ValueError, match="not both"):
        LoadPlan(concurrency=2, rate=1.0)


def _fake_build(tmp_path, monkeypatch, faulting: set[str]):
    """llama.cpp builds whose llama-bench is a script: one that dies of SIGILL (as the native AMX build does on
    prefill) for the variants in ``faulting``, one that succeeds for the others."""
    monkeypatch.setattr(llamacpp, "cache_root", lambda: tmp_path)
    built = []
    for variant in llamacpp.BUILDS:
        folder = llamacpp.build_dir(variant=variant)
        (folder / "bin").mkdir(parents=True)
        (folder / llamacpp.BUILT).write_text("{}")
        for name in llamacpp.TARGETS:
            exe = folder / "bin" / name
            exe.write_text("#!/bin/sh\n" + ("kill -ILL $$\n" if variant in faulting else "exit 0\n"))
            exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(llamacpp, "build", lambda log=print, jobs=None, variant="native": built.append(variant))
    return built


def test_a_build_that_faults_is_replaced_by_one_without_amx(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    built = _fake_build(tmp_path, monkeypatch, {"native"})
    assert llamacpp.smoke_test(gguf, "native") == "llama-bench died of SIGILL on m.gguf (prefill 64, decode 8)"
    variant, notes = llamacpp.working_build([gguf], log=lambda m: None)
    assert variant == "no-amx" and built == ["native", "no-amx"] and "SIGILL" in notes[0]
    opts = llamacpp.build_options("no-amx")
    assert "-DGGML_NATIVE=OFF" in opts and "-DGGML_AMX_INT8=OFF" in opts


def test_no_working_build_is_one_line(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    _fake_build(tmp_path, monkeypatch, set(llamacpp.BUILDS))
    with pytest.raises(EngineError, match="no llama.cpp build runs here"):
        llamacpp.working_build([gguf], log=lambda m: None)
    with pytest.raises(EngineError, match="unknown llama.cpp build"):
        llamacpp.build_options("fast")


def test_load_command_end_to_end(tmp_path, capsys):
    """Plain decoding, chain:2 and a schedule (chain:2 alone, plain from 2 on) through the runtime's server at
    concurrency 1 and 3, and plain decoding on the base the (Medusa-2) heads adapt: load.json's rows, each reply
    the runtime's plain greedy decoding alone (the tree's and the heads' plain on the base its heads adapt), the
    schedule's rows marked with the search's prediction, and the report's section."""
    out = tmp_path / "load.json"
    pred = {"by_batch": [{"batch": 1, "output_tokens_per_s": 20.0}, {"batch": 3, "output_tokens_per_s": 50.0}]}
    stats = _stats_of_one()
    latency = replace(_batched(per_row_ms=0.05), serving_step_ms=0.5, batch_context=16)
    acc, lat = save_stats(stats, tmp_path / "acceptance.json"), save_profile(latency, tmp_path / "latency.json")
    ranges = [(Decoding(chain(2)), [1, 1]), (Decoding(), [2, 16])]
    schedule = tmp_path / "tree.json"
    schedule.write_text(json.dumps({"schema": "medusa-tree/2", "medusa_choices": [[0], [0, 0]], "schedule": [
        {"batch": b, "configuration": configuration_json(d), "prediction": pred} for d, b in ranges],
        "acceptance_file": str(acc), "latency_file": str(lat)}))
    assert cli_main(["load", "--tree", "chain:2", "--limit", "3", "--concurrency", "1", "3", "--max-new-tokens", "12",
                     "--schedule", str(schedule), "--rounds", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["concurrencies"] == [1, 3] and len(doc["questions"]) == 3
    rows = {(r["config"], r["concurrency"]): r for r in doc["rows"]}
    assert doc["heads_base"] != doc["model"]  # the default heads carry an adapter
    assert set(rows) == {(c, n) for c in ("plain", HEADS_BASE_PLAIN, "chain:2", "schedule") for n in (1, 3)}
    assert doc["schedule_predicted_for"] == ON_REQUESTS  # priced on the load's prompts
    # each schedule row priced with the batched steps timed beside its runs (two rounds: before and after each),
    # serving's cost per step the one that prices plain decoding on the heads' base at its measured throughput
    loaded = load_model("default", "bfloat16", "cpu")
    suite = {str(q.question_id): q for q in load_suite(None)}
    prompts = [len(chat_template_ids(loaded, [{"role": "user", "content": suite[k].turns[0]}])) for k in doc["questions"]]

    def priced(costs: dict, serving: float) -> LatencyProfile:
        return replace(latency, batch_sizes=tuple(costs["batch_sizes"]), batch_nodes=tuple(costs["batch_nodes"]),
                       batch_step_ms=tuple(map(tuple, costs["batch_step_ms"])), serving_step_ms=serving,
                       serving_chunk_ms=0.0)

    for (dec, _), c in zip(ranges, (1, 3)):
        row = rows[("schedule", c)]
        costs = row["step_costs_during"]
        assert costs["rounds"] == 4 and costs["beside_plain"]["rounds"] == 4 and costs["serving_from"] == HEADS_BASE_PLAIN
        assert costs["batch_sizes"] == ([1] if c == 1 else [1, 2, 4]) and costs["batch_nodes"] == [1, 2, 3]
        assert throughput_on_prompts(stats, priced(costs["beside_plain"], costs["serving_step_ms"]), Decoding(), c,
                                     prompts, 12) == pytest.approx(rows[(HEADS_BASE_PLAIN, c)]["output_tokens_per_s"],
                                                                   rel=2e-3)
        assert row["predicted_output_tokens_per_s"] == pytest.approx(
            throughput_on_prompts(stats, priced(costs, costs["serving_step_ms"]), dec, c, prompts, 12), rel=2e-3)
        assert row["predicted_output_tokens_per_s_at_search"] == pytest.approx(
            throughput_on_prompts(stats, latency, dec, c, prompts, 12))
    assert all(r["schedule"] == (r["config"] == "schedule") for r in rows.values())
    assert rows[("schedule", 1)]["accepted_per_step"] > 0  # chain:2 alone; plain decoding from 2 requests on
    for row in rows.values():
        assert row["failed"] == 0 and row["identical_to_plain"] == 1.0 and row["output_tokens_per_s"] > 0
        assert row["ttft_ms"]["p50"] > 0 and row["output_tokens_per_s_ci"][0] <= row["output_tokens_per_s"]
    assert rows[("plain", 1)]["accepted_per_step"] == 0 and rows[("chain:2", 1)]["accepted_per_step"] > 0
    assert rows[(HEADS_BASE_PLAIN, 1)]["accepted_per_step"] == 0 and rows[(HEADS_BASE_PLAIN, 3)]["accepted_per_step"] == 0
    assert "speedup_vs_plain" in rows[("chain:2", 3)] and "chain:2" in doc["stops_paying"]
    assert "speedup_vs_heads_base_plain" in rows[("chain:2", 3)] and "speedup_vs_heads_base_plain" in rows[("schedule", 1)]
    assert HEADS_BASE_PLAIN not in doc["stops_paying"] and "speedup_vs_heads_base_plain" not in rows[("plain", 3)]
    records = (tmp_path / "load-records.jsonl").read_text().splitlines()
    # at concurrency 3 the 3 questions go twice (two requests per client), and repeats still match their question;
    # each row pools two rounds, their requests keyed by round
    assert rows[("plain", 3)]["requests"] == 2 * 6 and rows[("plain", 1)]["requests"] == 2 * 3
    assert len(records) == 4 * 2 * (3 + 6) and all(json.loads(line)["ok"] for line in records)
    keys = {(json.loads(line)["config"], json.loads(line)["concurrency"], json.loads(line)["key"]) for line in records}
    assert len(keys) == len(records) and {k[2][-3:] for k in keys} == {"#r0", "#r1"}
    section, summary, figures = load_section(tmp_path, tmp_path / "plots")
    assert "Under load" in section and summary["rows"] == doc["rows"]
    confs = [configuration_json(d)["config"] for d, _ in ranges]  # what the schedule runs at each concurrency
    assert rows[("schedule", 1)]["schedule_range"] == {"batch": [1, 1], "config": confs[0], "same_as": None}
    assert rows[("schedule", 3)]["schedule_range"] == {"batch": [2, 16], "config": confs[1], "same_as": HEADS_BASE_PLAIN}
    assert f"schedule at concurrency 3 (runs {confs[1]} at batch sizes 2-16): predicted " \
        f"{rows[('schedule', 3)]['predicted_output_tokens_per_s']:.1f} output tokens/s" in section
    assert f"There it decodes as the {HEADS_BASE_PLAIN} row does: {rows[('schedule', 3)]['output_tokens_per_s']:.1f} [" \
        in section
    assert "x plain decoding on the heads' base" in section and "x the fastest fixed configuration (chain:2)" in section
    assert {f.name for f in figures} >= {"throughput_vs_concurrency.png", "speedup_vs_concurrency.png"}
    assert os.path.getsize(tmp_path / "plots" / "throughput_vs_concurrency.png") > 0
    printed = capsys.readouterr().out
    assert "chain:2: " in printed and ("stops paying at concurrency" in printed or "pays at every" in printed)


def test_the_report_says_where_the_schedule_runs_plain_decoding_and_sets_it_beside_that_row():
    """Where the schedule's range is plain decoding, its row and the plain row on its base are the same decoding
    measured apart: the section names the range, puts the two intervals side by side and says whether they
    overlap, and the schedule's "stops paying" says that there it runs that decoding."""
    def row(config, c, tps, lo, hi, **extra):
        return {"config": config, "engine": "own", "concurrency": c, "output_tokens_per_s": tps,
                "output_tokens_per_s_ci": [lo, hi], **extra}

    def sched(c, tps, lo, hi, batch, config, same_as):
        return row("schedule", c, tps, lo, hi, schedule=True, predicted_output_tokens_per_s=tps,
                   speedup_vs_plain=tps / 100.0, schedule_range={"batch": batch, "config": config, "same_as": same_as})

    doc = {"concurrencies": [1, 8, 16], "rows": [
        row("plain", 1, 50.0, 48.0, 52.0), row("plain", 8, 100.0, 98.0, 102.0), row("plain", 16, 100.0, 99.0, 101.0),
        sched(1, 80.0, 78.0, 82.0, [1, 4], "chain:2", None), sched(8, 99.0, 97.0, 101.0, [5, 16], "plain", "plain"),
        sched(16, 95.0, 94.0, 96.0, [5, 16], "plain", "plain")],
        "stops_paying": {"schedule": {"engine": "own", "stops_paying_at": 8, "certain": False}}}
    lines = prediction_sentences(load_frame(doc))
    assert lines[0].startswith("schedule at concurrency 1 (runs chain:2 at batch sizes 1-4): predicted 80.0")
    assert "decodes as" not in lines[0]
    assert lines[1].startswith("schedule at concurrency 8 (runs plain at batch sizes 5-16)")
    assert lines[1].endswith("There it decodes as the plain row does: 99.0 [97.0, 101.0] against 100.0 [98.0, 102.0] "
                             "output tokens/s, the intervals overlap.")
    assert lines[2].endswith("95.0 [94.0, 96.0] against 100.0 [99.0, 101.0] output tokens/s, the intervals do not "
                             "overlap.")
    assert stop_sentences(doc) == ["schedule stops paying at concurrency 8: slower than plain decoding there (its "
                                   "interval still reaches 1), where it runs plain, the plain row's decoding."]


def test_rounds_pool_their_records_and_sum_their_counters():
    a = Measured([_rec("1#r0", 10, 1.0)], {"tokens": 10.0, "steps": 6.0, "accepted": {1: 3.0, 2: 1.0}})
    b = Measured([_rec("1#r1", 12, 2.0)], {"tokens": 12.0, "steps": 8.0, "accepted": {1: 4.0, 3: 1.0}})
    both = a.plus(b)
    assert [r.key for r in both.records] == ["1#r0", "1#r1"]
    assert both.counters == {"tokens": 22.0, "steps": 14.0, "accepted": {1: 7.0, 2: 1.0, 3: 1.0}}
    row = load_row("chain:2", "own", 1, both.records, None, both.counters)
    assert row["accepted_per_step"] == pytest.approx(9 / 14) and row["output_tokens_per_s"] == pytest.approx(22 / 3)
    assert a.plus(Measured([_rec("2", 5, 1.0)], None)).counters is None  # another engine's: no counters


def test_what_serving_costs_a_step_is_fitted_to_the_served_runs_beyond_the_same_runs_in_process():
    """bench.load.serving against closed forms: a run's overhead per batched step, the least-squares fit of
    ``step + c * chunk`` (against scipy's non-negative least squares), and the schedule's price of a served step."""
    # 100 steps, served 30 ms slower than in-process: 0.3 ms a step; a served token count that differs is scaled
    run = ServingRun(1, 4, 50, 50, 100, 830.0, 800.0)
    assert run.overhead_ms == pytest.approx(0.3)
    assert ServingRun(1, 4, 100, 50, 100, 1660.0, 800.0).overhead_ms == pytest.approx(0.3)
    # overheads exactly 1.0 + 0.2 c, two rounds each: the fit gives them back
    runs = [ServingRun(c, 4, 96, 96, 100, 500.0 + 100 * (1.0 + 0.2 * c), 500.0) for c in (1, 2, 4, 8, 16) * 2]
    assert fit_overhead(runs) == pytest.approx((1.0, 0.2))
    # a third round with one run gone astray: each concurrency's median holds the line
    astray = ServingRun(16, 32, 96, 96, 100, 500.0 + 100 * 0.5, 500.0)
    assert fit_overhead(runs + [astray, *runs[:4]]) == pytest.approx((1.0, 0.2))
    rng = np.random.default_rng(0)  # noisy and with a part that comes out negative: non-negative least squares
    for _ in range(20):
        runs = [ServingRun(int(c), 4, 96, 96, 100, 500.0 + 100 * float(y), 500.0)
                for c, y in zip([1, 2, 4, 8, 16], rng.normal(0.0, 1.0, 5) + rng.normal(0, 0.1) * np.array([1, 2, 4, 8, 16]))]
        c = np.array([r.concurrency for r in runs], dtype=float)
        y = np.array([r.overhead_ms for r in runs])
        best, _ = nnls(np.stack([np.ones_like(c), c], axis=1), y)
        assert fit_overhead(runs) == pytest.approx(tuple(best), abs=1e-9)
    # the schedule prices a served step at batch 4 with the step part and 4 chunks
    prof = replace(_batched(per_row_ms=1.0), batch_context=0)
    served = replace(prof, serving_step_ms=1.0, serving_chunk_ms=0.25)
    assert served.serving(4) == pytest.approx(2.0)
    res = replay(Decoding(), _stats_of_one())
    assert request_latencies(res, served, 4)[0] == pytest.approx(
        request_latencies(res, prof, 4)[0] + 2.0 * len(res.rollouts[0].verified))


def test_the_schedule_is_predicted_for_the_loads_own_prompts_where_tree_json_names_its_files(tmp_path):
    """bench.load.prediction: with tree.json's acceptance and latency files in place, each concurrency's
    prediction is its range's configuration priced on the load's prompts and token cap; with the acceptance file
    changed since the search, or gone, tree.json's own predictions stand, and the predictor says why."""
    stats = _stats_of_one()
    latency = replace(_batched(per_row_ms=0.05), serving_step_ms=0.5)
    acc, lat = save_stats(stats, tmp_path / "acceptance.json"), save_profile(latency, tmp_path / "latency.json")
    pred = {"by_batch": [{"batch": 1, "output_tokens_per_s": 20.0}, {"batch": 4, "output_tokens_per_s": 50.0}]}
    schedule = [{"batch": [1, 2], "configuration": configuration_json(Decoding(chain(2))), "prediction": pred},
                {"batch": [3, 16], "configuration": configuration_json(Decoding()), "prediction": pred}]
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"acceptance_file": str(acc), "acceptance_sha256": load_stats(acc).sha256,
                                "latency_file": str(lat), "schedule": schedule}))
    predict = schedule_predictor(str(tree), schedule, [12, 40], 16)
    assert predict.basis == ON_REQUESTS and not predict.why_not
    assert predict(1) == pytest.approx(throughput_on_prompts(stats, latency, Decoding(chain(2)), 1, [12, 40], 16))
    assert predict(4) == pytest.approx(throughput_on_prompts(stats, latency, Decoding(), 4, [12, 40], 16))
    assert predict(4) != pytest.approx(throughput_on_prompts(stats, latency, Decoding(), 4, [12, 40], 32))
    acc.write_text(acc.read_text().replace("{", "{ ", 1))  # the same statistics, another file: not the searched one
    changed = schedule_predictor(str(tree), schedule, [12, 40], 16)
    assert changed.basis == ON_CALIBRATION and "changed" in changed.why_not
    assert (changed(1), changed(4), changed(2)) == (20.0, 50.0, None)
    acc.unlink()
    assert "acceptance.json" in schedule_predictor(str(tree), schedule, [12, 40], 16).why_not


def test_the_serving_cost_that_prices_plain_decoding_at_its_measured_throughput(tmp_path):
    """``SchedulePredictor.served_as``: the per-step serving cost its closed form gives makes plain decoding's
    prediction the measured throughput, and equals the root a bracketing solver finds; a throughput above what
    no serving cost at all predicts gives 0."""
    stats = _stats_of_one()
    latency = replace(_batched(per_row_ms=0.05), serving_step_ms=0.5, serving_chunk_ms=0.1)
    acc, lat = save_stats(stats, tmp_path / "a.json"), save_profile(latency, tmp_path / "l.json")
    schedule = [{"batch": [1, 16], "configuration": configuration_json(Decoding(chain(2))), "prediction": {}}]
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"acceptance_file": str(acc), "latency_file": str(lat), "schedule": schedule}))
    predict = schedule_predictor(str(tree), schedule, [12, 40], 16)

    def plain(s: float) -> float:
        return throughput_on_prompts(stats, replace(latency, serving_step_ms=s, serving_chunk_ms=0.0), Decoding(), 4,
                                     [12, 40], 16)

    measured = 0.8 * plain(0.5)
    served = predict.served_as(4, latency, measured)
    assert served.serving_chunk_ms == 0.0 and served.serving_step_ms > 0.5
    assert served.serving_step_ms == pytest.approx(brentq(lambda s: plain(s) - measured, 0.0, 100.0), rel=1e-9)
    assert throughput_on_prompts(stats, served, Decoding(), 4, [12, 40], 16) == pytest.approx(measured)
    assert served.batch_step_ms == latency.batch_step_ms and served.prefill_ms == latency.prefill_ms
    assert predict.served_as(4, latency, 1.1 * plain(0.0)).serving_step_ms == 0.0


def test_steps_during_load_time_the_cells_each_concurrency_is_priced_with():
    """bench.load.step_costs: the grid's points up to the need, the most rows a schedule's request verifies, and
    rounds of real batched steps on a small model by (concurrency, run beside): each concurrency's profile holds
    the batch sizes up to the first at or beyond it and the node counts up to the first at or beyond the
    schedule's widest request, every cell a positive time that grows from one row to the most rows; the rest of
    the profile is the search's."""
    assert grid_upto((1, 2, 4, 8, 16), 3) == (1, 2, 4) and grid_upto((1, 2, 4), 4) == (1, 2, 4)
    assert grid_upto((1, 2, 4), 9) == (1, 2, 4) and grid_upto((1, 2, 4), 1) == (1,)
    schedule = [{"batch": [1, 2], "configuration": {**configuration_json(Decoding(chain(2))), "lookup": 2}},
                {"batch": [3, 16], "configuration": configuration_json(Decoding())}]
    assert rows_per_request(schedule) == 1 + 2 + 2 and rows_per_request(schedule[1:]) == 1  # root, chain, lookup
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=2, seed=1)
    latency = replace(_batched(per_row_ms=0.05), batch_context=16)
    steps = StepsDuringLoad(loaded, heads, latency, schedule, [1, 3])
    assert steps.steps.cfg.batch_sizes == (1, 2, 4) and steps.steps.cfg.batch_nodes == (1, 2, 3, 4, 5)  # NODES
    for c, beside in ((1, "schedule"), (1, "schedule"), (3, "schedule"), (3, "plain")):
        steps.take(c, beside)
    assert steps.profile_at(2, "schedule") is None and steps.profile_at(1, "plain") is None
    one, three = steps.profile_at(1, "schedule"), steps.profile_at(3, "schedule")
    assert one.batch_sizes == (1,) and three.batch_sizes == (1, 2, 4) and one.batch_nodes == (1, 2, 3, 4, 5)
    assert np.asarray(three.batch_step_ms).shape == (3, 5) and np.all(np.asarray(three.batch_step_ms) > 0)
    assert three.batch_step_ms[2][4] > three.batch_step_ms[0][0] and three.batch_context == 16
    assert (three.contexts, three.verify_ms, three.serving_step_ms) == (latency.contexts, latency.verify_ms,
                                                                        latency.serving_step_ms)
    doc = steps.as_json(1, "schedule")
    assert doc["rounds"] == 2 and doc["batch_step_ms"] == [[round(ms, 3) for ms in one.batch_step_ms[0]]]
    assert doc["search_batch_step_ms"] == [[latency.batch_step(1, n) for n in (1, 2, 3, 4, 5)]]


def _stats_of_one():
    loaded = tiny_llama(vocab=32, seed=2)
    heads = _heads_that_guess(loaded, k=2, seed=1)
    texts, ranks = _rollouts(loaded, heads, 1, 20, 6)
    return _stats(texts, ranks, 2, 6)


def test_the_profile_measures_what_serving_costs_a_step(tmp_path):
    """``medusa-bench profile --batch-sizes 1,2``: after the batched steps it serves plain decoding at 1 and 2
    clients (4 requests each, the built-in calibration prompts) beside the same requests decoded in-process, thrice,
    and writes the fit into latency.json with the runs it came from. The server's greedy tokens are the in-process
    run's, token for token in count, and the fit is the runs' own."""
    out = tmp_path / "latency.json"
    assert cli_main(["profile", "--heads", "default", "--nodes", "1", "2", "--contexts", "16", "--repeats", "3",
                     "--batch-sizes", "1,2", "--max-new-tokens", "8", "--out", str(out), "--json"]) == 0
    doc = json.loads(out.read_text())
    serving = doc["serving"]
    assert serving["concurrencies"] == [1, 2] and len(serving["runs"]) == 6
    for run in serving["runs"]:
        assert run["requests"] == 4 and run["served_tokens"] == run["tokens"] and 0 < run["tokens"] <= 4 * 8
        assert run["steps"] >= run["tokens"] / run["concurrency"] and run["served_ms"] > 0 and run["in_process_ms"] > 0
        assert run["overhead_ms"] == pytest.approx((run["served_ms"] - run["in_process_ms"]) / run["steps"], abs=1e-3)
    step, chunk = fit_overhead([ServingRun(r["concurrency"], r["requests"], r["served_tokens"], r["tokens"],
                                           r["steps"], r["served_ms"], r["in_process_ms"]) for r in serving["runs"]])
    assert doc["serving_step_ms"] == pytest.approx(step, abs=2e-3)
    assert doc["serving_chunk_ms"] == pytest.approx(chunk, abs=2e-3)
    prof = load_profile(out)
    assert (prof.serving_step_ms, prof.serving_chunk_ms) == (doc["serving_step_ms"], doc["serving_chunk_ms"])
    job = ProfileJob.from_namespace(build_parser().parse_args(["profile", "--batch-sizes", "1,2", "--no-serving"]))
    assert job.serving is False and job.batch_sizes == (1, 2)
