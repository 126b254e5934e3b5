"""What streaming costs a served step (``latency.json``'s ``serving_chunk_ms``), for the schedule's predictions.

A served step streams one chunk to each request it decoded, and the event loop, the HTTP stack and (on the
bench's machine) the load client run on the cores the forward runs on. That cost is measured once, on plain
decoding, against the profile's own batched steps::

    measured_r   = request r's latency through the server: c clients in a closed loop, plain greedy, streamed
    predicted_r  = sum over its steps i of batch_step(c, 1, prompt_r + i) + c * prefill(prompt_r)
    chunk ms     = max(0, (sum_r measured_r - sum_r predicted_r) / (c * sum_r steps_r))

``predicted_r`` prices the request as ``treesearch.schedule`` prices plain decoding at batch c (a request's
first token comes from its prefill, every further one from a step), and each of its steps streams a chunk to
each of the c requests decoding with it. The prompts are the built-in calibration prompts, not the questions
the load stage replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.load.client import LoadPlan, LoadRequest, RequestRecord, enough, run_load_sync
from bench.load.servers import OwnServer
from treesearch.cost import LatencyProfile
from treesearch.schedule import request_latency


@dataclass(frozen=True)
class ServingCost:
    chunk_ms: float  # wall ms one streamed chunk adds to a served step
    concurrency: int
    requests: int
    steps: int  # decode steps over the requests (tokens after each one's first)
    measured_ms: float  # sum of the requests' latencies through the server
    predicted_ms: float  # the same requests priced by the profile's batched steps, no streaming

    def as_json(self) -> dict[str, Any]:
        return {"chunk_ms": round(self.chunk_ms, 4), "concurrency": self.concurrency, "requests": self.requests,
                "steps": self.steps, "measured_ms": round(self.measured_ms, 1),
                "predicted_ms": round(self.predicted_ms, 1)}


def predicted_plain_ms(profile: LatencyProfile, concurrency: int, prompt_tokens: int, tokens: int) -> float:
    """A plain request's latency at batch ``concurrency`` by the profile, without streaming (ms): its tokens
    after the first one step each, of one node, at the context it has reached."""
    unstreamed = replace(profile, serving_chunk_ms=0.0)
    return request_latency(unstreamed, concurrency, [1] * (tokens - 1),
                           [prompt_tokens + i for i in range(1, tokens)], prompt_tokens)


def chunk_cost(records: Sequence[RequestRecord], prompt_tokens: dict[str, int], profile: LatencyProfile,
               concurrency: int) -> ServingCost:
    """The chunk cost from a closed-loop run's records (see the module doc); ``prompt_tokens`` by record key."""
    ok = [r for r in records if r.ok and r.tokens > 0]
    if not ok:
        raise ValueError("no request of the serving run succeeded: " + "; ".join(
            sorted({r.error for r in records})[:3]))
    measured = 1000.0 * sum(r.latency for r in ok)
    predicted = sum(predicted_plain_ms(profile, concurrency, prompt_tokens[r.key], r.tokens) for r in ok)
    steps = sum(r.tokens - 1 for r in ok)
    chunk = max(0.0, (measured - predicted) / (concurrency * steps)) if steps else 0.0
    return ServingCost(chunk, concurrency, len(ok), steps, measured, predicted)


def measure_serving(model: str, dtype: str, weights: str, profile: LatencyProfile, concurrency: int,
                    prompts: Sequence[Sequence[int]], max_new_tokens: int, log_file: Path | None = None,
                    progress=None) -> ServingCost:
    """Plain decoding served to ``concurrency`` clients, the prompts cycled to two requests per client at least,
    after one untimed request; its chunk cost against ``profile``."""
    requests = enough([LoadRequest(f"p{i}", tuple(p), max_new_tokens) for i, p in enumerate(prompts)], concurrency)
    server = OwnServer(model, "none", None, concurrency, max_new_tokens, dtype, log_file=log_file, weights=weights)
    try:
        run_load_sync(server.url + "/v1", server.model, requests[:1], LoadPlan(concurrency=1))
        records = run_load_sync(server.url + "/v1", server.model, requests, LoadPlan(concurrency=concurrency),
                                progress=progress)
    finally:
        server.close()
    return chunk_cost(records, {r.key: len(r.prompt) for r in requests}, profile, concurrency)
