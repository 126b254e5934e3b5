"""The latency profile taken during the replay: one round of its pieces every few questions.

The search prices its candidates with the profile measured before the replay; the report must price its
predictions at the speed the replay ran at. On a shared machine that speed moves while the replay runs
(this VM's memory bandwidth sits at one of two levels for minutes at a time), and it moves a multi-row
verify otherwise than one row (at the slower level extra rows hide under the weight stream: a 5-row
verify cost 1.33x one row in a profile at the fast level, 1.13x in a replay at the slow one;
docs/reports/verify-probes.md). So the replay takes one round of the profile's own pieces
(``medusa_runtime.measure.profile.Profiler``: tight verify forwards, real decode loops, prefills; ~10 s on the
default model) before every ``every``-th (question, turn, repeat), between records, never inside one,
and the report prices with the profile of those rounds (``latency-during.json``).

``profile_rounds.jsonl`` (beside ``records.jsonl``): one line per round, appended and flushed, keyed by
the (question, turn, repeat) it ran before, so an interrupted replay resumes its rounds as its records.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.replay.runner import load_records
from treesearch.cost import LatencyProfile, save_profile

ROUND_SCHEMA = "medusa-profile-round/1"
MIN_ROUNDS = 3  # fewer rounds make no profile (an interquartile mean of 1-2 samples is one sample)


def read_rounds(path: str | Path) -> list[dict]:
    """The rounds of a replay ([] without a file); a torn last line (a killed replay) is skipped, as the
    replay's own records are (``bench.replay.runner.load_records``)."""
    return [r for r in load_records(Path(path)) if isinstance(r, dict) and r.get("schema") == ROUND_SCHEMA]


class RoundsDuringReplay:
    """``bench.replay.runner.replay``'s ``between`` hook: before the (question, turn, repeat) at position ``index``
    of the replay's full matrix, one profile round when ``index % every == 0`` and that key has none yet.
    The first round a process takes is an untimed warm-up (decoders and caches built, weights touched)."""

    def __init__(self, path: str | Path, profiler, every: int = 2):
        if every < 1:
            raise ValueError(f"profile rounds every N questions: N must be >= 1, got {every}")
        self.path, self.profiler, self.every = Path(path), profiler, every
        self.done = {_key(r) for r in read_rounds(self.path)}
        self.warm = False

    def __call__(self, index: int, question_id: int, turn: int, repeat: int) -> None:
        key = (question_id, turn, repeat)
        if index % self.every or key in self.done:
            return
        if not self.warm:
            self.profiler.round()
            self.warm = True
        r = self.profiler.round()
        line = {"schema": ROUND_SCHEMA, "question_id": question_id, "turn": turn, "repeat": repeat,
                "time": time.time(), **r}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
        self.done.add(key)

    def write_profile(self, out: str | Path) -> LatencyProfile | None:
        """``out`` (``latency-during.json``) from every round on file; None (nothing written) under MIN_ROUNDS."""
        rounds = read_rounds(self.path)
        if len(rounds) < MIN_ROUNDS:
            return None
        which = "each" if self.every == 1 else f"every {_ordinal(self.every)}"
        prof = self.profiler.profile(rounds, meta={
            "taken": f"during the replay: {len(rounds)} rounds, one before {which} replayed (question, turn, repeat)"})
        save_profile(prof, out)
        return prof


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _key(r: dict) -> tuple[int, int, int]:
    return int(r["question_id"]), int(r["turn"]), int(r["repeat"])
