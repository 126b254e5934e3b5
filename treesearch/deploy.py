"""The one configuration to deploy: a search fitted on every replayed question, written as the final
``tree.json`` with its target, the heads it needs and its prediction with intervals.

The cross-fitting folds check the *procedure* (each fold's pick is measured on questions its search never
saw); the final configuration is what that procedure gives when it may read them all, as a user would run
it. Its intervals are percentile bootstraps over the rollouts (questions) resampled whole: how far the
prediction would move on another sample of questions like these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cost import LatencyProfile
from .replay import Decoding, configuration_json, replay
from .search import load_recommendation
from .stats import AcceptanceStats, StatsError, bootstrap_ratio
from .tree import read_json, write_json_atomic

LEVEL = 0.95


def prediction(dec: Decoding, stats: AcceptanceStats, latency: LatencyProfile, level: float = LEVEL
               ) -> dict[str, Any]:
    """tau and the speed-up over plain decoding of ``dec``, replayed on the rollouts, each with its interval."""
    if not stats.has_texts:
        raise StatsError("a final configuration is predicted by replaying rollouts: these statistics carry none")
    res, plain = replay(dec, stats, latency), replay(Decoding(), stats, latency)
    tokens = [sum(r.accept_lengths) for r in res.rollouts]
    steps = [len(r.accept_lengths) for r in res.rollouts]
    speedup_ci = bootstrap_ratio([r.time_ms for r in plain.rollouts], [r.time_ms for r in res.rollouts], level)
    return {"tau": round(res.tau, 6), "tau_ci": [round(x, 6) for x in bootstrap_ratio(tokens, steps, level)],
            "speedup_vs_plain": round(plain.time_ms / res.time_ms, 6),
            "speedup_vs_plain_ci": [round(x, 6) for x in speedup_ci],
            "tokens_per_s": round(res.tokens_per_s, 3), "level": level, "rollouts": len(res.rollouts)}


def write_final(search_file: str | Path, stats: AcceptanceStats, latency: LatencyProfile, heads: dict[str, Any],
                out: str | Path, fitted_on: list[str] | None = None) -> Path:
    """``out``: the search file's tree and provenance, plus ``configuration`` (what an export deploys: for this
    runtime the search's recommendation, which may use no heads; for an engine the fastest configuration with
    heads that it runs, since without heads there is nothing to export to it), ``heads`` (what it needs: name or path, digest,
    conditioning) and ``prediction`` (tau and speed-up over plain decoding, with intervals)."""
    obj = read_json(search_file, StatsError, "search file")
    if not isinstance(obj, dict) or "target" not in obj:
        raise StatsError(f"{search_file} is not a search file with a target (search again)")
    dec = load_recommendation(search_file, with_heads=obj["target"] != "own")
    final = {**obj, "name": "final", "configuration": configuration_json(dec), "heads": heads,
             "prediction": prediction(dec, stats, latency)}
    if fitted_on is not None:
        final["fitted_on"] = {"questions": len(fitted_on), "ids": list(fitted_on)}
    return write_json_atomic(out, final)
