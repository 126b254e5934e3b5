"""The stages' jobs: one frozen dataclass per command, its fields the command's flags, its defaults the
command line's; a stage's cache key is every field and the contents of what it reads, so changing any input
reruns the stage (the profile stage's key once left out the latency repeats, the calibrate stage's the
held-out share)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bench import pipeline
from bench.cli import build_parser
from bench.stages.cache import StageCache
from bench.stages.jobs import COMMAND_JOBS, JOBS, CalibrateJob, ProfileJob, ReplayJob, SearchJob, stage_key

from .conftest import fake_stage_runs, search_inputs

# the flags each command needs, with example values of the right type
REQUIRED = {"calibrate": {"heads": "fresh:2"}, "profile": {"heads": "fresh:2"},
            "search": {"acceptance": "acc.json", "budget": 8}, "replay": {"config": "matrix.json"},
            "judge": {"records": "records.jsonl"}, "train": {}, "speed": {},
            "model": {}, "draft-vocab": {"size": 64, "replies": "r.jsonl", "out": "o"}, "generate": {"prompt": "Hi"},
            "fidelity": {}, "validate": {"acceptance": "acc.json"}, "export": {}, "export-heads": {"out": "o"},
            "serve": {}, "self-prompts": {}, "distill": {}, "learning-curve": {}, "load": {}}
NOT_FIELDS = {"func", "command", "json"}  # argparse's bookkeeping and the output format


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers here
    return sub.choices[name]


def _argv(name: str) -> list[str]:
    return [name, *(x for k, v in REQUIRED[name].items() for x in (f"--{k.replace('_', '-')}", str(v)))]


def test_every_subcommand_has_a_job():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMAND_JOBS)


@pytest.mark.parametrize("name", sorted(COMMAND_JOBS))
def test_a_jobs_fields_are_its_commands_flags_and_its_defaults_the_command_lines(name):
    job_cls = COMMAND_JOBS[name]
    shown = [a for a in _subparser(name)._actions if a.help != argparse.SUPPRESS]  # old spellings: hidden
    dests = {a.dest for a in shown if a.dest != "help"} - NOT_FIELDS
    fields = {f.name for f in dataclasses.fields(job_cls)}
    assert dests == fields - {"progress"}  # progress: the command's `not --json`
    args = build_parser().parse_args(_argv(name))
    job = job_cls.from_namespace(args)
    assert job == job_cls(**REQUIRED[name])  # parsing no optional flag gives the dataclass's defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.out = "elsewhere"


def _other_value(value, annotation: str):
    """A value of the field's type that differs from ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple):
        return (*value, value[0] if value else _example(annotation.split("[", 1)[1]))
    assert value is None, (value, annotation)
    return _example(annotation)


def _example(annotation: str):
    for prefix, example in (("bool", True), ("int", 3), ("float", 0.25), ("str", "x"), ("tuple[int", (3,)),
                            ("tuple[str", ("x",)), ("tuple[float", (0.25,))):
        if annotation.startswith(prefix):
            return example
    raise AssertionError(f"no example for {annotation}")


@pytest.mark.parametrize("name", sorted(JOBS))
def test_changing_any_field_of_a_job_changes_its_stage_key(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example paths (acc.json, matrix.json) resolve here, absent
    job_cls = JOBS[name]
    job = job_cls(**REQUIRED[name])
    key = StageCache.key_of(stage_key(job))
    for field in dataclasses.fields(job_cls):
        other = dataclasses.replace(job, **{field.name: _other_value(getattr(job, field.name), str(field.type))})
        assert StageCache.key_of(stage_key(other)) != key, f"{name}: {field.name} is not in the stage key"


def test_the_keys_that_had_drifted_hold_their_inputs():
    """The profile stage's key once left out --repeats and the calibrate stage's --heldout."""
    prof = ProfileJob(heads="fresh:2", repeats=7)
    assert stage_key(prof) != stage_key(dataclasses.replace(prof, repeats=3))
    cal = CalibrateJob(heads="fresh:2", heldout=0.0)
    assert stage_key(cal) != stage_key(dataclasses.replace(cal, heldout=0.2))


def test_a_key_holds_the_contents_of_what_the_stage_reads(tmp_path):
    """Same fields, other file contents: another key. A replay's matrix names tree files and heads folders
    (the searches' picks, compared heads): theirs count too."""
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text("{}")
    cal = CalibrateJob(heads=str(heads), data=str(tmp_path / "prompts.jsonl"))
    (tmp_path / "prompts.jsonl").write_text('{"turns": ["a"]}\n')
    first = stage_key(cal)
    (heads / "config.json").write_text('{"medusa_num_heads": 2}')
    second = stage_key(cal)
    (tmp_path / "prompts.jsonl").write_text('{"turns": ["b"]}\n')
    assert len({json.dumps(k, sort_keys=True) for k in (first, second, stage_key(cal))}) == 3

    tree, other_heads = tmp_path / "pick.json", tmp_path / "m1"
    tree.write_text('{"medusa_choices": [[0]]}')
    other_heads.mkdir()
    (other_heads / "config.json").write_text("{}")
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({"configurations": [{"name": "pick", "method": "medusa", "tree": str(tree)},
                                                     {"name": "m1", "method": "medusa", "tree": "chain:1",
                                                      "heads": str(other_heads)}]}))
    replay = ReplayJob(config=str(matrix), heads=str(heads))
    before = stage_key(replay)
    tree.write_text('{"medusa_choices": [[0], [1]]}')
    after_tree = stage_key(replay)
    (other_heads / "config.json").write_text('{"x": 1}')
    assert before != after_tree != stage_key(replay) != before


def test_the_pipelines_stages_are_cached_under_their_jobs_keys(tmp_path, monkeypatch):
    """What stages.json records for a stage is the key of the job it ran, and the search stage's jobs are
    those its command line would build from the same flags."""
    ran = fake_stage_runs(monkeypatch, pipeline)
    acc, lat = search_inputs(tmp_path)
    out = tmp_path / "run"
    pipeline.stage_search(pipeline.PROFILES["quick"], out, StageCache(out), acc, lat, {"folds": [[1, 2], [3, 4]]})
    recorded = json.loads((out / "stages.json").read_text())
    names = ("search-fold-0", "search-heads-only-fold-0", "search-fold-1", "search-heads-only-fold-1", "search-typical")
    assert [recorded[n] for n in names] == [StageCache.key_of(stage_key(j)) for j in ran]
    fold1 = ran[2]
    args = build_parser().parse_args(["search", "--acceptance", str(acc), "--latency", str(lat), "--budget",
                                      str(fold1.budget), "--trials", str(fold1.trials), "--storage", fold1.storage,
                                      "--study-name", fold1.study, "--lookup", str(fold1.lookup), "--exclude-ids", "3", "4",
                                      "--out", fold1.out,
                                      "--quiet"])
    assert SearchJob.from_namespace(args) == fold1
    pipeline.stage_search(pipeline.PROFILES["quick"], out, StageCache(out), acc, lat, {"folds": [[1, 2], [3, 4]]})
    assert len(ran) == 5  # a second run: every stage cached
