"""One vocabulary: walks every parser of the project (each ``medusa-bench`` subcommand and ``python -m
bench.pipeline``) and checks that a concept has one flag and one default everywhere, that the old spellings
still parse into the same field with a deprecation line, and that docs/cli.md is what the parsers say."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import build_parser, resolve_args
from bench.cli_reference import DOC, all_parsers, default_of, render
from bench.commands import flags

# concept (argparse dest) -> (its one flag, its one default, commands that must take it)
EXPECTED = {
    "heads": ("--heads", "auto", {"model", "draft-vocab", "generate", "calibrate", "fidelity", "validate", "profile",
                                  "speed", "replay", "export-heads", "serve", "python -m bench.pipeline"}),
    "tree": ("--tree", "chain:2", {"generate", "validate", "speed", "export", "serve"}),
    "lookup": ("--lookup", 4, {"generate", "speed", "search", "serve"}),
    "dtype": ("--dtype", "auto", {"model", "draft-vocab", "generate", "train", "calibrate", "fidelity", "validate",
                                  "profile", "speed", "replay", "judge", "export", "export-heads", "serve",
                                  "python -m bench.pipeline"}),
    "device": ("--device", "auto", {"model", "draft-vocab", "generate", "train", "calibrate", "fidelity", "validate",
                                    "profile", "speed", "replay", "judge", "serve", "python -m bench.pipeline"}),
    "max_new_tokens": ("--max-new-tokens", None, {"generate", "train", "calibrate", "fidelity", "speed", "replay",
                                                  "serve", "python -m bench.pipeline"}),
    "judge": ("--judge", "none", {"judge", "python -m bench.pipeline"}),
    "accept": ("--accept", "greedy", {"generate", "validate", "search"}),
}


def _short(name: str) -> str:
    return name.removeprefix("medusa-bench ")


def _one(value):
    """A list of one value is that value (--tree takes several in speed and validate, one elsewhere)."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def _visible(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


@pytest.fixture(scope="module")
def parsers():
    return all_parsers()


@pytest.mark.parametrize("dest", sorted(EXPECTED))
def test_a_concept_has_one_flag_and_one_default(parsers, dest):
    flag, default, takers = EXPECTED[dest]
    seen = {}
    for name, parser in parsers.items():
        for action in _visible(parser):
            if action.dest == dest or flag in action.option_strings:
                assert action.option_strings == [flag], f"{name}: {dest} spelled {action.option_strings}"
                assert action.dest == dest, f"{name}: {flag} fills {action.dest}"
                seen[_short(name)] = _one(default_of(parser, action))
    assert takers <= set(seen), f"{dest}: missing from {sorted(takers - set(seen))}"
    # validate's --model (not walked here) defaults to the statistics' model; every other default is the one
    assert {k: v for k, v in seen.items() if v != default} == {}, f"{dest}: defaults differ from {default!r}"


def test_model_flag_is_one_name(parsers):
    for name, parser in parsers.items():
        for action in _visible(parser):
            if action.dest == "model":
                assert action.option_strings == ["--model"], name
                assert default_of(parser, action) in ("default", None), name  # None: validate, the statistics'


def test_no_old_spelling_is_shown(parsers):
    for name, parser in parsers.items():
        shown = {s for a in _visible(parser) for s in a.option_strings}
        assert not shown & set(flags.OLD_SPELLINGS), f"{name} shows {sorted(shown & set(flags.OLD_SPELLINGS))}"


def test_a_flag_name_means_one_field(parsers):
    """Across all commands, one option string always fills the same field (no --study here, study_name there)."""
    dests: dict[str, set[str]] = {}
    for parser in parsers.values():
        for action in _visible(parser):
            for option in action.option_strings:
                dests.setdefault(option, set()).add(action.dest)
    assert {o: d for o, d in dests.items() if len(d) > 1} == {}


OLD = [
    (["serve", "--max-tokens", "64"], "max_new_tokens", 64, "--max-new-tokens"),
    (["validate", "--acceptance", "a.json", "--trees", "chain:1", "chain:3"], "tree", ["chain:1", "chain:3"], "--tree"),
    (["search", "--acceptance", "a.json", "--budget", "8", "--max-lookup", "2"], "lookup", 2, "--lookup"),
    (["search", "--acceptance", "a.json", "--budget", "8", "--study", "s"], "study", "s", "--study-name"),
    (["train", "--gen-batch", "8"], "batch_size", 8, "--batch-size"),
    (["self-prompts", "--count", "20"], "limit", 20, "--limit"),
    (["judge", "--records", "r", "--backend", "local", "--judge-local", "mine"], "judge", "local:mine", "--judge"),
    (["judge", "--records", "r", "--backend", "local"], "judge", "local:default", "--judge"),
    (["judge", "--records", "r", "--judge-model", "m", "--backend", "openai"], "judge", "m", "--judge"),
    (["judge", "--records", "r", "--backend", "openai"], "judge", "gpt-4", "--judge"),
    (["judge", "--records", "r", "--backend", "none", "--judge-model", "m"], "judge", "none", "--judge"),
    (["export", "results/tree.json", "--format", "vllm"], "tree", "results/tree.json", "--tree"),
]


@pytest.mark.parametrize("argv,dest,value,new", OLD, ids=[" ".join(o[0][:1] + o[0][-2:]) for o in OLD])
def test_old_spellings_still_parse_with_a_deprecation_line(argv, dest, value, new, capsys):
    args = resolve_args(build_parser().parse_args(argv))
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    assert "deprecated" in err and f"use {new}" in err
    assert not any(k.startswith("old_") for k in vars(args))


def test_an_old_judge_model_alone_leaves_the_new_judge_flag_as_given(capsys):
    args = resolve_args(build_parser().parse_args(["judge", "--records", "r", "--judge", "m2", "--judge-model", "m"]))
    assert args.judge == "m2" and "deprecated" in capsys.readouterr().err


def test_new_spellings_parse_silently(capsys):
    args = resolve_args(build_parser().parse_args(["judge", "--records", "r", "--judge", "local:mine"]))
    assert args.judge == "local:mine" and capsys.readouterr().err == ""


def test_auto_heads_are_the_shipped_ones_on_the_default_model_only():
    from bench.stages.jobs import CalibrateJob, SpeedJob

    parse = build_parser().parse_args
    assert resolve_args(parse(["generate", "--prompt", "x"])).heads == "default"
    assert resolve_args(parse(["generate", "--model", "gemma3-270m", "--prompt", "x"])).heads == "none"
    assert resolve_args(parse(["generate", "--heads", "medusa1", "--prompt", "x"])).heads == "medusa1"
    assert resolve_args(parse(["validate", "--acceptance", "a.json"])).heads == "auto"  # the statistics' heads
    assert SpeedJob().heads == "default" and CalibrateJob(model="some/other").heads == "none"


def test_pipeline_resolves_auto_heads():
    from bench.pipeline import build_parser as pipeline_parser

    assert pipeline_parser().parse_args([]).heads == "auto"


def test_docs_cli_is_generated_from_the_parsers():
    assert DOC.read_text() == render(), "docs/cli.md is stale: python -m bench.cli_reference --write"
    text = render()
    for name in all_parsers():
        assert f"## `{name}`" in text
    assert "`--max-lookup` (--lookup)" in text and "| `--tree` | `chain:2` |" in text
