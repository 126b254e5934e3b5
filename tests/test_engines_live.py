"""The real engines, started (marker ``engines``; ``nox -s engines`` installs vLLM and runs these after the
bench): vLLM 0.32 loads and runs the heads the suite exports for it (the engines stage's and ``medusa-bench
export --target vllm``'s), llama.cpp's server answers greedy and
speculates with its lookup, and the judge's constrained rating works against a real ``vllm serve``.

vLLM's interpreter comes from ``$MEDUSA_VLLM_PYTHON``; without it these tests fail (they are never skipped:
the session that selects them installs vLLM)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from bench.engines import EngineSettings

pytestmark = pytest.mark.engines

PROMPT = ("Rewrite this sentence three times, each time changing one word: The quick brown fox jumps over the lazy "
          "dog. Then repeat the original sentence: The quick brown fox jumps over the lazy dog.")


@pytest.fixture(scope="module")
def vllm_python() -> str:
    from bench.engines.vllm_engine import vllm_python

    return vllm_python(EngineSettings())


@pytest.fixture(scope="module")
def loaded():
    from medusa_runtime.model import load_model

    return load_model("default", "float32", "cpu", log=lambda m: None)


def _prompt_ids(loaded, text: str = PROMPT) -> list[int]:
    from medusa_runtime.model import chat_template_ids

    return chat_template_ids(loaded, [{"role": "user", "content": text}])


def test_vllm_loads_the_exported_unconditioned_heads_and_accepts_their_drafts(tmp_path, vllm_python, loaded):
    from bench.engines.stage import model_folder
    from bench.engines.vllm_engine import VllmWorker, full_vocabulary_heads, medusa_speculative_config

    folder = full_vocabulary_heads("unconditioned", "default", tmp_path / "heads", log=lambda m: None)
    model, _ = model_folder("default", log=lambda m: None)
    worker = VllmWorker(vllm_python, str(model), "bfloat16", medusa_speculative_config(folder / "vllm", 2),
                        EngineSettings(), log_file=tmp_path / "vllm.log")
    try:
        reply = worker.complete(_prompt_ids(loaded), 64)
    finally:
        worker.close()
    spec = reply["spec"]
    assert len(reply["token_ids"]) > 0 and spec["drafts"] > 0 and spec["draft_tokens"] == 2 * spec["drafts"]
    assert spec["accepted_tokens"] > 0, spec  # vLLM's own count: the heads' drafts pass its verification
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]


def test_vllm_runs_the_export_of_a_final_tree_with_the_speculative_config_it_writes(tmp_path, vllm_python, loaded):
    """``medusa-bench export tree.json --target vllm --out DIR``, as a user runs it after ``python -m
    bench.pipeline --target vllm``: vLLM loads DIR with DIR/speculative_config.json, greedy, and accepts drafts."""
    import json
    import sys

    from bench.engines.stage import model_folder
    from bench.engines.vllm_engine import VllmWorker
    from bench.stages.deploy import heads_reference
    from medusa_runtime.heads.medusa import shipped_heads_dir
    from treesearch.tree import make_tree, tree_to_json, write_json_atomic

    choices = [[0], [0, 0]]
    conf = {"config": "chain:2", "uses_heads": True, "medusa_choices": choices, "tree_nodes": 2, "lookup": 0,
            "gate": 0.0}
    tree = write_json_atomic(tmp_path / "tree.json", tree_to_json(
        make_tree(choices, name="final"), target="vllm", configuration=conf,
        heads=heads_reference(shipped_heads_dir("unconditioned"))))
    out = tmp_path / "deploy"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "export", "--tree", str(tree), "--target", "vllm", "--out",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec["model"] == str(out.resolve()) and json.dumps(spec) in proc.stdout  # what it prints, it wrote
    model, _ = model_folder("default", log=lambda m: None)
    worker = VllmWorker(vllm_python, str(model), "bfloat16", spec, EngineSettings(), log_file=tmp_path / "vllm.log")
    try:
        reply = worker.complete(_prompt_ids(loaded), 64)
    finally:
        worker.close()
    assert reply["token_ids"] and reply["spec"]["draft_tokens"] == 2 * reply["spec"]["drafts"] > 0
    assert reply["spec"]["accepted_tokens"] > 0, reply["spec"]


def test_vllm_medusa_cannot_switch_its_draft_length_by_batch_size_so_the_export_refuses_a_schedule_that_does(
        tmp_path, vllm_python, loaded):
    """Why ``export --target vllm`` refuses a schedule that switches the chain length: vLLM 0.32 loads
    ``num_speculative_tokens_per_batch_size`` beside Medusa heads and drafts for a request alone, but the first
    step that the schedule gives another length (here 0, four requests together) fails in its Medusa drafter's
    assertion. The export of the same schedule is refused in one line; the schedule's batch-1 chain at every
    batch size exports, and vLLM drafts it."""
    import json
    import sys

    from bench.engines import EngineError
    from bench.engines.stage import model_folder
    from bench.engines.vllm_engine import VllmWorker
    from bench.stages.deploy import heads_reference
    from medusa_runtime.heads.medusa import shipped_heads_dir
    from treesearch.tree import make_tree, tree_to_json, write_json_atomic

    def conf(choices):
        return {"config": "chain:2" if choices else "plain", "uses_heads": bool(choices), "medusa_choices": choices,
                "tree_nodes": len(choices) if choices else None, "lookup": 0, "gate": 0.0}

    def export(name, ranges):
        tree = write_json_atomic(tmp_path / f"{name}.json", tree_to_json(
            make_tree(chain2, name="final"), target="vllm", configuration=conf(chain2),
            heads=heads_reference(shipped_heads_dir("unconditioned")),
            schedule=[{"batch": [a, b], "configuration": conf(c), "prediction": {}} for a, b, c in ranges]))
        return subprocess.run([sys.executable, "-m", "bench.cli", "export", "--tree", str(tree), "--target", "vllm",
                               "--out", str(tmp_path / name)], capture_output=True, text=True, timeout=600)

    chain2 = [[0], [0, 0]]
    switching = export("switching", [(1, 1, chain2), (2, 16, None)])
    assert switching.returncode == 2 and "MedusaProposer" in switching.stderr, switching.stderr
    kept = export("kept", [(1, 1, chain2), (2, 16, chain2)])
    assert kept.returncode == 0, kept.stderr
    spec = json.loads((tmp_path / "kept" / "speculative_config.json").read_text())
    assert spec["num_speculative_tokens"] == 2 and "num_speculative_tokens_per_batch_size" not in spec
    model, _ = model_folder("default", log=lambda m: None)
    ids = _prompt_ids(loaded)

    def run(spec_cfg):
        worker = VllmWorker(vllm_python, str(model), "bfloat16", spec_cfg, EngineSettings(),
                            log_file=tmp_path / "vllm.log", max_num_seqs=8)
        try:
            alone = worker.complete(ids, 48)
            try:
                together = worker.complete_together([ids] * 4, 48)
            except EngineError as exc:
                together = str(exc)
        finally:
            worker.close()
        return alone, together

    alone, together = run(spec)  # the kept export: drafts alone and together
    assert alone["spec"]["drafts"] > 0 and together["spec"]["drafts"] > 0, (alone["spec"], together["spec"])
    alone, together = run({**spec, "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 16, 0]]})
    assert alone["token_ids"] and alone["spec"]["drafts"] > 0, alone["spec"]
    assert isinstance(together, str) and "AssertionError" in together, together


def test_llama_server_answers_greedy_and_drafts_with_its_lookup(tmp_path, loaded):
    from bench.engines.llamacpp import LlamaServer, build
    from bench.engines.peers import llama_spec_args
    from medusa_runtime.model import locate_gguf

    build(log=lambda m: None)
    gguf = locate_gguf(log=lambda m: None)
    ids = _prompt_ids(loaded)
    plain = LlamaServer(gguf, log_file=tmp_path / "plain.log")
    lookup = LlamaServer(gguf, extra=llama_spec_args("ngram", 4), log_file=tmp_path / "lookup.log")
    try:
        first, again = plain.complete(ids, 48, loaded.eos_token_ids), plain.complete(ids, 48, loaded.eos_token_ids)
        drafted = lookup.complete(ids, 48, loaded.eos_token_ids)
    finally:
        plain.close()
        lookup.close()
    assert first["token_ids"] == again["token_ids"] and 0 < len(first["token_ids"]) <= 48 and first["wall_time"] > 0
    assert first["drafted"] == 0
    # the answer repeats the prompt's sentence: the lookup finds it and drafts, and greedy acceptance keeps the
    # same answer as plain decoding of the same GGUF
    assert drafted["drafted"] > 0 and drafted["accepted"] > 0, drafted
    assert drafted["token_ids"] == first["token_ids"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_judges_constrained_rating_against_a_real_vllm_serve(tmp_path, vllm_python):
    from bench.engines.stage import model_folder
    from bench.judge.grading import RATING_CHOICES, OpenAIBackend

    model, _ = model_folder("default", log=lambda m: None)
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    log = (tmp_path / "serve.log").open("w")
    # the API server's module: ``vllm serve`` itself fails in the vllm-cpu distribution (vllm/entrypoints/cli/
    # main.py asks importlib.metadata for a distribution named "vllm", which is installed as "vllm-cpu")
    server = subprocess.Popen([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
                               "2048", "--enforce-eager"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        judge = OpenAIBackend(str(model), base_url=f"http://127.0.0.1:{port}/v1", api_key="", retries=0)
        system, user = "You are a judge.", "Rate this answer from 1 to 10: 'Paris is the capital of France.'"
        judgment = judge.complete(system, user)
        assert judgment.strip()
        assert judge.rate(system, user, judgment) in RATING_CHOICES  # the constraint reached vLLM's sampler
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_engines_report_rows_of_the_bench(tmp_path):
    """The engines session's own report (results/bench, written by the pipeline run before these tests): every
    peer row measured, with an interval, and vLLM + Medusa's acceptance predicted."""
    import json

    report = Path(os.environ.get("MEDUSA_ENGINES_REPORT", "results/bench/report.json"))
    rows = {r["config"]: r for r in json.loads(report.read_text())["configs"]}
    wanted = ["vllm plain", *(f"vllm medusa chain:{k}" for k in (1, 2, 3, 4)), "llama.cpp bf16", "llama.cpp Q4_1"]
    for name in wanted:
        r = rows[name]
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_ci"][0] <= r["tokens_per_s"] <= r["tokens_per_s_ci"][1]
    for k in (1, 2, 3, 4):
        r = rows[f"vllm medusa chain:{k}"]
        assert len(r["accepted_per_position"]) == len(r["predicted_accepted_per_position"]) == k
