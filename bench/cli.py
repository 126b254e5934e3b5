"""``medusa-bench``: one console script, one subcommand per stage.

Each subcommand maps its flags onto the frozen configuration dataclasses of the stage it runs,
calls it, and prints what comes back. Known bad input ends with one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from medusa_runtime.train_profiles import TRAIN_PROFILES
from treesearch.export import FORMATS as EXPORT_FORMATS
from treesearch.export import TRTLLM_MAX_DRAFT_LEN
from treesearch.typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError, OSError)


def _result(args: argparse.Namespace, obj: dict, text: str | None = None) -> None:
    """A command's result on stdout: one JSON object with --json, else the human text (files written and
    plots are in the object; progress and logs go to stderr either way)."""
    if getattr(args, "json", False):
        print(json.dumps(obj, default=str))
    elif text is not None:
        print(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (offline SmolLM2-135M-Instruct), a folder or a hub id")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float16 on CUDA, bfloat16 on a CPU with AVX-512 BF16, else float32 (printed)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when present)")


def cmd_model(args: argparse.Namespace) -> int:
    from medusa_runtime.engine import c_forward_status
    from medusa_runtime.model import describe_model, load_model

    loaded = load_model(args.model, args.dtype, args.device, log=_log)
    base = loaded.name
    loaded = _adapted(loaded, args.heads)  # the base as those heads decode with it (Medusa-2: their adapter merged)
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


def _model_and_heads(args: argparse.Namespace):
    """The base model and the heads (``None`` for ``--heads none``) that a command's flags name."""
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model

    loaded = load_model(args.model, args.dtype, args.device, log=_log)
    args.dtype = str(loaded.dtype).removeprefix("torch.")  # 'auto' resolved: records and keys name the real one
    loaded = _adapted(loaded, args.heads)
    return loaded, resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, base_model=args.model)


def _base_name(model: str) -> str:
    """The model a recorded name was loaded from: ``<model>+adapter:<digest>`` names it with its heads' adapter
    merged (``_adapted`` merges it again from the heads)."""
    return model.split("+adapter:", 1)[0]


def _adapted(loaded, heads_spec: str | None):
    """The base with the adapter that the named heads were trained with merged in (Medusa-2 heads), else as
    it is; its name then says so (``<model>+adapter:<digest>``), and so does every record made with it."""
    from medusa_runtime.heads import heads_folder
    from medusa_runtime.medusa2 import apply_heads_adapter

    folder = heads_folder(heads_spec)
    return loaded if folder is None else apply_heads_adapter(loaded, folder, log=_log)


def cmd_generate(args: argparse.Namespace) -> int:
    from medusa_runtime.acceptance import AcceptConfig
    from medusa_runtime.decode import DecodeConfig, MedusaDecoder, encode_prompt
    from medusa_runtime.lookup import LookupConfig
    from treesearch.tree import load_tree

    accept_cfg = AcceptConfig(rule=args.accept, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              posterior_threshold=args.posterior_threshold, posterior_alpha=args.posterior_alpha)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, topk=args.candidates, seed=args.seed,
                          engine=args.engine, lookup=LookupConfig(args.lookup))
    tree = load_tree(args.tree) if args.heads not in (None, "none") else None  # validate before loading a model
    loaded, heads = _model_and_heads(args)
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


def cmd_search(args: argparse.Namespace) -> int:
    from treesearch.cost import load_profile
    from treesearch.search import SearchConfig, run_search, write_search
    from treesearch.stats import load_stats, select

    stats = load_stats(args.acceptance)
    if args.exclude_ids:  # cross-fitting: fit on every rollout but these questions'
        stats = select(stats, drop_ids=args.exclude_ids)
    latency = load_profile(args.latency, expect_model=stats.meta.get("model")) if args.latency else None
    joint = {"auto": None, "joint": True, "independent": False}[args.estimator]
    cfg = SearchConfig(budget=args.budget, trials=args.trials, objective=args.objective, storage=args.storage,
                       study_name=args.study, seed=args.seed, joint=joint, min_budget=args.min_budget,
                       heartbeat=args.heartbeat, grace=args.grace_period,
                       context=args.context, baseline=args.baseline, accept=args.accept,
                       max_regret=args.max_regret, configurations=not args.trees_only, max_lookup=args.max_lookup)
    result = run_search(stats, cfg, latency, show_progress=not args.quiet)
    path = write_search(result, stats, cfg, args.out, str(args.acceptance), str(args.latency) if args.latency else None)
    lines = [format_search_table(result)]
    if result.space == "configurations":
        best = result.best
        verdict = "use no heads" if not best.uses_heads else "use the heads"
        lines.append(f"\nrecommended: {best.label} ({verdict}; predicted tau {best.tau:.3f}, {best.speedup:.3f}x "
                     "plain decoding)")
    lines.append(f"\nwritten: {path}")
    plots = []
    if args.plots:
        from bench.plots import plot_search

        plots = [str(p) for p in plot_search(result, stats, latency, args.plots)]
        lines += [f"plot: {p}" for p in plots]
    _result(args, {"tree_file": str(path), **json.loads(Path(path).read_text()), "plots": plots}, "\n".join(lines))
    return 0


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


def cmd_export(args: argparse.Namespace) -> int:
    from treesearch.export import export_tree
    from treesearch.tree import load_tree

    print(export_tree(load_tree(args.tree), args.format, num_heads=args.num_heads, max_draft_len=args.max_draft_len,
                      model=args.draft_model))
    return 0


def cmd_export_heads(args: argparse.Namespace) -> int:
    import torch

    from medusa_runtime import serving
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model

    loaded = load_model(args.model, "float32", "cpu", log=_log)
    heads = resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, args.model)
    if heads is None:
        raise ValueError("--heads none: there are no heads to export")
    if engine_refused := serving.engine_refusal(heads, "vLLM" if args.format == "vllm" else "TGI"):
        raise ValueError(engine_refused)  # before merging an adapter and writing a base for nothing
    adapted = _adapted(loaded, args.heads)
    base = adapted if adapted is not loaded else None  # Medusa-2 heads: the engine must serve the adapted base
    lm = adapted.model.get_output_embeddings().weight
    dtype = getattr(torch, args.dtype)
    base_line = (f"the adapted base (Medusa-2 heads): {args.out}/{serving.BASE_DIR}" if base is not None
                 else "the base: BASE_MODEL, the model the heads were trained on")
    if args.format == "vllm":
        out = serving.export_vllm(heads, lm, args.out, args.num_speculative_tokens, dtype, base=base)
        spec = json.loads((out / serving.VLLM_SPEC_FILE).read_text())
        model = f"{out.resolve()}/{serving.BASE_DIR}" if base is not None else "BASE_MODEL"
        text = (f"written: {out} (vLLM Medusa model folder: config.json, model.safetensors); {base_line}\n"
                f"vLLM's Medusa drafts the heads' top-1 chain ({spec['num_speculative_tokens']} tokens per step), "
                f"not a tree:\n  vllm serve {model} --speculative-config '{json.dumps(spec)}'")
        _result(args, {"out": str(out), "speculative_config": spec, "base": None if base is None else model}, text)
        return 0
    k = args.num_speculative_tokens or heads.num_heads
    if not 1 <= k <= heads.num_heads:  # TGI refuses --speculate above medusa_num_heads
        raise ValueError(f"TGI drafts one token per head: --num-speculative-tokens must be 1..{heads.num_heads}, got {k}")
    notes: list[str] = []
    base_model = args.base_model or (str(loaded.model.config._name_or_path) if args.model == "default" else args.model)
    out = serving.export_tgi(heads, lm, args.out, base_model, dtype, warn=notes.append, base=base)
    cfg = json.loads((out / "config.json").read_text())
    text = (f"written: {out} (TGI Medusa folder, layout {serving.tgi_layout(heads).upper()}: config.json, "
            f"{serving.TGI_WEIGHTS}); base: {cfg['base_model_name_or_path']}\n" + "".join(f"note: {n}\n" for n in notes)
            + f"TGI drafts the heads' top-1 chain ({k} tokens per step), not a tree:\n"
            f"  text-generation-launcher --model-id {out.resolve()} --speculate {k}")
    _result(args, {"out": str(out), "layout": serving.tgi_layout(heads), "config": cfg, "notes": notes}, text)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from medusa_runtime.distill import DistillConfig, build_distill_data
    from medusa_runtime.model import load_model
    from medusa_runtime.prompts import load_prompt_source
    from medusa_runtime.train import TrainConfig, train_medusa1, train_medusa2

    prof = TRAIN_PROFILES[args.profile]
    top = args.method == "medusa2" and args.train_layers > 0  # Medusa-2 on the top layers (medusa_runtime.medusa2)
    if args.init is not None and args.method != "medusa1" and not top:
        raise SystemExit("--init (go on training heads trained before) is for --method medusa1, or medusa2 with "
                         "--train-layers")
    n_prompts = args.prompts if args.prompts is not None else prof["prompts"]
    # Medusa-2 on the top layers follows the paper's recipe: the next-token loss replaced by KL to the original
    defaults = {"base_lr": 2e-4, "lm_weight": 0.0} if top else {"base_lr": 2e-5, "lm_weight": 1.0}
    cfg = TrainConfig(method=args.method, num_heads=args.num_heads, num_layers=args.layers,
                      epochs=args.epochs if args.epochs is not None else prof["epochs"],
                      lr=args.lr if args.lr is not None else prof["lr"],
                      base_lr=args.base_lr if args.base_lr is not None else defaults["base_lr"],
                      lm_weight=args.lm_weight if args.lm_weight is not None else defaults["lm_weight"],
                      distill_weight=args.distill_weight, heads_warmup_ratio=args.heads_warmup,
                      batch_tokens=args.batch_tokens, seed=args.seed, lora_rank=args.lora_rank,
                      train_layers=args.train_layers if args.method == "medusa2" else 0,
                      head_grad_to_base=args.head_grad_to_base, soft_targets=args.soft_targets,
                      vocab=args.vocab or prof["vocab"], draft_size=args.draft_size,
                      condition=args.condition or prof["condition"])
    prompts = builtin_split(load_prompt_source(args.data), args.data, "train")
    prompts = prompts[:n_prompts] if n_prompts else prompts
    loaded = load_model(args.model, args.dtype, args.device, log=_log)
    dcfg = DistillConfig(max_new_tokens=args.max_new_tokens or prof["max_new_tokens"], batch_size=args.gen_batch,
                         follow_ups=prof["follow_ups"] if args.follow_ups is None else args.follow_ups)
    examples, cache = build_distill_data(loaded, prompts, dcfg)
    if args.max_examples:  # a budget cut over the cached data (same cache as the full run)
        examples = random.Random(args.seed).sample(examples, min(args.max_examples, len(examples)))
    provenance = {"model": args.model, "data": {"source": args.data, "prompts": len(prompts),
                                                "examples": len(examples), "cache": str(cache),
                                                "distill": dcfg.__dict__}, "profile": args.profile}
    from medusa_runtime.medusa2 import train_medusa2_top

    train = train_medusa1 if cfg.method == "medusa1" else train_medusa2_top if top else train_medusa2
    extra = {"hidden_cache": not args.no_hidden_cache, "init": args.init} if cfg.method == "medusa1" else \
        {"init": args.init} if top else {}
    result = train(loaded, examples, cfg, args.out, provenance=provenance, resume=args.resume, log=_log, **extra)
    from bench.plots import plot_training

    plots = [str(p) for p in plot_training(args.out)]
    lines = [f"trained {cfg.num_heads} heads ({cfg.method}) in {result.steps} steps, {result.seconds:.0f} s"]
    last = result.validation[-1]["topk"] if result.validation else []
    lines += [f"  head {j}: validation top-1..5 " + " ".join(f"{v:.3f}" for v in row) for j, row in enumerate(last)]
    official = "" if cfg.root_conditioned or top else f"{args.out}/heads-official, "  # no official layout for those
    adapter = " with its base adapter (heads/adapter, merged at load)" if top else ""
    lines.append(f"written: {args.out}/heads (shared lm_head){adapter}, {official}{args.out}/training.json")
    lines += [f"plot: {p}" for p in plots]
    _result(args, {"method": cfg.method, "num_heads": cfg.num_heads, "steps": result.steps,
                   "seconds": result.seconds, "validation_topk": last, "out": str(args.out), "plots": plots},
            "\n".join(lines))
    return 0


def builtin_split(prompts, source: str, part: str):
    """The ``train`` or ``calibration`` part of the built-in prompts; other sources are used whole."""
    from medusa_runtime.prompts import BUILTIN_NAMES
    from medusa_runtime.prompts import builtin_split as split

    return split(prompts, part) if source in BUILTIN_NAMES else prompts


def cmd_fidelity(args: argparse.Namespace) -> int:
    from bench.quality import fidelity
    from bench.suites import load_suite
    from bench.workload import spread_over_categories
    from medusa_runtime.decode import encode_prompt
    from medusa_runtime.model import load_model
    from treesearch.tree import write_json_atomic

    questions = spread_over_categories(load_suite(args.questions, log=_log), args.limit)
    original = load_model(args.reference, args.dtype, args.device, log=_log)
    # the retrained model: a folder (Medusa-2 on the whole base), or --model with --heads' adapter merged in
    trained = _adapted(load_model(args.model, args.dtype, args.device, log=_log), args.heads)
    prompts = [encode_prompt(original, q.turns[0], chat=True) for q in questions]
    res = fidelity(original, trained, prompts, args.max_new_tokens, args.batch_size)
    obj = {"schema": "medusa-fidelity/1", "model": trained.name, "reference": args.reference, "dtype": args.dtype,
           "heads": args.heads,
           "question_ids": [q.question_id for q in questions], "max_new_tokens": args.max_new_tokens,
           "agreement": res.agreement, "identical": res.identical, "ll_original": res.ll_original,
           "ll_trained": res.ll_trained, "ll_drop": res.ll_drop}
    write_json_atomic(args.out, obj)
    _result(args, {**obj, "file": str(args.out)},
            f"{res.prompts} MT-Bench first turns, greedy, {args.max_new_tokens} tokens:\n"
            f"  token agreement with the original's answers: {res.agreement:.3f} (identical answers "
            f"{res.identical:.2f})\n  mean log-likelihood of the original's answers: original {res.ll_original:.4f}, "
            f"trained {res.ll_trained:.4f} (drop {res.ll_drop:+.4f} nats/token)\nwritten: {args.out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from medusa_runtime.calibrate import CalibrationConfig, calibrate
    from medusa_runtime.prompts import load_prompt_source
    from treesearch.stats import save_stats

    cfg = CalibrationConfig(max_new_tokens=args.max_new_tokens, topk=args.candidates,
                            heldout_fraction=args.heldout, batch_size=args.batch_size, limit=args.limit,
                            seed=args.seed, typical_temperature=args.typical_temperature, rollouts=args.rollouts)
    prompts = builtin_split(load_prompt_source(args.data), args.data, "calibration")
    loaded, heads = _model_and_heads(args)
    if heads is None:
        raise ValueError("calibration needs heads (--heads DIR or fresh:K)")
    stats = calibrate(loaded, heads, prompts, cfg, provenance={"heads": args.heads, "data": args.data}, log=_log)
    path = save_stats(stats, args.out)
    topk = [[float(row[:r].sum()) for r in (1, 2, 3, 4, 5, stats.topk)] for row in stats.marginal]
    rows = replay_rows(stats)
    plots = []
    if args.plots:
        from bench.plots import plot_acceptance_heatmap

        plots = [str(p) for p in plot_acceptance_heatmap(stats, args.plots)]
    lines = [f"{stats.positions} positions from {len(stats.rollouts)} rollouts (+{len(stats.heldout)} held out); "
             f"written: {path}"]
    lines += [f"  head {j}: top-1..5 " + " ".join(f"{v:.3f}" for v in row[:5]) + f"  top-{stats.topk} {row[5]:.3f}"
              for j, row in enumerate(topk)]
    lines += [format_replay_rows(rows)] + [f"plot: {p}" for p in plots]
    _result(args, {"acceptance": str(path), "positions": stats.positions, "rollouts": len(stats.rollouts),
                   "heldout": len(stats.heldout), "topk_accuracy": topk, "trees": rows, "plots": plots},
            "\n".join(lines))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Replay-predicted tau on the held-out calibration prompts against the runtime's measured tau."""
    from medusa_runtime.acceptance import AcceptConfig
    from medusa_runtime.decode import DecodeConfig, MedusaDecoder, encode_prompt
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model
    from medusa_runtime.prompts import load_prompt_source
    from treesearch.stats import load_stats, tau_step_walk
    from treesearch.tree import load_tree
    from treesearch.typical import TypicalParams, typical_walk

    stats = load_stats(args.acceptance)
    meta = stats.meta
    if not stats.heldout:
        raise ValueError(f"{args.acceptance} has no held-out rollouts")
    source = meta.get("data", "builtin")
    prompts = builtin_split(load_prompt_source(source), source, "calibration")
    limit = meta.get("config", {}).get("limit")
    prompts = prompts[:limit] if limit else prompts
    held = [prompts[i] for i in meta["heldout_prompts"]]
    loaded = load_model(args.model or _base_name(meta.get("model", "default")), args.dtype or meta.get("dtype", "float32"),
                        args.device, log=_log)
    loaded = _adapted(loaded, args.heads or meta.get("heads"))
    heads = resolve_heads(args.heads or meta.get("heads"), loaded.hidden_size, loaded.vocab_size)
    n = int(meta.get("config", {}).get("max_new_tokens", 128))
    encoded = [encode_prompt(loaded, p.turns[0], chat=True) for p in held]
    accept, typical = AcceptConfig(), None
    if args.accept == "typical":
        if stats.typical is None or not stats.typical.heldout:
            raise ValueError(f"{args.acceptance} has no typical statistics: calibrate with --typical-temperature")
        typical = TypicalParams(args.posterior_threshold, args.posterior_alpha)
        accept = AcceptConfig("typical", stats.typical.temperature, posterior_threshold=typical.posterior_threshold,
                              posterior_alpha=typical.posterior_alpha)
        _log(f"typical acceptance at temperature {stats.typical.temperature}: epsilon "
             f"{typical.posterior_threshold}, delta {typical.posterior_alpha} (sampled: seed {args.seed})")
    rows = ["| tree | nodes | predicted tau (replay) | measured tau (runtime) | error |", "|---|---:|---:|---:|---:|"]
    results = []
    for spec in args.trees:
        tree = load_tree(spec)
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
    _result(args, {"prompts": len(held), "max_new_tokens": n, "trees": results},
            f"{len(held)} held-out prompts, {n} new tokens each\n" + "\n".join(rows))
    return 0


def replay_rows(stats, budgets=(16, 32, 64)) -> list[dict]:
    """tau of a few trees replayed on these rollouts (step walk, with a bootstrap interval over the
    rollouts), on the held-out ones, and under independence."""
    from treesearch.optimal import model_for, optimal_tree
    from treesearch.stats import step_walk_interval, tau_independent, tau_step_walk
    from treesearch.tree import chain, load_tree

    trees = [chain(min(stats.num_heads, 4))]
    trees += [optimal_tree(model_for(stats), b, name=f"optimal-{b}")[0] for b in budgets]
    if stats.num_heads >= 4 and stats.topk >= 10:
        trees.append(load_tree("mc_sim_7b_63"))
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
    import shutil

    from medusa_runtime.distill import reply_token_counts
    from medusa_runtime.heads import DRAFT_VOCAB_FILE, frequent_draft_vocab, heads_folder, resolve_heads
    from medusa_runtime.model import load_model
    from treesearch.fsutil import atomic_dir

    src = heads_folder(args.heads)
    if src is None or not src.is_dir():
        raise ValueError(f"--heads must name a heads folder or a shipped set, got {args.heads!r}")
    out = Path(args.out)
    if out.resolve() == src.resolve() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"--out {out} must be a new or empty folder (the heads are copied, never changed in place)")
    loaded = load_model(args.model, args.dtype, args.device, log=_log)  # its sizes check the heads; no adapter needed
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
    from medusa_runtime.profile import ProfileConfig, profile_latency
    from treesearch.cost import profile_to_json, save_profile

    loaded, heads = _model_and_heads(args)
    if heads is None:
        raise ValueError("profiling needs heads (--heads DIR or fresh:K)")
    cfg = ProfileConfig(nodes=tuple(args.nodes), contexts=tuple(sorted(args.contexts)), repeats=args.repeats,
                        prefill=tuple(sorted(args.prefill)))
    prof = profile_latency(loaded, heads, cfg)
    path = save_profile(prof, args.out)
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
    lines.append(f"written: {path}")
    plots = []
    if args.plots:
        from bench.plots import plot_latency

        plots = [str(p) for p in plot_latency(prof, args.plots)]
        lines += [f"plot: {p}" for p in plots]
    _result(args, {"latency": str(path), **profile_to_json(prof), "plots": plots}, "\n".join(lines))
    return 0


def _configs_from_trees(trees: list[str], prompt_lookup: bool = True, hf_engine: bool = False,
                        lookup: int = 0, gates: Sequence[float] = (), torch_path: bool = False):
    from bench.runner import MethodConfig

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


def _replay_inputs(args, configs) -> dict:
    """What records of a replay depend on besides their configuration's fields (which each record's hash
    carries): the runtime revision, model, heads' and tree files' contents, questions, lengths."""
    from bench.runner import REPLAY_ORDER, SEQUENTIAL_ORDER
    from bench.stages import RUNTIME_REVISION, file_hash, folder_hash
    from medusa_runtime.heads import heads_folder

    def heads_key(spec):
        folder = heads_folder(spec)
        return folder_hash(folder) if folder is not None and folder.is_dir() else spec

    return {"runtime": RUNTIME_REVISION, "model": args.model, "dtype": args.dtype, "device": args.device,
            "heads": heads_key(args.heads),
            "config_heads": {c.heads: heads_key(c.heads) for c in configs if c.heads is not None},
            "questions": file_hash(Path(args.questions)) if args.questions and Path(args.questions).is_file()
            else args.questions or "mt-bench",
            "max_new_tokens": args.max_new_tokens,
            "order": SEQUENTIAL_ORDER if getattr(args, "sequential", False) else REPLAY_ORDER,
            "trees": {c.tree: file_hash(Path(c.tree)) for c in configs if c.tree and Path(c.tree).is_file()},
            # records timed with profile rounds between them are not resumed without, nor the other way round
            **({"profile_like": file_hash(Path(args.profile_like)), "profile_every": args.profile_every}
               if getattr(args, "profile_like", None) else {})}


def _run_replay(args, configs, turns: int):
    from bench.analyze import records_frame, summary, to_markdown, write_tables
    from bench.runner import ReplayConfig, replay
    from bench.stages import StageCache, isolate_records
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model

    questions = select_questions(args)
    loaded, heads = _model_and_heads(args)
    if heads is None and any(c.method == "medusa" and c.heads is None for c in configs):
        raise ValueError("Medusa configurations need --heads")
    variants = {}  # heads that configurations name beside the replay's own: each with the base it decodes with
    for spec in dict.fromkeys(c.heads for c in configs if c.heads is not None):
        base = _adapted(load_model(args.model, args.dtype, args.device, log=_log), spec)
        variants[spec] = (base, resolve_heads(spec, base.hidden_size, base.vocab_size, base_model=args.model))
    cfg = ReplayConfig(max_new_tokens=args.max_new_tokens, turns=turns, repeats=args.repeats,
                       lockstep=not args.sequential)
    out_dir = Path(args.out)
    if getattr(args, "storage", None):  # the matrix shared among workers (bench.distributed)
        records = _replay_shared(args, configs, questions, cfg, loaded, heads, variants)
        machines = sorted({r["machine"] for r in records})
        if len(machines) > 1:  # never one ratio over two machines' timings: a summary per machine
            return loaded, None, *_per_machine_summaries(records, machines, out_dir)
    else:
        isolate_records(out_dir, StageCache.key_of(_replay_inputs(args, configs)))  # never resume another runtime's
        during = _profile_during(args, loaded, heads, out_dir)
        records = replay(loaded, heads, configs, questions, cfg, out_dir / "records.jsonl",
                         extra={"heads": args.heads}, variants=variants, between=during)
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
    import socket

    from bench.distributed import QueueConfig, ReplayQueue
    from bench.runner import replay
    from bench.stages import StageCache
    from treesearch.fsutil import atomic_file
    from treesearch.search import worker_id

    if getattr(args, "profile_like", None):
        raise ValueError("--profile-like prices one machine's replay: it does not combine with --storage")
    matrix = {**_replay_inputs(args, configs), "configs": [c.digest for c in configs], "repeats": args.repeats,
              "turns": cfg.turns, "question_ids": [q.question_id for q in questions]}
    qcfg = QueueConfig(args.storage, args.study_name, args.machine or socket.gethostname(), worker_id(),
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

    mine = queue.work(run_unit, progress=not args.json)
    _log(f"this worker ({qcfg.worker} on {qcfg.machine}) replayed {mine} of {queue.units} units")
    records = queue.merged_records()
    with atomic_file(out_dir / "records.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def _per_machine_summaries(records: list[dict], machines: list[str], out_dir: Path) -> tuple[str, dict]:
    """The summary tables of each machine's records on their own (``machines/<name>/``)."""
    from bench.analyze import records_frame, summary, to_markdown, write_tables

    texts, obj = [], {"machines": {}, "files": [str(out_dir / "records.jsonl")]}
    for m in machines:
        df = records_frame([r for r in records if r["machine"] == m])
        paths = write_tables(df, ["generate", "plain"], out_dir / "machines" / re.sub(r"[^A-Za-z0-9._-]", "_", m))
        table = summary(df, ["generate", "plain"])
        overall = table[table["category"] == "overall"][["config", "tokens", "tokens_per_s", "tau",
                                                           "speedup_vs_plain"]]
        texts.append(f"machine {m}:\n\n" + to_markdown(overall))
        obj["machines"][m] = overall.to_dict("records")
        obj["files"] += [str(paths["summary_csv"]), str(paths["summary_md"])]
    return "\n\n".join(texts) + f"\n\nwritten: {', '.join(obj['files'])}", obj


def _profile_during(args, loaded, heads, out_dir: Path):
    """``--profile-like LATENCY``: that profile's grid, profiled again in rounds during the replay
    (``bench.replay_profile``), one round every ``--profile-every`` questions."""
    if not getattr(args, "profile_like", None):
        return None
    from bench.replay_profile import RoundsDuringReplay
    from medusa_runtime.profile import ProfileConfig, Profiler
    from treesearch.cost import load_profile

    if heads is None:
        raise ValueError("--profile-like profiles the heads' trees: it needs --heads")
    like = load_profile(args.profile_like, expect_model=loaded.name)
    cfg = ProfileConfig(nodes=like.nodes, contexts=like.contexts, prefill=like.prefill_tokens or (), warmup=1)
    return RoundsDuringReplay(out_dir / "profile_rounds.jsonl", Profiler(loaded, heads, cfg), args.profile_every)


def select_questions(args: argparse.Namespace):
    """The questions a replay runs: the set (--questions), then --categories, --ids (in their order), --limit."""
    from bench.suites import load_suite
    from bench.workload import spread_over_categories

    questions = load_suite(args.questions, log=_log)
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
    from bench.analyze import to_markdown
    from bench.bandwidth import bandwidth_floor
    from medusa_runtime.engine import c_forward_status

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
    floor = bandwidth_floor(loaded)
    plain = df[df["config"] == "plain"]
    # a decode step: the plain runs' time after the prompt forward, per forward
    prefill = plain["prefill_time"].fillna(0) if "prefill_time" in plain else 0.0  # older records lack it
    step_ms = 1000 * (plain["wall_time"] - prefill).sum() / max(1, plain["steps"].sum())
    status = c_forward_status(loaded)
    text += (f"\n\nthe runtime's decode steps on the C forward: {status}"
             "\n\nwhere a step's time goes (ms per step; prefill ms per generate):\n\n" + to_markdown(breakdown)
             + f"\n\nbandwidth floor of one step: {floor.floor_ms:.1f} ms ({floor.weight_bytes / 1e6:.0f} MB of weights "
             f"at {floor.bandwidth_gbs:.1f} GB/s measured copy bandwidth); runtime plain decode step {step_ms:.1f} ms = "
             f"{step_ms / floor.floor_ms:.2f}x the floor")
    obj.update(c_forward=status, step_breakdown=breakdown.to_dict("records"), bandwidth_floor_ms=floor.floor_ms,
               bandwidth_gbs=floor.bandwidth_gbs, plain_step_ms=step_ms)
    _result(args, obj, text)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from bench.runner import MethodConfig

    spec = _read_config_file(args.config)
    for key in ("model", "heads", "dtype", "max_new_tokens", "repeats"):
        if key in spec and getattr(args, key, None) in (None, _DEFAULTS.get(key)):
            setattr(args, key, spec[key])
    configs = [MethodConfig(**c) for c in spec.get("configurations", [])]
    if not configs:
        raise ValueError(f"{args.config} lists no configurations")
    _, _, text, obj = _run_replay(args, configs, turns=int(spec.get("turns", 2)))
    _result(args, obj, text)
    return 0


_DEFAULTS = {"model": "default", "heads": "none", "dtype": "auto", "max_new_tokens": 128, "repeats": 1}


def _read_config_file(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

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


def cmd_judge(args: argparse.Namespace) -> int:
    """Quality of replayed answers: the log-likelihood proxy always (quality.json), FastChat single grading by
    a judge when one is named (judge/: FastChat's files and judge_scores.json; see bench.judging)."""
    from bench.analyze import to_markdown
    from bench.judging import answer_quality, backend_for, run_judge, write_quality
    from bench.mtbench import load_questions
    from bench.runner import load_records
    from medusa_runtime.model import load_model

    every = load_records(Path(args.records))
    records = [r for r in every if r.get("repeat", 0) == 0]  # the judge grades one answer per question and turn
    if not records:
        raise ValueError(f"no records in {args.records}")
    out = Path(args.out or Path(args.records).parent)
    questions = load_questions(args.questions, log=_log)
    missing = {r["question_id"] for r in records} - {q.question_id for q in questions}
    if missing:
        raise ValueError(f"the records answer questions that {args.questions or 'MT-Bench'} lacks: {sorted(missing)[:5]}")
    spec = {"none": None, "openai": args.judge_model, "local": f"local:{args.judge_local}"}[args.backend]
    backend = backend_for(spec, args.dtype, args.device) if spec else None  # a bad judge fails before the long part
    loaded = load_model(args.model, args.dtype, args.device, log=_log)  # the base the answers are scored under
    frame = answer_quality(loaded, every, questions, progress=not args.json)  # every sample
    quality = json.loads(write_quality(out, frame, loaded.name).read_text())
    lines = [f"{cfg}: {q['log_likelihood_per_token']:.4f} nats/token, regret {q['regret_per_token']:.4f}, over "
             f"{q['tokens']} tokens" for cfg, q in quality["configs"].items()]
    lines += [f"{c['config']} vs {c['reference']}: mean difference {c['mean_difference']:+.4f} nats/token, p = "
              f"{c['p_value']:.3f} ({c['questions']} questions; detects {c['detectable_at_80_power']:.3f} with 80 % power)"
              for c in quality["distribution_checks"] if c["p_value"] is not None]
    text = "answer quality under the base model (proxies, not a judge):\n" + "\n".join(lines)
    obj = {"quality": quality["configs"], "distribution_checks": quality["distribution_checks"]}
    if backend is None:
        _result(args, obj, text + "\n\nno judge backend selected (--backend openai|local grades with an LLM judge)")
        return 0
    scores = json.loads(run_judge(out, records, questions, backend, progress=not args.json,
                                  guided=args.guided_rating).read_text())
    table = pd_frame_of_scores(scores)
    obj.update(judge=scores["judge"], scores=scores["configs"])
    how = "ratings without [[x]] asked again, constrained to 1-10" if args.guided_rating else \
        "unparsable ratings left out as FastChat does"
    _result(args, obj, text + f"\n\njudge {scores['judge']} (FastChat single grading, 1-10; {how}):\n"
            + to_markdown(table))
    return 0


def pd_frame_of_scores(scores: dict):
    """judge_scores.json's configurations as one table: score overall, per turn, judgments, unparsable."""
    import pandas as pd

    rows = [{"config": cfg, "score": s["score"], **{f"turn {t}": v for t, v in s["by_turn"].items()},
             "judgments": s["judgments"], "unparsable": s["unparsable"], "guided": s.get("guided", 0)}
            for cfg, s in scores["configs"].items()]
    return pd.DataFrame(rows)


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


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help (those that have one: not None, not a switch left off)."""

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._has_default(action):  # an option without a help text still shows it
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if self._has_default(action) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit 2 like every other error, and --help
    shows every flag's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("medusa-bench")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


JSON_HELP = "print one JSON object with the result (logs and progress stay on stderr)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="medusa-bench", description="Medusa speculative decoding: run, tune, benchmark. "
                     "Set MEDUSA_BENCH_DEBUG=1 for a full traceback instead of the one-line error.")
    parser.add_argument("--version", action="version", version=f"medusa-bench {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("model", help="prepare and describe a base model (the offline default by default)")
    _add_model_args(p)
    p.add_argument("--heads", default="none", help="describe the base as these heads decode with it (Medusa-2 heads: "
                                                   "their adapter merged)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("draft-vocab", help="copy a heads folder with its draft vocabulary cut to the S most "
                                           "frequent tokens of some replies (a smaller projection per step)")
    _add_model_args(p)
    p.add_argument("--heads", required=True, help="heads folder or shipped set (default, medusa1)")
    p.add_argument("--size", type=int, required=True, help="tokens to keep (S)")
    p.add_argument("--replies", required=True,
                   help="self-distillation cache (JSONL: turns, input_ids, reply_start), as 'train' writes under "
                        "the model cache's distill/ folder; never the workload you measure on")
    p.add_argument("--limit", type=int, default=None, help="read only its first N replies")
    p.add_argument("--max-len", type=int, default=768, help="count reply tokens up to this position, as training does")
    p.add_argument("--out", required=True, help="new folder for the copy")
    p.set_defaults(func=cmd_draft_vocab)

    p = sub.add_parser("generate", help="decode one prompt with Medusa heads on a candidate tree")
    _add_model_args(p)
    p.add_argument("--heads", default="none", help="heads folder (either format), fresh:K[:L], or none for plain decoding")
    p.add_argument("--tree", default="mc_sim_7b_63", help="preset name, chain:N, or a tree JSON file")
    p.add_argument("--accept", default="greedy", choices=["greedy", "typical", "sample"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="top-k filter of the target distribution (0: off)")
    p.add_argument("--posterior-threshold", type=float, default=POSTERIOR_THRESHOLD, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, default=POSTERIOR_ALPHA, help="typical: delta")
    p.add_argument("--candidates", type=int, default=10, help="candidates read from each head's top-k (the tree's "
                                                               "ranks must stay below it); --top-k filters sampling")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engine", default="auto", choices=["auto", "lean", "lean-torch", "hf"],
                   help="forward engine: lean (Llama family, fast; its C forward in bf16 on AVX-512 BF16 CPUs), "
                        "lean-torch (the lean engine on PyTorch ops only) or hf (transformers, any model); auto picks")
    p.add_argument("--lookup", type=int, default=4,
                   help="prompt-lookup draft tokens laid beside the heads' tree (0: off; measured to pay on MT-Bench)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("train", help="train Medusa heads on self-distilled data (medusa1 or medusa2)")
    _add_model_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--method", default="medusa1", choices=["medusa1", "medusa2"])
    p.add_argument("--num-heads", type=int, default=4, help="number of heads K")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--data", default="builtin", help="builtin (tiers 1-2), builtin-open (tier 3), builtin-wide (tier 4), "
                                                     "builtin-all (tiers 1-4), a ShareGPT/plain JSON(L) file, "
                                                     "or a hub dataset id")
    p.add_argument("--profile", default="quick", choices=sorted(TRAIN_PROFILES))
    p.add_argument("--prompts", type=int, default=None, help="number of prompts (0: all; default from the profile)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="reply length cap (default from the profile)")
    p.add_argument("--follow-ups", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--gen-batch", type=int, default=32, help="prompts generated together")
    p.add_argument("--max-examples", type=int, default=None,
                   help="train on a random subset of this many examples of the (cached) data")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--lr", type=float, default=None, help="heads' peak learning rate (default: the profile's, "
                                                               "3e-3 for both)")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lora-rank", type=int, default=0, help="medusa2: LoRA rank (0: full fine-tuning)")
    p.add_argument("--train-layers", type=int, default=0,
                   help="medusa2: adapt only the top L decoder layers with LoRA (--lora-rank), their inputs computed "
                        "once and cached; the heads ship with the adapter (0: the whole base, written whole)")
    p.add_argument("--base-lr", type=float, default=None,
                   help="medusa2: the base's learning rate (default 2e-4 with --train-layers, else 2e-5)")
    p.add_argument("--lm-weight", type=float, default=None,
                   help="medusa2: weight of the next-token loss (default 0 with --train-layers: the paper's "
                        "self-distillation replaces it; else 1)")
    p.add_argument("--distill-weight", type=float, default=1.0, help="medusa2: weight of KL(original || trained)")
    p.add_argument("--heads-warmup", type=float, default=0.3,
                   help="medusa2: share of the steps that train only the heads (0 when --init heads are a warm-up)")
    p.add_argument("--head-grad-to-base", type=float, default=0.2,
                   help="medusa2: share of the head losses' gradient that reaches the base (1: all of it)")
    p.add_argument("--vocab", default=None, choices=["full", "replies"],
                   help="heads' training softmax over the full vocabulary or the replies' tokens, which then become the "
                        "heads' draft vocabulary (default: profile)")
    p.add_argument("--draft-size", type=int, default=0,
                   help="with --vocab replies: only the S most frequent reply tokens (a smaller projection per tree "
                        "level at decode time; 0: all the replies' tokens)")
    p.add_argument("--soft-targets", type=float, default=0.0,
                   help="weight (0..1) of the base's own next-token distribution as the heads' target, beside "
                        "the hard label of the self-distilled data")
    p.add_argument("--condition", default=None, choices=["none", "root", "path"],
                   help="root: heads also read the embedding of the step's root token (the base's own next "
                        "token); path: and each head that of its parent in the tree; both shared format only "
                        "(default: profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--init", default=None, metavar="HEADS",
                   help="medusa1: start from heads trained before (a folder or 'default', the shipped heads) and "
                        "train them on this data; they must have the shape --num-heads/--layers/--condition give; "
                        "their draft vocabulary grows by this data's reply tokens")
    p.add_argument("--no-hidden-cache", action="store_true",
                   help="medusa1: do not keep the base hidden states on disk between runs (<cache>/hidden, "
                        "about 1.2 MB per 1000 tokens for the default model)")
    p.add_argument("--out", default="results/heads")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("calibrate", help="measure head x rank acceptance on greedy rollouts -> acceptance.json")
    _add_model_args(p)
    p.add_argument("--heads", required=True, help="heads folder or fresh:K")
    p.add_argument("--data", default="builtin", help="builtin (its calibration split) or a prompt file")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--candidates", type=int, default=10, help="ranks recorded per head (at most 36)")
    p.add_argument("--heldout", type=float, default=0.2, help="share of prompts held out")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--typical-temperature", type=float, default=None,
                   help="also store what typical acceptance at this temperature needs (search --accept typical)")
    p.add_argument("--rollouts", default="runtime", choices=["runtime", "generate"],
                   help="greedy text to calibrate on: the runtime's own plain decoding (what its greedy configurations "
                        "decode, token for token) or transformers' batched generate (faster)")
    p.add_argument("--out", default="results/acceptance.json")
    p.add_argument("--plots", default=None, help="folder for the heatmap")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("fidelity", help="how far a retrained model (Medusa-2) drifted from the original on MT-Bench")
    _add_model_args(p)
    p.add_argument("--reference", default="default", help="the original model")
    p.add_argument("--heads", default=None,
                   help="Medusa-2 heads whose base adapter is merged into --model first (a folder, default)")
    p.add_argument("--questions", default=None, help="question JSONL (default: MT-Bench, offline)")
    p.add_argument("--limit", type=int, default=20, help="first turns, spread over the categories")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default="results/fidelity.json")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_fidelity)

    p = sub.add_parser("validate", help="replay-predicted tau vs measured tau on held-out calibration prompts")
    p.add_argument("--acceptance", required=True)
    p.add_argument("--trees", nargs="+", required=True)
    p.add_argument("--model", default=None, help="default: the model the statistics name")
    p.add_argument("--heads", default=None, help="default: the heads the statistics name")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--accept", default="greedy", choices=["greedy", "typical"],
                   help="typical: sample at the calibration's typical temperature and replay typical acceptance")
    p.add_argument("--posterior-threshold", type=float, default=POSTERIOR_THRESHOLD, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, default=POSTERIOR_ALPHA, help="typical: delta")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (typical)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("profile", help="measure verify time vs tree nodes on this machine -> latency.json")
    _add_model_args(p)
    p.add_argument("--heads", required=True, help="heads folder or fresh:K")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    p.add_argument("--prefill", type=int, nargs="+", default=[],
                   help="prompt lengths whose prefill is timed (default: the contexts)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="results/latency.json")
    p.add_argument("--plots", default=None)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_profile)

    for name, helptext in (("speed", "tokens/s of generate, plain, prompt lookup and Medusa trees, interleaved"),
                           ("replay", "replay MT-Bench for a matrix of configurations (resumable records)")):
        p = sub.add_parser(name, help=helptext)
        _add_model_args(p)
        p.add_argument("--heads", default="none", help="heads folder or fresh:K")
        if name == "speed":
            p.add_argument("--tree", nargs="+", default=["mc_sim_7b_63"], help="trees to time (presets or files)")
            p.add_argument("--hf-engine", action="store_true",
                           help="also time plain decoding on transformers' forward (engine 'hf')")
            p.add_argument("--torch-path", action="store_true",
                           help="also time plain decoding on the lean engine's PyTorch path (engine 'lean-torch')")
            p.add_argument("--lookup", type=int, default=0,
                           help="also time the runtime's prompt-lookup chain of N tokens, alone and beside each tree")
            p.add_argument("--gate", type=float, nargs="+", default=[],
                           help="also time each tree with these confidence gates (with the lookup chain when given)")
            p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                           help="time only these configurations (names as in the table; generate and plain always)")
        else:
            p.add_argument("--config", required=True, help="YAML or JSON file with the configurations")
            p.add_argument("--profile-like", default=None, metavar="LATENCY",
                           help="profile this latency file's grid again during the replay, in rounds between "
                                "questions (latency-during.json): predictions priced at the replay's own speed")
            p.add_argument("--profile-every", type=int, default=2, metavar="N",
                           help="with --profile-like: one round before every N-th question (default 2)")
            p.add_argument("--storage", default=None, metavar="URL",
                           help="share the matrix among workers on several machines through this Optuna storage "
                                "(postgresql://..., mysql://..., sqlite:///...): one question a unit, each claimed once")
            p.add_argument("--study-name", default="medusa-replay", help="with --storage: the matrix's queue")
            p.add_argument("--machine", default=None,
                           help="with --storage: this machine's name in the records (default: the host name)")
            p.add_argument("--heartbeat", type=int, default=5, help="with --storage: seconds between heartbeats")
            p.add_argument("--grace-period", type=int, default=20,
                           help="with --storage: seconds without a heartbeat before a unit goes to another worker")
        p.add_argument("--questions", default=None,
                       help="question set: mt-bench (default), humaneval (both fetched offline), or a JSONL")
        p.add_argument("--categories", nargs="+", default=None)
        p.add_argument("--ids", nargs="+", type=int, default=None, metavar="ID", help="only these question ids")
        p.add_argument("--limit", type=int, default=None, help="at most N questions, spread over categories")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--repeats", type=int, default=1)
        p.add_argument("--sequential", action="store_true",
                       help="decode each answer whole, one configuration after another (default: the runtime's "
                            "configurations of a question one step each in turn, so drift hits all alike)")
        p.add_argument("--out", default=f"results/{name}")
        p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(func=cmd_speed if name == "speed" else cmd_replay)

    p = sub.add_parser("judge", help="quality of replayed answers: log-likelihood under the base (quality.json) and, "
                                     "with a judge backend, FastChat single grading (judge/)")
    _add_model_args(p)
    p.add_argument("--records", required=True, help="records.jsonl from replay")
    p.add_argument("--questions", default=None)
    p.add_argument("--backend", default="none", choices=["none", "openai", "local"],
                   help="none: proxies only (offline); openai: OPENAI_API_KEY / OPENAI_BASE_URL; local: --judge-local")
    p.add_argument("--judge-model", default="gpt-4")
    p.add_argument("--judge-local", default="default", help="local judge model (folder or 'default')")
    p.add_argument("--guided-rating", action="store_true",
                   help="a judgment without [[rating]] gets one more turn whose reply is constrained to 1-10 "
                        "(guided_choice: vLLM's or medusa-bench serve's endpoints, or the local judge); not FastChat's "
                        "rule, counted per configuration as 'guided'")
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_judge)

    p = sub.add_parser("search", help="Optuna search for the best tree from acceptance statistics (and latency)")
    p.add_argument("--acceptance", required=True, help="acceptance.json from calibrate")
    p.add_argument("--latency", default=None, help="latency.json from profile (enables the speedup objective)")
    p.add_argument("--budget", type=int, required=True, help="largest number of tree nodes (root excluded)")
    p.add_argument("--min-budget", type=int, default=1)
    p.add_argument("--trials", type=int, default=60, help="complete trials the study should hold")
    p.add_argument("--objective", default="auto", choices=["auto", "tau", "speedup"])
    p.add_argument("--estimator", default="auto", choices=["auto", "joint", "independent"],
                   help="joint replay of rollouts (when present) or the independence model")
    p.add_argument("--storage", default="sqlite:///results/treesearch.db", help="any Optuna storage URL")
    p.add_argument("--study-name", "--study", dest="study", default="medusa-tree",
                   help="Optuna study name (workers sharing it share trials)")
    p.add_argument("--heartbeat", type=int, default=5, help="seconds between a running trial's heartbeats")
    p.add_argument("--grace-period", type=int, default=20,
                   help="seconds without a heartbeat after which another worker fails the trial and runs it again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=None, help="context length for the latency model")
    p.add_argument("--baseline", default="mc_sim_7b_63", help="tree evaluated as a baseline trial ('' for none)")
    p.add_argument("--accept", default="greedy", choices=["greedy", "typical"],
                   help="acceptance rule; typical also searches its thresholds against a quality proxy (Pareto front)")
    p.add_argument("--max-regret", type=float, default=0.05,
                   help="typical: pick the fastest Pareto tree losing at most this many nats per token")
    p.add_argument("--trees-only", action="store_true",
                   help="greedy: search heads trees only (default: every configuration the runtime runs, no heads, "
                        "lookup chain and gate included, when the statistics carry rollout tokens and --latency is given)")
    p.add_argument("--max-lookup", type=int, default=8, help="longest prompt-lookup chain a configuration may use")
    p.add_argument("--exclude-ids", nargs="+", default=[], metavar="ID",
                   help="fit without the rollouts of these prompt / question ids (cross-fitting: the questions a "
                        "search's pick will be measured on)")
    p.add_argument("--out", default="results/tree.json")
    p.add_argument("--plots", default=None, help="folder for the search plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("export", help="print a tree for a server: official Python list, TensorRT-LLM, vLLM")
    p.add_argument("tree", help="tree JSON file or preset name")
    p.add_argument("--format", default="python", choices=list(EXPORT_FORMATS),
                   help="trtllm: the --medusa_choices argument; trtllm-config: the LLM API / trtllm-serve "
                        "speculative_config (JSON, also YAML); vllm: --speculative-config (its Medusa drafts a "
                        "top-1 chain: a tree is exported as its chain, with a note)")
    p.add_argument("--num-heads", type=int, default=None, help="the engine's Medusa heads (trtllm-config; "
                   "default: the tree's depth); a deeper tree is refused")
    p.add_argument("--max-draft-len", type=int, default=TRTLLM_MAX_DRAFT_LEN,
                   help="TensorRT-LLM engine's draft limit; a tree with more nodes is refused")
    p.add_argument("--draft-model", default=None,
                   help="vllm: the heads folder written by export-heads (the speculative config's 'model')")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("export-heads", help="write heads as a model folder a serving engine loads (vLLM, TGI)")
    p.add_argument("--format", default="vllm", choices=["vllm", "tgi"])
    p.add_argument("--model", default="default", help="the base model the heads belong to")
    p.add_argument("--heads", default="default", help="heads folder (either format) or 'default'")
    p.add_argument("--out", required=True, help="folder to write (replaced atomically)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="the top-1 chain's length the engine drafts (default: every head)")
    p.add_argument("--base-model", default=None,
                   help="tgi: the base TGI loads, written into config.json (default: --model; Medusa-2 heads: "
                        "the adapted base the export writes to OUT/base)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the written weights")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_export_heads)

    from bench import serve

    serve.add_parser(sub, _add_model_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a reader that went away shows here, inside the handler below
        return code
    except BrokenPipeError:  # the reader went away (`medusa-bench export ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except USER_ERRORS as exc:
        if os.environ.get("MEDUSA_BENCH_DEBUG"):
            raise
        print(f"medusa-bench: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("medusa-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
