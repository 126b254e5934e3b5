"""The runtime's server under load, on loopback: ``medusa-bench serve`` started by the test (the default model,
plain decoding, continuous batching), driven by the real ``openai`` client and by raw HTTP.

Every answer is checked against the runtime's own plain greedy decoding of the same prompt alone (in this
process); streams against the non-streamed reply; bad requests against their 4xx; and the server's state after
the load (no row left running, nothing queued, memory back near its warm-up size)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.model import load_model
from treesearch.tree import load_tree

from .conftest import post_json

KEY = "test-key"
NEW = 16  # tokens per answer


def _start(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "serve", "--heads", "none", "--port", "0",
                             "--max-new-tokens", str(NEW), "--name", "m", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
    assert match, f"the server did not start: {line!r}"
    return proc, match.group(1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    assert proc.wait(timeout=30) == 0, "SIGTERM drains the server and it exits cleanly"
    proc.stdout.close()


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--max-batch", "16", "--api-key", KEY)
    try:
        yield proc, url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def alone(mt_bench_first_turns):
    """(question text, its answer under the runtime's plain greedy decoding alone) for 24 first turns, in the dtype
    the server picks (``--dtype auto``: bfloat16 on the C forward where the CPU has AVX-512 BF16, else float32)."""
    model = load_model("default", "auto", log=lambda m: None)
    dec = MedusaDecoder(model, None, None, config=DecodeConfig(max_new_tokens=NEW))
    out = []
    for q in mt_bench_first_turns[::3][:24]:
        ids = encode_prompt(model, q["turns"][0], chat=True)
        out.append((q["turns"][0], model.tokenizer.decode(dec.generate(ids).token_ids, skip_special_tokens=True)))
    return out


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, text: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": text}]
    if not stream:
        return client.chat.completions.create(model="m", messages=messages, temperature=0).choices[0].message.content
    chunks = client.chat.completions.create(model="m", messages=messages, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _get(url: str, path: str, key: str | None = KEY) -> tuple[int, str]:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def _post(url: str, path: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
    return post_json(url + path, data, key)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def _idle(url: str, timeout: float = 30.0) -> dict:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        health = json.loads(_get(url, "/health", key=None)[1])
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.1)
    return health


def test_answers_are_the_runtimes_greedy_decoding_alone_at_concurrency_1_4_and_16(server, alone):
    _, url = server
    client = _client(url)
    for concurrency in (1, 4, 16):
        with ThreadPoolExecutor(concurrency) as pool:
            got = list(pool.map(lambda qa: _ask(client, qa[0]), alone))
        assert got == [a for _, a in alone], concurrency


def test_a_schedule_switches_the_tree_with_the_live_batch_and_answers_stay_plain_greedy(tmp_path, alone):
    """``serve --schedule``: chain:3 alone, plain decoding at 2-3 requests, mc_sim_7b_63 with a lookup chain from 4
    (Medusa-1 heads, which decode on the base model): a request alone and 8 at once get plain greedy answers, and
    /metrics counts steps under the batch-1 configuration and under the one from 4 on."""
    def conf(name, choices, lookup=0):
        return {"config": name, "uses_heads": bool(choices), "medusa_choices": choices, "lookup": lookup, "gate": 0.0}

    wide = load_tree("mc_sim_7b_63").as_lists()
    schedule = [{"batch": [1, 1], "configuration": conf("chain:3", [[0], [0, 0], [0, 0, 0]])},
                {"batch": [2, 3], "configuration": conf("plain", None)},
                {"batch": [4, 16], "configuration": conf("wide", wide, 4)}]
    path = tmp_path / "tree.json"
    path.write_text(json.dumps({"schema": "medusa-tree/2", "medusa_choices": wide, "schedule": schedule}))
    proc, url = _start("--heads", "medusa1", "--schedule", str(path), "--max-batch", "8", "--api-key", KEY)
    try:
        with _client(url) as client:
            assert _ask(client, alone[0][0]) == alone[0][1]
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda qa: _ask(client, qa[0]), alone[1:9]))
        assert got == [a for _, a in alone[1:9]]
        steps = {s.labels["batch_sizes"]: s.value for f in text_string_to_metric_families(_get(url, "/metrics")[1])
                 if f.name == "medusa_schedule_steps" for s in f.samples}
        assert set(steps) == {"1-1", "2-3", "4-16"} and steps["1-1"] > 0 and steps["4-16"] > 0, steps
    finally:
        _stop(proc)
    bad = tmp_path / "none.json"
    bad.write_text(json.dumps({"schema": "medusa-tree/2", "medusa_choices": [[0]]}))
    out = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--schedule", str(bad), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds no schedule" in out.stderr and out.stderr.count("\n") == 1
    gated = tmp_path / "gated.json"  # a gate reads the heads' top-1 chain: refused on a wide tree, as the search does
    gated.write_text(json.dumps({**json.loads(path.read_text()), "schedule": [
        {"batch": [1, 16], "configuration": {**conf("forked", [[0], [1], [1, 0]]), "gate": 0.5}}]}))
    out = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--heads", "medusa1", "--schedule", str(gated),
                          "--port", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "batch sizes 1-16" in out.stderr and "top-1 chain" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    # ranges that draft with heads, served without any: refused in one line, before the model loads (it logs)
    out = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--heads", "none", "--schedule", str(path),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "batch sizes 1-1 uses heads: serve it with --heads" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr


def test_openai_stream_joins_into_the_non_streamed_reply(server, alone):
    """The openai client with stream=True: chunks (role first, a finish chunk, the usage chunk when asked) whose
    contents join into exactly the non-streamed reply, for chat and text completions."""
    _, url = server
    client = _client(url)
    for text, want in alone[:6]:
        assert _ask(client, text, stream=True) == _ask(client, text) == want
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": alone[0][0]}],
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length") and chunks[-1].choices == []
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": alone[0][0]}],
                                           temperature=0)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    prompt = [1, 504, 3151, 282, 260, 1789, 30]  # token ids, as the load bench sends them
    whole = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=NEW).choices[0].text
    parts = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=NEW, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == whole and whole


def test_api_key_metrics_and_errors(server):
    _, url = server
    assert _get(url, "/health", key=None)[0] == 200
    assert _get(url, "/v1/models", key=None)[0] == 401 and _get(url, "/v1/models", key="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    status, text = _get(url, "/metrics")
    assert status == 200
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"medusa_requests_running", "medusa_requests_waiting", "medusa_generated_tokens_total"} <= names
    for body, code in ((b"{not json", 400), (b'{"model": "m"}', 400), (b'{"model": "x", "messages": []}', 404),
                       (json.dumps({"model": "m", "prompt": [-1]}).encode(), 400)):
        status, err = _post(url, "/v1/chat/completions" if b"prompt" not in body else "/v1/completions", body)
        assert status == code and err["error"]["message"], body
    assert _get(url, "/nowhere")[0] == 404


def test_load_without_loss(server, alone):
    """64 clients at once on loopback: valid streamed and non-streamed requests, malformed bodies, oversize prompts
    and bodies, and clients that leave mid-stream. Every valid request gets its exact greedy answer, every bad one
    a 4xx with a reason; after the run no row is running, nothing waits, and it still answers. The same load run
    twice: the first reaches every path's high-water mark (a full batch, the tokenizer on an over-long prompt), so
    the server's memory after the second is within 64 MB of its size after the first (1 MB a request; a leak
    shows)."""
    proc, url = server
    client = _client(url)
    long_prompt = "word " * 9000  # over the model's 8192-token context
    bodies = {"malformed": b'{"model": "m", "messages": [',
              "oversize": json.dumps({"model": "m", "messages": [{"role": "user", "content": long_prompt}]}).encode(),
              "huge": json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()}

    def one(tally: dict, lock: threading.Lock, i: int, kind: str) -> None:
        q, want = alone[i % len(alone)]
        with lock:
            tally["sent"] += 1
        if kind in ("stream", "whole"):
            got = _ask(client, q, stream=kind == "stream")
            with lock:
                tally["exact" if got == want else "wrong"] += 1 if got == want else [(i, kind)]
        elif kind == "leave":
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                                    temperature=0, stream=True, max_tokens=NEW)
            next(iter(stream))
            stream.close()  # gone after its first chunk: its row must be freed
            with lock:
                tally["left"] += 1
        else:
            status, err = _post(url, "/v1/chat/completions", bodies[kind])
            with lock:
                if 400 <= status < 500 and err["error"]["message"]:
                    tally["refused"] += 1
                else:
                    tally["wrong"].append((i, kind, status))

    def load(seed: int) -> tuple[dict, dict, int]:
        kinds = ["stream", "whole"] * 20 + ["malformed"] * 6 + ["oversize"] * 6 + ["huge"] * 4 + ["leave"] * 8
        random.Random(seed).shuffle(kinds)
        tally = {"sent": 0, "exact": 0, "refused": 0, "left": 0, "wrong": []}
        lock = threading.Lock()
        with ThreadPoolExecutor(64) as pool:
            list(pool.map(lambda ik: one(tally, lock, *ik), enumerate(kinds)))
        health = _idle(url)
        assert tally["wrong"] == [] and tally["exact"] == 40 and tally["refused"] == 16 and tally["left"] == 8
        assert health["running"] == 0 and health["waiting"] == 0
        return tally, health, _rss_kb(proc.pid)

    _, _, rss_first = load(0)
    tally, health, rss_after = load(1)
    print(f"\nload without loss: {tally['sent']} sent, {tally['exact']} answered exactly, {tally['refused']} refused "
          f"with a reason, {tally['left']} disconnected, {health['running']} rows left running, "
          f"{health['waiting']} waiting; server RSS {rss_first / 1024:.0f} MB after the first run, "
          f"{rss_after / 1024:.0f} MB after the second")
    assert rss_after - rss_first < 64 * 1024
    assert proc.poll() is None and _ask(client, alone[0][0]) == alone[0][1]


def test_a_full_queue_answers_503_and_a_client_that_leaves_frees_its_row():
    proc, url = _start("--max-batch", "1", "--max-queue", "1", "--max-new-tokens", "200")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Count to two hundred."}],
                           "temperature": 0, "max_tokens": 200}).encode()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _post(url, "/v1/chat/completions", body, key=None), range(4)))
        busy = [err for status, err in results if status == 503]
        assert busy and all("queue is full" in err["error"]["message"] for err in busy)
        assert any(status == 200 for status, _ in results)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to 200."}],
                                                temperature=0, stream=True, max_tokens=200)
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:  # the role chunk comes first, before any token
            pass
        assert json.loads(_get(url, "/health", key=None)[1])["running"] == 1
        stream.close()
        assert _idle(url, 10.0)["running"] == 0  # freed long before its 200 tokens
    finally:
        _stop(proc)
