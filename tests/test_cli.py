"""The command line: JSON output on the default model, one-line errors with exit code 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.cli import main
from medusa_runtime.decode import encode_prompt
from medusa_runtime.heads import HeadsConfig, MedusaHeads, save_heads

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
    assert len(lines) == 1, lines
    assert message in lines[0] and "Traceback" not in err


def test_console_script_bad_tree_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "generate", "--heads", "fresh:4", "--tree", "nope",
                           "--prompt", "x"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown tree" in proc.stderr
    assert "Traceback" not in proc.stderr
