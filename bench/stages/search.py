"""What ``medusa-bench search`` and the pipeline's search stage run: the Optuna study over configurations (or trees)
-> tree JSON. Pure Python on treesearch: the pipeline runs several searches side by side in spawned processes, and
neither this module nor what it imports loads torch (tests/test_layout.py checks it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.stages.common import show
from bench.stages.jobs import SearchJob
from treesearch.cost import load_profile
from treesearch.schedule import SCHEDULE_GATES, candidates, schedule_json, search_schedule
from treesearch.search import SearchConfig, run_search, write_search
from treesearch.stats import load_stats, select
from treesearch.targets import TARGETS


def cmd_search(args: argparse.Namespace) -> int:
    return show(args, search_stage, SearchJob.from_namespace(args))


def search_stage(job: SearchJob) -> tuple[dict, str]:
    """The search stage: an Optuna study over the configurations (or trees) -> tree JSON (and its plots)."""
    stats = load_stats(job.acceptance)
    if job.exclude_ids:  # cross-fitting: fit on every rollout but these questions'
        stats = select(stats, drop_ids=job.exclude_ids)
    latency = load_profile(job.latency, expect_model=stats.meta.get("model")) if job.latency else None
    joint = {"auto": None, "joint": True, "independent": False}[job.estimator]
    cfg = SearchConfig(budget=job.budget, trials=job.trials, objective=job.objective, storage=job.storage,
                       study_name=job.study, seed=job.seed, joint=joint, min_budget=job.min_budget,
                       heartbeat=job.heartbeat, grace=job.grace_period,
                       context=job.context, baseline=job.baseline, accept=job.accept,
                       max_regret=job.max_regret, configurations=not job.trees_only, max_lookup=job.lookup,
                       target=job.target, engine_costs=job.engine_costs)
    if job.batch_sizes and latency is None:
        raise ValueError("--batch-sizes prices batched steps: give --latency (a profile with --batch-sizes)")
    result = run_search(stats, cfg, latency, show_progress=not job.quiet)
    schedule = schedule_of(result, stats, latency, job) if job.batch_sizes else None
    path = write_search(result, stats, cfg, job.out, str(job.acceptance), str(job.latency) if job.latency else None,
                        schedule)
    lines = [format_search_table(result)]
    if result.space == "configurations":
        best = result.best
        verdict = "use no heads" if not best.uses_heads else "use the heads"
        lines.append(f"\nrecommended: {best.label} ({verdict}; predicted tau {best.tau:.3f}, {best.speedup:.3f}x "
                     "plain decoding)")
    if schedule is not None:
        lines.append("\nschedule (batch sizes: configuration, predicted output tokens/s, speed-up over plain):")
        lines += [f"  {e['batch'][0]}-{e['batch'][1]}: {e['configuration']['config']}, "
                  f"{e['prediction']['output_tokens_per_s']:.1f} tok/s, {e['prediction']['speedup_vs_plain']:.3f}x"
                  for e in schedule]
    lines.append(f"\nwritten: {path}")
    plots = []
    if job.plots:
        from bench.report.plots import plot_search  # matplotlib: only when plots are asked for

        plots = [str(p) for p in plot_search(result, stats, latency, job.plots)]
        lines += [f"plot: {p}" for p in plots]
    return {"tree_file": str(path), **json.loads(Path(path).read_text()), "plots": plots}, "\n".join(lines)


def schedule_of(result, stats, latency, job: SearchJob) -> list[dict]:
    """tree.json's schedule: per batch size the fastest of what the target runs (``treesearch.schedule``), the
    file's own tree among the candidates."""
    options = candidates(TARGETS[job.target], stats.num_heads, result.tree_score.tree,
                         result.best.decoding if job.target == "own" else None,
                         SCHEDULE_GATES if stats.has_gate else ())
    return schedule_json(search_schedule(stats, latency, job.batch_sizes, options))


def format_search_table(result) -> str:
    rows = [("search best", result.best)]
    if result.best_with_heads is not None and result.best_with_heads is not result.best:
        rows.append(("best with heads", result.best_with_heads))
    rows.append(("exact optimum (full budget)", result.optimum))
    if result.baseline is not None:
        rows.append((f"baseline {result.baseline.tree.name}", result.baseline))
    typical = result.best.typical is not None
    lines = ["| configuration | tree | nodes | depth | lookup | gate | tau | speedup |"
             + (" eps | delta | regret |" if typical else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if typical else "")]
    if typical:
        rows += [(f"Pareto {i}", s) for i, s in enumerate(result.pareto)]
    for label, s in rows:
        sp = f"{s.speedup:.3f}x" if s.speedup is not None else "-"
        extra = ""
        if s.typical is not None:
            extra = f" {s.typical.posterior_threshold:.4f} | {s.typical.posterior_alpha:.4f} | {s.regret:.4f} |"
        tree = "no heads" if s.tree is None else f"{s.num_nodes - 1} nodes"
        depth = s.tree.depth if s.tree is not None else 0
        lines.append(f"| {label} | {tree} | {s.num_nodes - 1} | {depth} | {s.lookup} | {s.gate:g} | {s.tau:.4f} | "
                     f"{sp} |{extra}")
    lines.append(f"\nobjective: {result.objective} over {result.space}; study {result.study_name!r}: "
                 f"{result.trials_complete} complete trials ({result.storage})")
    return "\n".join(lines)
