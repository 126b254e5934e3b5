"""A load run's records -> the rows of load.json: throughput with its interval, latency percentiles, agreement with
plain decoding, and each configuration's speed-up over plain decoding at equal concurrency.

Throughput at concurrency c is c clients each producing sum(tokens) in sum(latency) (Little's law)::

    output_tokens_per_s = c * sum(tokens_i) / sum(latency_i)       (interval: requests resampled whole)

so the tail of a run (fewer than c requests left) does not lower it; the wall-clock figure (tokens over the
run's span) is kept beside it. A speed-up pairs each question's request under the configuration with the same
question's under plain decoding at the same concurrency, and resamples questions whole. Where the heads carry an
adapter (Medusa-2), the runtime's rows also have their speed-up over plain decoding on the heads' base
(``HEADS_BASE_PLAIN``): the same model, so the two differ by the decoding alone, not by the answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bench.load.client import RequestRecord, question_key
from treesearch.stats import bootstrap_ratio

SCHEMA = "medusa-load/1"
HEADS_BASE_PLAIN = "plain, heads' base"  # the runtime's plain decoding on the base the heads decode with
PERCENTILES = (50, 90, 99)


def percentiles_ms(values: Sequence[float], reps: int = 1000, seed: int = 0) -> dict | None:
    """p50/p90/p99 in milliseconds, each with a 95 % percentile-bootstrap interval (values resampled)."""
    if not values:
        return None
    v = np.asarray(values, dtype=np.float64) * 1e3
    out: dict = {f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES}
    draws = v[np.random.default_rng(seed).integers(0, v.size, size=(reps, v.size))]  # [reps, n]
    per = np.percentile(draws, PERCENTILES, axis=1)  # [3, reps]
    out["ci"] = {f"p{p}": [float(np.quantile(row, 0.025)), float(np.quantile(row, 0.975))]
                 for p, row in zip(PERCENTILES, per)}
    return out


def load_row(config: str, engine: str, concurrency: int, records: Sequence[RequestRecord],
             reference: dict[str, str] | None = None, counters: dict | None = None, build: str | None = None,
             schedule: bool = False, predicted: float | None = None) -> dict:
    """One (configuration, engine, concurrency) row. ``reference``: each question's text under the runtime's plain
    greedy decoding alone; ``counters``: the server's accepted drafts and steps over the run (the runtime's)."""
    ok = [r for r in records if r.ok]
    row = {"config": config, "engine": engine, "concurrency": concurrency, "requests": len(records),
           "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if not r.ok})[:3],
           "reconnects": sum(r.reconnects for r in records)}
    if build is not None:
        row["build"] = build
    if not ok:
        return row
    tokens, latency = [r.tokens for r in ok], [r.latency for r in ok]
    lo, hi = bootstrap_ratio(tokens, latency)
    span = max(r.ended for r in ok) - min(r.sent for r in ok)
    row.update({
        "output_tokens_per_s": concurrency * sum(tokens) / sum(latency),
        "output_tokens_per_s_ci": [concurrency * lo, concurrency * hi],
        "output_tokens_per_s_wall": sum(tokens) / span if span > 0 else None,
        "per_request_tokens_per_s": float(np.median([t / s for t, s in zip(tokens, latency)])),
        "output_tokens": int(sum(tokens)),
        "ttft_ms": percentiles_ms([r.ttft for r in ok]),
        "tpot_ms": percentiles_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": percentiles_ms([g for r in ok for g in r.itl]),
        "accepted_per_step": None, "accepted_per_position": None,
        "identical_to_plain": None if reference is None else
        sum(reference.get(question_key(r.key)) == r.text for r in ok) / len(ok),
        "schedule": schedule, "predicted_output_tokens_per_s": predicted,
    })
    if counters and counters.get("steps"):
        row["accepted_per_step"] = sum(counters["accepted"].values()) / counters["steps"]
        row["accepted_per_position"] = [counters["accepted"].get(p, 0) / counters["steps"]
                                        for p in range(1, max(counters["accepted"], default=0) + 1)]
    return row


def paired_speedup(config: Sequence[RequestRecord], plain: Sequence[RequestRecord], reps: int = 2000,
                   seed: int = 0) -> tuple[float, list[float]] | None:
    """(speed-up, 95 % interval) of a configuration's throughput over plain decoding's at the same concurrency, by
    question: both runs' tokens and latencies summed over the same resampled questions."""
    a = {r.key: r for r in config if r.ok}
    b = {r.key: r for r in plain if r.ok}
    keys = sorted(a.keys() & b.keys())
    if not keys:
        return None
    t = np.array([[a[k].tokens, a[k].latency, b[k].tokens, b[k].latency] for k in keys], dtype=np.float64)
    point = (t[:, 0].sum() / t[:, 1].sum()) / (t[:, 2].sum() / t[:, 3].sum())
    draws = t[np.random.default_rng(seed).integers(0, len(keys), size=(reps, len(keys)))].sum(axis=1)  # [reps, 4]
    ratios = (draws[:, 0] / draws[:, 1]) / (draws[:, 2] / draws[:, 3])
    return float(point), [float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))]


def add_speedups(rows: list[dict], records: dict[tuple[str, str, int], list[RequestRecord]]) -> None:
    """Each row's ``speedup_vs_plain`` (+ ``_ci``): over the same engine's plain row at its concurrency; and, where
    there is one, ``speedup_vs_heads_base_plain`` (+ ``_ci``) over plain decoding on the heads' base."""
    for row in rows:
        key = (row["config"], row["engine"], row["concurrency"])
        if row["config"] == "plain" or key not in records:
            continue
        for reference, field in (("plain", "speedup_vs_plain"), (HEADS_BASE_PLAIN, "speedup_vs_heads_base_plain")):
            plain = records.get((reference, row["engine"], row["concurrency"]))
            got = paired_speedup(records[key], plain) if plain is not None and row["config"] != reference else None
            if got is not None:
                row[field], row[field + "_ci"] = got


def stops_paying(rows: Sequence[dict]) -> dict[str, dict]:
    """Per configuration (the runtime's): the lowest concurrency measured at which its speed-up over plain decoding
    is below 1, and whether its interval lies below 1 there too (None: it pays at every concurrency measured)."""
    out: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        if row["config"] in ("plain", HEADS_BASE_PLAIN) or "speedup_vs_plain" not in row:
            continue
        entry = out.setdefault(row["config"], {"engine": row["engine"], "stops_paying_at": None, "certain": None})
        if entry["stops_paying_at"] is None and row["speedup_vs_plain"] < 1:
            entry["stops_paying_at"] = row["concurrency"]
            entry["certain"] = row["speedup_vs_plain_ci"][1] < 1
    return out
