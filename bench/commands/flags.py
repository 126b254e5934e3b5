"""The command line's one vocabulary: every concept that several commands take (model, heads, tree, lookup,
dtype, device, new tokens, storage and study, judge) is added by one helper here, with one flag name, one
default and one help text, in every subcommand of ``medusa-bench`` and in ``python -m bench.pipeline``.

The defaults and how a value resolves live in ``bench.stages.defaults`` (the job dataclasses name them too). The spellings that an
earlier release used still parse, into the same field, with one deprecation line on stderr; they are hidden
from ``--help`` and go in the next release.
"""

from __future__ import annotations

import argparse
import sys

from bench.stages.defaults import (  # noqa: F401 (the vocabulary's values, read here as flags.X)
    DEVICE,
    DTYPE,
    DTYPES,
    HEADS,
    JUDGE,
    LOOKUP,
    MAX_NEW_TOKENS,
    MODEL,
    NEW_TOKENS,
    TREE,
    adopt_gguf,
    judge_name,
    judge_spec,
    new_tokens,
)

MODEL_HELP = ("'default' (offline SmolLM2-135M-Instruct), 'gemma3-270m' (offline Gemma 3 270M), a transformers "
              "causal LM folder or a hub id")
HEADS_HELP = ("heads: a folder (either checkpoint format), 'default' (the shipped Medusa-2 heads), 'medusa1', "
              "'unconditioned' (what engines load), fresh:K[:L], none, or auto (the shipped heads on the default "
              "model, none on another)")
DTYPE_HELP = "auto: float16 on CUDA, bfloat16 on a CPU with AVX-512 BF16, else float32 (printed)"
WEIGHTS_HELP = ("the layers' linear weights: dense (in --dtype) or q4_1 (GGUF Q4_1 blocks, read from the "
                "model's GGUF where it ships as one, else quantised at load; the logits projection Q8_0, the heads "
                "bf16; bfloat16 activations on the CPU's C forward)")
DEVICE_HELP = "cpu, cuda, cuda:1 ... (auto: cuda when present)"
TREE_HELP = "the heads' candidate tree: a preset (mc_sim_7b_63, chain:N, ...) or a tree JSON (a search's tree.json)"
JSON_HELP = "print one JSON object with the result (logs and progress stay on stderr)"
WRITE_DTYPE_HELP = "dtype of the written weights (auto: bfloat16, what the engines serve)"
ACCEPT_RULES = {"greedy": "the base's own greedy tokens", "typical": "the Medusa paper's typical acceptance",
                "sample": "exact speculative sampling"}  # the acceptance rules, each with what it keeps
JUDGE_HELP = ("grade answers FastChat's way (single mode) with this judge: a model behind an OpenAI-compatible "
              "endpoint (OPENAI_BASE_URL, OPENAI_API_KEY), local:MODEL (a model loaded here; local:default), or none "
              "(the log-likelihood proxy only)")


class _Deprecated(argparse.Action):
    """An old spelling of a flag: stores into the new one's field and says so on stderr."""

    def __init__(self, option_strings, dest, new: str, nargs=None, **kwargs):
        self.new = new
        kwargs["help"] = argparse.SUPPRESS
        kwargs["default"] = argparse.SUPPRESS  # never overwrites the new flag's default
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        warn_deprecated(parser.prog, option_string or self.dest, self.new)
        setattr(namespace, self.dest, values)


def warn_deprecated(prog: str, old: str, new: str) -> None:
    print(f"{prog}: warning: {old} is deprecated, use {new} (the old spelling goes in the next release)",
          file=sys.stderr)


def deprecated(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs) -> None:
    """``old`` parses into ``dest`` (the field ``new`` fills), with a deprecation line."""
    p.add_argument(old, dest=dest, action=_Deprecated, new=new, **kwargs)


def add_model(p: argparse.ArgumentParser, default: str | None = MODEL, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", default=default, help=help)


def add_dtype(p: argparse.ArgumentParser, help: str = DTYPE_HELP) -> None:
    p.add_argument("--dtype", default=DTYPE, choices=DTYPES, help=help)


def add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="dense", choices=("dense", "q4_1"), help=WEIGHTS_HELP)


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=DEVICE, help=DEVICE_HELP)


def add_gguf(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", metavar="PATH", help="the --model's GGUF copied by hand (a machine without the package "
                   "registry): checked against its pinned sha256 and put into the model cache, where every command "
                   "finds it")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The base model and where it runs: --model, --dtype, --weights, --device."""
    add_model(p)
    add_dtype(p)
    add_weights(p)
    add_device(p)


def add_heads(p: argparse.ArgumentParser, role: str = "") -> None:
    p.add_argument("--heads", default=HEADS, help=HEADS_HELP + (f"; {role}" if role else ""))


def add_tree(p: argparse.ArgumentParser, many: bool = False, role: str = "") -> None:
    """--tree: one tree, or with ``many`` several (a list, the default one tree)."""
    help = (TREE_HELP + ("; several may follow" if many else "") + (f"; {role}" if role else ""))
    if many:
        p.add_argument("--tree", nargs="+", default=[TREE], help=help)
    else:
        p.add_argument("--tree", default=TREE, help=help)


def add_lookup(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--lookup", type=int, default=LOOKUP, metavar="N",
                   help=f"prompt-lookup draft tokens: {role} (0: none)")


def add_new_tokens(p: argparse.ArgumentParser, auto: str = f"{NEW_TOKENS}") -> None:
    """--max-new-tokens; unset (auto) it is ``auto`` (NEW_TOKENS, or what the command's profile says)."""
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, metavar="N",
                   help=f"new tokens per answer at most (default: auto, {auto})")


def add_accept(p: argparse.ArgumentParser, rules: tuple[str, ...] = tuple(ACCEPT_RULES), role: str = "") -> None:
    """--accept: the acceptance rule, among the ``rules`` this command runs."""
    described = ", ".join(f"{r} ({ACCEPT_RULES[r]})" for r in rules)
    p.add_argument("--accept", choices=list(rules), help=f"acceptance rule: {described}" + (f"; {role}" if role else ""))


def add_limit(p: argparse.ArgumentParser, help: str) -> None:
    """--limit N: at most N of what the command reads or makes."""
    p.add_argument("--limit", type=int, metavar="N", help=help)


def add_judge(p: argparse.ArgumentParser) -> None:
    p.add_argument("--judge", default=JUDGE, metavar="JUDGE", help=JUDGE_HELP)
    p.add_argument("--guided-rating", action="store_true",
                   help="with --judge: a judgment without [[rating]] gets one more turn whose reply is constrained to "
                        "1-10 (vLLM's guided_choice, medusa-bench serve, or a local judge); not FastChat's rule, "
                        "counted per configuration as 'guided'")


def add_storage(p: argparse.ArgumentParser, default: str | None, study: str, role: str) -> None:
    """--storage and --study-name: an Optuna storage URL shared by workers, and the study (queue) they share."""
    p.add_argument("--storage", default=default, metavar="URL",
                   help=f"{role}: an Optuna storage URL (postgresql://USER@HOST:PORT/DB, mysql://..., sqlite:///FILE)")
    p.add_argument("--study-name", dest="study", default=study, help="the study workers sharing --storage share")
    deprecated(p, "--study", "--study-name", "study")


def add_old_judge_flags(p: argparse.ArgumentParser) -> None:
    """judge's --backend, --judge-model, --judge-local: kept aside, folded into --judge by ``fold_old_judge``."""
    deprecated(p, "--backend", "--judge", "old_backend", choices=["none", "openai", "local"])
    deprecated(p, "--judge-model", "--judge MODEL", "old_judge_model")
    deprecated(p, "--judge-local", "--judge local:MODEL", "old_judge_local")


def fold_old_judge(args: argparse.Namespace) -> None:
    """The old judge flags as --judge: only --backend chose a judge (--judge-model and --judge-local alone did
    nothing, and they leave --judge as given)."""
    old = [getattr(args, k, None) for k in ("old_backend", "old_judge_model", "old_judge_local")]
    if old[0] is not None:
        args.judge = judge_spec(*old)
    for k in ("old_backend", "old_judge_model", "old_judge_local"):
        if hasattr(args, k):
            delattr(args, k)


CONCEPTS = {"model": "--model", "heads": "--heads", "tree": "--tree", "lookup": "--lookup", "dtype": "--dtype", "weights": "--weights",
            "device": "--device", "max_new_tokens": "--max-new-tokens", "judge": "--judge", "storage": "--storage",
            "study": "--study-name"}
# old spellings (hidden, still parsed) of the concepts above, for the test that walks the parsers
OLD_SPELLINGS = ("--count", "--trees", "--max-tokens", "--max-lookup", "--study", "--backend", "--judge-model", "--judge-local",
                 "--gen-batch")


def batch_sizes(text: str) -> tuple[int, ...]:
    """``1,2,4,8,16``: batch sizes, ascending from 1."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes are integers separated by commas, got {text!r}") from None
    if not sizes or sizes[0] != 1:
        raise argparse.ArgumentTypeError(f"batch sizes start at 1, got {text!r}")
    return sizes


def add_batch_sizes(p, role: str) -> None:
    p.add_argument("--batch-sizes", type=batch_sizes, metavar="LIST", help=f"{role} (comma-separated, from 1: "
                   "1,2,4,8,16)")
