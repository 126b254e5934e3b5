"""What serving costs a decode step (``latency.json``'s ``serving_step_ms`` and ``serving_chunk_ms``), for the
schedule's predictions.

A served step streams one chunk to each request it decoded, and it wakes the event loop, the HTTP stack and (on
the bench's machine) the load client, which run on the cores the forward runs on. The cost is measured on plain
decoding, paired: at each concurrency c, the same requests (c clients in a closed loop, two requests each, four
at least) go through the server and through the same batched decoder in this process, one run right after the
other, so that the machine's drift in speed falls on both::

    overhead(c)  = (served wall - in-process wall) / in-process steps            ms per batched step
    overhead(c) ~= step_ms + c * chunk_ms          least squares over each concurrency's median overhead

with both parts held non-negative. The served wall runs from the first request sent to the last one ended; the
in-process one is ``run_batched`` over the same prompts, ``c`` rows at most. Greedy decoding gives both the same
tokens (batch-invariant kernels); where a count differs, the served wall is scaled to the in-process tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.load.client import LoadPlan, LoadRequest, run_load_sync
from bench.load.servers import OwnServer
from medusa_runtime.decoding.batch import run_batched
from medusa_runtime.decoding.decode import MedusaDecoder


@dataclass(frozen=True)
class ServingRun:
    """One concurrency's requests served and decoded in-process."""

    concurrency: int
    requests: int
    served_tokens: int  # the server's completion tokens over the requests
    tokens: int  # the in-process run's new tokens
    steps: int  # the in-process run's batched steps
    served_ms: float  # first request sent to last one ended
    in_process_ms: float

    @property
    def overhead_ms(self) -> float:
        """What serving added to each batched step (ms; negative where the served run was the faster)."""
        served = self.served_ms * self.tokens / self.served_tokens if self.served_tokens else self.served_ms
        return (served - self.in_process_ms) / self.steps

    def as_json(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": self.requests, "served_tokens": self.served_tokens,
                "tokens": self.tokens, "steps": self.steps, "served_ms": round(self.served_ms, 2),
                "in_process_ms": round(self.in_process_ms, 2), "overhead_ms": round(self.overhead_ms, 4)}


@dataclass(frozen=True)
class ServingCost:
    step_ms: float  # what serving adds to a step whatever its chunks
    chunk_ms: float  # what each streamed chunk adds to it
    runs: tuple[ServingRun, ...]

    def as_json(self) -> dict[str, Any]:
        return {"step_ms": round(self.step_ms, 4), "chunk_ms": round(self.chunk_ms, 4),
                "concurrencies": sorted({r.concurrency for r in self.runs}), "runs": [r.as_json() for r in self.runs]}


def fit_overhead(runs: Sequence[ServingRun]) -> tuple[float, float]:
    """(step_ms, chunk_ms): least squares of ``overhead(c) = step_ms + c * chunk_ms`` over the median overhead at
    each concurrency (one run gone astray in a round moves nothing), both parts held non-negative (where one
    comes out negative it is 0 and the other is fitted alone)."""
    by_c: dict[int, list[float]] = {}
    for r in runs:
        by_c.setdefault(r.concurrency, []).append(r.overhead_ms)
    c = np.array(sorted(by_c), dtype=float)
    y = np.array([float(np.median(by_c[k])) for k in sorted(by_c)])
    if len(c) > 1:
        chunk, step = np.polyfit(c, y, 1)
        if step >= 0 and chunk >= 0:
            return float(step), float(chunk)
    options = [(max(0.0, float(y.mean())), 0.0), (0.0, max(0.0, float(c @ y / (c @ c))))]
    return min(options, key=lambda o: float(np.sum((o[0] + o[1] * c - y) ** 2)))


def serving_requests(prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int) -> list[LoadRequest]:
    """A run's requests: two per client, four at least, the prompts cycled."""
    n = max(4, 2 * concurrency)
    return [LoadRequest(f"p{i}", tuple(prompts[i % len(prompts)]), max_new_tokens) for i in range(n)]


def served_run(server: OwnServer, requests: Sequence[LoadRequest], concurrency: int) -> tuple[float, int]:
    """(ms from the first request sent to the last one ended, completion tokens) through ``server``."""
    records = run_load_sync(server.url + "/v1", server.model, requests, LoadPlan(concurrency=concurrency))
    failed = sorted({r.error for r in records if not r.ok})
    if failed or len(records) != len(requests):
        raise ValueError("a request of the serving run failed: " + "; ".join(failed[:3] or ["no record"]))
    return 1000.0 * (max(r.ended for r in records) - min(r.sent for r in records)), sum(r.tokens for r in records)


def in_process_run(decoder: MedusaDecoder, requests: Sequence[LoadRequest], concurrency: int
                   ) -> tuple[float, int, int]:
    """(ms, new tokens, batched steps) of the same requests decoded here, ``concurrency`` rows at most."""
    t0 = time.perf_counter()
    out, steps = run_batched(decoder, [r.prompt for r in requests], requests[0].max_tokens, concurrency)
    return 1000.0 * (time.perf_counter() - t0), sum(map(len, out)), steps


def measure_serving(model: str, heads: str, dtype: str, weights: str, decoder: MedusaDecoder,
                    concurrencies: Sequence[int], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    rounds: int = 3, log_file: Path | None = None, progress=None) -> ServingCost:
    """Plain decoding (on the heads' base, as ``decoder`` decodes) served and decoded in-process at each
    concurrency, ``rounds`` times, the concurrencies in a shuffled order each round, after one untimed request
    each way; the fitted cost and the runs."""
    requests = {c: serving_requests(prompts, c, max_new_tokens) for c in concurrencies}
    server = OwnServer(model, heads, "none", max(concurrencies), max_new_tokens, dtype, log_file=log_file,
                       weights=weights)
    runs = []
    try:
        warm = requests[min(concurrencies)][:1]
        served_run(server, warm, 1)
        in_process_run(decoder, warm, 1)
        for r in range(rounds):
            for c in random.Random(r).sample(list(concurrencies), len(concurrencies)):
                served_ms, served_tokens = served_run(server, requests[c], c)
                in_ms, tokens, steps = in_process_run(decoder, requests[c], c)
                runs.append(ServingRun(c, len(requests[c]), served_tokens, tokens, steps, served_ms, in_ms))
                if progress is not None:
                    progress(1)
    finally:
        server.close()
    step, chunk = fit_overhead(runs)
    return ServingCost(step, chunk, tuple(runs))
