"""What the commands that measure the runtime on a model run: model, generate, calibrate, validate, draft-vocab,
profile (their parsers: bench.commands.measure)."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from bench.engines import EngineError
from bench.load.serving import measure_serving
from bench.stages import defaults
from bench.stages.common import adapted, base_name, builtin_split, emit, log, model_and_heads, show, weights_of
from bench.stages.jobs import CalibrateJob, ProfileJob
from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.engines.lean import c_forward_status
from medusa_runtime.heads.medusa import DRAFT_VOCAB_FILE, frequent_draft_vocab, heads_folder, resolve_heads
from medusa_runtime.measure.bandwidth import floor_line
from medusa_runtime.measure.calibrate import CalibrationConfig, calibrate
from medusa_runtime.measure.profile import ProfileConfig, profile_latency
from medusa_runtime.model import chat_template_ids, describe_model, load_model
from medusa_runtime.prompts import builtin_prompts, load_prompt_source
from medusa_runtime.training.distill import reply_token_counts
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.cost import LatencyProfile, profile_to_json, save_profile
from treesearch.fsutil import atomic_dir
from treesearch.optimal import model_for, optimal_tree
from treesearch.stats import load_stats, save_stats, step_walk_interval, tau_independent, tau_step_walk
from treesearch.tree import chain, load_tree
from treesearch.typical import TypicalParams, typical_walk


def cmd_model(args: argparse.Namespace) -> int:
    defaults.adopt_gguf(args.gguf, args.model, log=log)
    loaded = load_model(args.model, args.dtype, args.device, log=log, weights=weights_of(args))
    base = loaded.name
    loaded = adapted(loaded, args.heads)  # the base as those heads decode with it (Medusa-2: their adapter merged)
    info = describe_model(loaded)
    info["c_forward"] = c_forward_status(loaded)
    if args.heads not in (None, "none"):
        info["heads"] = args.heads
        info["base_adapter"] = "merged (Medusa-2 heads)" if loaded.name != base else "none (the base as it is)"
    if args.json:
        print(json.dumps(info))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    accept_cfg = AcceptConfig(rule=args.accept, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              posterior_threshold=args.posterior_threshold, posterior_alpha=args.posterior_alpha)
    config = DecodeConfig(max_new_tokens=defaults.new_tokens(args.max_new_tokens), topk=args.candidates, seed=args.seed,
                          engine=args.engine, lookup=LookupConfig(args.lookup))
    tree = load_tree(args.tree) if args.heads not in (None, "none") else None  # validate before loading a model
    loaded, heads = model_and_heads(args)
    decoder = MedusaDecoder(loaded, heads, tree, accept_cfg, config)
    prompt_ids = encode_prompt(loaded, args.prompt, args.chat)
    result = decoder.generate(prompt_ids)
    text = loaded.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "steps": stats.steps,
                          "accept_lengths": stats.accept_lengths, "tau": stats.tau,
                          "tree": decoder.tree.name if decoder.tree else None, "stats": stats.to_dict()}))
        return 0
    print(text)
    print()
    print(format_stats_table(stats, label=decoder.tree.name if decoder.tree else "plain"))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    return show(args, calibrate_stage, CalibrateJob.from_namespace(args))


def calibrate_stage(job: CalibrateJob) -> tuple[dict, str]:
    """The calibrate stage: greedy rollouts of the job's prompts -> acceptance.json (and the heatmap)."""
    cfg = CalibrationConfig(max_new_tokens=defaults.new_tokens(job.max_new_tokens), topk=job.candidates,
                            heldout_fraction=job.heldout, batch_size=job.batch_size, limit=job.limit,
                            seed=job.seed, typical_temperature=job.typical_temperature, rollouts=job.rollouts)
    prompts = builtin_split(load_prompt_source(job.data), job.data, "calibration")
    loaded, heads = model_and_heads(job)
    if heads is None:
        raise ValueError("calibration needs heads (--heads DIR or fresh:K)")
    stats = calibrate(loaded, heads, prompts, cfg, provenance={"heads": job.heads, "data": job.data}, log=log)
    path = save_stats(stats, job.out)
    topk = [[float(row[:r].sum()) for r in (1, 2, 3, 4, 5, stats.topk)] for row in stats.marginal]
    rows = replay_rows(stats)
    plots = []
    if job.plots:
        from bench.report.plots import plot_acceptance_heatmap  # matplotlib: only when plots are asked for

        plots = [str(p) for p in plot_acceptance_heatmap(stats, job.plots)]
    lines = [f"{stats.positions} positions from {len(stats.rollouts)} rollouts (+{len(stats.heldout)} held out); "
             f"written: {path}"]
    lines += [f"  head {j}: top-1..5 " + " ".join(f"{v:.3f}" for v in row[:5]) + f"  top-{stats.topk} {row[5]:.3f}"
              for j, row in enumerate(topk)]
    lines += [format_replay_rows(rows)] + [f"plot: {p}" for p in plots]
    return ({"acceptance": str(path), "positions": stats.positions, "rollouts": len(stats.rollouts),
             "heldout": len(stats.heldout), "topk_accuracy": topk, "trees": rows, "plots": plots}, "\n".join(lines))


def cmd_validate(args: argparse.Namespace) -> int:
    """Replay-predicted tau on the held-out calibration prompts against the runtime's measured tau."""
    stats = load_stats(args.acceptance)
    meta = stats.meta
    if not stats.heldout:
        raise ValueError(f"{args.acceptance} has no held-out rollouts")
    source = meta.get("data", "builtin")
    prompts = builtin_split(load_prompt_source(source), source, "calibration")
    limit = meta.get("config", {}).get("limit")
    prompts = prompts[:limit] if limit else prompts
    held = [prompts[i] for i in meta["heldout_prompts"]]
    dtype = meta.get("dtype", "float32") if args.dtype in (None, "auto") else args.dtype
    spec = meta.get("heads") if args.heads in (None, "auto") else args.heads
    loaded = load_model(args.model or base_name(meta.get("model", "default")), dtype, args.device, log=log)
    loaded = adapted(loaded, spec)
    heads = resolve_heads(spec, loaded.hidden_size, loaded.vocab_size)
    n = int(meta.get("config", {}).get("max_new_tokens", 128))
    encoded = [encode_prompt(loaded, p.turns[0], chat=True) for p in held]
    accept, typical = AcceptConfig(), None
    if args.accept == "typical":
        if stats.typical is None or not stats.typical.heldout:
            raise ValueError(f"{args.acceptance} has no typical statistics: calibrate with --typical-temperature")
        typical = TypicalParams(args.posterior_threshold, args.posterior_alpha)
        accept = AcceptConfig("typical", stats.typical.temperature, posterior_threshold=typical.posterior_threshold,
                              posterior_alpha=typical.posterior_alpha)
        log(f"typical acceptance at temperature {stats.typical.temperature}: epsilon "
             f"{typical.posterior_threshold}, delta {typical.posterior_alpha} (sampled: seed {args.seed})")
    rows = ["| tree | nodes | predicted tau (replay) | measured tau (runtime) | error |", "|---|---:|---:|---:|---:|"]
    results = []
    for name in args.tree:
        tree = load_tree(name)
        dec = MedusaDecoder(loaded, heads, tree, accept,
                            config=DecodeConfig(max_new_tokens=n, topk=stats.topk, seed=args.seed))
        lengths = [length for ids in encoded for length in dec.generate(ids).stats.accept_lengths]
        measured = sum(lengths) / len(lengths)
        if typical is None:
            predicted = tau_step_walk(tree, stats.heldout).tau
        else:
            predicted = typical_walk(tree, stats.typical.heldout, typical).tau
        rows.append(f"| {tree.name} | {tree.num_nodes - 1} | {predicted:.4f} | {measured:.4f} | "
                    f"{100 * (predicted - measured) / measured:+.2f} % |")
        results.append({"tree": tree.name, "nodes": tree.num_nodes - 1, "predicted_tau": predicted,
                        "measured_tau": measured})
    emit(args, {"prompts": len(held), "max_new_tokens": n, "trees": results},
            f"{len(held)} held-out prompts, {n} new tokens each\n" + "\n".join(rows))
    return 0


def replay_rows(stats, budgets=(16, 32, 64), extra=()) -> list[dict]:
    """tau of a few trees replayed on these rollouts (step walk, with a bootstrap interval over the
    rollouts), on the held-out ones, and under independence; ``extra`` trees after the usual ones."""
    trees = [chain(min(stats.num_heads, 4))]
    trees += [optimal_tree(model_for(stats), b, name=f"optimal-{b}")[0] for b in budgets]
    if stats.num_heads >= 4 and stats.topk >= 10:
        trees.append(load_tree("mc_sim_7b_63"))
    trees += list(extra)
    return [{"tree": t.name, "nodes": t.num_nodes - 1, "tau": tau_step_walk(t, stats.rollouts).tau,
             "tau_interval": step_walk_interval(t, stats.rollouts),
             "tau_heldout": tau_step_walk(t, stats.heldout).tau if stats.heldout else None,
             "tau_independent": tau_independent(t, stats.marginal)} for t in trees]


def format_replay_rows(rows: list[dict]) -> str:
    lines = ["| tree | nodes | tau replay (fit) | 95 % interval over rollouts | tau replay (held-out) | "
             "tau independence |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        held = "-" if r["tau_heldout"] is None else f"{r['tau_heldout']:.3f}"
        lo, hi = r["tau_interval"]
        lines.append(f"| {r['tree']} | {r['nodes']} | {r['tau']:.3f} | {lo:.3f}-{hi:.3f} | {held} | "
                     f"{r['tau_independent']:.3f} |")
    return "\n".join(lines)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    """A copy of a heads folder whose draft vocabulary is cut to the S tokens most frequent in some replies."""
    src = heads_folder(args.heads)
    if src is None or not src.is_dir():
        raise ValueError(f"--heads must name a heads folder or a shipped set, got {args.heads!r}")
    out = Path(args.out)
    if out.resolve() == src.resolve() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"--out {out} must be a new or empty folder (the heads are copied, never changed in place)")
    loaded = load_model(args.model, args.dtype, args.device, log=log, weights=weights_of(args))  # its sizes check the heads; no adapter needed
    heads = resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, base_model=args.model)
    counts, read = reply_token_counts(args.replies, args.max_len, args.limit)
    before = heads.draft_vocab.numel() if heads.draft_vocab is not None else heads.config.vocab_size
    ids = frequent_draft_vocab(heads, counts, args.size)
    total = sum(counts.values())
    share = sum(counts[int(t)] for t in ids) / total
    with atomic_dir(out) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps(ids.tolist()) + "\n")
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["medusa_draft_vocab_cut"] = {"size": args.size, "from": before, "replies": Path(args.replies).name,
                                         "replies_read": read, "reply_tokens": total, "share": round(share, 6),
                                         "max_len": args.max_len}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    print(f"draft vocabulary: {args.size} of {before} tokens, {share:.1%} of the {total} reply tokens in {read} "
          f"replies of {args.replies}; written: {out}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    return show(args, profile_stage, ProfileJob.from_namespace(args))


def profile_stage(job: ProfileJob) -> tuple[dict, str]:
    """The profile stage: the latency profile the search prices with -> latency.json (and its plot)."""
    loaded, heads = model_and_heads(job)
    if heads is None:
        raise ValueError("profiling needs heads (--heads DIR or fresh:K)")
    cfg = ProfileConfig(nodes=tuple(job.nodes), contexts=tuple(sorted(job.contexts)), repeats=job.repeats,
                        prefill=tuple(sorted(job.prefill)), batch_sizes=tuple(job.batch_sizes))
    prof = profile_latency(loaded, heads, cfg)
    path = save_profile(prof, job.out)  # kept whatever the serving run does
    if job.batch_sizes and job.serving:
        prof = with_serving_cost(job, loaded, prof)
        path = save_profile(prof, job.out)
    lines = [f"plain step {min(prof.plain_ms):.1f}-{max(prof.plain_ms):.1f} ms, heads {prof.heads_ms:.2f} ms, "
             f"bookkeeping {prof.bookkeeping_ms:.2f} ms, lookup drafting {prof.lookup_ms:.3f} ms per step"]
    if prof.heads_nodes:
        lines.append("  heads by tree size: " + "  ".join(
            f"{n}:{v:.2f}" for n, v in zip(prof.heads_nodes, prof.heads_by_nodes_ms)))
    if prof.heads_fit:
        a, b, c = prof.heads_fit
        lines.append(f"  heads by shape: {a:.2f} + {b:.2f} per level + {c:.2f} per row ms")
    if prof.bookkeeping_nodes:
        lines.append("  bookkeeping by verified nodes: " + "  ".join(
            f"{n}:{v:.2f}" for n, v in zip(prof.bookkeeping_nodes, prof.bookkeeping_by_nodes_ms)))
    if prof.prefill_tokens:
        lines.append("  prefill by prompt length: " + "  ".join(
            f"{n}:{v:.1f}" for n, v in zip(prof.prefill_tokens, prof.prefill_ms)))
    for ctx, plain, row in zip(prof.contexts, prof.plain_ms, prof.verify_ms):
        lines.append(f"  context {ctx}: plain {plain:.2f}, verify " + "  ".join(
            f"{n}:{v:.1f}" for n, v in zip(prof.nodes, row)))
        if 1 in prof.nodes:
            one = row[prof.nodes.index(1)]
            lines.append("    verify / one row: " + "  ".join(f"{n}:{v / one:.3f}" for n, v in zip(prof.nodes, row)))
    if prof.has_batch:
        lines.append(f"  batched steps at context {prof.batch_context} (ms; requests x nodes each), compute-bound "
                     f"from {prof.compute_bound_rows or 'beyond the measured'} rows:")
        lines += ["    batch " + f"{b}: " + "  ".join(f"{n}:{v:.1f}" for n, v in zip(prof.batch_nodes, row))
                  for b, row in zip(prof.batch_sizes, prof.batch_step_ms)]
    if serving := prof.meta.get("serving"):
        lines.append(f"  serving adds {prof.serving_step_ms:.2f} ms + {prof.serving_chunk_ms:.3f} ms per streamed chunk "
                     f"to a step (plain decoding served at batch {', '.join(map(str, serving['concurrencies']))}, "
                     "against the same requests decoded here)" if "error" not in serving else
                     f"  what serving costs a step: not measured ({serving['error']})")
    if floor := prof.meta.get("bandwidth_floor"):
        lines.append(f"  {floor_line(floor)}; context {floor['context']}")
    lines.append(f"written: {path}")
    plots = []
    if job.plots:
        from bench.report.plots import plot_latency  # matplotlib: only when plots are asked for

        plots = [str(p) for p in plot_latency(prof, job.plots)]
        lines += [f"plot: {p}" for p in plots]
    return {"latency": str(path), **profile_to_json(prof), "plots": plots}, "\n".join(lines)


SERVING_ROUNDS = 3  # each concurrency served and decoded in-process this many times (bench.load.serving)


def with_serving_cost(job: ProfileJob, loaded, prof: LatencyProfile) -> LatencyProfile:
    """``prof`` with what serving costs a step (``bench.load.serving``): plain decoding of the built-in calibration
    prompts served at each profiled batch size, against the same requests decoded here; where the server cannot
    run, 0 and the reason in its ``serving``."""
    sizes = tuple(job.batch_sizes)
    prompts = [chat_template_ids(loaded, [{"role": "user", "content": p.turns[0]}])
               for p in builtin_split(builtin_prompts(), "builtin", "calibration")[:2 * max(sizes)]]
    new_tokens = defaults.new_tokens(job.max_new_tokens)
    plain = MedusaDecoder(loaded, None, None, AcceptConfig(), DecodeConfig(max_new_tokens=new_tokens))
    try:
        with tqdm(total=SERVING_ROUNDS * len(sizes), desc=f"serving plain decoding at batch {', '.join(map(str, sizes))}",
                  unit="run") as bar:
            cost = measure_serving(job.model, job.heads, job.dtype, weights_of(job), plain, sizes, prompts, new_tokens,
                                   SERVING_ROUNDS, Path(job.out).with_name("latency-serving.log"), bar.update)
    except (EngineError, ValueError) as exc:
        log(f"[profile] what serving costs was not measured: {exc}")
        return replace(prof, meta={**prof.meta, "serving": {"error": str(exc)}})
    return replace(prof, serving_step_ms=cost.step_ms, serving_chunk_ms=cost.chunk_ms,
                   meta={**prof.meta, "serving": cost.as_json()})


def format_stats_table(stats, label: str) -> str:
    """A small Markdown table of one generate's statistics."""
    rows = [
        ("configuration", label),
        ("tree nodes", stats.tree_nodes),
        ("new tokens", stats.new_tokens),
        ("steps", stats.steps),
        ("tau (tokens/step)", f"{stats.tau:.3f}"),
        ("head acceptance", " ".join(f"{a:.2f}" for a in stats.head_acceptance) or "-"),
        ("tokens/s", f"{stats.tokens_per_second:.1f}"),
        ("prefill s", f"{stats.time_prefill:.3f}"),
        ("heads s", f"{stats.time_heads:.3f}"),
        ("verify s", f"{stats.time_verify:.3f}"),
        ("bookkeeping s", f"{stats.time_bookkeeping:.3f}"),
        ("stop", stats.stop_reason),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'stat':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)
