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
from importlib.metadata import PackageNotFoundError, version

from bench.commands import flags, measure, replay, serve, training, trees
from bench.stages.jobs import import_function

# the subcommands in the order --help lists them
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    measure.add_model, measure.add_draft_vocab, measure.add_generate, training.add_distill, training.add_train,
    training.add_learning_curve, training.add_self_prompts, measure.add_calibrate, training.add_fidelity,
    measure.add_validate, measure.add_profile, replay.add_speed, replay.add_replay, replay.add_judge, trees.add_search,
    trees.add_export, trees.add_export_heads, serve.add_serve, serve.add_load)

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
    try:
        return version("medusa-bench")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="medusa-bench", description="Medusa speculative decoding: run, tune, benchmark. "
                     "Set MEDUSA_BENCH_DEBUG=1 for a full traceback instead of the one-line error.")
    parser.add_argument("--version", action="version", version=f"medusa-bench {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Parsed flags made concrete where one flag depends on another: the old judge flags folded into --judge,
    export's old positional tree into --tree, ``--heads auto`` into the heads it names on --model (validate
    keeps it: the statistics name their heads)."""
    from medusa_runtime.heads.medusa import auto_heads  # torch: --help and a bad flag stay light

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
    try:
        code = import_function(args.func)(args)  # --help and a bad flag never import a stage
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
