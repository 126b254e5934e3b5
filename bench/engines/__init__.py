"""Serving engines measured beside the runtime in the same replay (``--engines vllm,llama.cpp``).

Each engine is a peer: a warm process of the real engine (vLLM's ``LLM`` in its own environment, llama.cpp's
``llama-server``) that answers the replay's prompts, token ids through the same chat template, greedy, with
the same new-token budget, one request at a time, interleaved with the runtime's configurations question by
question. Its start-up is measured apart (``replay/engines.json``); its answers become records like every
other configuration's, with the engine's own speculative-decoding counters beside them.

- ``llamacpp``: llama.cpp built from the registry's source distribution, the GGUFs it runs, the server peer;
- ``vllm_engine``: the interpreter of vLLM's environment, the heads exported for it, the worker peer
  (``vllm_worker.py`` runs inside vLLM's environment);
- ``peers``: the peer configurations of the replay's matrix, the pool of warm engines, their runners.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("vllm", "llama.cpp")

class EngineError(RuntimeError):
    """An engine that cannot be installed, built, started or asked: one line, said to the user as it is."""

def parse_engines(spec: str | None) -> tuple[str, ...]:
    """``vllm,llama.cpp`` -> ('vllm', 'llama.cpp'); '' or 'none' -> (); unknown names refused in one line."""
    if not spec or spec == "none":
        return ()
    names = tuple(dict.fromkeys(s.strip() for s in spec.split(",") if s.strip()))
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise ValueError(f"--engines: unknown engine {unknown[0]!r}; use a comma-separated list of {', '.join(ENGINES)}")
    return names

@dataclass(frozen=True)
class EngineSettings:
    """How the peers run (the pipeline's ``--engines`` options)."""

    vllm_python: str | None = None  # the interpreter of vLLM's environment (None: $MEDUSA_VLLM_PYTHON)
    vllm_kv_cache_gb: int = 1  # at most this KV cache per warm vLLM engine (it gets what its batch needs)
    vllm_eager: bool = True  # enforce_eager: no torch.compile warm-up at each engine's start
    llama_threads: int | None = None  # llama.cpp's -t (None: every core the process may use)
    medusa_chains: tuple[int, ...] = (1, 2, 3, 4)  # vLLM + Medusa: chain lengths (those past the heads' count dropped)
    ngram_tokens: int = 4  # vLLM's n-gram proposer and llama.cpp's lookup: tokens drafted per step
    settle_s: float = 0.3  # untimed pause after each engine answer, so its idle threads stop before the next run
