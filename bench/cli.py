"""``medusa-bench``: one console script, one subcommand per stage.

Each subcommand maps its flags onto the frozen configuration dataclasses of the stage it runs,
calls it, and prints what comes back. Known bad input ends with one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError, OSError)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (offline SmolLM2-135M-Instruct), a folder or a hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (auto: cuda when present)")


def cmd_model(args: argparse.Namespace) -> int:
    from medusa_runtime.model import describe_model, load_model

    loaded = load_model(args.model, args.dtype, args.device, log=_log)
    info = describe_model(loaded)
    if args.json:
        print(json.dumps(info))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from medusa_runtime.acceptance import AcceptConfig
    from medusa_runtime.decode import DecodeConfig, MedusaDecoder, encode_prompt
    from medusa_runtime.heads import resolve_heads
    from medusa_runtime.model import load_model
    from treesearch.tree import load_tree

    accept_cfg = AcceptConfig(rule=args.accept, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              posterior_threshold=args.posterior_threshold, posterior_alpha=args.posterior_alpha)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, topk=args.topk, seed=args.seed)
    tree = load_tree(args.tree) if args.heads not in (None, "none") else None  # validate before loading a model
    loaded = load_model(args.model, args.dtype, args.device, log=_log)
    heads = resolve_heads(args.heads, loaded.hidden_size, loaded.vocab_size, base_model=args.model)
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
    from treesearch.search import SearchConfig, run_search
    from treesearch.stats import load_stats
    from treesearch.tree import save_tree

    stats = load_stats(args.acceptance)
    latency = load_profile(args.latency, expect_model=stats.meta.get("model")) if args.latency else None
    joint = {"auto": None, "joint": True, "independent": False}[args.estimator]
    cfg = SearchConfig(budget=args.budget, trials=args.trials, objective=args.objective, storage=args.storage,
                       study_name=args.study, seed=args.seed, joint=joint, min_budget=args.min_budget,
                       context=args.context, baseline=args.baseline)
    result = run_search(stats, cfg, latency, show_progress=not args.quiet)
    best = result.best
    provenance = {
        "model": stats.meta.get("model"), "heads": stats.meta.get("heads"),
        "acceptance_file": str(args.acceptance), "acceptance_sha256": stats.sha256,
        "latency_file": str(args.latency) if args.latency else None,
        "node_budget": cfg.budget, "predicted_tau": round(best.tau, 6),
        "predicted_speedup": round(best.speedup, 6) if best.speedup is not None else None,
        "estimator": "joint replay" if (joint if joint is not None else stats.has_joint) else "independence",
        "search": {"tool": "optuna", "study": cfg.study_name, "storage": cfg.storage, "objective": result.objective,
                   "trials_complete": result.trials_complete, "seed": cfg.seed},
    }
    path = save_tree(best.tree, args.out, **provenance)
    print(format_search_table(result))
    print(f"\nwritten: {path}")
    if args.plots:
        from bench.plots import plot_search

        for written in plot_search(result, stats, latency, args.plots):
            print(f"plot: {written}")
    return 0


def format_search_table(result) -> str:
    rows = [("search best", result.best), ("exact optimum (full budget)", result.optimum)]
    if result.baseline is not None:
        rows.append((f"baseline {result.baseline.tree.name}", result.baseline))
    lines = ["| tree | nodes | depth | tau | speedup |", "|---|---:|---:|---:|---:|"]
    for label, s in rows:
        sp = f"{s.speedup:.3f}x" if s.speedup is not None else "-"
        lines.append(f"| {label} | {s.tree.num_nodes - 1} | {s.tree.depth} | {s.tau:.4f} | {sp} |")
    lines.append(f"\nobjective: {result.objective}; study {result.study_name!r}: "
                 f"{result.trials_complete} complete trials ({result.storage})")
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from treesearch.export import export_tree
    from treesearch.tree import load_tree

    print(export_tree(load_tree(args.tree), args.format))
    return 0


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


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (no usage dump) and exit 2 like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="medusa-bench", description="Medusa speculative decoding: run, tune, benchmark.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("model", help="prepare and describe a base model (the offline default by default)")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_model)

    p = sub.add_parser("generate", help="decode one prompt with Medusa heads on a candidate tree")
    _add_model_args(p)
    p.add_argument("--heads", default="none", help="heads folder (either format), fresh:K[:L], or none for plain decoding")
    p.add_argument("--tree", default="mc_sim_7b_63", help="preset name, chain:N, or a tree JSON file")
    p.add_argument("--accept", default="greedy", choices=["greedy", "typical", "sample"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="top-k filter of the target distribution (0: off)")
    p.add_argument("--posterior-threshold", type=float, default=0.09, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, default=0.3, help="typical: delta")
    p.add_argument("--topk", type=int, default=10, help="candidates per head")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate)

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
    p.add_argument("--study", default="medusa-tree", help="study name (workers sharing it share trials)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=None, help="context length for the latency model")
    p.add_argument("--baseline", default="mc_sim_7b_63", help="tree evaluated as a baseline trial ('' for none)")
    p.add_argument("--out", default="results/tree.json")
    p.add_argument("--plots", default=None, help="folder for the search plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("export", help="print a tree for a server: official Python list, TensorRT-LLM, vLLM")
    p.add_argument("tree", help="tree JSON file or preset name")
    p.add_argument("--format", default="python", choices=["python", "trtllm", "vllm", "json"])
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
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
