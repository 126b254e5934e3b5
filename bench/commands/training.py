"""Commands that train heads: distill, train, learning-curve, self-prompts, fidelity (what each runs: bench.stages.training)."""

from __future__ import annotations

import argparse

from bench.commands import flags
from bench.stages.jobs import DistillJob, FidelityJob, LearningCurveJob, SelfPromptsJob, TrainJob
from medusa_runtime.training.profiles import TRAIN_PROFILES


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The training recipe's flags (train and learning-curve): method, head shape, data, optimisation."""
    p.add_argument("--method", choices=["medusa1", "medusa2"])
    p.add_argument("--num-heads", type=int, help="number of heads K")
    p.add_argument("--layers", type=int, help="residual blocks per head")
    add_distill_args(p)
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


def add_distill_args(p: argparse.ArgumentParser) -> None:
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


def add_distill(sub) -> None:
    p = sub.add_parser("distill", help="the model's own replies to the training prompts (self-distillation), in an "
                                       "answer store of resumable shards with a manifest; train reuses them")
    flags.add_model_args(p)
    add_distill_args(p)
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.training:cmd_distill", **DistillJob.defaults())


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train Medusa heads on self-distilled data (medusa1 or medusa2)")
    flags.add_model_args(p)
    add_train_args(p)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.training:cmd_train", **TrainJob.defaults())


def add_learning_curve(sub) -> None:
    p = sub.add_parser("learning-curve", help="heads trained on nested prefixes of the training prompts, each measured "
                                              "on a question set: head top-1 and tau@32 against training tokens")
    flags.add_model_args(p)
    add_train_args(p)
    p.add_argument("--points", type=int, nargs="+", metavar="N",
                   help="prompt counts, one trained set each (nested prefixes of the --data mix); with --resume, "
                        "points added to a curve join those it has")
    p.add_argument("--questions", help="question set each set is measured on: mt-bench, humaneval or a question JSONL")
    p.add_argument("--eval-tokens", type=int, help="greedy rollout length per question for the measurement")
    p.add_argument("--out", help="folder: one sub-folder per point, learning_curve.json, .md and the plot")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.training:cmd_learning_curve", **LearningCurveJob.defaults())


def add_self_prompts(sub) -> None:
    p = sub.add_parser("self-prompts", help="training prompts the model writes itself (its chat template's user turn "
                                            "left open, sampled), filtered and kept apart from replayed questions")
    flags.add_model_args(p)
    flags.add_limit(p, "prompts to keep")
    flags.deprecated(p, "--count", "--limit", "limit", type=int)
    p.add_argument("--shard-size", type=int, help="prompts sampled per shard (a stopped run resumes per shard)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--max-prompt-tokens", type=int, help="a sampled user turn's length cap (longer ones are dropped)")
    p.add_argument("--batch-size", type=int, help="sequences sampled together")
    p.add_argument("--seed", type=int)
    p.add_argument("--exclude", nargs="+", metavar="SUITE",
                   help="question sets no prompt may share a word 8-gram with: mt-bench, humaneval, or JSONL files")
    p.add_argument("--out", help="folder: shards, manifest.json, prompts.jsonl")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.training:cmd_self_prompts", **SelfPromptsJob.defaults())


def add_fidelity(sub) -> None:
    p = sub.add_parser("fidelity", help="how far a retrained model (Medusa-2) drifted from the original on MT-Bench")
    flags.add_model_args(p)
    p.add_argument("--reference", help="the original model")
    flags.add_heads(p, "Medusa-2 heads have their base adapter merged into --model first")
    p.add_argument("--questions", help="question JSONL (default: MT-Bench, offline)")
    flags.add_limit(p, "first turns, spread over the categories")
    flags.add_new_tokens(p)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--out")
    p.add_argument("--json", action="store_true", help=flags.JSON_HELP)
    p.set_defaults(func="bench.stages.training:cmd_fidelity", **FidelityJob.defaults())
