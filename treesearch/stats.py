"""Acceptance statistics (``acceptance.json``): marginal head x rank rates and replayable rank rollouts.

Greedy acceptance on a Medusa tree is decided by one *rank vector* per decoding position t: for
head j, the rank of the token the base model actually emits at t + j + 2 among head j's top-k
(``-1`` when it is not there). All heads read the same hidden state, so the accepted depth of ANY
tree at t is the length of the longest prefix of that vector which is a path of the tree. Storing
the rank vectors of real rollouts therefore lets us replay any tree exactly, with no independence
assumption:

* ``marginal[j][r]``: P(rank of head j == r), a K x k matrix (rows sum to at most 1);
* ``rollouts``: per calibration sequence, its rank vectors in order, encoded as one string of
  K characters per position (``0-9a-z`` for ranks 0..35, ``.`` for a miss);
* ``split``: which rollouts are for fitting and which are held out;
* ``texts`` (optional): per rollout its id (the question it answers), prompt and output token ids, and
  the heads' top-1 probabilities along their top-1 chain at every position. With them a rollout
  replays whole configurations, not only trees: the prompt-lookup chain (whose drafts depend on the
  tokens alone), the confidence gate, and the context length of every step (``treesearch.replay``);
  and the workload can be cross-fitted by question (``select``).

From rollouts we get two estimators of tau (tokens per step): the *position average*
1 + E_t[depth(t)], and the *step walk*, which replays the decoder itself along each sequence
(a step at t commits 1 + depth(t) tokens and the next step starts after them), exactly what the
runtime measures when it greedily decodes the same prompts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StatsError
from .tree import Tree, chain, read_json, write_json_atomic
from .typical import TypicalStats, typical_from_json, typical_to_json

ACCEPTANCE_SCHEMA = "medusa-acceptance/1"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
MISS = "."


def encode_ranks(ranks: Sequence[int]) -> str:
    """[r0, r1, ...] (−1 = miss) -> 'r0r1...' using 0-9a-z and '.'."""
    return "".join(MISS if r < 0 or r >= len(_DIGITS) else _DIGITS[r] for r in ranks)


def decode_ranks(code: str) -> list[int]:
    return [-1 if c == MISS else _DIGITS.index(c) for c in code]


@dataclass(frozen=True, eq=False)
class RolloutText:
    """What one calibration rollout decoded, beside its rank vectors (P = len(output) - 1 positions)."""

    id: str  # the prompt's id (a question id): folds of the workload are made of these
    prompt: tuple[int, ...]  # prompt token ids, chat template applied
    output: tuple[int, ...]  # the base model's greedy tokens y_1 .. y_M (EOS included when it stopped there)
    gate: np.ndarray | None = None  # [P, K] float32: head j's top-1 probability when heads 0..j-1 read their
    #                                  own top-1 guesses as parents (what the decoder's confidence gate reads)

    @property
    def positions(self) -> int:
        return max(0, len(self.output) - 1)


@dataclass(frozen=True)
class AcceptanceStats:
    """What calibration measured; the input of every tau estimator and of the search."""

    marginal: np.ndarray  # [K, k] P(head j's rank-r token is the emitted one)
    rollouts: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per sequence, per position: K ranks
    heldout: tuple[tuple[tuple[int, ...], ...], ...] = ()  # same, held-out sequences
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # provenance
    sha256: str = ""  # hash of the file it came from
    typical: TypicalStats | None = field(default=None, compare=False, hash=False)  # for typical acceptance
    texts: tuple[RolloutText, ...] = field(default=(), compare=False, hash=False)  # [rollouts], or () when absent
    heldout_texts: tuple[RolloutText, ...] = field(default=(), compare=False, hash=False)  # [heldout]

    @property
    def num_heads(self) -> int:
        return int(self.marginal.shape[0])

    @property
    def topk(self) -> int:
        return int(self.marginal.shape[1])

    @property
    def has_joint(self) -> bool:
        return len(self.rollouts) > 0

    @property
    def positions(self) -> int:
        return sum(len(s) for s in self.rollouts)

    @property
    def has_texts(self) -> bool:
        """Token ids stored beside the rank vectors: whole configurations (lookup, gate, context) replay."""
        return bool(self.texts) and len(self.texts) == len(self.rollouts)

    @property
    def has_gate(self) -> bool:
        """The heads' top-1 probabilities stored with the rollouts' tokens: a confidence gate replays."""
        return self.has_texts and all(t.gate is not None for t in self.texts)


def select(stats: AcceptanceStats, keep_ids: Iterable[str] | None = None, drop_ids: Iterable[str] = ()
           ) -> AcceptanceStats:
    """The statistics of the rollouts (fitting and held-out together) whose ids are kept and not dropped,
    as one fitting set: what a fold of a cross-fitted workload is predicted from. The marginal is
    recomputed from the rollouts kept, so nothing of a dropped rollout is left in the result."""
    if not stats.has_texts or (stats.heldout and len(stats.heldout_texts) != len(stats.heldout)):
        raise StatsError("these statistics carry no rollout ids: calibrate again to cross-fit them")
    keep = None if keep_ids is None else {str(i) for i in keep_ids}
    drop = {str(i) for i in drop_ids}
    texts_all = stats.texts + stats.heldout_texts
    typical_all = (stats.typical.rollouts + stats.typical.heldout) if stats.typical is not None else ()
    chosen = [i for i, t in enumerate(texts_all) if t.id not in drop and (keep is None or t.id in keep)]
    if not chosen:
        raise StatsError("no rollout is left to fit after removing the held-out questions")
    ranks_all = stats.rollouts + stats.heldout
    rollouts, texts = tuple(ranks_all[i] for i in chosen), tuple(texts_all[i] for i in chosen)
    typical = None
    if stats.typical is not None:
        typical = TypicalStats(stats.typical.temperature, tuple(typical_all[i] for i in chosen))
    selected = {"rollouts": len(rollouts), "dropped_ids": sorted(drop),
                "kept_ids": None if keep is None else sorted(keep)}
    # the selection's own hash: studies and caches keyed by it never mix two folds of one file
    sha = hashlib.sha256(f"{stats.sha256}:{json.dumps(selected, sort_keys=True)}".encode()).hexdigest()
    return AcceptanceStats(marginal_from_rollouts(rollouts, stats.num_heads, stats.topk), rollouts, (),
                           {**stats.meta, "selected": selected, "source_sha256": stats.sha256}, sha, typical, texts, ())


# ---------------------------------------------------------------------------- validation / I/O


def check_marginal(marginal: Any) -> np.ndarray:
    m = np.asarray(marginal, dtype=float)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise StatsError(f"'marginal' must be a non-empty K x k matrix, got shape {m.shape}")
    if not np.all(np.isfinite(m)) or (m < 0).any() or (m > 1).any():
        raise StatsError("'marginal' has probabilities outside [0, 1]")
    sums = m.sum(axis=1)
    if (sums > 1 + 1e-6).any():
        j = int(np.argmax(sums))
        raise StatsError(f"'marginal' row {j} sums to {sums[j]:.4f} > 1 (ranks of one head are exclusive events)")
    return m


def marginal_from_topk_accuracy(topk_accuracy: Any) -> np.ndarray:
    """Cumulative top-1..top-k accuracies per head (as training logs report them) -> per-rank rates."""
    acc = np.asarray(topk_accuracy, dtype=float)
    if acc.ndim != 2 or (np.diff(acc, axis=1) < -1e-9).any():
        raise StatsError("top-k accuracies must be a K x k matrix, non-decreasing along k")
    return check_marginal(np.diff(np.concatenate([np.zeros((acc.shape[0], 1)), acc], axis=1), axis=1))


def marginal_from_rollouts(rollouts: Iterable[Sequence[Sequence[int]]], num_heads: int, topk: int) -> np.ndarray:
    counts = np.zeros((num_heads, topk))
    n = 0
    for seq in rollouts:
        for ranks in seq:
            n += 1
            for j, r in enumerate(ranks[:num_heads]):
                if 0 <= r < topk:
                    counts[j, r] += 1
    return counts / max(n, 1)


def stats_to_json(stats: AcceptanceStats) -> dict[str, Any]:
    out = {"schema": ACCEPTANCE_SCHEMA, **stats.meta, "num_heads": stats.num_heads, "topk": stats.topk,
           "positions": stats.positions, "marginal": stats.marginal.round(6).tolist(),
           "rollouts": ["".join(encode_ranks(r) for r in seq) for seq in stats.rollouts],
           "heldout": ["".join(encode_ranks(r) for r in seq) for seq in stats.heldout]}
    if stats.typical is not None:
        out["typical"] = typical_to_json(stats.typical)
    if stats.texts:
        out["texts"] = {"rollouts": [text_to_json(t) for t in stats.texts],
                        "heldout": [text_to_json(t) for t in stats.heldout_texts]}
    return out


def text_to_json(text: RolloutText) -> dict[str, Any]:
    out: dict[str, Any] = {"id": text.id, "prompt": list(text.prompt), "output": list(text.output)}
    if text.gate is not None:  # little-endian float32, base64: the gate compares against thresholds exactly
        out["gate"] = base64.b64encode(np.asarray(text.gate, dtype="<f4").tobytes()).decode("ascii")
    return out


def text_from_json(obj: Any, num_heads: int) -> RolloutText:
    if not isinstance(obj, dict) or not all(isinstance(obj.get(k), list) for k in ("prompt", "output")):
        raise StatsError("each 'texts' entry must be an object with 'prompt' and 'output' token lists")
    if not all(isinstance(t, int) and t >= 0 for t in obj["prompt"] + obj["output"]):
        raise StatsError("'texts' token ids must be non-negative integers")
    text = RolloutText(str(obj.get("id", "")), tuple(obj["prompt"]), tuple(obj["output"]))
    if obj.get("gate") is None:
        return text
    try:
        raw = base64.b64decode(obj["gate"], validate=True)
    except (ValueError, TypeError):
        raise StatsError("'texts' gate is not valid base64") from None
    if len(raw) != 4 * text.positions * num_heads:
        raise StatsError(f"'texts' gate holds {len(raw) // 4} values, expected {text.positions} x {num_heads}")
    gate = np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(text.positions, num_heads)
    return RolloutText(text.id, text.prompt, text.output, gate)


def save_stats(stats: AcceptanceStats, path: str | os.PathLike[str]) -> Path:
    return write_json_atomic(path, stats_to_json(stats))


def _decode_rollouts(codes: Any, k: int, name: str) -> tuple[tuple[tuple[int, ...], ...], ...]:
    if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
        raise StatsError(f"'{name}' must be a list of strings")
    out = []
    for code in codes:
        if len(code) % k:
            raise StatsError(f"'{name}' entry of length {len(code)} is not a multiple of {k} heads")
        if any(c != MISS and c not in _DIGITS for c in code):
            raise StatsError(f"'{name}' has characters outside 0-9a-z and '.'")
        out.append(tuple(tuple(decode_ranks(code[i:i + k])) for i in range(0, len(code), k)))
    return tuple(out)


def stats_from_json(obj: Any, sha: str = "") -> AcceptanceStats:
    if not isinstance(obj, dict):
        raise StatsError("acceptance statistics must be a JSON object")
    if obj.get("schema") != ACCEPTANCE_SCHEMA:
        raise StatsError(f"acceptance file has schema {obj.get('schema')!r}, expected {ACCEPTANCE_SCHEMA!r}")
    if "marginal" not in obj:
        raise StatsError("acceptance file has no 'marginal' matrix")
    marginal = check_marginal(obj["marginal"])
    k = marginal.shape[0]
    rollouts = _decode_rollouts(obj.get("rollouts", []), k, "rollouts")
    heldout = _decode_rollouts(obj.get("heldout", []), k, "heldout")
    if any(r >= marginal.shape[1] for seq in rollouts for ranks in seq for r in ranks):
        raise StatsError(f"'rollouts' use ranks beyond the {marginal.shape[1]} columns of 'marginal'")
    typical = None
    if obj.get("typical") is not None:
        typical = typical_from_json(obj["typical"], k, marginal.shape[1])
        if [s.logp.shape[0] for s in typical.rollouts] != [len(s) for s in rollouts] or \
                [s.logp.shape[0] for s in typical.heldout] != [len(s) for s in heldout]:
            raise StatsError("'typical' rollouts do not match the rank rollouts position for position")
    texts: dict[str, tuple[RolloutText, ...]] = {"rollouts": (), "heldout": ()}
    if obj.get("texts") is not None:
        if not isinstance(obj["texts"], dict):
            raise StatsError("'texts' must be an object with 'rollouts' and 'heldout' lists")
        for key, ranks in (("rollouts", rollouts), ("heldout", heldout)):
            texts[key] = tuple(text_from_json(t, k) for t in obj["texts"].get(key, []))
            if [t.positions for t in texts[key]] != [len(s) for s in ranks]:
                raise StatsError(f"'texts' {key} do not match the rank rollouts position for position")
    skip = ("schema", "marginal", "rollouts", "heldout", "num_heads", "topk", "positions", "typical", "texts")
    meta = {key: v for key, v in obj.items() if key not in skip}
    return AcceptanceStats(marginal, rollouts, heldout, meta, sha, typical, texts["rollouts"], texts["heldout"])


def load_stats(path: str | os.PathLike[str]) -> AcceptanceStats:
    obj = read_json(path, StatsError, "acceptance file")
    return stats_from_json(obj, sha=hashlib.sha256(Path(path).read_bytes()).hexdigest())


# ---------------------------------------------------------------------------- tau estimators


def path_probability_independent(path: Sequence[int], marginal: np.ndarray) -> float:
    """P(path accepted) under independent heads: prod_j marginal[j][r_j]."""
    if len(path) > marginal.shape[0] or any(r >= marginal.shape[1] for r in path):
        return 0.0
    return float(math.prod(marginal[j, r] for j, r in enumerate(path)))


def tau_independent(tree: Tree, marginal: np.ndarray) -> float:
    """1 + sum over nodes of P(node accepted): expected tokens per step if heads were independent."""
    return 1.0 + sum(path_probability_independent(p, marginal) for p in tree.paths)


def prefix_counts(rollouts: Iterable[Sequence[Sequence[int]]]) -> tuple[Counter, int]:
    """Counts of every rank-path prefix over all positions (a position counts for each prefix it has)."""
    counts: Counter = Counter()
    n = 0
    for seq in rollouts:
        for ranks in seq:
            n += 1
            prefix: tuple[int, ...] = ()
            for r in ranks:
                if r < 0:
                    break
                prefix = prefix + (r,)
                counts[prefix] += 1
    return counts, n


def accepted_depth(tree_paths: frozenset | set, ranks: Sequence[int]) -> int:
    d = 0
    prefix: tuple[int, ...] = ()
    for r in ranks:
        if r < 0:
            break
        prefix = prefix + (r,)
        if prefix not in tree_paths:
            break
        d += 1
    return d


def tau_position_average(tree: Tree, rollouts: Sequence[Sequence[Sequence[int]]]) -> float:
    """1 + mean accepted depth over all recorded positions."""
    counts, n = prefix_counts(rollouts)
    if n == 0:
        raise StatsError("no rollouts to replay")
    return 1.0 + sum(counts.get(p, 0) for p in tree.paths) / n


@dataclass(frozen=True)
class WalkResult:
    tau: float  # tokens committed per step
    steps: int
    tokens: int
    accept_lengths: tuple[int, ...]


def tau_step_walk(tree: Tree, rollouts: Sequence[Sequence[Sequence[int]]]) -> WalkResult:
    """Replay greedy Medusa decoding along each rollout: a step at t commits 1 + depth(t) tokens.

    Position t of a rollout holds the ranks for a step whose last accepted token sits at t
    (the step's root is token t+1); ranks whose target lies past the rollout's end are misses, so
    a step never commits more than the rollout holds.
    """
    paths = frozenset(tree.paths)
    lengths: list[int] = []
    for seq in rollouts:
        t, n = 0, len(seq)
        while t < n:
            step = 1 + accepted_depth(paths, seq[t])
            lengths.append(step)
            t += step
    if not lengths:
        raise StatsError("no rollouts to replay")
    return WalkResult(sum(lengths) / len(lengths), len(lengths), sum(lengths), tuple(lengths))


def chain_accepted_per_position(rollouts: Sequence[Sequence[Sequence[int]]], depth: int) -> list[float]:
    """A top-1 chain of ``depth`` heads (what vLLM's Medusa drafts) walked along the rollouts: per chain position
    i, the share of drafting steps that accepted position i (its draft and every one before it): the figure
    vLLM reports as ``spec_decode_num_accepted_tokens_per_pos / spec_decode_num_drafts``."""
    walk = tau_step_walk(chain(depth), rollouts)
    lengths = np.asarray(walk.accept_lengths)  # 1 + accepted drafts per step
    return [float(np.mean(lengths > i + 1)) for i in range(depth)]


def step_walk_interval(tree: Tree, rollouts: Sequence[Sequence[Sequence[int]]], level: float = 0.95,
                       reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the step-walk tau over rollouts (resampled whole, as the prompts
    were drawn): how far another set of prompts, or another bf16 rollout of the same ones that takes a
    different greedy path, could move it. With 80 MT-Bench first turns its half-width is about 0.06-0.09."""
    walks = [tau_step_walk(tree, [seq]) for seq in rollouts if len(seq)]
    if not walks:
        raise StatsError("no rollouts to replay")
    return bootstrap_ratio([w.tokens for w in walks], [w.steps for w in walks], level, reps, seed)


def bootstrap_ratio(tokens: Sequence[float], steps: Sequence[float], level: float = 0.95, reps: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of sum(tokens) / sum(steps) over units resampled whole (rollouts,
    questions): the interval of a tokens-per-step or a time ratio."""
    if not 0 < level < 1:
        raise StatsError(f"level must lie in (0, 1), got {level}")
    num, den = np.asarray(tokens, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    if num.shape != den.shape or num.size == 0:
        raise StatsError("bootstrap needs one numerator and one denominator per unit")
    pick = np.random.default_rng(seed).integers(0, num.size, size=(reps, num.size))  # [reps, n] resamples
    ratios = num[pick].sum(axis=1) / den[pick].sum(axis=1)  # each resample's ratio
    lo, hi = np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
