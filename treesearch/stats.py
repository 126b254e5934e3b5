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
* ``split``: which rollouts are for fitting and which are held out.

From rollouts we get two estimators of tau (tokens per step): the *position average*
1 + E_t[depth(t)], and the *step walk*, which replays the decoder itself along each sequence
(a step at t commits 1 + depth(t) tokens and the next step starts after them), exactly what the
runtime measures when it greedily decodes the same prompts.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .tree import Tree, read_json, write_json_atomic

if TYPE_CHECKING:
    from .typical import TypicalStats

ACCEPTANCE_SCHEMA = "medusa-acceptance/1"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
MISS = "."


class StatsError(ValueError):
    """Statistics that cannot be used, with a one-line reason."""


def encode_ranks(ranks: Sequence[int]) -> str:
    """[r0, r1, ...] (−1 = miss) -> 'r0r1...' using 0-9a-z and '.'."""
    return "".join(MISS if r < 0 or r >= len(_DIGITS) else _DIGITS[r] for r in ranks)


def decode_ranks(code: str) -> list[int]:
    return [-1 if c == MISS else _DIGITS.index(c) for c in code]


@dataclass(frozen=True)
class AcceptanceStats:
    """What calibration measured; the input of every tau estimator and of the search."""

    marginal: np.ndarray  # [K, k] P(head j's rank-r token is the emitted one)
    rollouts: tuple[tuple[tuple[int, ...], ...], ...] = ()  # per sequence, per position: K ranks
    heldout: tuple[tuple[tuple[int, ...], ...], ...] = ()  # same, held-out sequences
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # provenance
    sha256: str = ""  # hash of the file it came from
    typical: TypicalStats | None = field(default=None, compare=False, hash=False)  # for typical acceptance

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
    from .typical import typical_to_json

    out = {"schema": ACCEPTANCE_SCHEMA, **stats.meta, "num_heads": stats.num_heads, "topk": stats.topk,
           "positions": stats.positions, "marginal": stats.marginal.round(6).tolist(),
           "rollouts": ["".join(encode_ranks(r) for r in seq) for seq in stats.rollouts],
           "heldout": ["".join(encode_ranks(r) for r in seq) for seq in stats.heldout]}
    if stats.typical is not None:
        out["typical"] = typical_to_json(stats.typical)
    return out


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
        from .typical import typical_from_json

        typical = typical_from_json(obj["typical"], k, marginal.shape[1])
        if [s.logp.shape[0] for s in typical.rollouts] != [len(s) for s in rollouts] or \
                [s.logp.shape[0] for s in typical.heldout] != [len(s) for s in heldout]:
            raise StatsError("'typical' rollouts do not match the rank rollouts position for position")
    skip = ("schema", "marginal", "rollouts", "heldout", "num_heads", "topk", "positions", "typical")
    meta = {key: v for key, v in obj.items() if key not in skip}
    return AcceptanceStats(marginal, rollouts, heldout, meta, sha, typical)


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


def step_walk_interval(tree: Tree, rollouts: Sequence[Sequence[Sequence[int]]], level: float = 0.95,
                       reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the step-walk tau over rollouts (resampled whole, as the prompts
    were drawn): how far another set of prompts, or another bf16 rollout of the same ones that takes a
    different greedy path, could move it. With 80 MT-Bench first turns its half-width is about 0.06-0.09."""
    if not 0 < level < 1:
        raise StatsError(f"level must lie in (0, 1), got {level}")
    walks = [tau_step_walk(tree, [seq]) for seq in rollouts if len(seq)]
    if not walks:
        raise StatsError("no rollouts to replay")
    tokens = np.array([w.tokens for w in walks], dtype=np.float64)
    steps = np.array([w.steps for w in walks], dtype=np.float64)
    pick = np.random.default_rng(seed).integers(0, len(walks), size=(reps, len(walks)))  # [reps, n] resamples
    taus = tokens[pick].sum(axis=1) / steps[pick].sum(axis=1)  # each resample's tokens per step
    lo, hi = np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
