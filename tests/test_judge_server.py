"""The judge end to end against a real OpenAI-compatible HTTP server: ``medusa-bench serve`` started by the test
on localhost, serving the embedded default model with its Medusa heads through the runtime; a real replay's
answers graded through it (FastChat single mode) into judge_scores.json, FastChat's own files (read by
FastChat's show_result.py from the registry's fschat wheel) and report.html (checked in headless Chromium)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile

import pandas as pd
import pytest

from bench.cli import main as cli_main
from bench.judge.answers import fastchat_id, score_tables
from bench.judge.grading import aggregate, parse_rating
from bench.replay.mtbench import load_questions
from bench.replay.runner import MethodConfig, ReplayConfig, replay
from bench.report.browser import check_page
from bench.report.build import quality_of, report
from medusa_runtime.heads.medusa import fresh_heads
from medusa_runtime.model import cache_root, download_wheel

from .conftest import DATA, post_json, read_lines, tiny_chat_model

FSCHAT = ("fschat", "0.2.36", "fschat", "a66ecf1e90f6db1d015096f6aa8a305d20d0a13e067951285aecdb56a33e9cb1")
JUDGE = "smol-judge"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The runtime's chat endpoint in its own process (the default model, its shipped heads, chain:2); yields
    its URL and its request log (http.server's one line per request, on stderr)."""
    log = tmp_path_factory.mktemp("server") / "requests.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "serve", "--heads", "default", "--tree", "chain:2",
                                 "--port", "0", "--max-new-tokens", "40", "--name", JUDGE],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()  # "serving <name> at http://127.0.0.1:<port>/v1 (...)"
        match = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        assert match, f"the server did not start: {line!r} {log.read_text()[-500:]}"
        yield match.group(1), log
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


def _posts(log) -> int:
    return log.read_text().count('"POST /v1/chat/completions')


def _post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(f"{url}/chat/completions", json.dumps(body).encode(), timeout=120)


def test_served_completion_is_the_runtimes_greedy_decoding_and_bad_requests_fail(server):
    from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
    from medusa_runtime.decoding.guided import guided_choice
    from medusa_runtime.heads.medusa import resolve_heads
    from medusa_runtime.model import load_model

    url, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, body = _post(url, {"model": JUDGE, "messages": messages, "temperature": 0, "max_tokens": 12})
    assert status == 200 and body["object"] == "chat.completion"
    # the same request decoded here, independently: plain greedy decoding of the same base (Medusa is lossless)
    loaded = load_model("default", "auto", None, log=lambda m: None)
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    plain = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=12)).generate(ids).token_ids
    assert body["choices"][0]["message"]["content"] == loaded.tokenizer.decode(plain, skip_special_tokens=True)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(plain),
                             "total_tokens": len(ids) + len(plain)}
    assert body["choices"][0]["finish_reason"] == ("length" if len(plain) == 12 else "stop")
    assert resolve_heads("default", loaded.hidden_size, loaded.vocab_size) is not None and body["medusa"]["tau"] >= 1
    # sampled with a seed: the same seed gives the same answer, whatever was asked in between
    sampled = {"model": JUDGE, "messages": messages, "temperature": 0.9, "max_tokens": 12, "seed": 5}
    first = _post(url, sampled)[1]["choices"][0]["message"]["content"]
    _post(url, {**sampled, "seed": 6})
    assert _post(url, sampled)[1]["choices"][0]["message"]["content"] == first
    # guided_choice (vLLM's extension): the reply is the runtime's constrained greedy choice, computed here too
    ratings = [str(i) for i in range(1, 11)]
    status, body = _post(url, {"model": JUDGE, "messages": messages, "temperature": 0, "guided_choice": ratings})
    assert status == 200 and body["choices"][0]["message"]["content"] == guided_choice(loaded, ids, ratings)
    # today's vLLM spelling of the same constraint (structured_outputs.choice), what the judge sends besides:
    # the same reply as guided_choice's from the same server, for other choices too
    for choices in (ratings, ["7", "8", "9"], ["blue", "green"]):
        status, body = _post(url, {"model": JUDGE, "messages": messages, "temperature": 0,
                                   "structured_outputs": {"choice": choices}})
        _, old = _post(url, {"model": JUDGE, "messages": messages, "temperature": 0, "guided_choice": choices})
        reply = body["choices"][0]["message"]["content"]
        assert status == 200 and reply in choices and reply == old["choices"][0]["message"]["content"]
    for bad, code in (({"model": JUDGE, "messages": messages, "structured_outputs": {"json": {}}}, 400),
                      ({"model": JUDGE, "messages": messages, "structured_outputs": {"choice": "7"}}, 400),
                      ({"model": "other", "messages": messages}, 404), ({"model": JUDGE, "messages": []}, 400),
                      ({"model": JUDGE, "messages": messages, "guided_choice": []}, 400),
                      ({"model": JUDGE, "messages": messages, "guided_choice": ["1", 2]}, 400),
                      ({"model": JUDGE, "messages": messages, "n": 2}, 400),
                      ({"model": JUDGE, "messages": [{"role": "robot", "content": "x"}]}, 400)):
        status, err = _post(url, bad)
        assert status == code and err["error"]["message"]


def _fastchat_show_result(tmp_path, judgment_file) -> str:
    """FastChat's own show_result.py (from the fschat wheel on PyPI) run on a judgment file."""
    wheel = download_wheel(*FSCHAT, cache_root() / "wheels", log=lambda m: None)
    script = tmp_path / "show_result.py"
    with zipfile.ZipFile(wheel) as zf:
        script.write_bytes(zf.read("fastchat/llm_judge/show_result.py"))
    proc = subprocess.run([sys.executable, str(script), "--mode", "single", "--input-file", str(judgment_file)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_judge_grades_a_replay_through_the_server_into_fastchat_files_and_the_report(server, tmp_path, monkeypatch):
    url, log = server
    questions = {q.question_id: q for q in load_questions(log=lambda m: None)}
    picked = [questions[81], questions[111], questions[121]]  # writing; math and coding (graded with references)
    qfile = tmp_path / "questions.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": q.question_id, "category": q.category, "turns": list(q.turns)})
                             + "\n" for q in picked))
    loaded = tiny_chat_model()
    out = tmp_path / "run"
    configs = [MethodConfig("plain", "plain"), MethodConfig("medusa chain:2", "medusa", tree="chain:2"),
               MethodConfig("plain sampled", "plain", temperature=0.7)]
    replay(loaded, fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size), configs, picked,
           ReplayConfig(max_new_tokens=6, turns=2, repeats=1, warmup_tokens=2), out / "replay" / "records.jsonl",
           progress=False)
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    monkeypatch.setenv("OPENAI_API_KEY", "")
    before = _posts(log)
    argv = ["judge", "--records", str(out / "replay" / "records.jsonl"), "--questions", str(qfile), "--judge",
            JUDGE, "--out", str(out), "--dtype", "float32", "--json", "--guided-rating"]
    assert cli_main(argv) == 0
    scores = json.loads((out / "judge" / "judge_scores.json").read_text())
    assert scores["schema"] == "medusa-judge/1" and scores["judge"] == JUDGE and scores["skipped_no_reference"] == 0
    judgments = [json.loads(line) for line in (out / "judge" / "model_judgment" / f"{JUDGE}_single.jsonl")
                 .read_text().splitlines()]
    assert len(judgments) == 3 * 3 * 2  # every configuration, question and turn graded once
    for j in judgments:
        assert j["judge"][0] == JUDGE and ("Start of Reference Answer" in j["user_prompt"]) == (j["question_id"] != 81)
        if parse_rating(j["judgment"]) != -1:  # FastChat's rule where the judgment has a rating
            assert j["rating"] == "parsed" and j["score"] == parse_rating(j["judgment"])
        else:  # else the follow-up turn's rating, constrained to 1-10 by the server
            assert j["rating"] == "guided" and j["score"] in range(1, 11)
    assert any(j["rating"] == "guided" for j in judgments)  # this small judge does not write [[x]] by itself
    # the two lossless configurations answered alike, so their judgments were asked once (the cache); each
    # judgment without a rating cost one follow-up request
    cache = (out / "judge" / "judge_cache.jsonl").read_text().splitlines()
    asked = {j["user_prompt"] for j in judgments} | {(j["user_prompt"], "again") for j in judgments
                                                     if j["rating"] == "guided"}
    assert len(cache) == len(asked) == _posts(log) - before < 2 * len(judgments)
    for cfg, s in scores["configs"].items():
        mine = [j for j in judgments if j["model"] == fastchat_id(cfg)]
        assert s["judgments"] == len(mine) == 6 and s["unparsable"] == 0
        assert s["guided"] == sum(j["rating"] == "guided" for j in mine)
        assert s["score"] == pytest.approx(sum(j["score"] for j in mine) / 6)
        category = {q.question_id: q.category for q in picked}
        for cat in set(category.values()):  # per category: the mean of its judgments
            theirs = [j["score"] for j in mine if category[j["question_id"]] == cat]
            assert s["by_category"][cat] == pytest.approx(sum(theirs) / len(theirs))
    answers = {p.stem: [json.loads(line) for line in p.read_text().splitlines()]
               for p in (out / "judge" / "model_answer").glob("*.jsonl")}
    assert set(answers) == {fastchat_id(c.name) for c in configs}
    assert all(len(a["choices"][0]["turns"]) == 2 for rows in answers.values() for a in rows)
    # FastChat's own reader takes the judgment file
    shown = _fastchat_show_result(tmp_path, out / "judge" / "model_judgment" / f"{JUDGE}_single.jsonl")
    assert "First turn" in shown and "Second turn" in shown and "Average" in shown
    for cfg, s in scores["configs"].items():
        assert fastchat_id(cfg) in shown and f"{s['score']:.6f}"[:4] in shown
    # quality.json: the log-likelihood proxy for every configuration
    quality = json.loads((out / "quality.json").read_text())
    assert set(quality["configs"]) == {c.name for c in configs}
    assert quality["configs"]["plain"] == quality["configs"]["medusa chain:2"]  # identical answers, same figure
    assert all(q["log_likelihood_per_token"] < 0 for q in quality["configs"].values())
    # into report.html: the judge's section, checked in the browser
    report(out)
    page = (out / "report.html").read_text()
    assert f"Judge <b>{JUDGE}</b>" in page and "Per category" in page and "unparsable" in page
    guided = sum(s["guided"] for s in scores["configs"].values())
    assert f"{guided} of {len(judgments)} ratings came from a follow-up turn" in page
    card = pd.DataFrame({"config": [c.name for c in configs], "temperature": [c.temperature for c in configs]})
    named = quality_of(card, quality, scores)  # report.json's quality object per configuration, as tools read it
    for cfg, s in scores["configs"].items():
        assert named[cfg]["judge_score"] == s["score"] and named[cfg]["judge_by_category"] == s["by_category"]
    check = check_page(out / "report.html")
    assert check.ok, (check.errors, check.broken)


def test_score_tables_match_fastchat_on_the_published_judgments():
    """Per turn as FastChat's show_result computes them; overall and per category by the same rule (-1 left out),
    on the 480 published GPT-4 judgments of the Medusa paper's answers."""
    rows = [json.loads(line) for line in read_lines(DATA / "medusa" / "model_judgment" / "gpt-4_single.jsonl.gz")]
    questions = {q.question_id: q for q in load_questions(DATA / "mt_bench" / "question.jsonl")}
    graded = [{**r, "config": r["model"], "category": questions[r["question_id"]].category} for r in rows]
    tables = score_tables(graded)
    by_turn = aggregate(rows)
    pd.testing.assert_frame_equal(tables["by_turn"].rename(columns={"config": "model"}), by_turn, check_dtype=False)
    df = pd.DataFrame(graded)
    valid = df[df["score"] != -1]
    for _, r in tables["overall"].iterrows():
        assert r["score"] == pytest.approx(valid[valid["model"] == r["config"]]["score"].mean())
    for _, r in tables["by_category"].iterrows():
        sub = valid[(valid["model"] == r["config"]) & (valid["category"] == r["category"])]
        assert r["score"] == pytest.approx(sub["score"].mean())
    counts = tables["counts"].set_index("config")
    for model, sub in df.groupby("model"):
        assert counts.loc[model, "judgments"] == len(sub)
        assert counts.loc[model, "unparsable"] == int((sub["score"] == -1).sum())


def _frame(rng, n_questions: int, shift: float) -> pd.DataFrame:
    """Two configurations' per-answer log-likelihoods: per question a common level, each answer its own noise."""
    rows = []
    for q in range(n_questions):
        level = rng.normal(-2.0, 0.5)
        for cfg, mu in (("exact", shift), ("plain", 0.0)):
            for s in range(2):
                tokens = 50
                rows.append({"config": cfg, "question_id": q, "repeat": s, "tokens": tokens,
                             "log_likelihood": tokens * (level + mu + rng.normal(0, 0.3))})
    return pd.DataFrame(rows)


def test_distribution_check_holds_its_size_and_the_power_it_states():
    """Under the null (same distribution) the check rejects about 5 % of the time; at the shift it says it
    detects with 80 % power, it rejects about 80 % of the time (16 questions, normal approximation)."""
    import numpy as np

    from bench.judge.answers import paired_check

    rng = np.random.default_rng(7)
    null = [paired_check(_frame(rng, 16, 0.0), "exact", "plain", draws=2000, seed=i) for i in range(300)]
    size = np.mean([not c["indistinguishable"] for c in null])
    assert 0.02 <= size <= 0.09
    mde = float(np.median([c["detectable_at_80_power"] for c in null]))
    shifted = [paired_check(_frame(rng, 16, mde), "exact", "plain", draws=2000, seed=i) for i in range(300)]
    power = np.mean([not c["indistinguishable"] for c in shifted])
    assert 0.65 <= power <= 0.92, (mde, power)


def test_answer_quality_regret_is_zero_for_greedy_answers_and_checks_exact_sampling(tmp_path):
    """Scored under the model that decoded them: every greedy answer has regret 0 (each token is the argmax);
    sampled ones have positive regret; exact tree sampling is checked against plain sampling at its
    temperature; the log-likelihood is the sequential forward's (teacher forcing, token by token)."""
    import torch

    from bench.judge.answers import answer_quality, write_quality
    from bench.replay.runner import chat_ids
    from tests.test_replay import QUESTIONS

    loaded = tiny_chat_model()
    configs = [MethodConfig("plain", "plain"), MethodConfig("medusa chain:2", "medusa", tree="chain:2"),
               MethodConfig("plain T0.8", "plain", temperature=0.8, samples=2),
               MethodConfig("medusa sample T0.8", "medusa", tree="chain:2", accept="sample", temperature=0.8, samples=2)]
    records = replay(loaded, fresh_heads(2, 1, loaded.hidden_size, loaded.vocab_size), configs, QUESTIONS,
                     ReplayConfig(max_new_tokens=6, turns=2, repeats=1, warmup_tokens=2), tmp_path / "r.jsonl",
                     progress=False)
    frame = answer_quality(loaded, records, QUESTIONS, progress=False)
    assert len(frame) == len(records) == 3 * 2 * (1 + 1 + 2 + 2)
    greedy = frame[frame["temperature"] == 0]
    assert (greedy["regret"].abs() < 1e-4).all()
    assert (frame[frame["temperature"] > 0]["regret"] > 0).any()
    # one answer's log-likelihood, token by token with a growing prefix (an independent path)
    r = next(r for r in records if r["config"] == "plain T0.8" and r["turn"] == 0)
    prompt = chat_ids(loaded, QUESTIONS[[q.question_id for q in QUESTIONS].index(r["question_id"])].turns[:1], [])
    total, ids = 0.0, list(prompt)
    with torch.inference_mode():
        for tok in r["token_ids"]:
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            total += float(torch.log_softmax(logits, -1)[tok])
            ids.append(tok)
    row = frame[(frame["config"] == "plain T0.8") & (frame["question_id"] == r["question_id"]) & (frame["turn"] == 0)
                & (frame["repeat"] == r["repeat"])]
    assert float(row["log_likelihood"].iloc[0]) == pytest.approx(total, abs=1e-3)
    quality = json.loads(write_quality(tmp_path, frame, loaded.name).read_text())
    assert quality["schema"] == "medusa-quality/1"
    assert quality["configs"]["plain"]["regret_per_token"] == pytest.approx(0, abs=1e-5)
    (check,) = quality["distribution_checks"]
    assert (check["config"], check["reference"], check["questions"]) == ("medusa sample T0.8", "plain T0.8", 3)
    assert 0 <= check["p_value"] <= 1 and check["detectable_at_80_power"] > 0
