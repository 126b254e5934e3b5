"""The pipeline's engines stage: what each engine needs, made ready, and the peers' configurations.

    llama.cpp: built once (cache), the bf16 GGUF converted by its own script, the packaged Q4_1 GGUF
    vLLM:      its environment checked, the Medusa heads it can run exported over the whole vocabulary,
               and the same heads as a runtime heads folder, which the pipeline calibrates on the replayed
               questions to predict what vLLM will accept (``engine_acceptance``)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.engines import EngineError, EngineSettings, llamacpp
from bench.engines.llamacpp import built_binary, require_tools
from bench.engines.peers import llamacpp_configurations, vllm_configurations
from bench.engines.vllm_engine import full_vocabulary_heads, vllm_python, vllm_version
from medusa_runtime.model import locate_gguf, prepare_packaged_model

MEDUSA_DIR = "medusa-heads"  # under the run's engines/ folder: heads/ (runtime layout) and vllm/ (vLLM's)
ACCEPTANCE = "acceptance-vllm-medusa.json"  # the calibration of those heads (vLLM's vocabulary)
NOTES = "notes.json"  # the engines (and builds) left out, with the reason: the report lists them


@dataclass(frozen=True)
class EnginePlan:
    configurations: list[dict]  # MethodConfig dicts of the peers
    medusa_heads: Path | None = None  # the heads vLLM runs, as a runtime heads folder (to calibrate), or None
    notes: list[str] = field(default_factory=list)  # what was left out, and why


def model_folder(model: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """The transformers folder the engines load, and a short name for the files made from it."""
    if model == "default":
        return prepare_packaged_model(log=log), "smollm2-135m-instruct"
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise EngineError(f"--engines need the model as a local transformers folder (or 'default'), not {model!r}")
    return folder, folder.name


def engine_heads(model: str, heads: str) -> str | None:
    """The heads vLLM's Medusa runs: on the default model the shipped unconditioned set (the shipped default
    heads are path-conditioned, which no engine implements); elsewhere the run's own heads, where vLLM can run
    them."""
    if model == "default":
        return "unconditioned"
    return None if heads in ("none", "default") else heads


def check(engines: tuple[str, ...], settings: EngineSettings) -> None:
    """What the engines need from outside, checked at once (the pipeline's first step): vLLM's environment,
    and llama.cpp's build tools unless it is built already."""
    if "vllm" in engines:
        vllm_version(vllm_python(settings))
    if "llama.cpp" in engines:
        if built_binary("llama-server") is None:
            require_tools()


def prepare(engines: tuple[str, ...], model: str, heads: str, settings: EngineSettings, out: Path,
            log: Callable[[str], None] = print) -> EnginePlan:
    folder, name = model_folder(model, log)
    configs: list[dict] = []
    notes: list[str] = []  # what was left out and why (the report says it)
    medusa_heads = None
    if "llama.cpp" in engines:
        llamacpp.build(log)  # the native build: its source tree converts the bf16 GGUF
        bf16 = llamacpp.bf16_gguf(folder, name, log)
        q4 = locate_gguf(log=log) if model == "default" else None
        try:  # each build smoke-tested on each GGUF (prefill and decode), the first that runs them all kept
            variant, left_out = llamacpp.working_build([bf16, *([q4] if q4 else [])], log, settings.llama_threads)
        except EngineError as exc:
            notes.append(f"llama.cpp left out: {exc}")
        else:
            notes += left_out
            configs += llamacpp_configurations(str(bf16), None if q4 is None else str(q4), settings, variant)
    if "vllm" in engines:
        log(f"[engines] vLLM's environment: {vllm_python(settings)}")
        source = engine_heads(model, heads)
        num_heads, export = 0, None
        if source is None:
            notes.append("vLLM + Medusa left out: no heads that vLLM can run for this model (pass unconditioned heads "
                         "with --heads)")
        else:
            target = full_vocabulary_heads(source, model, out / MEDUSA_DIR, log)
            medusa_heads, export = target / "heads", target / "vllm"
            num_heads = json.loads((export / "config.json").read_text())["num_heads"]
        configs += vllm_configurations(str(folder), None if export is None else str(export), num_heads, settings)
    return EnginePlan(configs, medusa_heads, notes)
