"""Cost model from a measured latency profile (``latency.json``): predicted tokens/s and speed-up of a tree.

    tokens/s (tree)  = tau / (heads(nodes) + verify(nodes) + bookkeeping)
    tokens/s (plain) = 1 / plain_step
    speedup          = tokens/s (tree) / tokens/s (plain)

``verify(n)`` is interpolated linearly between the measured node counts, at the context length
nearest to the one asked for (or the median over measured contexts). ``heads(n)`` likewise between
the tree sizes whose heads were timed (path-conditioned heads score one row per parent node, so their
time grows with the tree); a profile without those points uses its one ``heads_ms`` for every tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .stats import StatsError
from .tree import read_json, write_json_atomic

LATENCY_SCHEMA = "medusa-latency/1"


@dataclass(frozen=True)
class LatencyProfile:
    """Median step times in milliseconds, measured on one machine, model, dtype."""

    nodes: tuple[int, ...]  # node counts measured (root included), ascending
    contexts: tuple[int, ...]  # context lengths measured
    verify_ms: tuple[tuple[float, ...], ...]  # [context][nodes]: one verify forward
    plain_ms: tuple[float, ...]  # [context]: one plain decode step (runtime, root only)
    heads_ms: float  # all heads + top-k on one hidden state (a tree of about 16 nodes)
    bookkeeping_ms: float = 0.0  # acceptance + cache compaction per step
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # model, dtype, machine
    heads_nodes: tuple[int, ...] = ()  # tree sizes (root included, ascending) whose heads time was measured
    heads_by_nodes_ms: tuple[float, ...] = ()  # [heads_nodes]: heads + top-k for a tree of that size

    def _ctx_index(self, context: int | None) -> int | None:
        if context is None:
            return None
        return int(np.argmin([abs(c - context) for c in self.contexts]))

    def verify(self, num_nodes: int, context: int | None = None) -> float:
        """Interpolated verify time (ms) for a tree of ``num_nodes`` nodes (root included)."""
        table = np.asarray(self.verify_ms)
        row = table[self._ctx_index(context)] if context is not None else np.median(table, axis=0)
        return float(np.interp(num_nodes, self.nodes, row))

    def plain(self, context: int | None = None) -> float:
        i = self._ctx_index(context)
        return float(self.plain_ms[i] if i is not None else np.median(self.plain_ms))

    def heads(self, num_nodes: int) -> float:
        """Heads time (ms) for a tree of ``num_nodes`` nodes: interpolated, held flat outside the measured sizes."""
        if not self.heads_nodes:
            return self.heads_ms
        return float(np.interp(num_nodes, self.heads_nodes, self.heads_by_nodes_ms))

    def step_ms(self, num_nodes: int, context: int | None = None) -> float:
        if num_nodes <= 1:
            return self.plain(context)
        return self.heads(num_nodes) + self.verify(num_nodes, context) + self.bookkeeping_ms


@dataclass(frozen=True)
class Prediction:
    tau: float  # tokens per step
    step_ms: float  # predicted time of one Medusa step
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float  # over the runtime's plain decoding


def predict(profile: LatencyProfile, tau: float, num_nodes: int, context: int | None = None) -> Prediction:
    step = profile.step_ms(num_nodes, context)
    tps = 1000.0 * tau / step
    plain = 1000.0 / profile.plain(context)
    return Prediction(tau, step, tps, plain, tps / plain)


def profile_to_json(p: LatencyProfile) -> dict[str, Any]:
    return {"schema": LATENCY_SCHEMA, **p.meta, "nodes": list(p.nodes), "contexts": list(p.contexts),
            "verify_ms": [list(r) for r in p.verify_ms], "plain_ms": list(p.plain_ms), "heads_ms": p.heads_ms,
            "bookkeeping_ms": p.bookkeeping_ms, "heads_nodes": list(p.heads_nodes),
            "heads_by_nodes_ms": list(p.heads_by_nodes_ms)}


def save_profile(p: LatencyProfile, path: str | os.PathLike[str]) -> Path:
    return write_json_atomic(path, profile_to_json(p))


def profile_from_json(obj: Any) -> LatencyProfile:
    if not isinstance(obj, dict) or obj.get("schema") != LATENCY_SCHEMA:
        got = obj.get("schema") if isinstance(obj, dict) else type(obj).__name__
        raise StatsError(f"latency file has schema {got!r}, expected {LATENCY_SCHEMA!r}")
    try:
        nodes = tuple(int(n) for n in obj["nodes"])
        contexts = tuple(int(c) for c in obj["contexts"])
        verify = tuple(tuple(float(x) for x in row) for row in obj["verify_ms"])
        plain = tuple(float(x) for x in obj["plain_ms"])
        heads = float(obj["heads_ms"])
        book = float(obj.get("bookkeeping_ms", 0.0))
        heads_nodes = tuple(int(n) for n in obj.get("heads_nodes", ()))
        heads_by_nodes = tuple(float(x) for x in obj.get("heads_by_nodes_ms", ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise StatsError(f"latency file is malformed: {exc.__class__.__name__} {exc}") from None
    if list(nodes) != sorted(set(nodes)) or not nodes or nodes[0] < 1:
        raise StatsError("latency 'nodes' must be ascending, distinct and >= 1")
    if len(verify) != len(contexts) or any(len(r) != len(nodes) for r in verify) or len(plain) != len(contexts):
        raise StatsError("latency tables do not match 'nodes' x 'contexts'")
    if any(x <= 0 for r in verify for x in r) or any(x <= 0 for x in plain) or heads < 0 or book < 0:
        raise StatsError("latency times must be positive")
    if len(heads_nodes) != len(heads_by_nodes) or list(heads_nodes) != sorted(set(heads_nodes)) or any(
            n < 2 for n in heads_nodes) or any(x < 0 for x in heads_by_nodes):
        raise StatsError("latency 'heads_nodes' must be ascending, distinct and >= 2, with one non-negative "
                         "'heads_by_nodes_ms' time each")
    skip = {"schema", "nodes", "contexts", "verify_ms", "plain_ms", "heads_ms", "bookkeeping_ms", "heads_nodes",
            "heads_by_nodes_ms"}
    return LatencyProfile(nodes, contexts, verify, plain, heads, book, {k: v for k, v in obj.items() if k not in skip},
                          heads_nodes, heads_by_nodes)


def load_profile(path: str | os.PathLike[str], expect_model: str | None = None) -> LatencyProfile:
    prof = profile_from_json(read_json(path, StatsError, "latency file"))
    model = prof.meta.get("model")
    if expect_model is not None and model is not None and model != expect_model:
        raise StatsError(f"latency file {path} was measured on model {model!r}, the statistics are for {expect_model!r}")
    return prof

