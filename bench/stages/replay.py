"""What the commands that replay questions run (their parsers: bench.commands.replay): speed and replay (a matrix of
configurations, locally or shared among workers through a storage), judge (answer quality); and their helpers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import pandas as pd

from bench.engines import EngineSettings
from bench.engines.peers import PeerPool
from bench.judge.answers import answer_quality, backend_for, run_judge, write_quality
from bench.replay.analyze import records_frame, summary, to_markdown, write_tables
from bench.replay.distributed import QueueConfig, ReplayQueue, machine_dir
from bench.replay.mtbench import load_questions
from bench.replay.profile_rounds import RoundsDuringReplay
from bench.replay.runner import (
    PEER_METHODS,
    REPLAY_ORDER,
    SEQUENTIAL_ORDER,
    MethodConfig,
    ReplayConfig,
    load_records,
    replay,
)
from bench.replay.suites import load_suite
from bench.replay.workload import spread_over_categories
from bench.stages import defaults
from bench.stages.cache import RUNTIME_REVISION, StageCache, file_hash, folder_hash, isolate_records
from bench.stages.common import adapted, log, model_and_heads, show, weights_of
from bench.stages.jobs import JudgeJob, ReplayJob, SpeedJob, read_replay_config
from medusa_runtime.engines.lean import c_forward_status
from medusa_runtime.heads.medusa import auto_heads, heads_folder, resolve_heads
from medusa_runtime.measure.bandwidth import floor_line, floor_pairs
from medusa_runtime.measure.profile import ProfileConfig, Profiler
from medusa_runtime.model import load_model
from treesearch.cost import load_profile
from treesearch.fsutil import atomic_file
from treesearch.search import worker_id
from treesearch.tree import write_json_atomic


def _configs_from_trees(trees: list[str], prompt_lookup: bool = True, hf_engine: bool = False,
                        lookup: int = 0, gates: Sequence[float] = (), torch_path: bool = False):
    configs = [MethodConfig("generate", "generate"), MethodConfig("plain", "plain")]
    if hf_engine:  # the runtime's loop on transformers' forward: what the lean engine saves
        configs.append(MethodConfig("plain hf-engine", "plain", engine="hf"))
    if torch_path:  # the lean engine without its C forward: what the C forward saves
        configs.append(MethodConfig("plain lean-torch", "plain", engine="lean-torch"))
    if prompt_lookup:
        configs.append(MethodConfig("prompt-lookup", "prompt_lookup"))
    configs += [MethodConfig(f"medusa {t}", "medusa", tree=t) for t in trees]
    if lookup:  # the runtime's own lookup chain, alone and beside each tree
        configs.append(MethodConfig(f"plain +lookup{lookup}", "plain", lookup_tokens=lookup))
        configs += [MethodConfig(f"medusa {t} +lookup{lookup}", "medusa", tree=t, lookup_tokens=lookup) for t in trees]
    for g in gates:  # confidence-gated trees (levels tried only when the heads are sure enough)
        suffix = f" +lookup{lookup}" if lookup else ""
        configs += [MethodConfig(f"medusa {t}{suffix} gate{g:g}", "medusa", tree=t, lookup_tokens=lookup, gate=g)
                    for t in trees]
    return configs


def replay_inputs(args, configs) -> dict:
    """What records of a replay depend on besides their configuration's fields (which each record's hash
    carries): the runtime revision, model, heads' and tree files' contents, questions, lengths."""
    def heads_key(spec):
        folder = heads_folder(spec)
        return folder_hash(folder) if folder is not None and folder.is_dir() else spec

    return {"runtime": RUNTIME_REVISION, "model": args.model, "dtype": args.dtype, "device": args.device,
            "weights": weights_of(args), "heads": heads_key(args.heads),
            "config_heads": {c.heads: heads_key(c.heads) for c in configs if c.heads is not None},
            "questions": file_hash(Path(args.questions)) if args.questions and Path(args.questions).is_file()
            else args.questions or "mt-bench",
            "max_new_tokens": args.max_new_tokens,
            "order": SEQUENTIAL_ORDER if getattr(args, "sequential", False) else REPLAY_ORDER,
            "trees": {c.tree: file_hash(Path(c.tree)) for c in configs if c.tree and Path(c.tree).is_file()},
            # records timed with profile rounds between them are not resumed without, nor the other way round
            **({"profile_like": file_hash(Path(args.profile_like)), "profile_every": args.profile_every}
               if getattr(args, "profile_like", None) else {})}


def _peer_pool(configs, settings: dict | None, loaded, dtype: str, out_dir: Path):
    """The warm engines of the matrix's engine configurations (``bench.engines``), or a null context."""
    peers = [c for c in configs if c.method in PEER_METHODS]
    if not peers:
        return nullcontext(None)
    opts = EngineSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in (settings or {}).items()})
    base_name = loaded.name.split("+adapter:")[0]  # the engines run the original weights
    return PeerPool(peers, opts, loaded.eos_token_ids, base_name, dtype, out_dir / "engine-logs", log=log)


def _run_replay(args: ReplayJob | SpeedJob, configs, turns: int, engines: dict | None = None):
    args = dataclasses.replace(args, max_new_tokens=defaults.new_tokens(args.max_new_tokens))
    questions = select_questions(args)
    loaded, heads = model_and_heads(args)
    # 'auto' resolved: the records' key names the real dtype
    args = dataclasses.replace(args, dtype=str(loaded.dtype).removeprefix("torch."))
    if heads is None and any(c.method == "medusa" and c.heads is None for c in configs):
        raise ValueError("Medusa configurations need --heads")
    variants = {}  # heads that configurations name beside the replay's own: each with the base it decodes with
    for spec in dict.fromkeys(c.heads for c in configs if c.heads is not None):
        base = adapted(load_model(args.model, args.dtype, args.device, log=log, weights=weights_of(args)), spec)
        variants[spec] = (base, resolve_heads(spec, base.hidden_size, base.vocab_size, base_model=args.model))
    cfg = ReplayConfig(max_new_tokens=args.max_new_tokens, turns=turns, repeats=args.repeats,
                       lockstep=not args.sequential)
    out_dir = Path(args.out)
    if getattr(args, "storage", None):  # the matrix shared among workers (bench.replay.distributed)
        if any(c.method in PEER_METHODS for c in configs):
            raise ValueError("engines (vllm, llama.cpp) are replayed by one machine: they do not combine with --storage")
        records = _replay_shared(args, configs, questions, cfg, loaded, heads, variants)
        machines = sorted({r["machine"] for r in records})
        if len(machines) > 1:  # never one ratio over two machines' timings: a summary per machine
            return loaded, None, *_per_machine_summaries(records, machines, out_dir)
    else:
        isolate_records(out_dir, StageCache.key_of(replay_inputs(args, configs)))  # never resume another runtime's
        during = _profile_during(args, loaded, heads, out_dir)
        with _peer_pool(configs, engines, loaded, args.dtype, out_dir) as peers:
            if peers is not None:  # the engines' start-up, measured apart from their answers
                write_json_atomic(out_dir / "engines.json", {"schema": "medusa-engines/1", "startup_s": peers.startup,
                                                             "versions": peers.versions, "settings": engines or {}})
            records = replay(loaded, heads, configs, questions, cfg, out_dir / "records.jsonl",
                             extra={"heads": args.heads}, variants=variants, between=during, peers=peers)
        if during is not None:
            during.write_profile(out_dir / "latency-during.json")
    df = records_frame([r for r in records if r["config"] in {c.name for c in configs}])
    paths = write_tables(df, ["generate", "plain"], out_dir)
    table = summary(df, ["generate", "plain"])
    overall = table[table["category"] == "overall"][["config", "tokens", "tokens_per_s", "tau",
                                                       "speedup_vs_generate", "speedup_vs_plain"]]
    per_cat = table.pivot(index="category", columns="config", values="speedup_vs_generate")
    files = [str(out_dir / "records.jsonl"), str(paths["summary_csv"]), str(paths["summary_md"])]
    text = (to_markdown(overall) + "\n\nspeedup vs transformers generate, per category:\n\n"
            + to_markdown(per_cat.reset_index()) + f"\n\nwritten: {', '.join(files)}")
    obj = {"overall": overall.to_dict("records"), "by_category": table.to_dict("records"), "files": files}
    return loaded, df, text, obj


def _replay_shared(args, configs, questions, cfg, loaded, heads, variants) -> list[dict]:
    """This worker's share of a matrix queued in ``--storage`` (one question a unit), then, once every unit is
    done, the merged records written to ``--out``/records.jsonl (every worker writes the same file)."""
    if getattr(args, "profile_like", None):
        raise ValueError("--profile-like prices one machine's replay: it does not combine with --storage")
    matrix = {**replay_inputs(args, configs), "configs": [c.digest for c in configs], "repeats": args.repeats,
              "turns": cfg.turns, "question_ids": [q.question_id for q in questions]}
    qcfg = QueueConfig(args.storage, args.study, args.machine or socket.gethostname(), worker_id(),
                       args.heartbeat, args.grace_period)
    queue = ReplayQueue(qcfg, [q.question_id for q in questions], StageCache.key_of(matrix))
    by_id, out_dir = {q.question_id: q for q in questions}, Path(args.out)

    def run_unit(qid: int) -> list[dict]:
        scratch = out_dir / "units" / f"{os.getpid()}-{qid}.jsonl"  # this unit only: a retry starts afresh
        scratch.unlink(missing_ok=True)
        records = replay(loaded, heads, configs, [by_id[qid]], cfg, scratch, progress=False,
                         extra={"heads": args.heads}, variants=variants)
        scratch.unlink()
        return records

    mine = queue.work(run_unit, progress=args.progress)
    log(f"this worker ({qcfg.worker} on {qcfg.machine}) replayed {mine} of {queue.units} units")
    records = queue.merged_records()
    with atomic_file(out_dir / "records.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _per_machine_summaries(records: list[dict], machines: list[str], out_dir: Path) -> tuple[str, dict]:
    """The summary tables of each machine's records on their own (``machines/<name>/``)."""
    texts, obj = [], {"machines": {}, "files": [str(out_dir / "records.jsonl")]}
    for m in machines:
        df = records_frame([r for r in records if r["machine"] == m])
        paths = write_tables(df, ["generate", "plain"], machine_dir(out_dir, m))
        table = summary(df, ["generate", "plain"])
        overall = table[table["category"] == "overall"][["config", "tokens", "tokens_per_s", "tau",
                                                           "speedup_vs_plain"]]
        texts.append(f"machine {m}:\n\n" + to_markdown(overall))
        obj["machines"][m] = overall.to_dict("records")
        obj["files"] += [str(paths["summary_csv"]), str(paths["summary_md"])]
    return "\n\n".join(texts) + f"\n\nwritten: {', '.join(obj['files'])}", obj


def _profile_during(args, loaded, heads, out_dir: Path):
    """``--profile-like LATENCY``: that profile's grid, profiled again in rounds during the replay
    (``bench.replay.profile_rounds``), one round every ``--profile-every`` questions."""
    if not getattr(args, "profile_like", None):
        return None

    if heads is None:
        raise ValueError("--profile-like profiles the heads' trees: it needs --heads")
    like = load_profile(args.profile_like, expect_model=loaded.name)
    cfg = ProfileConfig(nodes=like.nodes, contexts=like.contexts, prefill=like.prefill_tokens or (), warmup=1)
    return RoundsDuringReplay(out_dir / "profile_rounds.jsonl", Profiler(loaded, heads, cfg), args.profile_every)


def select_questions(args: ReplayJob | SpeedJob):
    """The questions a replay runs: the set (--questions), then --categories, --ids (in their order), --limit."""
    questions = load_suite(args.questions, log=log)
    if args.categories:
        unknown = set(args.categories) - {q.category for q in questions}
        if unknown:
            raise ValueError(f"no questions in categories {sorted(unknown)}")
        questions = [q for q in questions if q.category in args.categories]
    if args.ids:
        by_id = {q.question_id: q for q in questions}
        missing = [i for i in args.ids if i not in by_id]
        if missing:
            raise ValueError(f"question ids not in the set: {', '.join(map(str, missing[:5]))}")
        questions = [by_id[i] for i in args.ids]
    return spread_over_categories(questions, args.limit) if args.limit else questions


def step_breakdown(df):
    """Per runtime configuration: ms per step in heads (and drafting), verify and bookkeeping, and the whole
    step, from the records' own split; prefill ms per generate."""
    rt = df[df["method"].isin(["plain", "medusa"])]
    if "time_verify" not in rt:
        return rt.head(0)
    g = rt.groupby("config", sort=False)
    steps = g["steps"].sum()
    out = (g[["time_heads", "time_verify", "time_bookkeeping"]].sum().div(steps, axis=0) * 1000).rename(
        columns={"time_heads": "heads", "time_verify": "verify", "time_bookkeeping": "bookkeeping"})
    out["step"] = out.sum(axis=1)
    out["prefill"] = g["prefill_time"].mean() * 1000
    return out.reset_index()


def cmd_speed(args: argparse.Namespace) -> int:
    return show(args, speed_stage, SpeedJob.from_namespace(args, progress=not args.json))


def speed_stage(args: SpeedJob) -> tuple[dict, str]:
    """generate, plain, prompt lookup and the job's trees timed on its questions, with the step's breakdown
    and the bandwidth floor."""
    configs = _configs_from_trees(args.tree, hf_engine=args.hf_engine, lookup=args.lookup, gates=args.gate,
                                  torch_path=args.torch_path)
    if args.only:
        unknown = set(args.only) - {c.name for c in configs}
        if unknown:
            raise ValueError(f"--only names no configuration: {', '.join(sorted(unknown))}; "
                             f"have {', '.join(c.name for c in configs)}")
        configs = [c for c in configs if c.name in (*args.only, "generate", "plain")]
    loaded, df, text, obj = _run_replay(args, configs, turns=1)
    breakdown = step_breakdown(df)
    floor = floor_pairs(loaded)
    plain = df[df["config"] == "plain"]
    # a decode step: the plain runs' time after the prompt forward, per forward
    prefill = plain["prefill_time"].fillna(0) if "prefill_time" in plain else 0.0  # older records lack it
    step_ms = 1000 * (plain["wall_time"] - prefill).sum() / max(1, plain["steps"].sum())
    status = c_forward_status(loaded)
    text += (f"\n\nthe runtime's decode steps on the C forward: {status}"
             "\n\nwhere a step's time goes (ms per step; prefill ms per generate):\n\n" + to_markdown(breakdown)
             + f"\n\nbandwidth floor (a plain generate alone between two copy probes, context {floor['context']}): "
             f"{floor_line(floor)}; the replay's plain decode step {step_ms:.1f} ms")
    obj.update(c_forward=status, step_breakdown=breakdown.to_dict("records"), bandwidth_floor_ms=floor["floor_ms"],
               bandwidth_gbs=floor["bandwidth_gbs"], plain_step_ms=step_ms, bandwidth_floor=floor)
    return obj, text


def cmd_replay(args: argparse.Namespace) -> int:
    return show(args, replay_stage, ReplayJob.from_namespace(args, progress=not args.json))


# the flags a configuration file may set, where the command line left them at their defaults
FILE_FLAGS = ("model", "heads", "dtype", "max_new_tokens", "repeats")


def replay_stage(job: ReplayJob) -> tuple[dict, str]:
    """The replay stage: the configuration file's matrix on the job's questions (resumable records)."""
    spec = read_replay_config(job.config)
    unset = {**ReplayJob.defaults(), "heads": auto_heads(defaults.HEADS, job.model)}
    job = dataclasses.replace(job, **{k: spec[k] for k in FILE_FLAGS
                                      if k in spec and getattr(job, k) in (None, unset.get(k))})
    configs = [MethodConfig(**c) for c in spec.get("configurations", [])]
    if not configs:
        raise ValueError(f"{job.config} lists no configurations")
    _, _, text, obj = _run_replay(job, configs, turns=int(spec.get("turns", 2)), engines=spec.get("engines"))
    return obj, text


def cmd_judge(args: argparse.Namespace) -> int:
    return show(args, judge_stage, JudgeJob.from_namespace(args, progress=not args.json))


def judge_stage(args: JudgeJob) -> tuple[dict, str]:
    """Quality of replayed answers: the log-likelihood proxy always (quality.json), FastChat single grading by
    a judge when one is named (judge/: FastChat's files and judge_scores.json; see bench.judge.answers)."""
    every = load_records(Path(args.records))
    records = [r for r in every if r.get("repeat", 0) == 0]  # the judge grades one answer per question and turn
    if not records:
        raise ValueError(f"no records in {args.records}")
    out = Path(args.out or Path(args.records).parent)
    questions = load_questions(args.questions, log=log)
    missing = {r["question_id"] for r in records} - {q.question_id for q in questions}
    if missing:
        raise ValueError(f"the records answer questions that {args.questions or 'MT-Bench'} lacks: {sorted(missing)[:5]}")
    spec = None if args.judge in ("none", "") else defaults.judge_name(args.judge)
    backend = backend_for(spec, args.dtype, args.device) if spec else None  # a bad judge fails before the long part
    loaded = load_model(args.model, args.dtype, args.device, log=log, weights=weights_of(args))  # the base the answers are scored under
    frame = answer_quality(loaded, every, questions, progress=args.progress)  # every sample
    quality = json.loads(write_quality(out, frame, loaded.name).read_text())
    lines = [f"{cfg}: {q['log_likelihood_per_token']:.4f} nats/token, regret {q['regret_per_token']:.4f}, over "
             f"{q['tokens']} tokens" for cfg, q in quality["configs"].items()]
    lines += [f"{c['config']} vs {c['reference']}: mean difference {c['mean_difference']:+.4f} nats/token, p = "
              f"{c['p_value']:.3f} ({c['questions']} questions; detects {c['detectable_at_80_power']:.3f} with 80 % power)"
              for c in quality["distribution_checks"] if c["p_value"] is not None]
    text = "answer quality under the base model (proxies, not a judge):\n" + "\n".join(lines)
    obj = {"quality": quality["configs"], "distribution_checks": quality["distribution_checks"]}
    if backend is None:
        return obj, text + "\n\nno judge selected (--judge MODEL or --judge local:MODEL grades with an LLM judge)"
    scores = json.loads(run_judge(out, records, questions, backend, progress=args.progress,
                                  guided=args.guided_rating).read_text())
    table = pd_frame_of_scores(scores)
    obj.update(judge=scores["judge"], scores=scores["configs"])
    how = "ratings without [[x]] asked again, constrained to 1-10" if args.guided_rating else \
        "unparsable ratings left out as FastChat does"
    return obj, text + f"\n\njudge {scores['judge']} (FastChat single grading, 1-10; {how}):\n" + to_markdown(table)


def pd_frame_of_scores(scores: dict):
    """judge_scores.json's configurations as one table: score overall, per turn, judgments, unparsable."""
    rows = [{"config": cfg, "score": s["score"], **{f"turn {t}": v for t, v in s["by_turn"].items()},
             "judgments": s["judgments"], "unparsable": s["unparsable"], "guided": s.get("guided", 0)}
            for cfg, s in scores["configs"].items()]
    return pd.DataFrame(rows)
