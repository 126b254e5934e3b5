"""``medusa-bench``: one console script, one subcommand per stage.

Each subcommand maps its flags onto the frozen configuration dataclasses of the stage it runs,
calls it, and prints what comes back. Known bad input ends with one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence

from bench.commands import flags
from bench.commands.common import _log, _model_and_heads, _result  # noqa: F401 (re-exported)
from bench.commands.flags import add_model_args as _add_model_args
from bench.commands.measure import (  # noqa: F401 (format_*, replay_rows: re-exported)
    cmd_calibrate,
    cmd_draft_vocab,
    cmd_generate,
    cmd_model,
    cmd_profile,
    cmd_validate,
    format_replay_rows,
    format_stats_table,
    replay_rows,
)
from bench.commands.replay import _replay_inputs, cmd_judge, cmd_replay, cmd_speed  # noqa: F401
from bench.commands.training import cmd_distill, cmd_fidelity, cmd_learning_curve, cmd_self_prompts, cmd_train
from bench.commands.trees import cmd_export, cmd_export_heads, cmd_search
from bench.jobs import (
    CalibrateJob,
    DistillJob,
    DraftVocabJob,
    ExportHeadsJob,
    ExportJob,
    FidelityJob,
    GenerateJob,
    JudgeJob,
    LearningCurveJob,
    ModelInfoJob,
    ProfileJob,
    ReplayJob,
    SearchJob,
    SelfPromptsJob,
    SpeedJob,
    TrainJob,
    ValidateJob,
)
from medusa_runtime.training.profiles import TRAIN_PROFILES
from treesearch.export import FORMATS as EXPORT_FORMATS
from treesearch.targets import TARGETS

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, RuntimeError, OSError)


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default in its help (those that have one: not None, not a switch left off)."""

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        empty = isinstance(action.default, (list, tuple)) and not action.default
        return bool(action.option_strings) and not empty and action.default not in (None, False, argparse.SUPPRESS)

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
WRITE_DTYPE_HELP = "dtype of the written weights (auto: bfloat16, what the engines serve)"


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """The training recipe's flags (train and learning-curve): method, head shape, data, optimisation."""
    p.add_argument("--method", choices=["medusa1", "medusa2"])
    p.add_argument("--num-heads", type=int, help="number of heads K")
    p.add_argument("--layers", type=int, help="residual blocks per head")
    _add_distill_args(p)
    p.add_argument("--max-examples", type=int,
                   help="train on a random subset of this many examples of the (cached) data")
    p.add_argument("--epochs", type=float)
    p.add_argument("--lr", type=float, help="heads' peak learning rate (default: the profile's, "
                                            "3e-3 for both)")
    p.add_argument("--batch-tokens", type=int)
    p.add_argument("--lora-rank", type=int, help="medusa2: LoRA rank (0: full fine-tuning)")
    p.add_argument("--train-layers", type=int,
                   help="medusa2: adapt only the top L decoder layers with LoRA (--lora-rank), their inputs computed "
                        "once and cached; the heads ship with the adapter (0: the whole base, written whole)")
    p.add_argument("--base-lr", type=float,
                   help="medusa2: the base's learning rate (default 2e-4 with --train-layers, else 2e-5)")
    p.add_argument("--lm-weight", type=float,
                   help="medusa2: weight of the next-token loss (default 0 with --train-layers: the paper's "
                        "self-distillation replaces it; else 1)")
    p.add_argument("--distill-weight", type=float, help="medusa2: weight of KL(original || trained)")
    p.add_argument("--heads-warmup", type=float,
                   help="medusa2: share of the steps that train only the heads (0 when --init heads are a warm-up)")
    p.add_argument("--head-grad-to-base", type=float,
                   help="medusa2: share of the head losses' gradient that reaches the base (1: all of it)")
    p.add_argument("--vocab", choices=["full", "replies"],
                   help="heads' training softmax over the full vocabulary or the replies' tokens, which then become the "
                        "heads' draft vocabulary (default: profile)")
    p.add_argument("--draft-size", type=int,
                   help="with --vocab replies: only the S most frequent reply tokens (a smaller projection per tree "
                        "level at decode time; 0: all the replies' tokens)")
    p.add_argument("--soft-targets", type=float,
                   help="weight (0..1) of the base's own next-token distribution as the heads' target, beside "
                        "the hard label of the self-distilled data")
    p.add_argument("--condition", choices=["none", "root", "path"],
                   help="root: heads also read the embedding of the step's root token (the base's own next "
                        "token); path: and each head that of its parent in the tree; both shared format only "
                        "(default: profile)")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--init", metavar="HEADS",
                   help="medusa1: start from heads trained before (a folder or 'default', the shipped heads) and "
                        "train them on this data; they must have the shape --num-heads/--layers/--condition give; "
                        "their draft vocabulary grows by this data's reply tokens")
    p.add_argument("--no-hidden-cache", action="store_true",
                   help="medusa1: do not keep the base hidden states on disk between runs (<cache>/hidden, "
                        "about 1.2 MB per 1000 tokens for the default model)")


def _add_distill_args(p: argparse.ArgumentParser) -> None:
    """The training data's flags (distill and train): prompts, reply length and where the replies are kept."""
    p.add_argument("--data", help="builtin (tiers 1-2), builtin-open (tier 3), builtin-wide (tier 4), "
                                   "builtin-all (tiers 1-4), a ShareGPT/plain JSON(L) file, "
                                   "or a hub dataset id; A+B mixes sources, spread evenly (training.json records the mix)")
    p.add_argument("--profile", choices=sorted(TRAIN_PROFILES))
    p.add_argument("--prompts", type=int, help="number of prompts (0: all; default from the profile)")
    flags.add_new_tokens(p, "the --profile's: " + ", ".join(f"{k} {v['max_new_tokens']}"
                                                        for k, v in TRAIN_PROFILES.items()))
    p.add_argument("--follow-ups", action=argparse.BooleanOptionalAction)
    p.add_argument("--batch-size", type=int, help="prompts generated together while distilling")
    flags.deprecated(p, "--gen-batch", "--batch-size", "batch_size", type=int)
    p.add_argument("--shard-size", type=int, help="replies per shard of the answer store (a stopped run keeps every "
                                                 "finished shard)")
    p.add_argument("--answers", metavar="DIR",
                   help="the answer store's folder (default: one in the cache, named by model, weights, dtype and reply "
                        "length); a store made elsewhere, a GPU machine say, is reused where its settings match")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="medusa-bench", description="Medusa speculative decoding: run, tune, benchmark. "
                     "Set MEDUSA_BENCH_DEBUG=1 for a full traceback instead of the one-line error.")
    parser.add_argument("--version", action="version", version=f"medusa-bench {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("model", help="prepare and describe a base model (the offline default by default)")
    _add_model_args(p)
    flags.add_gguf(p)
    flags.add_heads(p, "the base is described as they decode with it (Medusa-2 heads: their adapter merged)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_model, **ModelInfoJob.defaults())

    p = sub.add_parser("draft-vocab", help="copy a heads folder with its draft vocabulary cut to the S most "
                                           "frequent tokens of some replies (a smaller projection per step)")
    _add_model_args(p)
    flags.add_heads(p, "the heads to copy")
    p.add_argument("--size", type=int, required=True, help="tokens to keep (S)")
    p.add_argument("--replies", required=True,
                   help="self-distilled replies: an answer store folder (what 'distill' and 'train' write, under the "
                        "model cache's distill/ folder by default) or one JSONL of replies (turns, input_ids, "
                        "reply_start); never the workload you measure on")
    p.add_argument("--limit", type=int, help="read only its first N replies")
    p.add_argument("--max-len", type=int, help="count reply tokens up to this position, as training does")
    p.add_argument("--out", required=True, help="new folder for the copy")
    p.set_defaults(func=cmd_draft_vocab, **DraftVocabJob.defaults())

    p = sub.add_parser("generate", help="decode one prompt with Medusa heads on a candidate tree")
    _add_model_args(p)
    flags.add_heads(p, "none: plain decoding")
    flags.add_tree(p)
    p.add_argument("--accept", choices=["greedy", "typical", "sample"])
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int, help="top-k filter of the target distribution (0: off)")
    p.add_argument("--posterior-threshold", type=float, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, help="typical: delta")
    p.add_argument("--candidates", type=int, help="candidates read from each head's top-k (the tree's "
                                                  "ranks must stay below it); --top-k filters sampling")
    p.add_argument("--seed", type=int)
    flags.add_new_tokens(p)
    p.add_argument("--engine", choices=["auto", "lean", "lean-torch", "lean-static", "hf"],  # engine.ENGINES
                   help="forward engine: lean (Llama family, fast; its C forward in bf16 on AVX-512 BF16 CPUs, CUDA "
                        "graphs on CUDA), lean-torch (the lean engine on eager PyTorch ops), lean-static (the "
                        "fixed-shape steps CUDA graphs capture, run eagerly) or hf (transformers, any model); auto "
                        "picks")
    flags.add_lookup(p, "a chain laid beside the heads' tree (measured to pay on MT-Bench)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_generate, **GenerateJob.defaults())

    p = sub.add_parser("distill", help="the model's own replies to the training prompts (self-distillation), in an "
                                       "answer store of resumable shards with a manifest; train reuses them")
    _add_model_args(p)
    _add_distill_args(p)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_distill, **DistillJob.defaults())

    p = sub.add_parser("train", help="train Medusa heads on self-distilled data (medusa1 or medusa2)")
    _add_model_args(p)
    _add_train_args(p)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_train, **TrainJob.defaults())

    p = sub.add_parser("learning-curve", help="heads trained on nested prefixes of the training prompts, each measured "
                                              "on a question set: head top-1 and tau@32 against training tokens")
    _add_model_args(p)
    _add_train_args(p)
    p.add_argument("--points", type=int, nargs="+", metavar="N",
                   help="prompt counts, one trained set each (nested prefixes of the --data mix); with --resume, "
                        "points added to a curve join those it has")
    p.add_argument("--questions", help="question set each set is measured on: mt-bench, humaneval or a question JSONL")
    p.add_argument("--eval-tokens", type=int, help="greedy rollout length per question for the measurement")
    p.add_argument("--out", help="folder: one sub-folder per point, learning_curve.json, .md and the plot")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_learning_curve, **LearningCurveJob.defaults())

    p = sub.add_parser("self-prompts", help="training prompts the model writes itself (its chat template's user turn "
                                            "left open, sampled), filtered and kept apart from replayed questions")
    _add_model_args(p)
    p.add_argument("--count", type=int, help="prompts to keep")
    p.add_argument("--shard-size", type=int, help="prompts sampled per shard (a stopped run resumes per shard)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--max-prompt-tokens", type=int, help="a sampled user turn's length cap (longer ones are dropped)")
    p.add_argument("--batch-size", type=int, help="sequences sampled together")
    p.add_argument("--seed", type=int)
    p.add_argument("--exclude", nargs="+", metavar="SUITE",
                   help="question sets no prompt may share a word 8-gram with: mt-bench, humaneval, or JSONL files")
    p.add_argument("--out", help="folder: shards, manifest.json, prompts.jsonl")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_self_prompts, **SelfPromptsJob.defaults())

    p = sub.add_parser("calibrate", help="measure head x rank acceptance on greedy rollouts -> acceptance.json")
    _add_model_args(p)
    flags.add_heads(p)
    p.add_argument("--data", help="builtin (its calibration split) or a prompt file")
    p.add_argument("--limit", type=int, help="use the first N prompts")
    flags.add_new_tokens(p)
    p.add_argument("--candidates", type=int, help="ranks recorded per head (at most 36)")
    p.add_argument("--heldout", type=float, help="share of prompts held out")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--typical-temperature", type=float,
                   help="also store what typical acceptance at this temperature needs (search --accept typical)")
    p.add_argument("--rollouts", choices=["runtime", "generate"],
                   help="greedy text to calibrate on: the runtime's own plain decoding (what its greedy configurations "
                        "decode, token for token) or transformers' batched generate (faster)")
    p.add_argument("--out")
    p.add_argument("--plots", help="folder for the heatmap")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_calibrate, **CalibrateJob.defaults())

    p = sub.add_parser("fidelity", help="how far a retrained model (Medusa-2) drifted from the original on MT-Bench")
    _add_model_args(p)
    p.add_argument("--reference", help="the original model")
    flags.add_heads(p, "Medusa-2 heads have their base adapter merged into --model first")
    p.add_argument("--questions", help="question JSONL (default: MT-Bench, offline)")
    p.add_argument("--limit", type=int, help="first turns, spread over the categories")
    flags.add_new_tokens(p)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_fidelity, **FidelityJob.defaults())

    p = sub.add_parser("validate", help="replay-predicted tau vs measured tau on held-out calibration prompts")
    p.add_argument("--acceptance", required=True)
    flags.add_tree(p, many=True, role="each replayed and decoded")
    flags.deprecated(p, "--trees", "--tree", "tree", nargs="+")
    flags.add_model(p, default=None, help="default: the model the statistics name")
    flags.add_heads(p, "here auto: the heads the statistics name")
    flags.add_dtype(p, help="auto: the dtype the statistics were measured in")
    flags.add_device(p)
    p.add_argument("--accept", choices=["greedy", "typical"],
                   help="typical: sample at the calibration's typical temperature and replay typical acceptance")
    p.add_argument("--posterior-threshold", type=float, help="typical: epsilon")
    p.add_argument("--posterior-alpha", type=float, help="typical: delta")
    p.add_argument("--seed", type=int, help="sampling seed (typical)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_validate, **ValidateJob.defaults())

    p = sub.add_parser("profile", help="measure verify time vs tree nodes on this machine -> latency.json")
    _add_model_args(p)
    flags.add_heads(p)
    p.add_argument("--nodes", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--prefill", type=int, nargs="+",
                   help="prompt lengths whose prefill is timed (default: the contexts)")
    p.add_argument("--repeats", type=int)
    p.add_argument("--out")
    p.add_argument("--plots")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_profile, **ProfileJob.defaults())

    for name, helptext in (("speed", "tokens/s of generate, plain, prompt lookup and Medusa trees, interleaved"),
                           ("replay", "replay MT-Bench for a matrix of configurations (resumable records)")):
        p = sub.add_parser(name, help=helptext)
        _add_model_args(p)
        flags.add_heads(p)
        if name == "speed":
            flags.add_tree(p, many=True, role="each timed")
            p.add_argument("--hf-engine", action="store_true",
                           help="also time plain decoding on transformers' forward (engine 'hf')")
            p.add_argument("--torch-path", action="store_true",
                           help="also time plain decoding on the lean engine's PyTorch path (engine 'lean-torch')")
            flags.add_lookup(p, "also time the runtime's chain of N, alone and beside each tree")
            p.add_argument("--gate", type=float, nargs="+",
                           help="also time each tree with these confidence gates (with the lookup chain when given)")
            p.add_argument("--only", nargs="+", metavar="NAME",
                           help="time only these configurations (names as in the table; generate and plain always)")
        else:
            p.add_argument("--config", required=True, help="YAML or JSON file with the configurations")
            p.add_argument("--profile-like", metavar="LATENCY",
                           help="profile this latency file's grid again during the replay, in rounds between "
                                "questions (latency-during.json): predictions priced at the replay's own speed")
            p.add_argument("--profile-every", type=int, metavar="N",
                           help="with --profile-like: one round before every N-th question (default 2)")
            flags.add_storage(p, None, ReplayJob.study, "share the matrix among workers on several machines (one "
                                                        "question a unit, each claimed once)")
            p.add_argument("--machine",
                           help="with --storage: this machine's name in the records (default: the host name)")
            p.add_argument("--heartbeat", type=int, help="with --storage: seconds between heartbeats")
            p.add_argument("--grace-period", type=int,
                           help="with --storage: seconds without a heartbeat before a unit goes to another worker")
        p.add_argument("--questions",
                       help="question set: mt-bench (default), humaneval (both fetched offline), or a JSONL")
        p.add_argument("--categories", nargs="+")
        p.add_argument("--ids", nargs="+", type=int, metavar="ID", help="only these question ids")
        p.add_argument("--limit", type=int, help="at most N questions, spread over categories")
        flags.add_new_tokens(p)
        p.add_argument("--repeats", type=int)
        p.add_argument("--sequential", action="store_true",
                       help="decode each answer whole, one configuration after another (default: the runtime's "
                            "configurations of a question one step each in turn, so drift hits all alike)")
        p.add_argument("--out")
        p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.set_defaults(func=cmd_speed if name == "speed" else cmd_replay,
                       **(SpeedJob if name == "speed" else ReplayJob).defaults())

    p = sub.add_parser("judge", help="quality of replayed answers: log-likelihood under the base (quality.json) and, "
                                     "with a judge backend, FastChat single grading (judge/)")
    _add_model_args(p)
    p.add_argument("--records", required=True, help="records.jsonl from replay")
    p.add_argument("--questions")
    flags.add_judge(p)
    flags.add_old_judge_flags(p)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_judge, **JudgeJob.defaults())

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
    p.add_argument("--accept", choices=["greedy", "typical"],
                   help="acceptance rule; typical also searches its thresholds against a quality proxy (Pareto front)")
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
    p.add_argument("--exclude-ids", nargs="+", metavar="ID",
                   help="fit without the rollouts of these prompt / question ids (cross-fitting: the questions a "
                        "search's pick will be measured on)")
    p.add_argument("--out")
    p.add_argument("--plots", help="folder for the search plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_search, **SearchJob.defaults())

    p = sub.add_parser("export", help="deploy a search's tree.json to an engine (--target, --out), or print a tree "
                                      "for a server (--format)")
    flags.add_tree(p, role="the bench's final one is results/bench/tree.json")
    p.add_argument("old_tree", nargs="?", default=None, help=argparse.SUPPRESS)  # the positional of an earlier release
    p.add_argument("--target", choices=list(TARGETS),
                   help="write everything this target loads into --out (heads, speculative config / medusa_choices / "
                        "LLM API options / TGI speculate); refused in one line where it cannot run the configuration")
    p.add_argument("--out", help="with --target: the folder to write (replaced atomically)")
    flags.add_model(p, help="with --target: the base model the heads belong to")
    flags.add_dtype(p, help=WRITE_DTYPE_HELP)
    p.add_argument("--base-model",
                   help="with --target trtllm / tgi: the base the engine loads (default: --model)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
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
    p.set_defaults(func=cmd_export, **ExportJob.defaults())

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
    flags.add_dtype(p, help=WRITE_DTYPE_HELP)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_export_heads, **ExportHeadsJob.defaults())

    from bench import serve

    serve.add_parser(sub, _add_model_args)
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Parsed flags made concrete where one flag depends on another: the old judge flags folded into --judge,
    export's old positional tree into --tree, ``--heads auto`` into the heads it names on --model (validate
    keeps it: the statistics name their heads)."""
    from medusa_runtime.heads import auto_heads

    flags.fold_old_judge(args)
    if getattr(args, "old_tree", None) is not None:
        flags.warn_deprecated("medusa-bench export", "the tree as a positional argument", "--tree")
        args.tree = args.old_tree
    if hasattr(args, "old_tree"):
        del args.old_tree
    if getattr(args, "heads", None) == "auto" and getattr(args, "model", None) is not None:
        args.heads = auto_heads(args.heads, args.model)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve_args(build_parser().parse_args(argv))
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
