"""The workload: which questions are replayed, which calibrate, and cross-fitted predictions.

A deployment tunes on a sample of its own traffic and serves the rest. The bench does the same with
its question set: the replayed questions (a seeded sample over the categories) are rolled out once for
calibration (``acceptance.json`` keeps each rollout's question id) and split into folds, and a replayed
question is only ever predicted from the rollouts of *the other folds*: the fold's search, and every
prediction for it, read ``select(stats, drop_ids=fold)`` (``treesearch.stats.select``), which holds
nothing of the fold. Averaged over the folds, the predictions then speak for the replayed set itself
(fitting on questions outside it would add their sampling difference from it: 5 % and more for 40
questions, measured on MT-Bench and HumanEval rollouts).

Predictions per configuration are the exact replay of that configuration on the fold's fitting
rollouts (heads, lookup chain and gate jointly, ``treesearch.replay``), priced step by step by the
latency profile; over folds they are weighted by the fold's number of replayed questions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay.mtbench import Question
from bench.replay.runner import MethodConfig
from treesearch.cost import LatencyProfile
from treesearch.replay import Decoding, replay
from treesearch.stats import AcceptanceStats, select
from treesearch.tree import load_tree

MIN_POSITIONS = 2000  # fewer fitting positions than this: the prediction's interval is reported as wide


def spread_over_categories(questions: Sequence[Question], limit: int) -> list[Question]:
    """The first questions of each category in turn, so a small limit still covers every category."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    out: list[Question] = []
    i = 0
    while len(out) < min(limit, len(questions)):
        for cat in by_cat:
            if i < len(by_cat[cat]) and len(out) < limit:
                out.append(by_cat[cat][i])
        i += 1
    return out


def sample_over_categories(questions: Sequence[Question], limit: int, seed: int = 0) -> list[Question]:
    """``limit`` questions spread over the categories as evenly as they allow, drawn at random (seeded) within
    each category: a sample of the set, not its first questions (sets are often ordered, e.g. by difficulty)."""
    rng = random.Random(seed)
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    shuffled = [q for cat in by_cat.values() for q in rng.sample(cat, len(cat))]
    return spread_over_categories(shuffled, limit)


def make_folds(replayed: Sequence[Question], folds: int, seed: int = 0) -> list[tuple[int, ...]]:
    """The replayed question ids in ``folds`` groups, each category spread over the folds (seeded)."""
    if not 1 <= folds <= len(replayed):
        raise ValueError(f"folds must be within 1..{len(replayed)} (the replayed questions), got {folds}")
    order = sorted(replayed, key=lambda q: (q.category, q.question_id))
    rng = random.Random(seed)
    groups: list[list[int]] = [[] for _ in range(folds)]
    start = rng.randrange(folds)
    for i, q in enumerate(order):  # round-robin over a category-sorted list: every fold gets every category
        groups[(start + i) % folds].append(q.question_id)
    return [tuple(sorted(g)) for g in groups]


def check_disjoint(calibration: Sequence[str], replayed: Sequence[Question], allow_overlap: bool) -> None:
    """Refuse calibration prompts that repeat a replayed question's first turn (unless allowed): a
    prediction fitted on the very rollouts it is checked against would flatter itself."""
    firsts = {q.turns[0].strip(): q.question_id for q in replayed}
    hits = sorted({firsts[t.strip()] for t in calibration if t.strip() in firsts})
    if hits and not allow_overlap:
        shown = ", ".join(map(str, hits[:5])) + (" ..." if len(hits) > 5 else "")
        raise ValueError(f"the calibration set holds {len(hits)} replayed question(s) ({shown}); use other "
                         "prompts, or --allow-overlap to accept predictions fitted on what they predict")


def fold_stats(stats: AcceptanceStats, folds: Sequence[tuple[int, ...]]) -> list[AcceptanceStats]:
    """Per fold, the statistics it may be predicted from: every rollout except its own questions'."""
    return [select(stats, drop_ids=[str(i) for i in fold]) for fold in folds]


def decoding_of(cfg: MethodConfig) -> Decoding | None:
    """The configuration the replay of rollouts can predict (the runtime, greedy, with the heads and base that
    were calibrated: not a configuration with heads of its own), else None."""
    if cfg.method not in ("plain", "medusa") or cfg.temperature > 0 or cfg.temperature_policy != "fixed" \
            or cfg.accept != "greedy" or cfg.engine not in ("auto", "lean") or cfg.heads is not None:
        return None
    tree = load_tree(cfg.tree) if cfg.method == "medusa" else None
    return Decoding(tree, cfg.lookup_tokens, cfg.gate)


@dataclass(frozen=True)
class FoldPrediction:
    fold: int
    questions: int  # replayed questions of the fold (its weight)
    tau: float
    speedup: float  # over plain decoding, both predicted on the fold's fitting rollouts
    tau_interval: tuple[float, float]  # 95 % bootstrap over the fitting rollouts
    positions: int  # fitting positions behind the prediction


@dataclass(frozen=True)
class ConfigPrediction:
    config: str
    tau: float  # over folds, weighted by replayed questions
    speedup: float
    folds: tuple[FoldPrediction, ...]
    complete: bool = True  # it ran on every replayed question (else on a subset, whose measurement carries that
    #                        subset's sampling noise: only over all folds does cross-fitting cancel it)

    @property
    def positions(self) -> int:
        return min(f.positions for f in self.folds)

    @property
    def tau_interval(self) -> tuple[float, float]:
        w = sum(f.questions for f in self.folds)
        return (sum(f.questions * f.tau_interval[0] for f in self.folds) / w,
                sum(f.questions * f.tau_interval[1] for f in self.folds) / w)


def predict_configs(configs: Sequence[MethodConfig], per_fold: Sequence[AcceptanceStats],
                    folds: Sequence[tuple[int, ...]], latency: LatencyProfile) -> dict[str, ConfigPrediction]:
    """Cross-fitted prediction of every configuration the replay can predict. A configuration restricted to
    some questions (``question_ids``: the per-fold search pick, the peers) is predicted on the folds it runs
    on, weighted by its questions there."""
    plain = [replay(Decoding(), s, latency) for s in per_fold]
    replayed = {i for fold in folds for i in fold}
    parts: dict[str, list[FoldPrediction]] = {}
    covered: dict[str, set[int]] = {}
    for cfg in configs:
        dec = decoding_of(cfg)
        if dec is None:
            continue
        for f, (fold, stats) in enumerate(zip(folds, per_fold)):
            mine = set(fold) if cfg.question_ids is None else set(fold) & set(cfg.question_ids)
            if not mine:
                continue
            covered.setdefault(cfg.name, set()).update(mine)
            res = replay(dec, stats, latency)
            interval = res.tau_interval()
            parts.setdefault(cfg.name, []).append(FoldPrediction(f, len(mine), res.tau, plain[f].time_ms / res.time_ms,
                                                                 interval, stats.positions))
    out = {}
    for name, fps in parts.items():
        w = sum(p.questions for p in fps)
        out[name] = ConfigPrediction(name, sum(p.questions * p.tau for p in fps) / w,
                                     sum(p.questions * p.speedup for p in fps) / w, tuple(fps),
                                     covered[name] == replayed)
    return out
