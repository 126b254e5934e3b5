"""The stages' configurations: one frozen dataclass per command that the main job runs (train, calibrate,
profile, search, replay, judge; and speed, replay's sibling), each field one of the command's flags under its
argparse name, each default the command line's own.

The command line parses into these (``from_namespace``) and calls the stage with the object; the pipeline
builds the object and calls the same stage. A stage's cache key (``stage_key``) is every field of its job,
the hash of every file or folder the job reads (``reads``), what the stage depends on besides
(``depends``: code constants, an endpoint) and the runtime revision, so that no input can be left out of
a key by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bench.stages import defaults
from bench.stages.cache import RUNTIME_REVISION, file_hash, folder_hash
from medusa_runtime.prompts import BUILTIN_NAMES, BUILTIN_REVISION, mix_parts
from medusa_runtime.training.profiles import TRAIN_PROFILES
from medusa_runtime.training.selfprompts import SelfPromptConfig
from treesearch.export import TRTLLM_MAX_DRAFT_LEN
from treesearch.typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD

J = TypeVar("J", bound="Job")


def import_function(spec: str) -> Callable:
    """The function ``module:function`` names, its module imported only now: what a stage imports (torch, the
    model) loads only when that stage runs, not when the command line or the pipeline starts."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)

DEFAULT_NODES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True, kw_only=True)
class Job:
    """What every job shares: how to build one from parsed flags, and what its key reads."""

    @classmethod
    def from_namespace(cls: type[J], ns: argparse.Namespace, **overrides: Any) -> J:
        """The job of parsed flags: each field from the flag of the same name (lists become tuples)."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        return cls(**{**values, **overrides})

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every field that has a default, by flag name: what the command line's parser sets as its defaults."""
        return {f.name: f.default for f in fields(cls) if f.default is not dataclasses.MISSING}

    def reads(self) -> dict[str, Path]:
        """The files and folders the stage reads (their contents key it), by role."""
        return {}

    def depends(self) -> dict[str, Any]:
        """What else the stage's result depends on (code constants, the environment)."""
        return {}


def _path_hash(path: Path) -> str:
    return folder_hash(path) if path.is_dir() else file_hash(path)


def stage_key(job: Job) -> dict:
    """A stage's cache inputs: the job's kind and every field, the hash of each file it reads, what else it
    depends on, and the runtime revision (measured stages change with the runtime's speed)."""
    return {"job": type(job).__name__, "fields": dataclasses.asdict(job),
            "reads": {name: _path_hash(path) for name, path in sorted(job.reads().items())},
            "depends": job.depends(), "runtime": RUNTIME_REVISION}


def _heads_path(spec: str | None) -> dict[str, Path]:
    from medusa_runtime.heads.medusa import heads_folder  # torch: the command line stays light

    folder = heads_folder(spec)
    return {} if folder is None else {"heads": folder}


def _file(role: str, path: str | None) -> dict[str, Path]:
    """A flag that names a file: keyed by its contents ('missing' when absent); one that names something else
    (a preset, a hub id) is keyed by the field alone."""
    return {role: Path(path)} if path and Path(path).is_file() else {}


def _prompts_revision(source: str) -> dict[str, Any]:
    return {"builtin_prompts": BUILTIN_REVISION} if source in BUILTIN_NAMES else {}


@dataclass(frozen=True, kw_only=True)
class ModelJob(Job):
    """The model flags every measuring command takes; a job's ``heads: auto`` becomes the heads it names on
    this model (medusa_runtime.heads.medusa.auto_heads)."""

    model: str = defaults.MODEL  # 'default' (the embedded SmolLM2-135M-Instruct), 'gemma3-270m', a folder or a hub id
    dtype: str = defaults.DTYPE  # auto | float32 | bfloat16 | float16
    weights: str = "dense"  # dense (the weights in dtype) | q4_1 (the layers as GGUF Q4_1 blocks, the C forward)
    device: str = defaults.DEVICE  # cpu | cuda | cuda:N | auto

    def __post_init__(self) -> None:
        from medusa_runtime.heads.medusa import auto_heads  # torch: the command line stays light

        if getattr(self, "heads", None) == "auto":
            object.__setattr__(self, "heads", auto_heads("auto", self.model))


@dataclass(frozen=True, kw_only=True)
class DistillJob(ModelJob):
    """``medusa-bench distill``: the model's own replies to the training prompts, in an answer store (resumable
    shards and a manifest); exactly the replies ``train`` with the same flags trains on. None: the profile's."""

    data: str = "builtin"
    profile: str = "quick"
    prompts: int | None = None
    max_new_tokens: int | None = None
    follow_ups: bool | None = None
    batch_size: int = 32  # prompts generated together
    shard_size: int = 256  # replies per shard file
    answers: str | None = None  # the answer store's folder (None: the cache's)

    def reads(self) -> dict[str, Path]:
        data = {f"data:{s}" if s != self.data else "data": p for s in mix_parts(self.data)
                for p in _file("data", s).values()}
        return {**data, **(_file("answers", str(Path(self.answers) / "manifest.json")) if self.answers else {})}

    def depends(self) -> dict[str, Any]:
        builtin = [r for s in mix_parts(self.data) if (r := _prompts_revision(s))]
        return {"profile": TRAIN_PROFILES.get(self.profile), **(builtin[0] if builtin else {})}


@dataclass(frozen=True, kw_only=True)
class TrainJob(DistillJob):
    """``medusa-bench train``: heads (Medusa-1 or Medusa-2) on self-distilled replies. None: the profile's."""

    method: str = "medusa1"
    num_heads: int = 4
    layers: int = 1
    max_examples: int | None = None
    epochs: float | None = None
    lr: float | None = None
    batch_tokens: int = 2048
    lora_rank: int = 0
    train_layers: int = 0
    base_lr: float | None = None
    lm_weight: float | None = None
    distill_weight: float = 1.0
    heads_warmup: float = 0.3
    head_grad_to_base: float = 0.2
    vocab: str | None = None
    draft_size: int = 0
    soft_targets: float = 0.0
    condition: str | None = None
    seed: int = 0
    resume: bool = False
    init: str | None = None
    no_hidden_cache: bool = False
    out: str = "results/heads"

    def reads(self) -> dict[str, Path]:
        init = _heads_path(self.init)
        return {**super().reads(), **({"init": init["heads"]} if init else {})}


@dataclass(frozen=True, kw_only=True)
class LearningCurveJob(TrainJob):
    """``medusa-bench learning-curve``: the train recipe on nested prefixes of the prompt mix (``points``: prompt
    counts), each set measured by calibration on ``questions`` (greedy rollouts of ``eval_tokens``)."""

    points: tuple[int, ...] = (120, 360, 1080)
    questions: str = "mt-bench"
    eval_tokens: int = 128
    out: str = "results/learning-curve"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.points or any(n < 1 for n in self.points) or len(set(self.points)) != len(self.points):
            raise ValueError(f"--points must be distinct prompt counts >= 1, got {list(self.points)}")
        if self.prompts is not None or self.max_examples is not None:
            raise ValueError("--points sets each trained set's prompts; --prompts and --max-examples do not apply")


@dataclass(frozen=True, kw_only=True)
class CalibrateJob(ModelJob):
    """``medusa-bench calibrate``: head x rank acceptance on greedy rollouts -> acceptance.json."""

    heads: str = defaults.HEADS
    data: str = "builtin"
    limit: int | None = None
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    candidates: int = 10
    heldout: float = 0.2
    batch_size: int = 16
    seed: int = 0
    typical_temperature: float | None = None
    rollouts: str = "runtime"
    out: str = "results/acceptance.json"
    plots: str | None = None

    def reads(self) -> dict[str, Path]:
        return {**_heads_path(self.heads), **_file("data", self.data)}

    def depends(self) -> dict[str, Any]:
        return _prompts_revision(self.data)


@dataclass(frozen=True, kw_only=True)
class ProfileJob(ModelJob):
    """``medusa-bench profile``: verify, heads, bookkeeping and prefill times on this machine -> latency.json."""

    heads: str = defaults.HEADS
    nodes: tuple[int, ...] = DEFAULT_NODES
    contexts: tuple[int, ...] = (128, 512)
    prefill: tuple[int, ...] = ()
    repeats: int = 7
    batch_sizes: tuple[int, ...] = ()  # also batched steps of this many requests (what a schedule is priced with)
    serving: bool = True  # with batch_sizes: also what serving adds to a step (bench.load.serving)
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS  # per request of that serving run
    out: str = "results/latency.json"
    plots: str | None = None

    def reads(self) -> dict[str, Path]:
        return _heads_path(self.heads)


@dataclass(frozen=True, kw_only=True)
class SearchJob(Job):
    """``medusa-bench search``: the Optuna study for the fastest configuration -> tree JSON."""

    acceptance: str
    budget: int
    latency: str | None = None
    min_budget: int = 1
    trials: int = 60
    objective: str = "auto"
    estimator: str = "auto"
    storage: str = "sqlite:///results/treesearch.db"
    study: str = "medusa-tree"
    heartbeat: int = 5
    grace_period: int = 20
    seed: int = 0
    context: int | None = None
    baseline: str = "mc_sim_7b_63"
    accept: str = "greedy"
    max_regret: float = 0.05
    trees_only: bool = False
    lookup: int = defaults.LOOKUP  # longest prompt-lookup chain a configuration may draft
    target: str = "own"  # own | vllm | trtllm | tgi (treesearch.targets)
    engine_costs: str | None = None  # report.json of an engines run: the target's measured step costs
    batch_sizes: tuple[int, ...] = ()  # also a schedule: the fastest configuration per batch size (from 1)
    exclude_ids: tuple[str, ...] = ()
    out: str = "results/tree.json"
    plots: str | None = None
    quiet: bool = False

    def reads(self) -> dict[str, Path]:
        return {"acceptance": Path(self.acceptance), **({"latency": Path(self.latency)} if self.latency else {}),
                **_file("engine_costs", self.engine_costs)}


@dataclass(frozen=True, kw_only=True)
class QuestionsJob(ModelJob):
    """The flags of the commands that replay questions (replay, speed)."""

    heads: str = defaults.HEADS
    questions: str | None = None  # mt-bench (None), humaneval, or a JSONL
    categories: tuple[str, ...] | None = None
    ids: tuple[int, ...] | None = None
    limit: int | None = None
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    repeats: int = 1
    sequential: bool = False
    progress: bool = True

    def depends(self) -> dict[str, Any]:
        from bench.replay.runner import (  # torch (the runner decodes): jobs stay light for the command line
            REPLAY_ORDER,
            SEQUENTIAL_ORDER,
        )

        return {"order": SEQUENTIAL_ORDER if self.sequential else REPLAY_ORDER}


@dataclass(frozen=True, kw_only=True)
class ReplayJob(QuestionsJob):
    """``medusa-bench replay``: a matrix of configurations (a JSON/YAML file) on a question set."""

    config: str
    profile_like: str | None = None
    profile_every: int = 2
    storage: str | None = None
    study: str = "medusa-replay"
    machine: str | None = None
    heartbeat: int = 5
    grace_period: int = 20
    out: str = "results/replay"

    def reads(self) -> dict[str, Path]:
        """The configuration file, the heads (the job's and those its configurations name), every tree file it
        names, the questions and the profile it prices like."""
        got = {"config": Path(self.config), **_heads_path(self.heads), **_file("questions", self.questions),
               **_file("profile_like", self.profile_like)}
        spec = read_replay_config(self.config) if Path(self.config).is_file() else {}
        for c in spec.get("configurations", []):
            for role, path in (*_heads_path(c.get("heads")).items(), *_file("tree", c.get("tree")).items()):
                got[f"{role}:{c.get(role)}"] = path
        return got


def read_replay_config(path: str) -> dict:
    """A replay's configuration file (JSON, or YAML by its suffix): a mapping with 'configurations'."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        try:
            spec = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ValueError(f"config file {path} is not valid YAML{where}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"config file {path} must hold a mapping with 'configurations'")
        return spec
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None


@dataclass(frozen=True, kw_only=True)
class SpeedJob(QuestionsJob):
    """``medusa-bench speed``: generate, plain, prompt lookup and Medusa trees timed, interleaved."""

    tree: tuple[str, ...] = (defaults.TREE,)
    hf_engine: bool = False
    torch_path: bool = False
    lookup: int = defaults.LOOKUP
    gate: tuple[float, ...] = ()
    only: tuple[str, ...] | None = None
    out: str = "results/speed"

    def reads(self) -> dict[str, Path]:
        trees = {f"tree:{t}": Path(t) for t in self.tree if Path(t).is_file()}
        return {**_heads_path(self.heads), **_file("questions", self.questions), **trees}


@dataclass(frozen=True, kw_only=True)
class JudgeJob(ModelJob):
    """``medusa-bench judge``: answer quality (the log-likelihood proxy) and, with a backend, FastChat grading."""

    records: str
    questions: str | None = None
    judge: str = defaults.JUDGE  # none | MODEL (an OpenAI-compatible endpoint's) | local:MODEL
    guided_rating: bool = False
    out: str | None = None
    progress: bool = True

    def reads(self) -> dict[str, Path]:
        return {"records": Path(self.records), **_file("questions", self.questions)}

    def depends(self) -> dict[str, Any]:
        # an OpenAI-compatible judge is named by its model and the endpoint serving it
        remote = self.judge not in ("none", "") and not self.judge.startswith("local:")
        return {"endpoint": os.environ.get("OPENAI_BASE_URL")} if remote else {}


# The commands that run no cached stage: their flags and defaults, as the stages' jobs hold theirs.


@dataclass(frozen=True, kw_only=True)
class ModelInfoJob(ModelJob):
    """``medusa-bench model``: prepare and describe a base model (as the heads decode with it)."""

    heads: str = defaults.HEADS
    gguf: str | None = None  # the packaged model's GGUF copied by hand, put into the cache first


@dataclass(frozen=True, kw_only=True)
class DraftVocabJob(ModelJob):
    """``medusa-bench draft-vocab``: a heads folder copied with its draft vocabulary cut to ``size`` tokens."""

    heads: str = defaults.HEADS
    size: int
    replies: str
    limit: int | None = None
    max_len: int = 768
    out: str


@dataclass(frozen=True, kw_only=True)
class GenerateJob(ModelJob):
    """``medusa-bench generate``: one prompt decoded with the heads on a tree."""

    heads: str = defaults.HEADS
    tree: str = defaults.TREE
    accept: str = "greedy"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA
    candidates: int = 10
    seed: int | None = None
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    engine: str = "auto"
    lookup: int = defaults.LOOKUP
    prompt: str
    chat: bool = False


@dataclass(frozen=True, kw_only=True)
class FidelityJob(ModelJob):
    """``medusa-bench fidelity``: how far a retrained model drifted from the original on MT-Bench."""

    reference: str = defaults.MODEL
    heads: str = defaults.HEADS
    questions: str | None = None
    limit: int = 20
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    batch_size: int = 8
    out: str = "results/fidelity.json"


@dataclass(frozen=True, kw_only=True)
class ValidateJob(Job):
    """``medusa-bench validate``: replay-predicted tau against measured tau; model, heads and dtype default to
    those the statistics name."""

    acceptance: str
    tree: tuple[str, ...] = (defaults.TREE,)
    model: str | None = None
    heads: str = defaults.HEADS
    dtype: str = defaults.DTYPE
    device: str = defaults.DEVICE
    accept: str = "greedy"
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class ExportJob(Job):
    """``medusa-bench export``: a tree printed for a server (``format``), or deployed to a ``target``."""

    tree: str = defaults.TREE
    target: str | None = None
    out: str | None = None
    model: str = defaults.MODEL
    dtype: str = defaults.DTYPE
    base_model: str | None = None
    format: str = "python"
    num_heads: int | None = None
    max_draft_len: int = TRTLLM_MAX_DRAFT_LEN
    draft_model: str | None = None


@dataclass(frozen=True, kw_only=True)
class ExportHeadsJob(Job):
    """``medusa-bench export-heads``: heads written as a model folder a serving engine loads."""

    format: str = "vllm"
    model: str = defaults.MODEL
    heads: str = defaults.HEADS
    out: str
    num_speculative_tokens: int | None = None
    base_model: str | None = None
    dtype: str = defaults.DTYPE


@dataclass(frozen=True, kw_only=True)
class ServeJob(ModelJob):
    """``medusa-bench serve``: the runtime behind an OpenAI-compatible chat endpoint."""

    heads: str = defaults.HEADS
    tree: str = defaults.TREE
    lookup: int = defaults.LOOKUP
    gate: float = 0.0
    schedule: str | None = None  # a tree.json with a schedule: the configuration follows the live batch size
    name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS
    max_batch: int = 16  # requests decoded together at most
    max_queue: int = 64  # requests waiting for a row at most (beyond: 503)
    api_key: str | None = None  # required as "Authorization: Bearer <key>" when set


@dataclass(frozen=True, kw_only=True)
class LoadJob(ModelJob):
    """``medusa-bench load``: the questions' first turns through servers at fixed concurrencies (load.json)."""

    heads: str = defaults.HEADS
    tree: tuple[str, ...] = (defaults.TREE,)  # Medusa configurations served beside plain decoding
    lookup: int = defaults.LOOKUP
    config: str | None = None  # or: a replay configuration file whose greedy Medusa configurations are served
    schedule: str | None = None  # also a server following this tree.json's schedule (its row: "schedule")
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    rate: tuple[float, ...] = ()  # Poisson arrivals at these request rates (per second), beside the concurrencies
    rounds: int = 1  # the servers (not llama-server) measured this many times per concurrency, in turn, pooled
    questions: str | None = None  # mt-bench (None) or a JSONL
    limit: int = 16  # first turns replayed, spread over the categories
    max_new_tokens: int | None = defaults.MAX_NEW_TOKENS  # None: defaults.NEW_TOKENS
    engines: tuple[str, ...] = ()  # llama.cpp: its llama-server on the bf16 GGUF, as many slots as clients
    out: str = "results/bench/load.json"
    progress: bool = True

    def reads(self) -> dict[str, Path]:
        trees = {f"tree:{t}": Path(t) for t in self.tree if Path(t).is_file()}
        return {**_heads_path(self.heads), **_file("questions", self.questions), **_file("config", self.config),
                **_file("schedule", self.schedule), **trees}


JOBS: dict[str, type[Job]] = {"train": TrainJob, "calibrate": CalibrateJob, "profile": ProfileJob,
                              "search": SearchJob, "replay": ReplayJob, "speed": SpeedJob, "judge": JudgeJob,
                              "load": LoadJob}


_SELF = SelfPromptConfig()


@dataclass(frozen=True, kw_only=True)
class SelfPromptsJob(ModelJob):
    """``medusa-bench self-prompts``: training prompts the model writes itself, filtered (resumable shards);
    the sampling defaults are SelfPromptConfig's."""

    limit: int = _SELF.count  # prompts to keep (SelfPromptConfig.count)
    shard_size: int = _SELF.shard_size
    temperature: float = _SELF.temperature
    top_p: float = _SELF.top_p
    max_prompt_tokens: int = _SELF.max_prompt_tokens
    batch_size: int = _SELF.batch_size
    seed: int = _SELF.seed
    exclude: tuple[str, ...] = ("mt-bench", "humaneval")
    out: str = "results/self-prompts"


# every subcommand's job: its flags are the job's fields, its defaults the job's
COMMAND_JOBS: dict[str, type[Job]] = {**JOBS, "model": ModelInfoJob, "draft-vocab": DraftVocabJob, "generate": GenerateJob,
                                      "fidelity": FidelityJob, "validate": ValidateJob, "export": ExportJob,
                                      "export-heads": ExportHeadsJob, "serve": ServeJob, "self-prompts": SelfPromptsJob,
                                      "distill": DistillJob, "learning-curve": LearningCurveJob}
