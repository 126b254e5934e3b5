"""Cost model from a measured latency profile (``latency.json``): predicted tokens/s and speed-up of a tree.

    step (plain)            = plain(context)                 [+ lookup, when a lookup chain is drafted]
    step (n verified nodes) = verify(n, context) + bookkeeping(n) + heads(tree nodes) [+ lookup]
    tokens/s (tree)         = tau / step ;  tokens/s (plain) = 1 / plain step
    speedup                 = tokens/s (tree) / tokens/s (plain)

``verify(n, c)`` is interpolated linearly between the measured node counts and, between the measured
context lengths, linearly in the context (attention reads every cached position once per row, so its
share of a step grows linearly with the context; beyond the longest measured context the last segment
is extended, below the shortest its time is kept, and with one context that one is used everywhere). ``heads(n)`` is interpolated between the
tree sizes whose heads were timed (path-conditioned heads score one row per parent node, so their
time grows with the tree); a profile without those points uses its one ``heads_ms`` for every tree. What
the heads do depends on the tree's shape more than on its size (a 3-node chain runs two heads, a 3-node
fan one), so a profile also fits ``heads_time(tree) = a + b * levels + c * rows`` over trees of many shapes,
rows being what the heads score (one per parent node for path-conditioned heads, one per head otherwise).
``bookkeeping(n)`` (acceptance, cache compaction, the loop) likewise where it was timed per size, else
the one ``bookkeeping_ms``. ``prefill(p)``, the prompt forward of p tokens, lets a whole generate be
predicted (``treesearch.replay``), since measured tokens/s include it.

Under load a step verifies every live request's tree at once. ``batch_step(B, n, context)`` is one step of B
requests each verifying n nodes (heads, the forward of B x n rows, acceptance and compaction per row), measured
in real batched decode steps (``batch_step_ms[batch][nodes]`` at ``batch_context``) and interpolated in n within
each measured batch size, then linearly in B (beyond the largest measured, the last segment extended). At another
context each row's attention moves as its own verify does: ``+ B * (verify(n, c) - verify(n, batch_context))``.
Below ``compute_bound_rows`` verified rows a step costs less than twice a one-row step: it is bound by reading
the weights, which every row shares; above it, by the rows' arithmetic.

Through a server each step also streams one chunk to each of its B requests, and wakes the event loop, the
HTTP stack and (on the bench's machine) the load client, which run on the same cores as the forward. A served
step of B requests costs ``batch_step(B, n, c) + serving(B)``, ``serving(B) = serving_step_ms + B *
serving_chunk_ms``: a part per step and a part per streamed chunk, fitted to plain decoding served at each
profiled batch size against the same requests decoded in-process (``bench.load.serving``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StatsError
from .tree import Tree, read_json, write_json_atomic

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
    bookkeeping_nodes: tuple[int, ...] = ()  # verified node counts (root included, ascending) timed for bookkeeping
    bookkeeping_by_nodes_ms: tuple[float, ...] = ()  # [bookkeeping_nodes]: the rest of a real step of that size
    prefill_tokens: tuple[int, ...] = ()  # prompt lengths whose prefill was timed (ascending)
    prefill_ms: tuple[float, ...] = ()  # [prefill_tokens]: new cache + prompt forward + first token
    lookup_ms: float = 0.0  # drafting from the n-gram index and extending it, per step with a lookup chain
    # heads time fitted on trees of many shapes: ms = intercept + per_level * depth + per_row * head rows
    heads_fit: tuple[float, ...] = ()  # (intercept, per_level, per_row); () when not fitted
    heads_path_conditioned: bool = False  # path-conditioned heads score one row per parent (else one per head)
    # what a sampled step (typical acceptance at the search's temperature) costs over the greedy step of the same
    # size, timed in real decode loops (ms, by verified nodes; () when not measured: counted as 0)
    sampling_nodes: tuple[int, ...] = ()
    sampling_extra_ms: tuple[float, ...] = ()
    # whole batched decode steps: B requests, each verifying n nodes (root included), at one context
    batch_sizes: tuple[int, ...] = ()  # requests per step measured (ascending, 1 first)
    batch_nodes: tuple[int, ...] = ()  # nodes per request measured (ascending, 1 = plain decoding)
    batch_step_ms: tuple[tuple[float, ...], ...] = ()  # [batch_sizes][batch_nodes] ms per step
    batch_context: int = 0  # the cached positions of every request while it was timed
    serving_chunk_ms: float = 0.0  # wall ms a streamed chunk adds to a served step (0: not measured)
    serving_step_ms: float = 0.0  # wall ms serving adds to a step whatever its chunks (0: not measured)

    @property
    def has_batch(self) -> bool:
        return bool(self.batch_sizes)

    def batch_step(self, batch: int, num_nodes: int, context: int | None = None) -> float:
        """One step of ``batch`` requests each verifying ``num_nodes`` nodes (ms), at ``context``."""
        if not self.batch_sizes:
            raise StatsError("this latency profile has no batched steps: profile again with --batch-sizes")
        table = np.asarray(self.batch_step_ms, dtype=float)  # [batch, nodes]
        by_batch = np.array([_extended(num_nodes, self.batch_nodes, row) for row in table])  # [batch]
        sizes = np.asarray(self.batch_sizes, dtype=float)
        if len(sizes) == 1:
            ms = by_batch[0] * batch / sizes[0]
        elif batch > sizes[-1]:  # the last segment extended: rows beyond the largest batch cost as the last did
            ms = by_batch[-1] + (batch - sizes[-1]) * (by_batch[-1] - by_batch[-2]) / (sizes[-1] - sizes[-2])
        else:
            ms = float(np.interp(batch, sizes, by_batch))
        if context is not None and self.batch_context:
            ms += batch * (self.verify(num_nodes, context) - self.verify(num_nodes, self.batch_context))
        return float(max(ms, 1e-6))

    def serving(self, batch: int) -> float:
        """What serving adds to a step of ``batch`` requests (ms): waking the server and its clients, and one
        streamed chunk per request."""
        return self.serving_step_ms + batch * self.serving_chunk_ms

    @property
    def compute_bound_rows(self) -> int | None:
        """The fewest verified rows (batch x nodes) measured at which a step costs at least twice the one-row
        step (None: never, within what was measured)."""
        if not self.batch_sizes:
            return None
        one = self.batch_step(1, 1)
        cells = sorted((b * n, ms) for b, row in zip(self.batch_sizes, self.batch_step_ms)
                       for n, ms in zip(self.batch_nodes, row))
        return next((rows for rows, ms in cells if ms >= 2 * one), None)

    def _by_context(self, values: np.ndarray, context: int | None) -> np.ndarray:
        """values [contexts, ...] at ``context``: linear between measured contexts, the last segment extended
        beyond the longest, held at the shortest below it (None: the median over contexts)."""
        if context is None:
            return np.median(values, axis=0)
        ctx = np.asarray(self.contexts, dtype=float)
        if len(ctx) == 1 or context <= ctx[0]:
            return values[0]
        i = min(int(np.searchsorted(ctx, context)) - 1, len(ctx) - 2)  # segment [i, i + 1]
        w = (context - ctx[i]) / (ctx[i + 1] - ctx[i])
        return values[i] + w * (values[i + 1] - values[i])

    def verify(self, num_nodes: int, context: int | None = None) -> float:
        """Interpolated verify time (ms) for a tree of ``num_nodes`` nodes (root included)."""
        row = self._by_context(np.asarray(self.verify_ms, dtype=float), context)
        return float(np.interp(num_nodes, self.nodes, row))

    def plain(self, context: int | None = None) -> float:
        """One plain decode step (ms) at this context."""
        return float(self._by_context(np.asarray(self.plain_ms, dtype=float)[:, None], context)[0])

    def heads_time(self, tree: Tree) -> float:
        """Heads + top-k for this tree (ms): the fit over tree shapes where the profile has one, else the
        interpolation by node count."""
        if not self.heads_fit:
            return self.heads(tree.num_nodes)
        levels, rows = head_rows(tree, self.heads_path_conditioned)
        intercept, per_level, per_row = self.heads_fit
        return max(0.0, intercept + per_level * levels + per_row * rows)

    def bookkeeping(self, num_nodes: int) -> float:
        """Acceptance, compaction and the loop (ms) for a step that verified ``num_nodes`` nodes."""
        if not self.bookkeeping_nodes:
            return self.bookkeeping_ms
        return float(np.interp(num_nodes, self.bookkeeping_nodes, self.bookkeeping_by_nodes_ms))

    def sampling_extra(self, num_nodes: int) -> float:
        """What typical acceptance adds to a step that verified ``num_nodes`` nodes (0 where not measured)."""
        if not self.sampling_nodes:
            return 0.0
        return float(np.interp(num_nodes, self.sampling_nodes, self.sampling_extra_ms))

    def prefill(self, prompt_tokens: int) -> float:
        """The prompt forward (ms): linear between the timed lengths, the end segments extended (0 if not timed)."""
        if not self.prefill_tokens:
            return 0.0
        if len(self.prefill_tokens) == 1:
            return self.prefill_ms[0]
        x, y = np.asarray(self.prefill_tokens, dtype=float), np.asarray(self.prefill_ms, dtype=float)
        i = int(np.clip(np.searchsorted(x, prompt_tokens) - 1, 0, len(x) - 2))
        return float(max(y[i] + (prompt_tokens - x[i]) * (y[i + 1] - y[i]) / (x[i + 1] - x[i]), 0.0))

    def heads(self, num_nodes: int) -> float:
        """Heads time (ms) for a tree of ``num_nodes`` nodes: interpolated, held flat outside the measured sizes."""
        if not self.heads_nodes:
            return self.heads_ms
        return float(np.interp(num_nodes, self.heads_nodes, self.heads_by_nodes_ms))

    def step_ms(self, num_nodes: int, context: int | None = None, heads_ms: float | None = None,
                lookup: bool = False) -> float:
        """One decode step verifying ``num_nodes`` nodes (root included) at this context. ``heads_ms``: what the
        heads cost this step (default: ``heads(num_nodes)``; 0 for no heads, see ``heads_time``); ``lookup``:
        a lookup chain was drafted (its nodes are counted in ``num_nodes``)."""
        heads = (self.heads(num_nodes) if num_nodes > 1 else 0.0) if heads_ms is None else heads_ms
        extra = self.lookup_ms if lookup else 0.0
        if num_nodes <= 1 and heads <= 0:
            return self.plain(context) + extra
        return heads + self.verify(num_nodes, context) + self.bookkeeping(num_nodes) + extra


def _extended(x: float, xs: tuple[int, ...], ys: np.ndarray) -> float:
    """ys at x: linear between the points, the last segment extended beyond the last (held below the first)."""
    if len(xs) > 1 and x > xs[-1]:
        return float(ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return float(np.interp(x, xs, ys))


def head_rows(tree: Tree, path_conditioned: bool) -> tuple[int, int]:
    """(levels, rows) the heads score for ``tree``: one level per depth; path-conditioned heads score level d
    once per parent node at level d - 1 (the root alone for d = 1), other heads one row per head."""
    if not path_conditioned:
        return tree.depth, tree.depth
    parents = {p[:-1] for p in tree.paths}  # every node with a child, the root () included
    return tree.depth, len(parents)


@dataclass(frozen=True)
class Prediction:
    tau: float  # tokens per step
    step_ms: float  # predicted time of one Medusa step
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float  # over the runtime's plain decoding


def predict(profile: LatencyProfile, tau: float, num_nodes: int, context: int | None = None,
            sampled: bool = False) -> Prediction:
    """tau at a step of ``num_nodes`` against plain (greedy) decoding; ``sampled``: the step samples (typical
    acceptance), so it pays the profile's sampling extra too."""
    step = profile.step_ms(num_nodes, context) + (profile.sampling_extra(num_nodes) if sampled else 0.0)
    tps = 1000.0 * tau / step
    plain = 1000.0 / profile.plain(context)
    return Prediction(tau, step, tps, plain, tps / plain)


def profile_to_json(p: LatencyProfile) -> dict[str, Any]:
    return {"schema": LATENCY_SCHEMA, **p.meta, "nodes": list(p.nodes), "contexts": list(p.contexts),
            "verify_ms": [list(r) for r in p.verify_ms], "plain_ms": list(p.plain_ms), "heads_ms": p.heads_ms,
            "bookkeeping_ms": p.bookkeeping_ms, "heads_nodes": list(p.heads_nodes),
            "heads_by_nodes_ms": list(p.heads_by_nodes_ms), "bookkeeping_nodes": list(p.bookkeeping_nodes),
            "bookkeeping_by_nodes_ms": list(p.bookkeeping_by_nodes_ms), "prefill_tokens": list(p.prefill_tokens),
            "prefill_ms": list(p.prefill_ms), "lookup_ms": p.lookup_ms, "heads_fit": list(p.heads_fit),
            "heads_path_conditioned": p.heads_path_conditioned, "sampling_nodes": list(p.sampling_nodes),
            "sampling_extra_ms": list(p.sampling_extra_ms), "batch_sizes": list(p.batch_sizes),
            "batch_nodes": list(p.batch_nodes), "batch_step_ms": [list(r) for r in p.batch_step_ms],
            "batch_context": p.batch_context, "compute_bound_rows": p.compute_bound_rows,
            "serving_chunk_ms": p.serving_chunk_ms, "serving_step_ms": p.serving_step_ms}


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
        book_nodes = tuple(int(n) for n in obj.get("bookkeeping_nodes", ()))
        book_by_nodes = tuple(float(x) for x in obj.get("bookkeeping_by_nodes_ms", ()))
        prefill_tokens = tuple(int(n) for n in obj.get("prefill_tokens", ()))
        prefill = tuple(float(x) for x in obj.get("prefill_ms", ()))
        lookup = float(obj.get("lookup_ms", 0.0))
        heads_fit = tuple(float(x) for x in obj.get("heads_fit", ()))
        path_conditioned = bool(obj.get("heads_path_conditioned", False))
        sampling_nodes = tuple(int(n) for n in obj.get("sampling_nodes", ()))
        sampling_extra = tuple(float(x) for x in obj.get("sampling_extra_ms", ()))
        batch_sizes = tuple(int(b) for b in obj.get("batch_sizes", ()))
        batch_nodes = tuple(int(n) for n in obj.get("batch_nodes", ()))
        batch_step = tuple(tuple(float(x) for x in row) for row in obj.get("batch_step_ms", ()))
        batch_context = int(obj.get("batch_context", 0))
        serving_chunk = float(obj.get("serving_chunk_ms", 0.0))
        serving_step = float(obj.get("serving_step_ms", 0.0))
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
    for name, xs, ys, low in (("bookkeeping_nodes", book_nodes, book_by_nodes, 1),
                              ("prefill_tokens", prefill_tokens, prefill, 1),
                              ("sampling_nodes", sampling_nodes, sampling_extra, 1)):
        if len(xs) != len(ys) or list(xs) != sorted(set(xs)) or any(n < low for n in xs) or any(y < 0 for y in ys):
            raise StatsError(f"latency '{name}' must be ascending, distinct and >= {low}, with one non-negative "
                             "time each")
    if list(contexts) != sorted(set(contexts)) or lookup < 0:
        raise StatsError("latency 'contexts' must be ascending and distinct, 'lookup_ms' non-negative")
    if len(heads_fit) not in (0, 3):
        raise StatsError("latency 'heads_fit' must be [intercept, per_level, per_row]")
    for name, value in (("serving_chunk_ms", serving_chunk), ("serving_step_ms", serving_step)):
        if not value >= 0:
            raise StatsError(f"latency '{name}' must be a non-negative time, got {value!r}")
    if batch_sizes and (list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[0] != 1
                        or list(batch_nodes) != sorted(set(batch_nodes)) or not batch_nodes or batch_nodes[0] < 1
                        or len(batch_step) != len(batch_sizes) or any(len(r) != len(batch_nodes) for r in batch_step)
                        or any(x <= 0 for r in batch_step for x in r) or batch_context < 0):
        raise StatsError("latency 'batch_sizes' must be ascending from 1 and 'batch_nodes' ascending from >= 1, with "
                         "one positive 'batch_step_ms' per (batch size, nodes)")
    skip = {"schema", "nodes", "contexts", "verify_ms", "plain_ms", "heads_ms", "bookkeeping_ms", "heads_nodes",
            "heads_by_nodes_ms", "bookkeeping_nodes", "bookkeeping_by_nodes_ms", "prefill_tokens", "prefill_ms",
            "lookup_ms", "heads_fit", "heads_path_conditioned", "sampling_nodes", "sampling_extra_ms", "batch_sizes",
            "batch_nodes", "batch_step_ms", "batch_context", "compute_bound_rows", "serving_chunk_ms",
            "serving_step_ms"}
    return LatencyProfile(nodes, contexts, verify, plain, heads, book, {k: v for k, v in obj.items() if k not in skip},
                          heads_nodes, heads_by_nodes, book_nodes, book_by_nodes, prefill_tokens, prefill, lookup,
                          heads_fit, path_conditioned, sampling_nodes, sampling_extra, batch_sizes, batch_nodes,
                          batch_step, batch_context, serving_chunk, serving_step)


def mean_profile(profiles: list[LatencyProfile]) -> LatencyProfile:
    """The element-wise mean of profiles measured with the same grid (sizes, contexts, prompt lengths) at
    different times, e.g. before and after a replay: the machine's speed over that window, its drift halved.
    Profiles on other grids are refused (StatsError)."""
    first = profiles[0]
    grid = (first.nodes, first.contexts, first.heads_nodes, first.bookkeeping_nodes, first.prefill_tokens,
            len(first.heads_fit), first.heads_path_conditioned, first.sampling_nodes, first.batch_sizes,
            first.batch_nodes, first.batch_context)
    for p in profiles[1:]:
        if (p.nodes, p.contexts, p.heads_nodes, p.bookkeeping_nodes, p.prefill_tokens, len(p.heads_fit),
                p.heads_path_conditioned, p.sampling_nodes, p.batch_sizes, p.batch_nodes, p.batch_context) != grid:
            raise StatsError("latency profiles measured on different grids cannot be averaged")

    def mean(values):  # values: one float, or nested tuples of floats, per profile
        arr = np.mean(np.asarray(values, dtype=float), axis=0)
        if arr.ndim == 0:
            return float(arr)
        return tuple(tuple(float(x) for x in row) for row in arr) if arr.ndim == 2 else tuple(float(x) for x in arr)

    fields = ("verify_ms", "plain_ms", "heads_ms", "bookkeeping_ms", "heads_by_nodes_ms", "bookkeeping_by_nodes_ms",
              "prefill_ms", "lookup_ms", "heads_fit", "sampling_extra_ms", "batch_step_ms", "serving_chunk_ms",
              "serving_step_ms")
    averaged = {f: mean([getattr(p, f) for p in profiles]) for f in fields}
    meta = {**first.meta, "averaged_profiles": len(profiles)}
    return replace(first, meta=meta, **averaged)


def load_profile(path: str | os.PathLike[str], expect_model: str | None = None) -> LatencyProfile:
    prof = profile_from_json(read_json(path, StatsError, "latency file"))
    model = prof.meta.get("model")
    if expect_model is not None and model is not None and model != expect_model:
        raise StatsError(f"latency file {path} was measured on model {model!r}, the statistics are for {expect_model!r}")
    return prof

