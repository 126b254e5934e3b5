"""Verify probes: the latency profile's tight verify table timed again before each replayed question.

The replay's predictions are priced with the latency profile, measured before the replay. On a shared
machine the speed moves while the replay runs (this VM's memory bandwidth sits at one of two levels for
minutes at a time), and a multi-row verify relative to one row costs otherwise at each level, so a profile
timed at one level misprices a replay that ran at the other. One round of the profile's tight table (every
tree size at every profiled context, about a second here) before each (question, turn, repeat) samples the
machine's speed where the replay's time is spent; ``treesearch.cost.repriced`` moves the profile's verify
and plain step to those probes' mean. The replay's records and their timings are untouched: a probe runs
between questions, never inside one.

``probes.jsonl`` (beside ``records.jsonl``): one line per (question, turn, repeat), appended and flushed, so
an interrupted replay resumes its probes as it resumes its records.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from treesearch.cost import LatencyProfile, repriced
from treesearch.stats import StatsError

PROBE_SCHEMA = "medusa-probe/1"


class ProbeLog:
    """Called before each (question, turn, repeat) the replay runs: times ``table`` (a
    ``medusa_runtime.profile.VerifyTable`` on the profile's grid) once and appends it, unless that key has its
    probe already."""

    def __init__(self, path: str | Path, table, profile: LatencyProfile):
        self.path = Path(path)
        self.table = table
        self.grid = {"nodes": list(profile.nodes), "contexts": list(profile.contexts)}
        self.done = {_key(p) for p in read_probes(self.path)}

    def __call__(self, question_id: int, turn: int, repeat: int) -> None:
        key = (question_id, turn, repeat)
        if key in self.done:
            return
        ms = self.table()
        line = {"schema": PROBE_SCHEMA, "question_id": question_id, "turn": turn, "repeat": repeat,
                "time": time.time(), **self.grid, "verify_ms": ms}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
        self.done.add(key)


def _key(probe: dict) -> tuple[int, int, int]:
    return int(probe["question_id"]), int(probe["turn"]), int(probe["repeat"])


def read_probes(path: str | Path) -> list[dict]:
    """The probes of a replay ([] when there is no file); a torn last line (a killed replay) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    probes = []
    for line in p.read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and obj.get("schema") == PROBE_SCHEMA:
            probes.append(obj)
    return probes


def priced_by_probes(profile: LatencyProfile, path: str | Path) -> tuple[LatencyProfile, int]:
    """(the profile repriced at the probes' mean speed, the number of probes used); the profile itself and 0
    when there are no probes on its grid or it has no tight table to scale from."""
    grid = (list(profile.nodes), list(profile.contexts))
    tables = [p["verify_ms"] for p in read_probes(path) if (p.get("nodes"), p.get("contexts")) == grid]
    if not tables:
        return profile, 0
    try:
        return repriced(profile, tables), len(tables)
    except StatsError:
        return profile, 0
