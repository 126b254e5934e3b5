"""The servers a load run drives, each on a free loopback port: the runtime's own (``medusa-bench serve`` in a
process of its own, one per configuration), llama.cpp's ``llama-server`` with as many slots as clients, and
vLLM's OpenAI server (in vLLM's own environment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.engines import EngineError, EngineSettings
from bench.engines.llamacpp import LlamaServer, free_port
from bench.engines.process import start_server, stop_process, wait_healthy
from bench.engines.vllm_engine import kv_cache_bytes


class OwnServer:
    """``medusa-bench serve`` for one configuration (``tree`` None: plain decoding) or a schedule of them, batches of
    ``max_batch``."""

    engine = "own"

    def __init__(self, model: str, heads: str, tree: str | None, max_batch: int, max_new_tokens: int,
                 dtype: str = "auto", lookup: int = 0, gate: float = 0.0, log_file: Path | None = None,
                 timeout_s: float = 600.0, schedule: str | None = None, weights: str = "dense"):
        args = [sys.executable, "-m", "bench.cli", "serve", "--model", model, "--dtype", dtype, "--weights", weights,
                "--port", "0",
                "--heads", heads if tree or schedule else "none", "--max-batch", str(max_batch), "--max-queue",
                "1024", "--max-new-tokens", str(max_new_tokens), "--name", "load", "--lookup", str(lookup),
                "--gate", str(gate)]
        if schedule:  # the configuration follows the live batch size (tree.json's schedule)
            args += ["--schedule", schedule]
        elif tree:
            args += ["--tree", tree]
        self._log = open(log_file or os.devnull, "a")  # noqa: SIM115  closed in close()
        self.proc = start_server(args, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, text=True)
        t0 = time.perf_counter()
        line = self.proc.stdout.readline()  # "serving load at http://127.0.0.1:<port>/v1 (...)"
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if match is None:
            self.close()
            raise EngineError(f"the runtime's server did not start ({tree or 'plain'}): {line.strip() or 'no output'}")
        self.url, self.model = match.group(1), "load"
        wait_healthy(self.url, self.proc, t0, timeout_s)

    def counters(self) -> dict:
        """The server's generated tokens, decode steps and accepted drafts by position so far (/metrics)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {"tokens": 0.0, "steps": 0.0, "accepted": {}}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "medusa_generated_tokens_total":
                    out["tokens"] = s.value
                elif s.name == "medusa_decode_steps_total":
                    out["steps"] = s.value
                elif s.name == "medusa_accepted_drafts_total":
                    out["accepted"][int(s.labels["position"])] = s.value
        return out

    def close(self) -> None:
        stop_process(self.proc, 30)
        self.proc.stdout.close()
        self._log.close()


def counter_delta(before: dict, after: dict) -> dict:
    return {"tokens": after["tokens"] - before["tokens"], "steps": after["steps"] - before["steps"],
            "accepted": {p: v - before["accepted"].get(p, 0.0) for p, v in after["accepted"].items()}}


class LlamaSlots:
    """``llama-server`` with ``slots`` parallel slots (continuous batching in llama.cpp), its context split among
    them, serving ``/v1/completions``."""

    engine = "llama.cpp"

    def __init__(self, gguf: Path, slots: int, ctx_per_slot: int = 2048, threads: int | None = None,
                 log_file: Path | None = None, build: str = "native"):
        self.server = LlamaServer(gguf, threads, ctx=ctx_per_slot * slots, log_file=log_file, build=build,
                                  slots=slots)
        self.url, self.model = self.server.url, "load"

    def counters(self) -> dict | None:
        return None

    def close(self) -> None:
        self.server.close()


class VllmServer:
    """vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) on the transformers folder of the same weights,
    plain decoding, up to ``max_num_seqs`` requests in its batch; run by the Python of vLLM's environment."""

    engine = "vllm"

    def __init__(self, python: str, model_folder: Path, max_num_seqs: int, settings: EngineSettings,
                 dtype: str = "bfloat16", log_file: Path | None = None, timeout_s: float = 900.0):
        port = free_port()
        self.url, self.model = f"http://127.0.0.1:{port}", "load"
        max_len = 4096
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
                "--served-model-name", "load", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_len), "--kv-cache-memory-bytes",
                str(kv_cache_bytes(model_folder, max_len, max_num_seqs, max(settings.vllm_kv_cache_gb, 4))),
                *(["--enforce-eager"] if settings.vllm_eager else [])]
        # its KV cache: room for max_num_seqs sequences (the environment's older setting would override it)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self._log = open(log_file or os.devnull, "a")  # noqa: SIM115  closed in close()
        self.proc = start_server(args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            wait_healthy(self.url, self.proc, time.perf_counter(), timeout_s)
        except EngineError:
            self.close()
            raise

    def counters(self) -> dict | None:
        return None

    def close(self) -> None:
        stop_process(self.proc, 60)
        self._log.close()
