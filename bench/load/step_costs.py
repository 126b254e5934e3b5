"""The batched step costs the schedule's predictions are priced with: measured during the load, beside the runs of
the schedule's server and of plain decoding on its base.

The search priced the schedule with the latency profile taken before it. On a shared machine the speed moves
between the profile and the load (memory bandwidth can sit at one of two levels for minutes at a time, and the
slower level stretches a one-row step, bound by the weights' bytes, more than a many-row verify). A prediction
priced at the profile's speed then misses by what the machine moved, not by what the model got wrong. So, as
the replay does with its profile rounds (``bench.replay.profile_rounds``), the load stage times the profile's
own batched steps (``medusa_runtime.measure.profile.BatchedSteps``: B requests each verifying a tree of n nodes,
one whole step) in this process while every server idles, right before and right after each run of the
schedule's server and of plain decoding on its base, and keeps the rounds by (concurrency, run beside)::

    cells        batch sizes of the profile up to the first >= c, node counts up to the first >= the most rows a
                 request of the schedule verifies (root, tree and lookup chain)
    profile(c)   the search's latency profile with those cells' interquartile means over the rounds at c in
                 place of its batched steps (its contexts and prefills kept)

The load stage prices the schedule at c with the rounds beside its runs, and serving's cost per step with the
one that prices the plain row at its measured throughput against the rounds beside that row's runs
(``bench.load.prediction.SchedulePredictor.served_as``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from medusa_runtime.measure.profile import BatchedSteps, ProfileConfig
from treesearch.cost import LatencyProfile


def grid_upto(grid: Sequence[int], need: int) -> tuple[int, ...]:
    """The grid's points up to the first at or beyond ``need`` (all of them where none is)."""
    points = sorted(grid)
    last = next((i for i, p in enumerate(points) if p >= need), len(points) - 1)
    return tuple(points[:last + 1])


def rows_per_request(schedule: Sequence[dict]) -> int:
    """The most rows one request verifies in a step of any of the schedule's configurations: the root, its tree's
    nodes (``tree_nodes`` counts them without the root) and its lookup chain."""
    return max(1 + int(e["configuration"].get("tree_nodes") or 0) + int(e["configuration"].get("lookup") or 0)
               for e in schedule)


class StepsDuringLoad:
    """Rounds of batched steps taken during a load, by concurrency (``take``), and the profile they price with
    (``profile_at``). The first round is an untimed warm-up (caches built, weights touched)."""

    def __init__(self, loaded, heads, latency: LatencyProfile, schedule: Sequence[dict],
                 concurrencies: Sequence[int]):
        if not latency.has_batch:
            raise ValueError("the latency profile has no batched steps to measure again")
        self.latency = latency
        nodes = grid_upto(latency.batch_nodes, rows_per_request(schedule))
        cfg = ProfileConfig(contexts=(latency.batch_context,), batch_sizes=grid_upto(latency.batch_sizes,
                                                                                     max(concurrencies)),
                            batch_nodes=nodes)
        self.steps = BatchedSteps(loaded, heads if len(nodes) > 1 else None, cfg)
        self.rounds: dict[tuple[int, str], list[list[float]]] = {}  # by (concurrency, the run they flank)
        self.taken = 0
        self.steps.round(self.taken)
        self.taken += 1

    def _upto(self, concurrency: int) -> int:
        return grid_upto(self.steps.cfg.batch_sizes, concurrency)[-1]

    def take(self, concurrency: int, beside: str) -> None:
        """One round of the cells concurrency ``concurrency`` is priced with, beside a run of ``beside``."""
        self.rounds.setdefault((concurrency, beside), []).append(self.steps.round(self.taken,
                                                                                  self._upto(concurrency)))
        self.taken += 1

    def profile_at(self, concurrency: int, beside: str) -> LatencyProfile | None:
        """The search's profile with the batched steps of the rounds taken at ``concurrency`` beside the runs of
        ``beside`` (None: none)."""
        taken = self.rounds.get((concurrency, beside))
        if not taken:
            return None
        sizes, nodes, table, context = self.steps.table_of(taken, self._upto(concurrency))
        return replace(self.latency, batch_sizes=sizes, batch_nodes=nodes, batch_step_ms=table, batch_context=context)

    def as_json(self, concurrency: int, beside: str) -> dict[str, Any] | None:
        """What ``profile_at`` priced with, for load.json."""
        prof = self.profile_at(concurrency, beside)
        if prof is None:
            return None
        return {"rounds": len(self.rounds[(concurrency, beside)]), "batch_sizes": list(prof.batch_sizes),
                "batch_nodes": list(prof.batch_nodes), "context": prof.batch_context,
                "batch_step_ms": [[round(ms, 3) for ms in row] for row in prof.batch_step_ms],
                "search_batch_step_ms": [[round(self.latency.batch_step(b, n), 3) for n in prof.batch_nodes]
                                         for b in prof.batch_sizes]}
