"""Quality of a bench run's answers: FastChat single grading by a judge, and the judge-free log-likelihood proxy.

Files (under the run folder), each written atomically and resumable:

* ``judge/model_answer/<id>.jsonl`` and ``judge/model_judgment/<judge>_single.jsonl``: FastChat's own layouts
  (``show_result.py --input-file`` reads the second as it reads GPT-4's); ``<id>`` is the configuration's
  name with anything but ``[A-Za-z0-9._-]`` replaced by ``_`` (``judge_scores.json`` maps them back);
* ``judge/judge_cache.jsonl``: every judge reply keyed by (judge, system prompt, user prompt): a rerun, or
  configurations whose answers are identical (greedy ones are), cost no request;
* ``judge/judge_scores.json`` (``medusa-judge/1``): per configuration the mean score overall, per turn and
  per category (FastChat's rule: unparsable ratings, -1, left out), how many ratings were unparsable and,
  with ``guided`` rating, how many came from the constrained follow-up turn (``bench.judge.grading``) instead of
  the judgment's own ``[[rating]]``;
* ``quality.json`` (``medusa-quality/1``): per configuration the mean log-likelihood per answer token under
  the base model (each distinct (prompt, answer) scored once).
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from bench.judge.grading import (
    NEED_REF_CATEGORIES,
    CachedJudge,
    LocalBackend,
    OpenAIBackend,
    build_judge_prompt,
    load_judge_prompts,
    load_references,
    score_judgment,
)
from bench.judge.proxies import answer_scores
from bench.replay.mtbench import Question, mtbench_dir
from bench.replay.runner import chat_ids, record_key
from medusa_runtime.model import load_model
from treesearch.fsutil import atomic_file
from treesearch.tree import write_json_atomic

JUDGE_SCHEMA, QUALITY_SCHEMA = "medusa-judge/1", "medusa-quality/1"


def backend_for(spec: str, dtype: str = "auto", device: str | None = None):
    """``local:MODEL`` (a transformers chat model, ``local:default`` the embedded one) or the name of a model
    behind an OpenAI-compatible endpoint (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``)."""
    if not spec or not spec.strip():
        raise ValueError("--judge needs a model name (an endpoint's model, or local:MODEL)")
    if spec.startswith("local:"):
        return LocalBackend(load_model(spec.removeprefix("local:") or "default", dtype, device))
    return OpenAIBackend(spec)


def fastchat_id(config: str) -> str:
    """A configuration's name as a FastChat model id (its answer file's stem)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", config)


def answers_of(records: Sequence[dict]) -> dict[tuple[str, int], list[str]]:
    """(config, question_id) -> answer turns in order, from the first repeat of each."""
    out: dict[tuple[str, int], list[str]] = {}
    for r in sorted((r for r in records if r.get("repeat", 0) == 0), key=lambda r: r["turn"]):
        out.setdefault((r["config"], r["question_id"]), []).append(r["answer"])
    return out


def write_model_answers(answers: dict[tuple[str, int], list[str]], folder: Path) -> list[Path]:
    """FastChat's ``model_answer/<model_id>.jsonl``: one line per question, ``choices[0].turns`` the answers."""
    by_config: dict[str, list[tuple[int, list[str]]]] = {}
    for (config, qid), turns in answers.items():
        by_config.setdefault(config, []).append((qid, turns))
    written = []
    for config, rows in by_config.items():
        mid = fastchat_id(config)
        text = "".join(json.dumps({"question_id": qid, "answer_id": f"{mid}-{qid}", "model_id": mid,
                                   "choices": [{"index": 0, "turns": turns}], "tstamp": time.time()}) + "\n"
                       for qid, turns in sorted(rows))
        path = folder / "model_answer" / f"{mid}.jsonl"
        with atomic_file(path) as tmp:
            tmp.write_text(text)
        written.append(path)
    return written


def grade_answers(judge: CachedJudge, questions: Sequence[Question], answers: dict[tuple[str, int], list[str]],
                  progress: bool = True, guided: bool = False) -> tuple[list[dict], int]:
    """FastChat single grading of every answer turn (FastChat's record fields, plus ``rating``: parsed, guided
    or unparsable), and the count of turns left ungraded because their category needs a reference answer that
    the question set lacks."""
    folder = mtbench_dir(lambda m: None)
    prompts, refs = load_judge_prompts(folder / "judge_prompts.jsonl"), load_references(folder / "reference_gpt-4.jsonl")
    by_id = {q.question_id: q for q in questions}
    todo = [(cfg, qid, t) for (cfg, qid), turns in answers.items() for t in range(min(len(turns), len(by_id[qid].turns), 2))]
    graded, skipped = [], 0
    for cfg, qid, turn in tqdm(todo, desc="judge", unit="answer", disable=not progress):
        q = by_id[qid]
        if q.category in NEED_REF_CATEGORIES and qid not in refs:
            skipped += 1
            continue
        name, system, user = build_judge_prompt(prompts, q, answers[(cfg, qid)], turn, refs.get(qid))
        text = judge.complete(system, user)
        score, how = score_judgment(judge, system, user, text, guided)
        graded.append({"question_id": qid, "model": fastchat_id(cfg), "config": cfg, "category": q.category,
                       "judge": [judge.backend.name, name], "user_prompt": user, "judgment": text,
                       "score": score, "rating": how, "turn": turn + 1, "tstamp": time.time()})
    return graded, skipped


def write_model_judgments(graded: Sequence[dict], judge_name: str, folder: Path) -> Path:
    """FastChat's ``model_judgment/<judge>_single.jsonl`` (the fields its gen_judgment writes)."""
    keep = ("question_id", "model", "judge", "user_prompt", "judgment", "score", "rating", "turn", "tstamp")
    path = folder / "model_judgment" / f"{fastchat_id(judge_name)}_single.jsonl"
    with atomic_file(path) as tmp:
        tmp.write_text("".join(json.dumps({k: g[k] for k in keep}) + "\n" for g in graded))
    return path


def score_tables(graded: Sequence[dict]) -> dict[str, pd.DataFrame]:
    """FastChat's show_result means (unparsable -1 left out): per (config, turn), per config overall, per
    (config, category); and per config the judgments and how many were unparsable."""
    df = pd.DataFrame.from_records(graded, columns=["config", "category", "turn", "score", "rating"])
    ok = df[df["score"] != -1]
    counts = df.groupby("config", sort=False).agg(judgments=("score", "size"),
                                                   unparsable=("score", lambda s: int((s == -1).sum())),
                                                   guided=("rating", lambda s: int((s == "guided").sum())))
    return {"by_turn": ok.groupby(["config", "turn"])["score"].mean().reset_index(),
            "overall": ok.groupby("config")["score"].mean().reset_index(),
            "by_category": ok.groupby(["config", "category"])["score"].mean().reset_index(),
            "counts": counts.reset_index()}


def scores_json(tables: dict[str, pd.DataFrame], judge_name: str, skipped: int, configs: Sequence[str],
                guided: bool = False) -> dict:
    def mean(frame: pd.DataFrame, cfg: str, key: str | None = None) -> dict | float | None:
        sub = frame[frame["config"] == cfg]
        if key is None:
            return float(sub["score"].iloc[0]) if len(sub) else None
        return {str(k): float(v) for k, v in zip(sub[key], sub["score"])}

    counts = tables["counts"].set_index("config")
    out = {}
    for cfg in configs:
        out[cfg] = {"fastchat_id": fastchat_id(cfg), "score": mean(tables["overall"], cfg),
                    "by_turn": mean(tables["by_turn"], cfg, "turn"),
                    "by_category": mean(tables["by_category"], cfg, "category"),
                    "judgments": int(counts.loc[cfg, "judgments"]) if cfg in counts.index else 0,
                    "unparsable": int(counts.loc[cfg, "unparsable"]) if cfg in counts.index else 0,
                    "guided": int(counts.loc[cfg, "guided"]) if cfg in counts.index else 0}
    return {"schema": JUDGE_SCHEMA, "judge": judge_name, "mode": "single (FastChat)",
            "rating": "[[rating]], else a guided follow-up (1-10)" if guided else "[[rating]] (FastChat)",
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "skipped_no_reference": skipped, "configs": out}


def run_judge(out: Path, records: Sequence[dict], questions: Sequence[Question], backend,
              progress: bool = True, guided: bool = False) -> Path:
    """Grade every configuration's answers with ``backend``; write FastChat's files and judge_scores.json.
    ``guided``: a judgment without a rating gets the constrained follow-up turn (see ``bench.judge.grading``)."""
    folder = out / "judge"
    answers = answers_of(records)
    write_model_answers(answers, folder)
    judge = CachedJudge(backend, folder / "judge_cache.jsonl")
    graded, skipped = grade_answers(judge, questions, answers, progress, guided)
    write_model_judgments(graded, backend.name, folder)
    configs = list(dict.fromkeys(cfg for cfg, _ in answers))
    return write_json_atomic(folder / "judge_scores.json", scores_json(score_tables(graded), backend.name, skipped,
                                                                       configs, guided))


# ---------------------------------------------------------------------------- the judge-free proxy


def answer_quality(loaded, records: Sequence[dict], questions: Sequence[Question],
                   progress: bool = True) -> pd.DataFrame:
    """[config, method, accept, temperature, question_id, turn, repeat, tokens, log_likelihood, regret] (sums
    over each answer's tokens) under ``loaded``, every sample included; a turn's prompt is the question's turns
    with that sample's own earlier answers, as replayed. Each distinct (prompt, answer, temperature) is scored
    once (the lossless configurations share plain decoding's answers)."""
    by_id = {q.question_id: q for q in questions}
    done = {record_key(r): r for r in records}
    seen: dict[tuple, tuple[float, float]] = {}
    rows = []
    for r in tqdm(records, desc="answer quality", unit="answer", disable=not progress):
        q = by_id[r["question_id"]]
        earlier = [done[record_key({**r, "turn": t})]["answer"] for t in range(r["turn"])]
        prompt, answer = tuple(chat_ids(loaded, q.turns[: r["turn"] + 1], earlier)), tuple(r["token_ids"])
        t = float(r.get("temperature") or 0.0)
        if (prompt, answer, t) not in seen:
            seen[(prompt, answer, t)] = answer_scores(loaded, prompt, answer, t)
        ll, regret = seen[(prompt, answer, t)]
        rows.append({"config": r["config"], "method": r.get("method"), "accept": r.get("accept"), "temperature": t,
                     "lookup_tokens": r.get("lookup_tokens", 0), "heads": r.get("heads"),
                     "question_id": r["question_id"], "turn": r["turn"], "repeat": r.get("repeat", 0),
                     "tokens": len(answer), "log_likelihood": ll, "regret": regret})
    return pd.DataFrame(rows)


Z_975, Z_80 = 1.959964, 0.841621  # normal quantiles: two-sided 5 % test, 80 % power


def paired_check(frame: pd.DataFrame, config: str, reference: str, draws: int = 20000, seed: int = 0) -> dict:
    """Is ``config``'s log-likelihood per token distributed as ``reference``'s? Per question the mean over
    all its answers' tokens (samples and turns), paired by question; a two-sided sign-flip permutation test
    of the mean difference, and the shift it detects with 80 % power at the 5 % level (normal approximation:
    (z_0.975 + z_0.8) sd(d) / sqrt(n))."""
    def per_q(name: str) -> pd.Series:
        sub = frame[frame["config"] == name].groupby("question_id")[["log_likelihood", "tokens"]].sum()
        return sub["log_likelihood"] / sub["tokens"]

    a, b = per_q(config), per_q(reference)
    common = a.index.intersection(b.index)
    d = (a.loc[common] - b.loc[common]).to_numpy(float)
    n = len(d)
    if n < 2:
        return {"config": config, "reference": reference, "questions": n, "p_value": None, "mean_difference": None,
                "detectable_at_80_power": None, "indistinguishable": None}
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(draws, n))
    observed = abs(d.mean())
    p = float((np.abs((signs * d).mean(axis=1)) >= observed - 1e-12).mean())
    mde = (Z_975 + Z_80) * float(d.std(ddof=1)) / n ** 0.5
    return {"config": config, "reference": reference, "questions": n,
            "answers": int((frame["config"] == config).sum()), "mean_difference": float(d.mean()), "p_value": p,
            "detectable_at_80_power": mde, "indistinguishable": p >= 0.05,
            "test": "two-sided sign-flip permutation test of the per-question mean log-likelihood per token, "
                    f"{draws} draws; detectable shift: (z_0.975 + z_0.8) sd / sqrt(n)"}


def distribution_checks(frame: pd.DataFrame) -> list[dict]:
    """Each exact tree-sampling configuration against plain sampling of the same base at its temperature."""
    firsts = frame.drop_duplicates("config")
    checks = []
    for _, r in firsts[(firsts["method"] == "medusa") & (firsts["accept"] == "sample")].iterrows():
        ref = firsts[(firsts["method"] == "plain") & (firsts["temperature"] == r["temperature"])
                     & (firsts["lookup_tokens"].fillna(0) == 0) & (firsts["heads"].isna() | (firsts["heads"] == r["heads"]))]
        if len(ref):
            checks.append(paired_check(frame, r["config"], ref["config"].iloc[0]))
    return checks


def write_quality(out: Path, frame: pd.DataFrame, model: str) -> Path:
    """quality.json: per configuration the mean log-likelihood and regret per token (all its answers' tokens
    together), and the distribution checks of exact tree sampling against plain sampling."""
    per = frame.groupby("config", sort=False).agg(tokens=("tokens", "sum"), answers=("tokens", "size"),
                                                  ll=("log_likelihood", "sum"), regret=("regret", "sum"),
                                                  temperature=("temperature", "max"))
    configs = {cfg: {"log_likelihood_per_token": float(row["ll"] / row["tokens"]) if row["tokens"] else None,
                     "regret_per_token": float(row["regret"] / row["tokens"]) if row["tokens"] else None,
                     "temperature": float(row["temperature"]), "tokens": int(row["tokens"]),
                     "answers": int(row["answers"])} for cfg, row in per.iterrows()}
    return write_json_atomic(out / "quality.json", {
        "schema": QUALITY_SCHEMA, "model": model,
        "measure": "log-likelihood per answer token under the base model; regret per token: log p_T(argmax) - "
                   "log p_T(token) at the configuration's temperature (0 for greedy decoding)",
        "configs": configs, "distribution_checks": distribution_checks(frame)})
