"""``nox -s bench``: every stage end to end on the default model, each stage cached by its inputs.

    heads (shipped, or trained with --retrain) -> calibrate (the workload) -> profile -> search (per fold)
        -> replay -> report

The workload is a question set (MT-Bench by default, ``--questions humaneval`` or a JSONL). Every
question is rolled out once for calibration; the replayed questions are split into folds, and each
fold's search and predictions read only the other questions' rollouts (``bench.replay.workload``). The
search's pick for a fold is replayed on that fold's questions, beside the alternatives, in one
interleaved run; the report sets predicted against measured for every configuration.

A stage is skipped when its outputs exist and the hash of its inputs (configuration plus the files it
reads) matches the one recorded in ``results/bench/stages.json``; a second run only redoes what
changed. ``--profile quick`` (default) is sized for a 2-core CPU; ``--profile full`` replays all of
MT-Bench; ``--profile smoke`` runs every stage on a few questions (a check that the job runs).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.commands import flags
from bench.engines import EngineSettings, parse_engines
from bench.replay.matrix import baseline_configurations, replay_configurations, sampled_configurations
from bench.stages import defaults
from bench.stages.cache import RUNTIME_REVISION, StageCache, file_hash, folder_hash, isolate_records  # noqa: F401
from bench.stages.jobs import (
    CalibrateJob,
    Job,
    JudgeJob,
    LoadJob,
    ProfileJob,
    ReplayJob,
    SearchJob,
    TrainJob,
    import_function,
    stage_key,
)
from medusa_runtime.prompts import BUILTIN_NAMES, builtin_split, load_prompt_source
from treesearch.cost import load_profile
from treesearch.deploy import write_final
from treesearch.stats import load_stats
from treesearch.targets import TARGETS, heads_conditioning, load_engine_costs
from treesearch.tree import write_json_atomic
from treesearch.typical import SEARCH_TEMPERATURE

# the function each stage's job runs (bench.stages), imported when the stage runs: the searches, run side by side
# in spawned processes, import this module and only the search's, which load no torch
STAGES = {TrainJob: "bench.stages.training:train_stage", CalibrateJob: "bench.stages.measure:calibrate_stage",
          ProfileJob: "bench.stages.measure:profile_stage", SearchJob: "bench.stages.search:search_stage",
          ReplayJob: "bench.stages.replay:replay_stage", JudgeJob: "bench.stages.replay:judge_stage",
          LoadJob: "bench.stages.load:load_stage"}

WORKLOAD_SCHEMA = "medusa-workload/1"


@dataclass(frozen=True)
class BenchProfile:
    questions: int  # questions replayed, spread over the categories
    folds: int  # cross-fitting folds over the replayed questions
    turns: int  # turns replayed per question (calibration rolls out first turns)
    max_new_tokens: int  # per replayed turn; calibration rollouts have the same length
    latency_nodes: tuple[int, ...]  # tree sizes profiled
    latency_repeats: int
    search_budget: int  # largest tree searched (root excluded)
    search_trials: int
    peers: int  # transformers' generate and prompt lookup run on this many of the replayed
    #             questions (spread over the categories): slow here, and not what the search is checked against
    load_questions: int = 12  # first turns the load stage sends at each concurrency (0: no load stage)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)  # profiled batched steps; tree.json's schedule; load concurrencies
    load_rounds: int = 2  # the load stage's rounds per concurrency (each server's row pools them)


PROFILES = {
    # node counts: dense where trees are picked, both sides of the AMX path's 16-row chunks (16 | 17, 32 | 33)
    # 10 folds: each fold's search fits 36 of the 40 questions, so the folds' picks mostly agree and their
    # prediction errors cancel over the folds as a fixed configuration's do (with 5 folds on HumanEval the
    # picks differed per fold and the pick's tau came out 4.8 % high while fixed configurations were within 0.4 %)
    "quick": BenchProfile(40, 10, 1, 96, (1, 2, 3, 4, 5, 6, 8, 12, 16, 17, 24, 32, 33, 48, 64, 96), 7, 64, 60, 16),
    # full: all of MT-Bench at FastChat's answer length (gen_model_answer's max_new_token, 1024), what its judge
    # grades; hours on a 2-core CPU (the replay alone ~8 h at 120 tokens/s)
    "full": BenchProfile(80, 5, 2, 1024, (1, 2, 3, 4, 5, 6, 8, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128, 160, 192),
                         7, 128, 120, 80, 40),
    # smoke: every stage on a few questions and short answers (nox -s gpu runs it after its tests); its figures
    # check that the job runs, not what a configuration is worth
    "smoke": BenchProfile(20, 5, 1, 32, (1, 2, 4, 8, 16, 32, 48), 3, 32, 20, 2, 4, (1, 2, 4), 1),
}


@dataclass(frozen=True)
class BenchOptions:
    profile: str = "quick"  # a key of PROFILES
    questions: str = "mt-bench"  # mt-bench | humaneval | a question JSONL
    calibration: str | None = None  # None: the question set itself, cross-fitted; else a prompt source
    allow_overlap: bool = False  # accept a calibration set that holds replayed questions
    retrain: bool = False  # train heads (quick profile) instead of the shipped ones
    out: str = "results/bench"
    folds: int | None = None  # cross-fitting folds (None: the profile's)
    dtype: str = "bfloat16"  # resolved: main() turns 'auto' into the device's dtype before any stage keys it
    weights: str = "dense"  # dense | q4_1 (the layers as GGUF Q4_1 blocks on the C forward; dtype bfloat16)
    model: str = "default"  # 'default' (the embedded SmolLM2), 'gemma3-270m' (from the registry too), a causal LM folder or (online) a hub id
    heads: str = "default"  # 'default' (the shipped heads of the default model) or a heads folder in either format
    device: str = "cpu"  # cpu | cuda | cuda:N
    compare_heads: tuple[str, ...] = ()  # head sets whose chains are replayed beside --heads' (each on its own base)
    judge: str | None = None  # FastChat single grading by this model (an OpenAI-compatible endpoint's, or local:M)
    guided_rating: bool = False  # a judgment without [[rating]] asked again, its reply constrained to 1-10
    max_new_tokens: int | None = None  # per replayed turn and calibration rollout (None: the profile's)
    engines: tuple[str, ...] = ()  # serving engines replayed beside the runtime (bench.engines: vllm, llama.cpp)
    vllm_python: str | None = None  # the interpreter of vLLM's environment (None: $MEDUSA_VLLM_PYTHON)
    target: str = "own"  # where the final configuration is deployed: own | vllm | trtllm | tgi (treesearch.targets)
    engine_costs: str | None = None  # report.json of an engines run: the target engine's measured step costs

    def model_fields(self) -> dict[str, str]:
        """What every stage's job gets to load the same model the same way."""
        return {"model": self.model, "dtype": self.dtype, "weights": self.weights, "device": self.device}


def run_job(job: Job) -> None:
    """A stage's job run in this process, by the function its command calls; prints what the command prints."""
    _, text = import_function(STAGES[type(job)])(job)
    print(text, flush=True)


def _cached(cache: StageCache, name: str, job: Job, outputs: list[Path]) -> bool:
    """The job run unless its outputs exist under the same key (``bench.stages.jobs.stage_key``: every field, the
    files it reads, the runtime revision)."""
    return cache.run(name, stage_key(job), outputs, lambda: run_job(job))


def stage_workers() -> int:
    """Processes the searches run in side by side (``MEDUSA_BENCH_WORKERS``; default: the cores, at most 8)."""
    raw = os.environ.get("MEDUSA_BENCH_WORKERS", "")
    try:
        return max(1, int(raw)) if raw else max(1, min(8, os.cpu_count() or 1))
    except ValueError:
        raise ValueError(f"MEDUSA_BENCH_WORKERS must be a whole number, got {raw!r}") from None


def _captured(job: Job) -> str:
    """``run_job`` in a worker process, its printed lines returned (printed by the parent, whole, in order)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run_job(job)
    return buffer.getvalue()


def _cached_many(cache: StageCache, stages: list[tuple[str, Job, list[Path]]]) -> None:
    """Independent jobs (the searches: pure Python, one core each) run side by side in ``stage_workers()``
    fresh processes, each recorded as done when it finishes; the cached ones are skipped. With one worker, or
    one job to run, they run here in turn. A job that fails stops the stage after the running ones end."""
    keyed = [(name, job, outputs, stage_key(job)) for name, job, outputs in stages]  # keys hash the files read
    todo = [stage for stage in keyed if not cache.fresh(stage[0], stage[3], stage[2])]
    workers = min(stage_workers(), len(todo))
    if workers <= 1:
        for name, job, outputs, key in todo:
            cache.run(name, key, outputs, lambda job=job: run_job(job))
        return
    print(f"[bench] {', '.join(stage[0] for stage in todo)}: running in {workers} processes ...", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_captured, job): (name, key) for name, job, _, key in todo}
        for future in as_completed(futures):
            name, key = futures[future]
            try:
                printed = future.result()  # the job's own error, raised here
            except BaseException:
                pool.shutdown(cancel_futures=True)  # the queued ones never start; the running ones end
                raise
            print(printed, end="", flush=True)
            cache.record(name, key)
            print(f"[bench] {name}: done at {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- stages


def stage_heads(opts: BenchOptions, out: Path, cache: StageCache) -> Path:
    """The shipped heads, or heads trained with the quick profile (``--retrain``)."""
    from medusa_runtime.heads.medusa import (  # torch: spawned search workers import this module
        SHIPPED,
        shipped_heads_dir,
    )

    if opts.heads in SHIPPED and opts.heads != "default" and not opts.retrain:
        folder = shipped_heads_dir(opts.heads)
        if folder is None or opts.model != "default":
            raise ValueError(f"the shipped '{opts.heads}' heads belong to the default model: pass --heads FOLDER")
        return folder
    if opts.heads not in ("default", "none") and not opts.retrain:
        folder = Path(opts.heads)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--heads {opts.heads}: not a heads folder (no config.json)")
        return folder
    heads_dir = shipped_heads_dir() if opts.model == "default" else None
    if opts.retrain or heads_dir is None:
        if opts.model != "default" and not opts.retrain:
            raise ValueError(f"the shipped heads belong to the default model, not {opts.model}: pass --heads FOLDER "
                             "(heads trained for it) or --retrain")
        heads_dir = out / "heads-trained" / "heads"
        # heads train on the dense weights (PyTorch's); they decode on whichever weights the bench runs
        job = TrainJob(profile="quick", **{**opts.model_fields(), "weights": "dense"}, out=str(out / "heads-trained"))
        _cached(cache, "train", job, [heads_dir])
    return heads_dir


def stage_workload(opts: BenchOptions, prof: BenchProfile, out: Path, fits: bool = True) -> dict:
    """questions.jsonl (the set, MT-Bench schema), calibration.jsonl (the replayed questions) and workload.json:
    replayed questions, folds, calibration. Each fold is fitted on the other folds' questions only: the mean of
    the folds' predictions then speaks for the replayed set as a whole, while no prediction reads the rollout of
    a question it is measured on (fitting on questions outside the replayed set would add their sampling
    difference from it, 5 % and more for 40 questions)."""
    from bench.replay.suites import load_suite, write_questions  # torch: spawned search workers import this module
    from bench.replay.workload import (  # torch: spawned search workers import this module
        check_disjoint,
        make_folds,
        sample_over_categories,
        spread_over_categories,
    )

    questions = load_suite(opts.questions, log=log)
    replayed = sample_over_categories(questions, prof.questions)
    folds = make_folds(replayed, prof.folds)
    qfile = write_questions(out / "questions.jsonl", questions)
    write_questions(out / "calibration.jsonl", replayed)
    if opts.calibration is not None:  # another prompt set: it must not hold what is replayed
        prompts = load_prompt_source(opts.calibration)
        prompts = builtin_split(prompts, "calibration") if opts.calibration in BUILTIN_NAMES else prompts
        check_disjoint([p.turns[0] for p in prompts], replayed, opts.allow_overlap)
    elif fits and len(replayed) - max(len(f) for f in folds) < 16:
        raise ValueError(f"{len(replayed)} replayed questions in {len(folds)} folds leave fewer than 16 to fit a fold "
                         "on; replay more questions or use more folds")
    workload = {"schema": WORKLOAD_SCHEMA, "questions": opts.questions, "questions_sha256": file_hash(qfile),
                "total": len(questions), "replayed": [q.question_id for q in replayed],
                "folds": [list(f) for f in folds],
                "peers": [q.question_id for q in spread_over_categories(replayed, prof.peers)],
                "calibration": opts.calibration or "the replayed questions, cross-fitted: each fold on the other folds",
                "allow_overlap": opts.allow_overlap, "max_new_tokens": prof.max_new_tokens, "turns": prof.turns}
    write_json_atomic(out / "workload.json", workload)
    return workload


def stage_calibrate(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache, heads: Path,
                    workload: dict) -> Path:
    """Greedy rollouts of every calibration prompt, as long as a replayed turn, with ranks, tokens and gate."""
    acc = out / "acceptance.json"
    job = CalibrateJob(heads=str(heads), **opts.model_fields(), data=opts.calibration or str(out / "calibration.jsonl"),
                       max_new_tokens=prof.max_new_tokens, heldout=0.0, out=str(acc),
                       typical_temperature=SEARCH_TEMPERATURE, plots=str(out / "plots"))
    _cached(cache, "calibrate", job, [acc])
    return acc


def workload_lengths(acc: Path, max_new_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(contexts, prefill lengths) that cover the workload: the calibration prompts' lengths, short to long,
    and the contexts their steps run at (the prompt plus up to a turn of new tokens)."""
    stats = load_stats(acc)
    lengths = sorted(len(t.prompt) for t in stats.texts + stats.heldout_texts)
    if not lengths:
        return (256,), (256,)
    lo, mid, hi = lengths[0], int(statistics.median(lengths)), lengths[-1]
    contexts = sorted({max(16, 16 * round(c / 16)) for c in (lo, mid + max_new_tokens // 2, hi + max_new_tokens)})
    prefill = sorted({lo, mid, hi})
    return tuple(contexts), tuple(prefill)


def stage_profile(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache, heads: Path, acc: Path
                  ) -> Path:
    """The latency profile the search prices with (``latency.json``). The report prices its predictions with
    the same grid profiled again during the replay (``stage_replay``): this VM's speed moves 10-20 % in
    minutes, and bandwidth-bound small steps move otherwise than compute-bound large trees."""
    lat = out / "latency.json"
    contexts, prefill = workload_lengths(acc, prof.max_new_tokens)
    job = ProfileJob(heads=str(heads), **opts.model_fields(), nodes=prof.latency_nodes, contexts=contexts,
                     prefill=prefill, repeats=prof.latency_repeats, batch_sizes=prof.batch_sizes,
                     max_new_tokens=prof.max_new_tokens, out=str(lat), plots=str(out / "plots"))
    _cached(cache, "profile", job, [lat])
    return lat


def _ids_digest(ids) -> str:
    """A short digest of a fold's question ids: a study is named by what it was fitted without, so that fold f
    of another fold count (other questions left out) is a study of its own, never a clash."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:8]


def _study(acc: Path, lat: Path) -> str:
    return f"bench-{file_hash(acc)}-{file_hash(lat)}"


SEARCH_LOOKUP = 8  # the longest prompt-lookup chain the bench's searches range over


def _search_fields(prof: BenchProfile, out: Path, acc: Path, lat: Path) -> dict:
    return {"acceptance": str(acc), "latency": str(lat), "budget": prof.search_budget, "trials": prof.search_trials,
            "storage": f"sqlite:///{out / 'treesearch.db'}", "quiet": True, "lookup": SEARCH_LOOKUP}


def stage_search(prof: BenchProfile, out: Path, cache: StageCache, acc: Path, lat: Path, workload: dict,
                 target: str = "own", engine_costs: str | None = None) -> tuple[list[Path], list[Path]]:
    """Per fold, fitted without the fold's questions: the configuration search for the target, and one without
    lookup chains (Medusa alone, what engines without prompt lookup serve); and the typical search (this
    runtime's). Returns both lists of per-fold files."""
    study = _study(acc, lat) + ("" if target == "own" else f"-{target}")
    files, heads_only, stages = [], [], []
    common = {**_search_fields(prof, out, acc, lat), "target": target, "engine_costs": engine_costs}
    for f, fold in enumerate(workload["folds"]):
        path = out / "search" / f"fold-{f}.json"
        files.append(path)
        job = SearchJob(**common, study=f"{study}-fold{f}-{_ids_digest(fold)}", exclude_ids=tuple(map(str, fold)),
                        out=str(path), plots=str(out / "plots") if f == 0 else None)
        stages.append((f"search-fold-{f}", job, [path]))
        path = out / "search" / f"fold-{f}-heads-only.json"
        heads_only.append(path)
        job = SearchJob(**{**common, "lookup": 0}, study=f"{study}-heads-only-fold{f}-{_ids_digest(fold)}",
                        exclude_ids=tuple(map(str, fold)), out=str(path))
        stages.append((f"search-heads-only-fold-{f}", job, [path]))
    # typical acceptance: thresholds and tree searched together against the regret proxy (Pareto plot)
    typical = out / "tree-typical.json"
    fold0 = workload["folds"][0]
    job = SearchJob(**{**common, "target": "own", "engine_costs": None}, accept="typical",
                    study=f"{study}-typical-{_ids_digest(fold0)}", exclude_ids=tuple(map(str, fold0)),
                    out=str(typical), plots=str(out / "plots"))
    stages.append(("search-typical", job, [typical]))
    _cached_many(cache, stages)  # the studies are independent: side by side, one core each
    return files, heads_only


def stage_final(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache, acc: Path, lat: Path,
                workload: dict, heads: Path) -> Path:
    """The configuration to deploy on the target (``tree.json``): its search fitted on every replayed question
    (the folds check the procedure; this is its result), with the heads it needs and its prediction with
    intervals (``treesearch.deploy``)."""
    from bench.stages.deploy import heads_reference  # torch: spawned search workers import this module

    search = out / "search" / f"final-{opts.target}.json"
    replayed = tuple(map(str, workload["replayed"]))
    job = SearchJob(**_search_fields(prof, out, acc, lat), target=opts.target, engine_costs=opts.engine_costs,
                    study=f"{_study(acc, lat)}-final-{opts.target}-{_ids_digest(replayed)}", out=str(search),
                    batch_sizes=prof.batch_sizes)
    _cached(cache, f"search-final-{opts.target}", job, [search])
    # the acceptance file holds the replayed questions' rollouts (or, with --calibration, another prompt set's)
    fitted = list(replayed) if opts.calibration is None else None
    path = write_final(search, load_stats(acc), load_profile(lat), heads_reference(heads), out / "tree.json", fitted)
    log(f"[bench] the configuration to deploy ({opts.target}): {path}")
    return path


def stage_engines(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache):
    """The engines made ready (``bench.engines.stage``: llama.cpp built and its GGUFs, vLLM's environment and
    the heads exported for it), and the heads vLLM runs calibrated on the replayed questions with vLLM's
    vocabulary (``engines/acceptance-vllm-medusa.json``): what the report predicts vLLM's acceptance from.
    Returns the plan (the peers' configurations) and the engine settings the replay starts them with."""
    from bench.engines.stage import ACCEPTANCE, NOTES, prepare  # torch: spawned search workers import this module

    settings = EngineSettings(vllm_python=opts.vllm_python)
    folder = out / "engines"
    plan = prepare(opts.engines, opts.model, opts.heads, settings, folder, log=log)
    for note in plan.notes:
        log(f"[engines] {note}")
    write_json_atomic(folder / NOTES, {"schema": "medusa-engine-notes/1", "left_out": plan.notes})  # the report says them
    acc = folder / ACCEPTANCE
    if plan.medusa_heads is not None:
        job = CalibrateJob(heads=str(plan.medusa_heads), **opts.model_fields(), data=str(out / "calibration.jsonl"),
                           max_new_tokens=prof.max_new_tokens, heldout=0.0, out=str(acc))
        _cached(cache, "calibrate-engine-heads", job, [acc])
    else:
        acc.unlink(missing_ok=True)
    return plan, asdict(settings)


def engine_configurations(opts: BenchOptions, plan) -> list[dict]:
    """The peers' configurations, and plain decoding of the original base where the main heads decode on an
    adapted one (the engines run the original weights: their outputs are compared with that base's)."""
    configs = list(plan.configurations)
    if opts.model == "default" and opts.heads == "default" and not opts.retrain \
            and not ({"medusa1", "unconditioned"} & set(opts.compare_heads)):
        configs.append({"name": "plain, original base", "method": "plain", "heads": "unconditioned"})
    return configs


PROFILE_EVERY = 2  # the replay takes a profile round before every 2nd question (~10 s each on the default model)


def stage_replay(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache, heads: Path, acc: Path,
                 lat: Path, searches: tuple[list[Path], list[Path]], workload: dict,
                 engines: tuple[list[dict], dict] = ([], {})) -> None:
    """Every configuration, interleaved question by question, and the latency profile again in rounds between
    the questions (``bench.replay.profile_rounds``: ``replay/latency-during.json``, what the report prices its
    predictions with). The configuration file names the searches' and the typical search's tree files and the
    compared heads: the stage's key holds their contents (``ReplayJob.reads``)."""
    picks, heads_only = searches
    configs = replay_configurations(acc, picks, workload, heads, opts.compare_heads, out / "tree-typical.json",
                                    heads_only) + engines[0]
    config = {"model": opts.model, "heads": str(heads), "dtype": opts.dtype, "device": opts.device, "max_new_tokens": prof.max_new_tokens,
              "turns": prof.turns, "repeats": 1, "configurations": configs, **({"engines": engines[1]} if engines[0] else {})}
    cfg_file = out / "replay_config.json"
    write_json_atomic(cfg_file, config)
    replay_dir = out / "replay"
    job = ReplayJob(config=str(cfg_file), heads=str(heads), **opts.model_fields(), questions=str(out / "questions.jsonl"),
                    ids=tuple(workload["replayed"]), max_new_tokens=prof.max_new_tokens, profile_like=str(lat),
                    profile_every=PROFILE_EVERY, out=str(replay_dir))
    _cached(cache, "replay", job, [replay_dir / "summary.csv"])


LOAD_CONFIGURATIONS = 2  # the fastest fixed Medusa configurations of the replay that the load stage serves


def fastest_fixed(out: Path, n: int = LOAD_CONFIGURATIONS) -> list[dict]:
    """The replay's ``n`` fastest greedy Medusa configurations that every question ran (not a fold's pick), by
    overall tokens/s."""
    import pandas as pd  # pandas: spawned search workers import this module

    if not (out / "replay" / "summary.csv").is_file():
        return []
    configs = json.loads((out / "replay_config.json").read_text())["configurations"]
    fixed = {c["name"]: c for c in configs if c.get("method") == "medusa" and not c.get("question_ids")
             and c.get("accept", "greedy") == "greedy" and not c.get("temperature")}
    table = pd.read_csv(out / "replay" / "summary.csv")
    overall = table[(table["category"] == "overall") & table["config"].isin(fixed)]
    return [fixed[name] for name in overall.sort_values("tokens_per_s", ascending=False)["config"].head(n)]


def stage_load(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache, heads: Path) -> None:
    """The bench under concurrency (``bench.stages.load``): plain decoding, the replay's fastest fixed Medusa
    configurations and tree.json's schedule through the runtime's server at the profile's batch sizes as
    concurrencies, and the engines' servers with --engines: ``load.json``."""
    if not prof.load_questions:
        return
    if opts.vllm_python:  # the load stage's vLLM server reads it where the replay's workers take the option
        os.environ["MEDUSA_VLLM_PYTHON"] = opts.vllm_python
    picks = fastest_fixed(out)
    if not picks:
        log("[load] no fixed greedy Medusa configuration in the replay's summary: no load stage")
        return
    cfg_file = out / "load_config.json"
    write_json_atomic(cfg_file, {"configurations": picks})
    final = out / "tree.json"
    scheduled = final.is_file() and "schedule" in json.loads(final.read_text())
    job = LoadJob(config=str(cfg_file), heads=str(heads), **opts.model_fields(), limit=prof.load_questions,
                  max_new_tokens=prof.max_new_tokens, engines=tuple(opts.engines),
                  concurrency=prof.batch_sizes, rounds=prof.load_rounds, schedule=str(final) if scheduled else None,
                  out=str(out / "load.json"))
    _cached(cache, "load", job, [out / "load.json"])


LOOKUPS_WITHOUT_HEADS = (2, 4, 6, 8)  # --heads none: the runtime's prompt-lookup chains replayed


def stage_replay_without_heads(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache,
                               workload: dict, engines: tuple[list[dict], dict] = ([], {})) -> None:
    """``--heads none``: what a base model without heads can run, measured: the runtime's plain decoding
    alone and with prompt-lookup chains of 2-8 tokens, transformers' generate and prompt lookup on the
    peers' questions, plain sampling there too; nothing to calibrate or search, so nothing predicted."""
    configs = [*baseline_configurations(workload["peers"]),
               *({"name": f"plain +lookup{n}", "method": "plain", "lookup_tokens": n} for n in LOOKUPS_WITHOUT_HEADS),
               *sampled_configurations(None, workload["peers"]), *engines[0]]
    config = {"model": opts.model, "heads": "none", "dtype": opts.dtype, "device": opts.device,
              "max_new_tokens": prof.max_new_tokens, "turns": prof.turns, "repeats": 1, "configurations": configs,
              **({"engines": engines[1]} if engines[0] else {})}
    cfg_file = out / "replay_config.json"
    write_json_atomic(cfg_file, config)
    job = ReplayJob(config=str(cfg_file), heads="none", **opts.model_fields(), questions=str(out / "questions.jsonl"),
                    ids=tuple(workload["replayed"]), max_new_tokens=prof.max_new_tokens, out=str(out / "replay"))
    _cached(cache, "replay", job, [out / "replay" / "summary.csv"])


def run(opts: BenchOptions) -> None:
    from bench.engines.stage import check  # torch: spawned search workers import this module
    from bench.report.build import report  # torch: spawned search workers import this module

    prof = PROFILES[opts.profile]
    if opts.folds is not None:
        prof = replace(prof, folds=opts.folds)
    if opts.max_new_tokens is not None:
        if opts.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
        prof = replace(prof, max_new_tokens=opts.max_new_tokens)
    if opts.engine_costs is not None:
        load_engine_costs(opts.engine_costs, TARGETS[opts.target])  # one line now, not after calibration
    if opts.guided_rating and not opts.judge:
        raise ValueError("--guided-rating needs --judge (it changes how the judge's ratings are read)")
    if opts.engines:  # before hours of stages: what the engines need and cannot get is said now, in one line
        check(opts.engines, EngineSettings(vllm_python=opts.vllm_python))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = StageCache(out)
    (out / "latency-after.json").unlink(missing_ok=True)  # what earlier versions priced with: not this run's
    t_start = time.perf_counter()
    if opts.heads == "none":  # a base model without heads: plain decoding and prompt lookup, measured
        if opts.retrain or opts.compare_heads:
            raise ValueError("--heads none runs without heads: it takes neither --retrain nor --compare-heads")
        for stale in ("acceptance.json", "latency.json", "tree.json"):  # a run with heads in this folder: not this one's
            (out / stale).unlink(missing_ok=True)
        workload = stage_workload(opts, prof, out, fits=False)
        peers = _engines(opts, prof, out, cache)
        stage_replay_without_heads(opts, prof, out, cache, workload, peers)
    else:
        heads = stage_heads(opts, out, cache)
        workload = stage_workload(opts, prof, out)
        peers = _engines(opts, prof, out, cache)  # built and smoke-tested before the hours of the other stages
        acc = stage_calibrate(opts, prof, out, cache, heads, workload)
        lat = stage_profile(opts, prof, out, cache, heads, acc)
        searches = stage_search(prof, out, cache, acc, lat, workload, opts.target, opts.engine_costs)
        stage_final(opts, prof, out, cache, acc, lat, workload, heads)
        stage_replay(opts, prof, out, cache, heads, acc, lat, searches, workload, peers)
        stage_load(opts, prof, out, cache, heads)
    stage_quality(opts, out, cache)

    written = report(out)
    print(f"\n[bench] finished in {(time.perf_counter() - t_start) / 60:.1f} min; plots and tables:")
    for p in written:
        print(f"  {p}")


def _engines(opts: BenchOptions, prof: BenchProfile, out: Path, cache: StageCache) -> tuple[list[dict], dict]:
    """(the peers' configurations, their settings) with --engines, else nothing; a run without engines removes
    an earlier run's engine calibration, so that its predictions are not reported beside these records."""
    from bench.engines.stage import ACCEPTANCE  # torch: spawned search workers import this module

    if not opts.engines:
        (out / "engines" / ACCEPTANCE).unlink(missing_ok=True)
        return [], {}
    plan, settings = stage_engines(opts, prof, out, cache)
    return engine_configurations(opts, plan), settings


def judge_fields(judge: str | None, guided: bool = False) -> dict:
    """The judge job's fields for ``--judge`` (None: no judge, the proxy only)."""
    if judge is None:
        return {"judge": defaults.JUDGE}
    return {"judge": defaults.judge_name(judge), "guided_rating": guided}


def stage_quality(opts: BenchOptions, out: Path, cache: StageCache) -> Path:
    """Every configuration's answers scored: log-likelihood per token under the base (``quality.json``) and,
    with ``--judge``, FastChat single grading (``judge/``; the judge's replies are cached, so a rerun or a
    killed run asks only what it has not asked yet)."""
    quality, records = out / "quality.json", out / "replay" / "records.jsonl"
    products = [quality] + ([out / "judge" / "judge_scores.json"] if opts.judge else [])
    if not opts.judge:  # scores of an earlier run's answers must not be reported beside these (the cache stays)
        for stale in ("judge_scores.json", "model_judgment", "model_answer"):
            path = out / "judge" / stale
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    job = JudgeJob(records=str(records), questions=str(out / "questions.jsonl"), **opts.model_fields(),
                   **judge_fields(opts.judge, opts.guided_rating), out=str(out))
    _cached(cache, "quality", job, products)
    return quality


def _resolved_device_dtype(device: str, dtype: str, weights: str = "dense") -> dict[str, str]:
    """The device and dtype by name, 'auto' resolved here once (stage keys and every stage see the same); Q4_1
    weights run in bfloat16."""
    from medusa_runtime.model import (  # torch: spawned search workers import this module
        q4_1_dtype,
        resolve_device,
        resolve_dtype,
    )

    dev = resolve_device(None if device == "auto" else device)
    resolved = q4_1_dtype(dtype, dev) if weights == "q4_1" else resolve_dtype(dtype, dev)
    return {"device": str(dev), "dtype": str(resolved).removeprefix("torch.")}


def _compare_heads(specs: list[str], args) -> tuple[str, ...]:
    """--compare-heads resolved: 'auto' replays the other shipped sets beside the shipped default (on the
    default model, heads not retrained): the Medusa-1 heads where the default is Medusa-2, and the
    unconditioned heads that serving engines load; 'none' nothing."""
    from medusa_runtime.heads.adapter import adapter_info  # torch: spawned search workers import this module
    from medusa_runtime.heads.medusa import shipped_heads_dir  # torch: spawned search workers import this module

    if specs in (["none"], []):
        return ()
    if specs != ["auto"]:
        if "auto" in specs or "none" in specs:
            raise ValueError("--compare-heads: 'auto' and 'none' stand alone")
        return tuple(dict.fromkeys(specs))

    if not (args.model == "default" and args.heads == "default" and not args.retrain):
        return ()
    default = shipped_heads_dir("default")
    out = []
    medusa1 = shipped_heads_dir("medusa1")
    if default is not None and medusa1 is not None and medusa1 != default and adapter_info(default):
        out.append("medusa1")
    if shipped_heads_dir("unconditioned") is not None:
        out.append("unconditioned")
    return tuple(out)


def _target_heads(target: str, heads: str, retrain: bool) -> str:
    """The heads a target decodes with: an engine runs no root- or path-conditioned heads, so the shipped default
    (path-conditioned) gives way to the shipped unconditioned set; heads it cannot run are refused now."""
    from medusa_runtime.heads.medusa import heads_folder  # torch: spawned search workers import this module

    if target == "own":
        return heads
    if heads == "none":
        raise ValueError(f"--target {target} picks a configuration with heads: --heads none searches nothing")
    if retrain:
        raise ValueError(f"--target {target}: --retrain trains path-conditioned heads, which {TARGETS[target].engine} "
                         "does not run; train unconditioned ones (medusa-bench train --condition none) and pass --heads")
    heads = "unconditioned" if heads == "default" else heads
    folder = heads_folder(heads)
    if folder is not None and (folder / "config.json").is_file():
        conditioning = heads_conditioning(json.loads((folder / "config.json").read_text()))
        if conditioning != "none":
            raise ValueError(f"--target {target}: {TARGETS[target].engine} does not run {conditioning}-conditioned "
                             f"heads ({heads}); pass unconditioned ones")
    return heads


def _write_command(out: Path, argv: list[str], opts: BenchOptions) -> None:
    """command.json: how this run was started (the report shows it), beside the options it resolved to."""
    write_json_atomic(out / "command.json", {"command": "python -m bench.pipeline " + shlex.join(argv),
                                             "options": asdict(opts)})


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The main job's flags; the concepts it shares with ``medusa-bench`` come from bench.commands.flags."""
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    parser.add_argument("--questions", default="mt-bench",
                        help="question set replayed and (cross-fitted) calibrated on: mt-bench, humaneval, or a JSONL "
                             "with question_id, category, turns")
    parser.add_argument("--calibration", default=None,
                        help="calibrate on this prompt source instead (builtin, a file): it must not hold replayed "
                             "questions")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="accept a --calibration set that holds replayed questions")
    parser.add_argument("--retrain", action="store_true", help="train heads (quick profile) instead of the shipped ones")
    parser.add_argument("--out", default="results/bench")
    parser.add_argument("--folds", type=int, default=None,
                        help="cross-fitting folds over the replayed questions (default: the profile's)")
    flags.add_model(parser)
    flags.add_gguf(parser)
    flags.add_heads(parser, "none: plain decoding and prompt lookup only, measured, nothing predicted; --retrain "
                            "trains heads for --model instead")
    parser.add_argument("--compare-heads", nargs="+", default=["auto"], metavar="HEADS",
                        help="head sets whose chains are replayed beside the main heads' (folders, medusa1, "
                             "unconditioned; none; auto: the other shipped sets, on the default model)")
    flags.add_device(parser)
    flags.add_new_tokens(parser, "the --profile's: " + ", ".join(f"{k} {p.max_new_tokens}" for k, p in PROFILES.items())
                         + "; per replayed turn and calibration rollout")
    flags.add_judge(parser)
    flags.add_dtype(parser)
    flags.add_weights(parser)
    parser.add_argument("--engines", default=None, metavar="LIST",
                        help="serving engines replayed beside the runtime, comma-separated: vllm, llama.cpp (nox -s "
                             "engines installs them; llama.cpp is built into the cache on first use)")
    parser.add_argument("--target", default="own", choices=list(TARGETS),
                        help="where the final configuration (OUT/tree.json) is deployed: own (this runtime), vllm, "
                             "trtllm, tgi; the searches range over what it runs, and an engine target decodes with "
                             "the shipped unconditioned heads unless --heads names others it runs")
    parser.add_argument("--engine-costs", default=None, metavar="REPORT",
                        help="with --target vllm: price the searches with vLLM's own step costs, measured by an "
                             "earlier engines run (its report.json), instead of this runtime's")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="with --engines vllm: the Python of vLLM's environment (default: $MEDUSA_VLLM_PYTHON)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from medusa_runtime.heads.medusa import auto_heads  # torch: spawned search workers import this module

    args = build_parser().parse_args(argv)
    try:
        # auto: the shipped heads on the default model, else none; with --retrain, the trained ones
        args.heads = "default" if args.retrain and args.heads == "auto" else auto_heads(args.heads, args.model)
        args.heads = _target_heads(args.target, args.heads, args.retrain)
        opts = BenchOptions(args.profile, args.questions, args.calibration, args.allow_overlap, args.retrain, args.out,
                            args.folds, **_resolved_device_dtype(args.device, args.dtype, args.weights),
                            weights=args.weights, model=args.model, heads=args.heads,
                            compare_heads=_compare_heads(args.compare_heads, args), judge=None if args.judge == defaults.JUDGE else args.judge,
                            guided_rating=args.guided_rating, max_new_tokens=args.max_new_tokens,
                            engines=parse_engines(args.engines), vllm_python=args.vllm_python,
                            target=args.target, engine_costs=args.engine_costs)
        print(f"[bench] {opts.model} on {opts.device} in {opts.dtype}"
              f"{', Q4_1 weights' if opts.weights == 'q4_1' else ''}, heads {opts.heads}"
              f"{' (retrained)' if opts.retrain else ''}; profile {args.profile}: {asdict(PROFILES[args.profile])}"
              + (f", {opts.folds} folds" if opts.folds else ""),
              flush=True)
        defaults.adopt_gguf(args.gguf, opts.model, log=lambda m: print(f"[bench] {m}", flush=True))
        _write_command(Path(opts.out), argv if argv is not None else sys.argv[1:], opts)
        run(opts)
    except (ValueError, OSError, RuntimeError) as exc:  # bad input, missing files, a model or engine that fails
        print(f"[bench] error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
