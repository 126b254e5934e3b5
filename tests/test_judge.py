"""The judge against FastChat's real data, and its HTTP client against a local OpenAI-compatible server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest

from bench.judge.grading import (
    CachedJudge,
    OpenAIBackend,
    aggregate,
    build_judge_prompt,
    grade,
    load_judge_prompts,
    load_references,
    parse_rating,
)
from bench.replay.mtbench import Question, load_questions

from .conftest import DATA, read_lines

JUDGMENTS = DATA / "medusa" / "model_judgment" / "gpt-4_single.jsonl.gz"
ANSWERS = DATA / "medusa" / "model_answer" / \
    "medusa-vicuna-7b-v1.3-temperature-0.0-posterior_threshold-0.09-posterior_alpha-0.3.jsonl.gz"
MT = DATA / "mt_bench"


def _judgments() -> list[dict]:
    return [json.loads(line) for line in read_lines(JUDGMENTS)]


def test_parser_recovers_every_published_score():
    rows = _judgments()
    assert len(rows) == 480
    for r in rows:
        assert parse_rating(r["judgment"]) == r["score"], r["judgment"][-200:]


def test_aggregation_reproduces_turn_means():
    rows = _judgments()
    ours = aggregate([{**r, "score": parse_rating(r["judgment"])} for r in rows])
    # FastChat's show_result: drop -1, group by (model, turn), mean
    ref = pd.DataFrame(rows)[["model", "turn", "score"]]
    ref = ref[ref["score"] != -1].groupby(["model", "turn"]).mean().reset_index()
    pd.testing.assert_frame_equal(ours.reset_index(drop=True), ref.reset_index(drop=True))
    assert len(ours) == 6


def test_parser_fallback_and_unparsable():
    assert parse_rating("Rating: [[7]]") == 7
    assert parse_rating("I'd say [8.5] overall") == 8.5
    assert parse_rating("no rating here") == -1
    assert parse_rating("[[3]] then [[9]]") == 3


def test_prompts_match_fastchat_for_every_category():
    """Rebuild the judge's user prompt for the Medusa answers and compare with the published judgments."""
    prompts = load_judge_prompts(MT / "judge_prompts.jsonl")
    refs = load_references(MT / "reference_answer" / "gpt-4.jsonl")
    questions = {q.question_id: q for q in load_questions(MT / "question.jsonl")}
    answers = {}
    for line in read_lines(ANSWERS):
        r = json.loads(line)
        answers[int(r["question_id"])] = r["choices"][0]["turns"]
    medusa = [j for j in _judgments() if j["model"].startswith("medusa")]
    assert len(medusa) == 160
    seen = set()
    for j in medusa:
        q = questions[j["question_id"]]
        name, _, user = build_judge_prompt(prompts, q, answers[q.question_id], j["turn"] - 1, refs.get(q.question_id))
        assert name == j["judge"][1]
        assert user == j["user_prompt"]
        seen.add((q.category, j["turn"]))
    assert len(seen) == 16  # 8 categories x 2 turns


class _Server(BaseHTTPRequestHandler):
    calls: list[dict] = []
    fail_first = 1

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        if type(self).fail_first > 0:
            type(self).fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        user = body["messages"][1]["content"]
        reply = {"choices": [{"message": {"role": "assistant",
                                          "content": f"Fine answer. Rating: [[{6 if 'Reference' in user else 8}]]"}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def server():
    _Server.calls = []
    _Server.fail_first = 1
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_http_judge_retries_uses_references_and_caches(server, tmp_path):
    prompts = load_judge_prompts(MT / "judge_prompts.jsonl")
    refs = load_references(MT / "reference_answer" / "gpt-4.jsonl")
    qs = load_questions(MT / "question.jsonl")
    pick = [next(q for q in qs if q.category == c) for c in ("writing", "math", "coding", "humanities")]
    answers = {("m", q.question_id): [f"answer one to {q.question_id}", f"answer two to {q.question_id}"]
               for q in pick}
    backend = OpenAIBackend("judge-model", base_url=server, api_key="k", backoff=0.01)
    judge = CachedJudge(backend, tmp_path / "cache.jsonl")
    rows = grade(judge, prompts, pick, answers, refs)
    assert len(rows) == 8 and judge.misses == 8 and judge.hits == 0
    # one 503 was retried: 8 judgments took 9 requests
    assert len(_Server.calls) == 9
    for r in rows:
        q = next(x for x in pick if x.question_id == r["question_id"])
        expected = build_judge_prompt(prompts, q, answers[("m", q.question_id)], r["turn"] - 1, refs.get(q.question_id))
        assert r["judge"][1] == expected[0] and r["user_prompt"] == expected[2]
        uses_ref = q.category in ("math", "coding")
        assert ("Reference" in r["user_prompt"]) == uses_ref
        assert r["score"] == (6 if uses_ref else 8)
    sent = _Server.calls[-1]
    assert sent["model"] == "judge-model" and sent["messages"][0]["role"] == "system"
    # a rerun is served from the cache: no request at all
    again = CachedJudge(backend, tmp_path / "cache.jsonl")
    rows2 = grade(again, prompts, pick, answers, refs)
    assert again.hits == 8 and again.misses == 0 and len(_Server.calls) == 9
    assert [r["score"] for r in rows2] == [r["score"] for r in rows]


def test_reference_required_for_math():
    prompts = load_judge_prompts(MT / "judge_prompts.jsonl")
    q = Question(999, "math", ("1+1?",))
    with pytest.raises(ValueError, match="reference"):
        build_judge_prompt(prompts, q, ["2"], 0, None)
