"""Commands on trees: search, export, export-heads (what each runs: bench.stages.trees)."""

from __future__ import annotations

import argparse

from bench.commands import flags
from bench.stages.jobs import ExportHeadsJob, ExportJob, SearchJob
from treesearch.export import FORMATS as EXPORT_FORMATS
from treesearch.targets import TARGETS


def add_search(sub) -> None:
    p = sub.add_parser("search", help="Optuna search for the best tree from acceptance statistics (and latency)")
    p.add_argument("--acceptance", required=True, help="acceptance.json from calibrate")
    p.add_argument("--latency", help="latency.json from profile (enables the speedup objective)")
    p.add_argument("--budget", type=int, required=True, help="largest number of tree nodes (root excluded)")
    p.add_argument("--min-budget", type=int)
    p.add_argument("--trials", type=int, help="complete trials the study should hold")
    p.add_argument("--objective", choices=["auto", "tau", "speedup"])
    p.add_argument("--estimator", choices=["auto", "joint", "independent"],
                   help="joint replay of rollouts (when present) or the independence model")
    flags.add_storage(p, SearchJob.storage, SearchJob.study, "trials shared by workers on several machines")
    p.add_argument("--heartbeat", type=int, help="seconds between a running trial's heartbeats")
    p.add_argument("--grace-period", type=int,
                   help="seconds without a heartbeat after which another worker fails the trial and runs it again")
    p.add_argument("--seed", type=int)
    p.add_argument("--context", type=int, help="context length for the latency model")
    p.add_argument("--baseline", help="tree evaluated as a baseline trial ('' for none)")
    flags.add_accept(p, ("greedy", "typical"),
                     "typical also searches its thresholds against a quality proxy (Pareto front)")
    p.add_argument("--max-regret", type=float,
                   help="typical: pick the fastest Pareto tree losing at most this many nats per token")
    p.add_argument("--trees-only", action="store_true",
                   help="greedy: search heads trees only (default: every configuration the runtime runs, no heads, "
                        "lookup chain and gate included, when the statistics carry rollout tokens and --latency is given)")
    flags.add_lookup(p, "the longest chain a configuration may draft")
    flags.deprecated(p, "--max-lookup", "--lookup", "lookup", type=int)
    p.add_argument("--target", choices=list(TARGETS),
                   help="where the result is deployed: own (this runtime: trees, lookup, gates), vllm or tgi (the "
                        "heads' top-1 chain only), trtllm (trees of at most 63 nodes); engines: no lookup, no gate")
    p.add_argument("--engine-costs", metavar="REPORT",
                   help="with --target vllm: price its chains with vLLM's own step costs, measured by an engines run "
                        "(its report.json), instead of this runtime's")
    flags.add_batch_sizes(p, "also a schedule: per batch size the configuration of the highest predicted "
                             "throughput, priced by the latency profile's batched steps")
    p.add_argument("--exclude-ids", nargs="+", metavar="ID",
                   help="fit without the rollouts of these prompt / question ids (cross-fitting: the questions a "
                        "search's pick will be measured on)")
    p.add_argument("--out")
    p.add_argument("--plots", help="folder for the search plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.search:cmd_search", **SearchJob.defaults())


def add_export(sub) -> None:
    p = sub.add_parser("export", help="deploy a search's tree.json to an engine (--target, --out), or print a tree "
                                      "for a server (--format)")
    flags.add_tree(p, role="the bench's final one is results/bench/tree.json")
    p.add_argument("old_tree", nargs="?", default=None, help=argparse.SUPPRESS)  # the positional of an earlier release
    p.add_argument("--target", choices=list(TARGETS),
                   help="write everything this target loads into --out (heads, speculative config / medusa_choices / "
                        "LLM API options / TGI speculate); refused in one line where it cannot run the configuration")
    p.add_argument("--out", help="with --target: the folder to write (replaced atomically)")
    flags.add_model(p, help="with --target: the base model the heads belong to")
    flags.add_dtype(p, help=flags.WRITE_DTYPE_HELP)
    p.add_argument("--base-model",
                   help="with --target trtllm / tgi: the base the engine loads (default: --model)")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.add_argument("--format", choices=list(EXPORT_FORMATS),
                   help="trtllm: the --medusa_choices argument; trtllm-config: the LLM API / trtllm-serve "
                        "speculative_config (JSON, also YAML); vllm: --speculative-config (its Medusa drafts a "
                        "top-1 chain: a tree is exported as its chain, with a note)")
    p.add_argument("--num-heads", type=int, help="trtllm-config: the heads in the checkpoint "
                   "(TensorRT-LLM's num_medusa_heads, required); a deeper tree is refused")
    p.add_argument("--max-draft-len", type=int,
                   help="TensorRT-LLM engine's draft limit; a tree with more nodes is refused")
    p.add_argument("--draft-model",
                   help="vllm: the heads folder written by export-heads (the speculative config's 'model')")
    p.set_defaults(func="bench.stages.trees:cmd_export", **ExportJob.defaults())


def add_export_heads(sub) -> None:
    p = sub.add_parser("export-heads", help="write heads as a model folder a serving engine loads (vLLM, TGI)")
    p.add_argument("--format", choices=["vllm", "tgi"])
    flags.add_model(p, help="the base model the heads belong to")
    flags.add_heads(p)
    p.add_argument("--out", required=True, help="folder to write (replaced atomically)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="the top-1 chain's length the engine drafts (default: every head)")
    p.add_argument("--base-model",
                   help="tgi: the base TGI loads, written into config.json (default: --model; Medusa-2 heads: "
                        "the adapted base the export writes to OUT/base)")
    flags.add_dtype(p, help=flags.WRITE_DTYPE_HELP)
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.trees:cmd_export_heads", **ExportHeadsJob.defaults())
