"""A configuration for each load: the batch-size schedule written into tree.json.

Under load one step verifies every live request's tree. With B requests decoding together (a closed loop of B
clients: one leaves, the next joins), a request of M new tokens takes its own steps, each costing a whole
batched step, plus the prefills of the requests that join while it runs (about B of them over its life)::

    latency_r(B)  = sum over its steps i of [batch_step(B, nodes_i, context_i) + serving(B)] + B * prefill(prompt_r)
    tokens/s (B)  = B * sum_r M_r / sum_r latency_r(B)          # output throughput of the server
    speed-up (B)  = tokens/s (B) / tokens/s of plain decoding (B)

The steps (their nodes and contexts) come from replaying each candidate configuration on the calibration
rollouts (``treesearch.replay``), the step costs from the latency profile's batched steps
(``LatencyProfile.batch_step``, interpolated between the profiled batch sizes), and ``serving(B)`` is what
serving adds to a step: a part per step and one per streamed chunk (``LatencyProfile.serving``; every live request
gets a chunk each step, so configurations that take fewer steps pay it fewer times). Per batch size, every one from 1
to the largest searched, the candidate with the highest predicted throughput wins; adjacent batch sizes with the
same pick merge into one inclusive range. Intervals are percentile bootstraps over the rollouts resampled whole.

What a target can run bounds the candidates: chain targets (vLLM, TGI) take plain decoding and the heads'
chains 1..K, which is the whole space, so the pick is exact; TensorRT-LLM's engine keeps one ``medusa_choices``
and shortens its draft, so its candidates are plain and the prefixes of the searched tree (in the engine's
order) within its node limit; this runtime takes those, the chains behind confidence gates (a row drafts only
when its heads are confident enough: at a batch where every verified row costs about as much as a token, a
draft pays only where it is likely accepted) and the search's own recommendation. A step a gate closes
verifies the root alone, priced as plain decoding's step plus the heads' first level, which the gate reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .cost import LatencyProfile
from .replay import Decoding, ReplayResult, configuration_json, decoding_of_json, replay
from .stats import AcceptanceStats, StatsError, bootstrap_ratio
from .targets import Target
from .tree import Tree, chain, make_tree, read_json

LEVEL = 0.95
SCHEDULE_GATES = (0.3, 0.5, 0.7, 0.85)  # the confidence gates the heads' chains are priced behind (own target)


@dataclass(frozen=True)
class LoadPrediction:
    """One configuration's predicted throughput at one batch size."""

    batch: int
    output_tokens_per_s: float
    output_tokens_per_s_ci: tuple[float, float]
    speedup_vs_plain: float
    speedup_vs_plain_ci: tuple[float, float]
    tau: float

    def as_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "output_tokens_per_s": round(self.output_tokens_per_s, 3),
                "output_tokens_per_s_ci": [round(x, 3) for x in self.output_tokens_per_s_ci],
                "speedup_vs_plain": round(self.speedup_vs_plain, 6),
                "speedup_vs_plain_ci": [round(x, 6) for x in self.speedup_vs_plain_ci], "tau": round(self.tau, 6)}


@dataclass(frozen=True)
class ScheduleRange:
    first: int
    last: int
    decoding: Decoding
    predictions: tuple[LoadPrediction, ...]  # at its first batch size, then each searched size within it


def request_latencies(res: ReplayResult, latency: LatencyProfile, batch: int) -> list[float]:
    """[rollouts] ms from a request's arrival to its last token with ``batch`` requests decoding together: its
    steps (nodes verified, context) each a batched step plus what serving it costs, and B prefills (see the
    module doc)."""
    served = latency.serving(batch)  # ms serving adds to each step: waking the server, B streamed chunks
    closed = gate_closed_heads_ms(res.decoding, latency)
    return [sum(latency.batch_step(batch, n, c) + served + (closed if n == 1 else 0.0)
                for n, c in zip(r.verified, r.contexts))
            + batch * latency.prefill(r.prompt_tokens) for r in res.rollouts]


def gate_closed_heads_ms(dec: Decoding, latency: LatencyProfile) -> float:
    """What a step whose gate verified the root alone still pays for the heads: their first level, which the gate
    reads (a batched step runs every row's heads in one call, priced here as one row's). The profile's batched
    steps of one node are plain decoding's, without heads."""
    if dec.gate <= 0 or dec.tree is None:
        return 0.0
    return latency.heads_time(chain(1))  # head 0 on the root: the level the gate reads


def output_tokens_per_s(res: ReplayResult, latencies: list[float], batch: int) -> float:
    """``res``'s predicted output throughput with ``batch`` requests together, its requests taking ``latencies``."""
    return 1000.0 * batch * sum(float(r.tokens) for r in res.rollouts) / sum(latencies)


def predict_at(res: ReplayResult, latencies: list[float], plain_latencies: list[float], batch: int,
               level: float = LEVEL) -> LoadPrediction:
    """``res``'s output throughput at ``batch`` (its requests taking ``latencies``, ``request_latencies``) and its
    speed-up over plain decoding's (``plain_latencies``), with intervals."""
    tokens = [float(r.tokens) for r in res.rollouts]
    scale = 1000.0 * batch
    lo, hi = bootstrap_ratio(tokens, latencies, level)
    s_lo, s_hi = bootstrap_ratio(plain_latencies, latencies, level)
    return LoadPrediction(batch, output_tokens_per_s(res, latencies, batch), (scale * lo, scale * hi),
                          sum(plain_latencies) / sum(latencies), (s_lo, s_hi), res.tau)


def on_prompts(res: ReplayResult, prompt_tokens: Sequence[int], max_new_tokens: int | None = None) -> ReplayResult:
    """``res``'s rollouts as requests of other prompts: every rollout on every one of the ``prompt_tokens``
    lengths (its contexts moved by the difference), its steps cut where it reaches ``max_new_tokens``. What the
    replayed configuration would do on a workload of those prompts, with the rollouts' acceptance."""
    out = []
    for r in res.rollouts:
        first = r.tokens - sum(r.accept_lengths)  # the prefill's token(s)
        keep, made = 0, first
        for n in r.accept_lengths:
            if max_new_tokens is not None and made >= max_new_tokens:
                break
            keep, made = keep + 1, made + n
        tokens = r.tokens if max_new_tokens is None else min(r.tokens, max_new_tokens)
        for p in prompt_tokens:
            shift = int(p) - r.prompt_tokens
            out.append(replace(r, id=f"{r.id}@{p}", accept_lengths=r.accept_lengths[:keep], tokens=tokens,
                               verified=r.verified[:keep], contexts=tuple(c + shift for c in r.contexts[:keep]),
                               prompt_tokens=int(p)))
    return ReplayResult(res.decoding, tuple(out))


def throughput_on_prompts(stats: AcceptanceStats, latency: LatencyProfile, dec: Decoding, batch: int,
                          prompt_tokens: Sequence[int], max_new_tokens: int | None = None) -> float:
    """``dec``'s predicted output tokens/s at ``batch`` on a workload of these prompts (``on_prompts``)."""
    res = on_prompts(replay(dec, stats, latency), prompt_tokens, max_new_tokens)
    return output_tokens_per_s(res, request_latencies(res, latency, batch), batch)


def prefixes(tree: Tree, max_nodes: int | None = None) -> list[Tree]:
    """The trees made of the first 1..n draft nodes of ``tree`` in its (official) order: every parent comes
    before its children there, so each prefix is a tree; what an engine verifies when it shortens the draft."""
    n = len(tree.paths) if max_nodes is None else min(len(tree.paths), max_nodes)
    return [make_tree(tree.paths[:k], name=f"{tree.name}[:{k}]") for k in range(1, n + 1)]


def candidates(target: Target, num_heads: int, tree: Tree | None = None, recommended: Decoding | None = None,
               gates: Sequence[float] = ()) -> list[Decoding]:
    """What the schedule chooses from for ``target``, plain decoding first (see the module doc). ``gates``: also
    the heads' chains behind each of these confidence gates, where the target runs a gate (the statistics must
    carry the heads' top-1 probabilities, ``AcceptanceStats.has_gate``)."""
    out = [Decoding()]
    if target.chain_only:
        return out + [Decoding(chain(k)) for k in range(1, num_heads + 1)]
    if tree is not None:
        out += [Decoding(t) for t in prefixes(tree, target.max_nodes)]
    if target.name == "own":
        out += [Decoding(chain(k)) for k in range(1, num_heads + 1)]
        if target.gates:
            out += [Decoding(chain(k), gate=g) for k in range(1, num_heads + 1) for g in gates]
        if recommended is not None:
            out.append(recommended)
    seen, unique = set(), []
    for dec in out:  # the same configuration under two names is priced once
        key = (dec.tree.paths if dec.tree is not None else None, dec.lookup, dec.gate)
        if key not in seen:
            seen.add(key)
            unique.append(dec)
    return unique


def search_schedule(stats: AcceptanceStats, latency: LatencyProfile, batch_sizes: Sequence[int],
                    options: Sequence[Decoding], level: float = LEVEL) -> list[ScheduleRange]:
    """Per batch size from 1 to the largest searched one, the option with the highest predicted throughput, as
    merged ranges. Every size is priced, the unprofiled ones on the profile's interpolated steps: under load the
    live batch takes every value up to the concurrency (a request leaves, the next has not joined yet), so a
    range's bounds fall where the picks change, not at the next profiled size. Each range carries its
    predictions at its first size and at the searched sizes it holds."""
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] != 1:
        raise StatsError(f"a schedule's batch sizes start at 1, got {list(batch_sizes)}")
    if not latency.has_batch:
        raise StatsError("the latency profile has no batched steps: profile again with --batch-sizes")
    if not options or options[0].tree is not None or options[0].lookup:
        raise StatsError("a schedule's options start with plain decoding")
    results = [replay(dec, stats, latency) for dec in options]
    sizes_priced = range(1, sizes[-1] + 1)
    latencies = [[request_latencies(res, latency, b) for res in results] for b in sizes_priced]  # [batch - 1][option]
    picks = [max(range(len(results)), key=lambda i: (output_tokens_per_s(results[i], lat[i], b), -i))  # ties: simpler
             for b, lat in zip(sizes_priced, latencies)]
    searched, ranges = set(sizes), []
    for i, run in itertools.groupby(sizes_priced, key=lambda b: picks[b - 1]):  # adjacent sizes of one pick
        batches = list(run)
        ranges.append(ScheduleRange(batches[0], batches[-1], options[i], tuple(
            predict_at(results[i], latencies[b - 1][i], latencies[b - 1][0], b, level)
            for b in batches if b == batches[0] or b in searched)))
    return ranges


def schedule_json(ranges: list[ScheduleRange]) -> list[dict[str, Any]]:
    """tree.json's ``schedule``: ``{batch: [first, last], configuration, prediction}`` per range, the prediction
    at the range's first batch size with every searched size of the range in ``by_batch``."""
    return [{"batch": [r.first, r.last], "configuration": configuration_json(r.decoding),
             "prediction": {**r.predictions[0].as_json(), "level": LEVEL,
                            "by_batch": [p.as_json() for p in r.predictions]}} for r in ranges]


def decoding_at(schedule: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """The configuration a schedule gives ``batch`` live requests (the last range's beyond it)."""
    for entry in schedule:
        if entry["batch"][0] <= batch <= entry["batch"][1]:
            return entry["configuration"]
    return schedule[-1]["configuration"]


def read_schedule(path: str) -> list[dict[str, Any]]:
    """The schedule of a tree.json (StatsError, one line, where the file has none or a malformed one)."""
    obj = read_json(path, StatsError, "schedule file")
    if not isinstance(obj, dict) or "schedule" not in obj:
        raise StatsError(f"{path} holds no schedule (search with --batch-sizes)")
    return check_schedule(obj["schedule"])


def check_schedule(schedule: Any) -> list[dict[str, Any]]:
    """A tree.json ``schedule`` as read: ranges ascending, inclusive, contiguous from 1 (StatsError otherwise)."""
    if not isinstance(schedule, list) or not schedule:
        raise StatsError("a schedule is a non-empty list of {batch: [first, last], configuration, prediction}")
    expect = 1
    for entry in schedule:
        try:
            first, last = (int(x) for x in entry["batch"])
            entry["configuration"]["config"]
        except (KeyError, TypeError, ValueError):
            raise StatsError(f"schedule entry {entry!r} lacks batch: [first, last] or a configuration") from None
        if first != expect or last < first:
            raise StatsError(f"schedule ranges must run contiguously from batch 1: got [{first}, {last}] where "
                             f"{expect} was due")
        schedule_decoding(entry)
        expect = last + 1
    return schedule


def schedule_decoding(entry: dict[str, Any]) -> Decoding:
    """The configuration of one schedule range, checked as the search checks its own (StatsError, one line)."""
    first, last = entry["batch"]
    try:
        return decoding_of_json(entry["configuration"])
    except (ValueError, TypeError) as exc:
        raise StatsError(f"the schedule's configuration for batch sizes {first}-{last}: {exc}") from None
