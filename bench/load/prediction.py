"""What the schedule's row of the load stage is set against: its predicted output throughput at each concurrency.

tree.json's own predictions are for the search's calibration rollouts: their prompts and lengths. The load
stage replays other requests (the questions' first turns, ``--max-new-tokens`` each), and at a large batch a
request's prefills and contexts weigh in its latency. So the prediction is made again for the load's requests:
each range's configuration replayed on the acceptance statistics tree.json was searched on, every rollout moved
onto every one of the load's prompt lengths and cut at its token cap, and priced by the latency profile it was
searched with (``treesearch.schedule.throughput_on_prompts``), its batched steps measured again during the load
(``bench.load.step_costs``). Where tree.json's files are gone or changed, tree.json's own prediction stands, and
the row says which.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from treesearch.cost import LatencyProfile, load_profile
from treesearch.replay import decoding_of_json
from treesearch.schedule import decoding_at, throughput_on_prompts
from treesearch.stats import AcceptanceStats, StatsError, load_stats

ON_REQUESTS = "these requests"  # predicted for the load's own prompts and token cap
ON_CALIBRATION = "the search's calibration rollouts"  # tree.json's own prediction
PLAIN = {"config": "plain", "medusa_choices": None, "lookup": 0, "gate": 0.0}  # plain decoding, as tree.json writes it


@dataclass(frozen=True)
class SchedulePredictor:
    schedule: tuple[dict, ...]
    stats: AcceptanceStats | None  # None: tree.json's predictions only
    latency: LatencyProfile | None
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    why_not: str = ""  # why the load's requests could not be predicted for

    @property
    def basis(self) -> str:
        return ON_REQUESTS if self.stats is not None else ON_CALIBRATION

    def __call__(self, concurrency: int, latency: LatencyProfile | None = None) -> float | None:
        """Predicted output tokens/s at ``concurrency`` (None where tree.json holds none and it cannot be made),
        priced by ``latency`` (default: the profile the search priced with)."""
        if self.stats is not None:
            dec = decoding_of_json(decoding_at(list(self.schedule), concurrency))
            return throughput_on_prompts(self.stats, latency or self.latency, dec, concurrency, self.prompt_tokens,
                                         self.max_new_tokens)
        for entry in self.schedule:
            for p in entry.get("prediction", {}).get("by_batch", []):
                if p.get("batch") == concurrency:
                    return p.get("output_tokens_per_s")
        return None

    def served_as(self, concurrency: int, latency: LatencyProfile, plain_tokens_per_s: float) -> LatencyProfile:
        """``latency`` with the serving cost per step that prices plain decoding at ``concurrency`` at the
        ``plain_tokens_per_s`` its server was measured at (beside the schedule's, in the same rounds).

        A request's predicted latency is linear in a per-step serving cost s (every step pays it), so with
        t0 and t1 plain decoding's predicted throughputs at s = 0 and s = 1 ms, a measured throughput m gives
        s = (1/m - 1/t0) / (1/t1 - 1/t0), held at 0 or more."""
        plain = decoding_of_json(PLAIN)
        t0, t1 = (throughput_on_prompts(self.stats, replace(latency, serving_step_ms=s, serving_chunk_ms=0.0), plain,
                                        concurrency, self.prompt_tokens, self.max_new_tokens) for s in (0.0, 1.0))
        step = (1.0 / plain_tokens_per_s - 1.0 / t0) / (1.0 / t1 - 1.0 / t0)
        return replace(latency, serving_step_ms=max(0.0, step), serving_chunk_ms=0.0)


def schedule_predictor(tree_json: str, schedule: Sequence[dict], prompt_tokens: Sequence[int],
                       max_new_tokens: int) -> SchedulePredictor:
    """The predictor for a load of these prompts, on the files tree.json names where they are as it read them."""
    fallback = SchedulePredictor(tuple(schedule), None, None, tuple(prompt_tokens), max_new_tokens)
    try:
        doc = json.loads(Path(tree_json).read_text())
        stats = load_stats(doc["acceptance_file"])
        latency = load_profile(doc["latency_file"])
    except (OSError, KeyError, TypeError, ValueError, StatsError) as exc:
        return replace(fallback, why_not=f"{type(exc).__name__}: {exc}")
    if doc.get("acceptance_sha256") not in (None, stats.sha256):
        return replace(fallback, why_not=f"{doc['acceptance_file']} changed since the search")
    if not latency.has_batch:
        return replace(fallback, why_not=f"{doc['latency_file']} has no batched steps")
    return replace(fallback, stats=stats, latency=latency)
