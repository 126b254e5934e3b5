"""Best trees under greedy acceptance: the exact optimum for a node budget, and the official greedy growth.

Under greedy acceptance a node is accepted exactly when its rank path is a prefix of the position's
rank vector, so the expected accepted depth of a tree is the sum of its nodes' path probabilities
(both under independence and for empirical joint statistics, averaged over positions). A child's
probability never exceeds its parent's, so the n most probable paths form a valid tree, and no
other n-node tree can have a larger sum: taking the top n by path probability is exactly optimal.
Best-first search finds them without enumerating the k^depth candidates.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .stats import AcceptanceStats, StatsError, path_probability_independent, prefix_counts
from .tree import Tree, make_tree

PathT = tuple[int, ...]


class PathModel(Protocol):
    """Probabilities of rank paths being accepted (a prefix of the position's rank vector)."""

    def prob(self, path: PathT) -> float: ...

    def children(self, path: PathT) -> Iterable[tuple[PathT, float]]: ...


@dataclass(frozen=True)
class Constraints:
    """Limits on the trees a search may build."""

    max_depth: int | None = None  # deepest level (<= number of heads used)
    rank_caps: tuple[int, ...] | None = None  # per depth: ranks allowed are 0 .. cap-1


class IndependentModel:
    """P(path) = prod_j marginal[j][r_j]."""

    def __init__(self, marginal: np.ndarray):
        self.marginal = np.asarray(marginal, dtype=float)

    def prob(self, path: PathT) -> float:
        return path_probability_independent(path, self.marginal)

    def children(self, path: PathT) -> Iterable[tuple[PathT, float]]:
        depth = len(path)
        if depth >= self.marginal.shape[0]:
            return []
        base = self.prob(path) if path else 1.0
        return [(path + (r,), base * float(p)) for r, p in enumerate(self.marginal[depth]) if p > 0]


class JointModel:
    """P(path) = fraction of recorded positions whose rank vector starts with the path."""

    def __init__(self, rollouts: Sequence[Sequence[Sequence[int]]]):
        counts, n = prefix_counts(rollouts)
        if n == 0:
            raise StatsError("no rollouts: joint statistics are empty")
        self.counts: Counter = counts
        self.n = n
        self._kids: dict[PathT, list[PathT]] = defaultdict(list)
        for p in counts:
            self._kids[p[:-1]].append(p)

    def prob(self, path: PathT) -> float:
        return self.counts.get(path, 0) / self.n

    def children(self, path: PathT) -> Iterable[tuple[PathT, float]]:
        return [(c, self.counts[c] / self.n) for c in self._kids.get(path, [])]


def model_for(stats: AcceptanceStats, joint: bool | None = None) -> PathModel:
    """Joint model when rollouts exist (unless ``joint=False``), else independence."""
    use_joint = stats.has_joint if joint is None else joint
    if use_joint and not stats.has_joint:
        raise StatsError("these statistics have no rollouts, so only the independence model is available")
    return JointModel(stats.rollouts) if use_joint else IndependentModel(stats.marginal)


def _allowed(path: PathT, c: Constraints) -> bool:
    if c.max_depth is not None and len(path) > c.max_depth:
        return False
    if c.rank_caps is not None:
        if len(path) > len(c.rank_caps) or path[-1] >= c.rank_caps[len(path) - 1]:
            return False
    return True


def top_paths(model: PathModel, budget: int, constraints: Constraints = Constraints()) -> list[tuple[PathT, float]]:
    """The ``budget`` most probable paths (ties: shorter, then smaller ranks first), best-first."""
    if budget < 1:
        raise StatsError(f"the node budget must be >= 1, got {budget}")
    heap: list[tuple[float, int, PathT]] = []
    for child, p in model.children(()):
        if p > 0 and _allowed(child, constraints):
            heapq.heappush(heap, (-p, len(child), child))
    chosen: list[tuple[PathT, float]] = []
    while heap and len(chosen) < budget:
        neg_p, _, path = heapq.heappop(heap)
        chosen.append((path, -neg_p))
        for child, p in model.children(path):
            if p > 0 and _allowed(child, constraints):
                heapq.heappush(heap, (-p, len(child), child))
    return chosen


def expected_depth(tree: Tree, model: PathModel) -> float:
    return sum(model.prob(p) for p in tree.paths)


def optimal_tree(model: PathModel, budget: int, constraints: Constraints = Constraints(),
                 name: str = "optimal") -> tuple[Tree, float]:
    """The exact greedy-acceptance optimum with at most ``budget`` non-root nodes, and its tau."""
    chosen = top_paths(model, budget, constraints)
    if not chosen:
        raise StatsError("no path has a positive acceptance probability under these constraints")
    tree = make_tree([list(p) for p, _ in chosen], name=name)
    return tree, 1.0 + sum(p for _, p in chosen)


def greedy_grown_tree(model: PathModel, budget: int, max_depth: int, topk: int, name: str = "greedy-grown") -> Tree:
    """The official recipe, as a baseline: start from an empty tree and repeatedly add the frontier node
    (a child of the root or of a chosen node, up to ``topk`` ranks and ``max_depth`` levels) whose
    addition raises the expected accepted length the most."""
    chosen: list[PathT] = []
    frontier = {(r,) for r in range(topk)}
    while len(chosen) < budget and frontier:
        best = max(frontier, key=lambda p: (model.prob(p), -len(p), tuple(-r for r in p)))
        if model.prob(best) <= 0:
            break
        chosen.append(best)
        frontier.discard(best)
        if len(best) < max_depth:
            frontier.update(best + (r,) for r in range(topk))
    if not chosen:
        raise StatsError("no path has a positive acceptance probability")
    return make_tree([list(p) for p in chosen], name=name)
