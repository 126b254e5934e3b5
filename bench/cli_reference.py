"""docs/cli.md, rendered from the parsers themselves: every subcommand of ``medusa-bench`` and the flags of
``python -m bench.pipeline``, each flag with its default and help, and the shared vocabulary first.

``python -m bench.cli_reference --write`` rewrites docs/cli.md; ``--check`` exits 1 when it differs from what
the parsers say (the test suite checks the same), so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.cli import build_parser
from bench.commands import flags
from bench.pipeline import build_parser as pipeline_parser

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

HEADER = """# Command reference

Generated from the parsers by `python -m bench.cli_reference --write` (a test fails when this file and the
parsers differ). What the commands do and how they fit together: [commands.md](commands.md); the main job:
[bench.md](bench.md).

Every command that prints a result takes `--json` (one JSON object on stdout; progress and logs stay on
stderr). Bad input ends with one line on stderr and exit code 2 (`MEDUSA_BENCH_DEBUG=1`: the full traceback).
"""


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # a subcommand's one-line help describes it here
                sub = action.choices[choice.dest]
                sub.description = sub.description or choice.help
            return dict(action.choices)
    return {}


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command line of the project: ``medusa-bench SUB`` for each subcommand, and the main job."""
    parsers = {f"medusa-bench {name}": p for name, p in subparsers(build_parser()).items()}
    parsers["python -m bench.pipeline"] = pipeline_parser()
    return parsers


def default_of(parser: argparse.ArgumentParser, action: argparse.Action):
    """A flag's default as the parser applies it (a subcommand's set_defaults first)."""
    return parser._defaults.get(action.dest, action.default)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default_cell(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.required:
        return "required"
    value = default_of(parser, action)
    if value is None or value is False or value == argparse.SUPPRESS:
        return "-"
    if isinstance(value, (list, tuple)):
        value = " ".join(map(str, value)) or "-"
    return f"`{value}`"


def _flag_cell(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or action.dest
    if action.nargs == 0:
        return f"`{names}`"
    metavar = action.metavar or (f"{{{','.join(map(str, action.choices))}}}" if action.choices else
                                 action.dest.upper())
    return f"`{names} {metavar}{' ...' if action.nargs in ('+', '*') else ''}`"


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {"default": default_of(parser, action), "prog": parser.prog}
    return _cell(text)


def command_section(name: str, parser: argparse.ArgumentParser) -> str:
    lines = [f"## `{name}`", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    lines += ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        lines.append(f"| {_flag_cell(action)} | {_default_cell(parser, action)} | {_help(action, parser)} |")
    return "\n".join(lines) + "\n"


def vocabulary_section(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """The shared concepts: one flag, one default, and the commands that take it."""
    lines = ["## One vocabulary", "",
             "The same concept has the same flag and default in every command that takes it:", "",
             "| flag | default | taken by |", "|---|---|---|"]
    for dest, flag in flags.CONCEPTS.items():
        takers = [n.removeprefix("medusa-bench ") for n, p in parsers.items()
                  if any(a.dest == dest and flag in a.option_strings for a in p._actions)]
        if not takers:
            continue
        cells = {}
        for name, parser in parsers.items():
            for action in parser._actions:
                if action.dest == dest and flag in action.option_strings:
                    cells.setdefault(_default_cell(parser, action), []).append(name.removeprefix("medusa-bench "))
        if dest == "max_new_tokens":  # unset: 128, or the --profile's where the command has one
            cells = {f"auto: {flags.NEW_TOKENS}, or the `--profile`'s": takers}
        default = next(iter(cells)) if len(cells) == 1 else \
            "; ".join(f"{', '.join(names)}: {cell}" for cell, names in cells.items())
        lines.append(f"| `{flag}` | {default} | {', '.join(takers)} |")
    lines += ["", "Spellings of an earlier release still parse, with a deprecation line on stderr, until the next "
              "release: " + ", ".join(f"`{old}` ({new})" for old, new in deprecated_spellings(parsers).items())
              + ", and `export TREE` (`--tree TREE`).", ""]
    return "\n".join(lines)


def deprecated_spellings(parsers: dict[str, argparse.ArgumentParser]) -> dict[str, str]:
    found: dict[str, str] = {}
    for parser in parsers.values():
        for action in parser._actions:
            new = getattr(action, "new", None)
            if new is not None:
                for old in action.option_strings:
                    found.setdefault(old, new)
    return dict(sorted(found.items()))


def render() -> str:
    parsers = all_parsers()
    body = [HEADER, vocabulary_section(parsers)] + [command_section(n, p) for n, p in parsers.items()]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_reference", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {DOC.name}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {DOC.name} differs from the parsers")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC.write_text(text)
        print(f"written: {DOC}")
    elif args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} differs from the parsers: python -m bench.cli_reference --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
