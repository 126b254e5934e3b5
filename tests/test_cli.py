"""The command line: JSON output on the default model, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.cli import main
from medusa_runtime.decoding.decode import encode_prompt
from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads, save_heads

from .conftest import hf_greedy

PROMPT = "Give me two tips for learning to cook."


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_model_json(capsys, default_model):
    code, out, _ = run_cli(capsys, "model", "--json")
    info = json.loads(out)
    assert code == 0 and info["parameters"] == 134_515_008 and info["vocab_size"] == 49152


def test_generate_json_equals_hf_generate(capsys, default_model):
    code, out, _ = run_cli(capsys, "generate", "--heads", "fresh:5", "--tree", "mc_sim_7b_63", "--accept", "greedy",
                           "--dtype", "float32", "--max-new-tokens", "20", "--prompt", PROMPT, "--chat", "--json")
    assert code == 0
    obj = json.loads(out)
    assert {"token_ids", "text", "steps", "accept_lengths", "tau"} <= set(obj)
    ref = hf_greedy(default_model, encode_prompt(default_model, PROMPT, chat=True), 20)
    assert obj["token_ids"] == ref
    assert obj["text"] == default_model.tokenizer.decode(ref, skip_special_tokens=True)
    assert obj["steps"] == len(obj["accept_lengths"]) and obj["tau"] >= 1.0


def test_generate_sample_is_seeded(capsys, default_model):
    args = ["generate", "--heads", "fresh:2", "--tree", "chain:2", "--accept", "sample", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "11", "--max-new-tokens", "12", "--prompt", PROMPT, "--json"]
    first = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    assert json.loads(run_cli(capsys, *args)[1])["token_ids"] == first


def _bad_heads(tmp_path):
    return str(save_heads(MedusaHeads(HeadsConfig(2, 1, 32, 49152, shared_lm_head=True)), tmp_path / "h32"))


@pytest.mark.parametrize(
    "case, extra, message",
    [
        ("unknown tree", ["--heads", "fresh:4", "--tree", "no_such_tree"], "unknown tree"),
        ("malformed tree json", ["--heads", "fresh:4", "--tree", "{bad}"], "not valid JSON"),
        ("tree missing parent", ["--heads", "fresh:4", "--tree", "{orphan}"], "no parent"),
        ("tree too deep", ["--heads", "fresh:2", "--tree", "mc_sim_7b_63"], "only 2 Medusa heads"),
        ("mismatched heads", ["--heads", "{h32}"], "hidden size 32, the model has 576"),
        ("missing heads", ["--heads", "/nonexistent/heads"], "heads folder not found"),
        ("missing model", ["--model", "/nonexistent/model"], "model not found"),
        ("bad dtype", ["--dtype", "int3"], "invalid choice"),
        ("bad accept", ["--accept", "maybe"], "invalid choice"),
        ("bad temperature", ["--temperature", "-1"], "temperature must be >= 0"),
        ("bad heads spec", ["--heads", "fresh:x"], "bad heads spec"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, tmp_path, default_model, case, extra, message):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "orphan.json").write_text(json.dumps({"schema": "medusa-tree/1", "medusa_choices": [[0], [1, 1]]}))
    subs = {"{bad}": str(tmp_path / "bad.json"), "{orphan}": str(tmp_path / "orphan.json")}
    if "{h32}" in extra:
        subs["{h32}"] = _bad_heads(tmp_path)
    argv = ["generate", "--prompt", "hi", "--max-new-tokens", "2"] + [subs.get(a, a) for a in extra]
    try:
        code, out, err = run_cli(capsys, *argv)
    except SystemExit as exc:  # argparse exits by itself
        code, err = exc.code, capsys.readouterr().err
    assert code == 2, case
    lines = err.strip().splitlines()
    # the error is one line, the last; before it at most the model loader's own notes (the dtype it chose)
    assert message in lines[-1] and "error" in lines[-1] and "Traceback" not in err
    assert all(line.startswith("dtype ") for line in lines[:-1]), lines


def test_console_script_bad_tree_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "generate", "--heads", "fresh:4", "--tree", "nope",
                           "--prompt", "x"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown tree" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_help_show_defaults(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"medusa-bench {version('medusa-bench')}"
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 60)" in help_text and "(default: sqlite:///results/treesearch.db)" in help_text
    assert "--min-budget MIN_BUDGET (default: 1)" in help_text  # also options without a help text


def test_malformed_replay_yaml_is_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text("configurations:\n  - name: plain\n    method: [unclosed\n")
    code, _, err = run_cli(capsys, "replay", "--config", str(bad))
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "not valid YAML (line" in err
    bad.write_text("- just\n- a list\n")
    code, _, err = run_cli(capsys, "replay", "--config", str(bad))
    assert code == 2 and "must hold a mapping" in err


def test_search_json_is_the_tree_file(capsys, tmp_path):
    """--json prints one object: here the tree file the search wrote, with its provenance."""
    from treesearch.stats import AcceptanceStats, marginal_from_rollouts, save_stats

    rollouts = (((0, 0), (1, -1), (0, 2)), ((2, 1), (0, 0)))
    save_stats(AcceptanceStats(marginal_from_rollouts(rollouts, 2, 3), rollouts, (), {"model": "m"}),
               tmp_path / "acc.json")
    code, out, _ = run_cli(capsys, "search", "--acceptance", str(tmp_path / "acc.json"), "--budget", "3", "--trials",
                           "4", "--storage", f"sqlite:///{tmp_path}/s.db", "--baseline", "", "--out",
                           str(tmp_path / "tree.json"), "--quiet", "--json")
    obj = json.loads(out)
    assert code == 0 and obj["tree_file"] == str(tmp_path / "tree.json")
    assert obj["medusa_choices"] == json.loads((tmp_path / "tree.json").read_text())["medusa_choices"]


def test_output_cut_short_by_its_reader_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "export", "--tree", "mc_sim_7b_63", "--format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before the tree is written
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait() == 0 and "Traceback" not in err and "BrokenPipe" not in err
