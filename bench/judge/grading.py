"""FastChat-style single-answer grading (MT-Bench "single" mode), with cached, retrying backends.

* prompts: FastChat's judge prompts; math, reasoning and coding use the reference-answer variants
  (``single-math-v1``), second turns the multi-turn variants that show the whole conversation;
* parsing: ``[[rating]]``, falling back to ``[rating]``, and -1 when neither appears; optionally (not
  FastChat's rule, and labelled so wherever it is used) a judgment with neither is followed by one more
  turn that asks for the number alone, its reply constrained to "1".."10" (``guided_choice``, as vLLM's
  and ``medusa-bench serve``'s endpoints accept; the local judge constrains its own decoding). A small
  judge that never writes the format still rates every answer that way;
* aggregation: mean score per (model, turn) and per category, ignoring -1 as FastChat does;
* backends: any OpenAI-compatible chat endpoint (``OPENAI_API_KEY``, ``OPENAI_BASE_URL``), with
  retries and exponential backoff on 429/5xx, or a local transformers model. Every answer is
  cached by the hash of (judge model, system prompt, user prompt), so a rerun costs nothing.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pandas as pd
import torch

from bench.replay.mtbench import Question, mtbench_dir
from medusa_runtime.decoding.guided import guided_choice
from medusa_runtime.model import chat_template_ids

NEED_REF_CATEGORIES = ("math", "reasoning", "coding")
_SCORE = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_SCORE_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
RATING_CHOICES = tuple(str(i) for i in range(1, 11))
RATING_FOLLOWUP = ("Your evaluation did not give the rating in the required format. Rate the response on a scale "
                   "of 1 to 10. Reply with the number only.")


def parse_rating(judgment: str) -> float:
    """FastChat's rule: the first ``[[x]]``, else the first ``[x]``, else -1."""
    match = _SCORE.search(judgment) or _SCORE_BACKUP.search(judgment)
    if not match:
        return -1
    try:
        return float(ast.literal_eval(match.group(1)))
    except (ValueError, SyntaxError):
        return -1


@dataclass(frozen=True)
class JudgePrompt:
    name: str  # single-v1, single-math-v1, single-v1-multi-turn, single-math-v1-multi-turn
    system_prompt: str
    prompt_template: str


def load_judge_prompts(path: str | Path | None = None) -> dict[str, JudgePrompt]:
    file = Path(path) if path else mtbench_dir() / "judge_prompts.jsonl"
    out = {}
    for line in file.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["name"]] = JudgePrompt(r["name"], r["system_prompt"], r["prompt_template"])
    return out


def load_references(path: str | Path | None = None) -> dict[int, list[str]]:
    """question_id -> reference answer turns (GPT-4's, as FastChat uses)."""
    file = Path(path) if path else mtbench_dir() / "reference_gpt-4.jsonl"
    refs = {}
    for line in file.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            refs[int(r["question_id"])] = list(r["choices"][0]["turns"])
    return refs


def build_judge_prompt(prompts: dict[str, JudgePrompt], question: Question, answers: Sequence[str], turn: int,
                       reference: Sequence[str] | None) -> tuple[str, str, str]:
    """(judge prompt name, system prompt, user prompt) for grading ``turn`` (0-based) of ``answers``."""
    needs_ref = question.category in NEED_REF_CATEGORIES
    if needs_ref and reference is None:
        raise ValueError(f"question {question.question_id} ({question.category}) needs a reference answer")
    name = ("single-math-v1" if needs_ref else "single-v1") + ("-multi-turn" if turn == 1 else "")
    jp = prompts[name]
    if turn == 0:
        kwargs = {"question": question.turns[0], "answer": answers[0]}
        if needs_ref:
            kwargs["ref_answer_1"] = reference[0]
    else:
        kwargs = {"question_1": question.turns[0], "question_2": question.turns[1], "answer_1": answers[0],
                  "answer_2": answers[1]}
        if needs_ref:
            kwargs.update(ref_answer_1=reference[0], ref_answer_2=reference[1])
    return name, jp.system_prompt, jp.prompt_template.format(**kwargs)


# ---------------------------------------------------------------------------- backends


class Backend(Protocol):
    name: str
    def complete(self, system: str, user: str) -> str: ...

    def rate(self, system: str, user: str, judgment: str) -> str:
        """The follow-up turn after ``judgment``: one of RATING_CHOICES."""
        ...


def rating_messages(system: str, user: str, judgment: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": judgment}, {"role": "user", "content": RATING_FOLLOWUP}]


class OpenAIBackend:
    """Any OpenAI-compatible ``/chat/completions`` endpoint; key and base URL from the environment."""

    def __init__(self, model: str = "gpt-4", base_url: str | None = None, api_key: str | None = None,
                 retries: int = 5, backoff: float = 1.0, timeout: float = 120.0):
        self.name = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1").rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.retries, self.backoff, self.timeout = retries, backoff, timeout

    def complete(self, system: str, user: str) -> str:
        return self._post({"model": self.name, "temperature": 0, "max_tokens": 2048,
                           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})

    def rate(self, system: str, user: str, judgment: str) -> str:
        # the constraint in both spellings: vLLM from 0.1x on reads ``structured_outputs.choice`` (0.32's
        # vllm/entrypoints/openai/chat_completion/protocol.py has no guided_choice) and ignores unknown fields;
        # earlier vLLM and medusa-bench serve read ``guided_choice``
        choices = list(RATING_CHOICES)
        reply = self._post({"model": self.name, "temperature": 0, "max_tokens": 4,
                            "messages": rating_messages(system, user, judgment),
                            "structured_outputs": {"choice": choices}, "guided_choice": choices})
        if reply.strip() not in RATING_CHOICES:
            raise RuntimeError(f"the judge endpoint ignored the choice constraint (replied {reply[:40]!r}); it needs an "
                               "engine that constrains replies (vLLM, medusa-bench serve), or no --guided-rating")
        return reply.strip()

    def _post(self, payload: dict) -> str:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(f"{self.base_url}/chat/completions", data=body, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as exc:
                exc.close()  # the error carries the open response; its body is not read
                if exc.code not in (408, 409, 429) and exc.code < 500:
                    raise RuntimeError(f"judge endpoint refused the request: HTTP {exc.code}") from None
                last = exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                last = exc
            time.sleep(self.backoff * 2 ** attempt)
        raise RuntimeError(f"judge endpoint failed after {self.retries + 1} tries: {last}")


class LocalBackend:
    """A local transformers chat model as the judge (greedy)."""

    def __init__(self, loaded, max_new_tokens: int = 512):
        self.loaded, self.max_new_tokens = loaded, max_new_tokens
        self.name = f"local:{loaded.name}"

    def complete(self, system: str, user: str) -> str:
        tok = self.loaded.tokenizer
        ids = torch.tensor([chat_template_ids(self.loaded, [{"role": "system", "content": system},
                                                            {"role": "user", "content": user}])],
                           device=self.loaded.device)
        out = self.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                         do_sample=False, top_p=None, top_k=None, temperature=None)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def rate(self, system: str, user: str, judgment: str) -> str:
        return guided_choice(self.loaded, chat_template_ids(self.loaded, rating_messages(system, user, judgment)),
                             RATING_CHOICES)


class CachedJudge:
    """Wraps a backend with an append-only JSONL cache keyed by (judge, system, user)."""

    def __init__(self, backend: Backend, cache_file: str | Path):
        self.backend = backend
        self.file = Path(cache_file)
        self.cache: dict[str, str] = {}
        self.hits = self.misses = 0
        if self.file.is_file():
            for line in self.file.read_text().splitlines():
                try:
                    r = json.loads(line)
                    self.cache[r["key"]] = r["judgment"]
                except (json.JSONDecodeError, KeyError):
                    continue

    def key(self, system: str, user: str, judgment: str | None = None) -> str:
        parts = [self.backend.name, system, user] + ([] if judgment is None else ["guided rating", judgment])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def complete(self, system: str, user: str) -> str:
        return self._cached(self.key(system, user), lambda: self.backend.complete(system, user))

    def rate(self, system: str, user: str, judgment: str) -> str:
        """The backend's guided follow-up rating of ``judgment`` (cached like a judgment)."""
        return self._cached(self.key(system, user, judgment), lambda: self.backend.rate(system, user, judgment))

    def _cached(self, k: str, ask: Callable[[], str]) -> str:
        if k in self.cache:
            self.hits += 1
            return self.cache[k]
        self.misses += 1
        text = ask()
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with self.file.open("a") as fh:
            fh.write(json.dumps({"key": k, "judge": self.backend.name, "judgment": text}) + "\n")
        self.cache[k] = text
        return text


def score_judgment(judge: CachedJudge, system: str, user: str, judgment: str, guided: bool) -> tuple[float, str]:
    """(score, how it was read): FastChat's parse ("parsed"); failing that, with ``guided``, the follow-up turn's
    constrained rating ("guided"); else (-1, "unparsable")."""
    score = parse_rating(judgment)
    if score != -1:
        return score, "parsed"
    if guided:
        return float(judge.rate(system, user, judgment)), "guided"
    return -1, "unparsable"


def grade(judge: CachedJudge, prompts: dict[str, JudgePrompt], questions: Sequence[Question],
          answers: dict[tuple[str, int], list[str]], references: dict[int, list[str]],
          progress: Callable[[int], None] | None = None) -> list[dict]:
    """Judgments for every (model, question, turn) whose answers exist. ``answers[(model, qid)]`` = turns."""
    out = []
    by_id = {q.question_id: q for q in questions}
    for (model, qid), turns in answers.items():
        q = by_id[qid]
        for turn in range(min(len(turns), len(q.turns), 2)):
            name, system, user = build_judge_prompt(prompts, q, turns, turn, references.get(qid))
            text = judge.complete(system, user)
            out.append({"question_id": qid, "model": model, "category": q.category, "turn": turn + 1,
                        "judge": [judge.backend.name, name], "user_prompt": user, "judgment": text,
                        "score": parse_rating(text)})
            if progress:
                progress(1)
    return out


def aggregate(judgments: Sequence[dict]) -> pd.DataFrame:
    """Mean score per (model, turn), ignoring unparsable (-1) judgments, as FastChat's show_result."""
    df = pd.DataFrame.from_records(judgments)[["model", "turn", "score"]]
    df = df[df["score"] != -1]
    return df.groupby(["model", "turn"]).mean().reset_index()
