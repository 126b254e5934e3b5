"""Latency profile: median time of a verify step against tree size, the heads, and a plain step.

Timing hygiene: warm-up excluded, device synchronised, ``perf_counter``, medians of repeats taken in
rounds across the tree sizes (a slow spell of a shared machine hits every size alike). The
verify step is timed through the decoder's own ``verify_step`` (what its decode loop runs) on top of a
real KV cache of the given context length, which is cropped back after every forward.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from numpy.typing import ArrayLike
from tqdm.auto import tqdm

from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.batch import BatchDecoder
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.decoding.lockstep import lockstep
from medusa_runtime.engines.graphs import graphs_enabled
from medusa_runtime.engines.lean import c_forward_status
from medusa_runtime.heads.medusa import MedusaHeads
from medusa_runtime.kernels import cpuinfo_line
from medusa_runtime.measure.bandwidth import FloorProbe, floor_pair, generate_kv_bytes, pairs_summary, step_weight_bytes
from medusa_runtime.model import LoadedModel, device_sync
from medusa_runtime.tree.lookup import LookupConfig, NgramIndex
from treesearch.cost import LatencyProfile, head_rows
from treesearch.optimal import IndependentModel, optimal_tree
from treesearch.tree import chain, load_tree
from treesearch.typical import SEARCH_TEMPERATURE


@dataclass(frozen=True)
class ProfileConfig:
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # tree sizes, root included
    contexts: tuple[int, ...] = (128, 512)  # KV-cache lengths
    repeats: int = 7  # timed repeats per point (median)
    warmup: int = 2  # untimed repeats first
    prefill: tuple[int, ...] = ()  # prompt lengths whose prefill is timed (empty: the contexts)
    loop_nodes: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # tree sizes also run in real decode loops (heads, bookkeeping)
    # sizes whose decode loops also run at every other context (with plain decoding): their verify there priced
    # from loops too, not from the tight forwards' ratio between contexts alone
    context_loop_nodes: tuple[int, ...] = (2, 4)
    # batched steps (empty: none timed): B requests each verifying n nodes, at the shortest context
    batch_sizes: tuple[int, ...] = ()  # requests per step, from 1
    batch_nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 64)  # nodes per request (root included; 1: plain decoding)

    def __post_init__(self) -> None:
        if self.batch_sizes and (self.batch_sizes[0] != 1 or list(self.batch_sizes) != sorted(self.batch_sizes)):
            raise ValueError(f"profile batch_sizes must ascend from 1, got {list(self.batch_sizes)}")
        if self.batch_sizes and (1 not in self.batch_nodes or list(self.batch_nodes) != sorted(self.batch_nodes)):
            raise ValueError(f"profile batch_nodes must ascend and hold 1, got {list(self.batch_nodes)}")
        for name in ("nodes", "contexts", "prefill", "loop_nodes", "context_loop_nodes", "batch_sizes",
                     "batch_nodes"):
            values = getattr(self, name)
            if any(v < 1 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"profile {name} must be distinct and >= 1, got {list(values)}")
        if not self.nodes or not self.contexts or self.repeats < 1:
            raise ValueError("a profile needs node counts, contexts and repeats >= 1")


def _cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo), None elsewhere."""
    line = cpuinfo_line("model name")
    return line.split(":", 1)[1].strip() if line and ":" in line else None


def describe_machine(loaded: LoadedModel) -> dict[str, object]:
    info: dict[str, object] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                               "cpu_model": _cpu_model(),
                               "cpu_count": os.cpu_count(), "torch": torch.__version__,
                               "torch_threads": torch.get_num_threads(), "device": str(loaded.device),
                               "lean_c_forward": c_forward_status(loaded)}
    if loaded.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(loaded.device)
        info["cuda_graphs"] = graphs_enabled(loaded.device)  # the lean engine's steps replayed so
    else:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def _shape_tree(num_nodes: int, depth: int):
    """A realistic tree shape of ``num_nodes`` nodes: the optimum under geometric head accuracies."""
    ranks = 0.5 ** np.arange(1, 33)
    marginal = np.stack([ranks * (0.6 ** j) for j in range(depth)])
    tree, _ = optimal_tree(IndependentModel(marginal / marginal.sum(1, keepdims=True) * 0.9), num_nodes - 1)
    return tree


def _time_ms(fn, sync) -> float:
    """ms of one call of ``fn``, the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1000


def _median_ms(fn, sync, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(_time_ms(fn, sync) for _ in range(repeats))


def _central(values: list[float]) -> float:
    """The mean of the middle half (the interquartile mean): robust to a slow spell like the median, less
    jumpy than it with few samples."""
    v = sorted(values)
    cut = len(v) // 4
    return statistics.fmean(v[cut: len(v) - cut])


def _rounds(count: int, repeats: int, seed: int = 0):
    """Per round, the order in which to run ``count`` timed pieces: shuffled (seeded), so that no piece
    always runs after the same neighbour (a heavy one before it leaves the caches and clocks its own way)."""
    rng = random.Random(seed)
    for _ in range(repeats):
        order = list(range(count))
        rng.shuffle(order)
        yield order


def _ratio_of_means(a: ArrayLike, b: ArrayLike) -> float:
    """mean(a) / mean(b) over the same rounds: what a ratio of totals (the replay's speeds are totals over
    questions) is made of. Not the rounds' own ratios: a round's pieces do not share its slow spells here
    (the plain and mc_sim_7b_63 loops' verify correlate 0.11 and -0.07 over a replay's 40 rounds, the plain
    loop's varying 19 %), so the central ratio of rounds only added the skew of a noisy denominator and priced
    mc_sim_7b_63 3-6 % slow (docs/reports/ratio-of-means.md)."""
    return float(np.mean(np.asarray(a, dtype=float)) / np.mean(np.asarray(b, dtype=float)))


@dataclass(frozen=True)
class LoopTimes:
    """ms per step of real generate calls (interquartile mean over rounds), split as the decode loop times it."""

    step: float  # the whole step (the loop's time after prefill, per step)
    heads: float  # drafting and the heads (propose)
    verify: float  # the forward of the verified nodes
    rest: float  # acceptance, compaction, the loop: everything else
    prefill: float  # the generate's prefill (new cache, prompt forward, first token), ms per generate
    verify_rounds: tuple[float, ...] = ()  # the verify per step of each round (for ratios within rounds)


def _loop_times(samples: list[list[float]]) -> LoopTimes:
    """One decoder's LoopTimes from its [step, heads, verify, rest, prefill] of each round."""
    return LoopTimes(*(_central([v[k] for v in samples]) for k in range(5)), tuple(v[2] for v in samples))


class Profiler:
    """The profile's timed pieces, built once: the tight verify forwards (every size on a real KV cache of
    every context, cropped back after each), real decode loops (plain decoding, shapes by size, chains 1..K,
    mc_sim_7b_63, and the same sampled), and prefills. ``round()`` times each piece once, in shuffled order
    per group (the decode loops one step each in turn, ``medusa_runtime.decoding.lockstep``), and returns the raw
    samples; ``profile(rounds)`` turns any rounds into a LatencyProfile,
    whether they were taken back to back (``profile_latency``) or one every few questions of a replay
    (``bench.replay.profile_rounds``: the profile then sees the machine's speed where the replay spent its time)."""

    def __init__(self, loaded: LoadedModel, heads: MedusaHeads, cfg: ProfileConfig):
        self.loaded, self.heads, self.cfg = loaded, heads, cfg
        dev = loaded.device
        self.sync = lambda: device_sync(dev)
        gen = torch.Generator().manual_seed(0)
        trees = {n: _shape_tree(n, heads.num_heads) for n in cfg.nodes if n > 1}
        verifiers = {n: MedusaDecoder(loaded, heads, t, config=DecodeConfig(topk=t.max_rank + 1))
                     for n, t in trees.items()}
        plain_dec = MedusaDecoder(loaded, None, None)
        self.steps = []  # [contexts x nodes], context-major
        for ctx in cfg.contexts:
            cache = plain_dec.new_cache(ctx + max(cfg.nodes))
            plain_dec.prefill(torch.randint(0, loaded.vocab_size, (ctx,), generator=gen).to(dev), cache)
            for n in cfg.nodes:
                dec = verifiers.get(n, plain_dec)
                tokens = torch.randint(0, loaded.vocab_size, (n,), generator=gen).to(dev)

                def step(dec=dec, tokens=tokens, ctx=ctx, cache=cache):
                    dec.verify_step(tokens, ctx, cache, dec.buffers)  # what a decode step runs
                    dec.compact(cache, ctx, [])  # drop the tree again

                self.steps.append(step)
        self.loop_sizes = sorted(n for n in cfg.loop_nodes if n > 1)
        self.loop_trees = [trees.get(n) or _shape_tree(n, heads.num_heads) for n in self.loop_sizes] + \
            [chain(d) for d in range(1, heads.num_heads + 1)] + _wide_trees(heads)
        loops = [MedusaDecoder(loaded, None, None, config=_loop_cfg())] + \
            [MedusaDecoder(loaded, heads, t, config=_loop_cfg(t.max_rank + 1)) for t in self.loop_trees]
        # the same steps sampled (plain sampling, typical acceptance on the shapes), in the same rounds
        typical = AcceptConfig(rule="typical", temperature=SEARCH_TEMPERATURE)
        sampled = [MedusaDecoder(loaded, None, None, AcceptConfig(rule="sample", temperature=SEARCH_TEMPERATURE),
                                 _loop_cfg(seed=0))] + \
            [MedusaDecoder(loaded, heads, t, typical, _loop_cfg(t.max_rank + 1, seed=0))
             for t in self.loop_trees[:len(self.loop_sizes)]]
        self.decoders, self.num_loops = loops + sampled, len(loops)
        self.mid = sorted(cfg.contexts)[len(cfg.contexts) // 2]
        self.loop_prompt = torch.randint(0, loaded.vocab_size, (self.mid,), generator=gen).to(dev)
        # plain decoding and the context loop sizes again at every other context: (context, size, decoder)
        # (a decoder runs several generates at once safely: a step's state lives in its own cache)
        by_size = {1: loops[0], **{n: loops[1 + i] for i, n in enumerate(self.loop_sizes)}}
        for n in cfg.context_loop_nodes:
            if n not in by_size:
                tree = trees.get(n) or _shape_tree(n, heads.num_heads)
                by_size[n] = MedusaDecoder(loaded, heads, tree, config=_loop_cfg(tree.max_rank + 1))
        sizes = sorted({1, *cfg.context_loop_nodes})
        self.context_runs = [(c, n, by_size[n]) for c in sorted(cfg.contexts) if c != self.mid for n in sizes]
        self.context_prompts = {c: torch.randint(0, loaded.vocab_size, (c,), generator=gen).to(dev)
                                for c in {c for c, _, _ in self.context_runs}}
        self.prefill_tokens = tuple(sorted(cfg.prefill or cfg.contexts))
        self.prefill_dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=1, stop_on_eos=False))
        self.prefill_prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=gen) for n in self.prefill_tokens]
        self.floor_probe = FloorProbe(device=dev)  # the copy bandwidth on either side of each round's plain generate
        self.rounds_taken = 0
        self.batched = BatchedSteps(loaded, heads, cfg) if cfg.batch_sizes else None

    @torch.inference_mode()
    def round(self) -> dict[str, list]:
        """One round of every piece: {"tight": ms [contexts x nodes], "loops": [step, heads, verify, rest,
        prefill] ms per decoder (a generate's own split, per step), "prefill": ms per prompt length,
        "floor": [a plain generate's ms per step, the copy bandwidth right before and right after it (GB/s)],
        "context_loops": the same five per ``context_runs`` entry (plain and sizes at the other contexts)}."""
        r = self.rounds_taken
        self.rounds_taken += 1
        tight = [0.0] * len(self.steps)
        for i in next(_rounds(len(self.steps), 1, seed=r)):
            tight[i] = _time_ms(self.steps[i], self.sync)
        loops: list[list[float]] = [[] for _ in self.decoders]
        context_loops: list[list[float]] = [[] for _ in self.context_runs]

        def loop_times(key: tuple[str, int], res) -> None:
            st = res.stats
            steps, loop = max(1, st.steps), st.step_ms
            heads, verify = 1000 * st.time_heads / steps, 1000 * st.time_verify / steps
            (loops if key[0] == "mid" else context_loops)[key[1]] = \
                [loop, heads, verify, loop - heads - verify, 1000 * st.time_prefill]

        # the loops stepped in turn, as the replay steps its configurations: every size meets the same
        # moments of the machine, so their ratios in a round carry little of its drift
        runs = {("mid", i): dec.generate_steps(self.loop_prompt) for i, dec in enumerate(self.decoders)}
        runs.update({("context", j): dec.generate_steps(self.context_prompts[c])
                     for j, (c, _, dec) in enumerate(self.context_runs)})
        lockstep(runs, f"profile/{r}", loop_times)
        floor = list(floor_pair(self.floor_probe, self.decoders[0], self.loop_prompt))  # the plain loop, alone
        prefill = [0.0] * len(self.prefill_prompts)
        for i in next(_rounds(len(self.prefill_prompts), 1, seed=20_000 + r)):
            prefill[i] = _time_ms(lambda p=self.prefill_prompts[i]: self.prefill_dec.generate(p), self.sync)
        batch = self.batched.round(r) if self.batched is not None else []
        return {"tight": tight, "loops": loops, "prefill": prefill, "floor": floor, "context_loops": context_loops,
                "batch": batch}

    def profile(self, rounds: list[dict], meta: dict | None = None) -> LatencyProfile:
        """The latency profile of ``rounds`` (interquartile means over them; see the note in its meta) and of
        one lookup timing taken now."""
        cfg, heads, loaded = self.cfg, self.heads, self.loaded
        tight = np.asarray([r["tight"] for r in rounds], dtype=float).T.reshape(
            len(cfg.contexts), len(cfg.nodes), len(rounds))  # [contexts, nodes, rounds] ms
        times = [_loop_times([r["loops"][i] for r in rounds]) for i in range(len(self.decoders))]
        times, sampled_times = times[:self.num_loops], times[self.num_loops:]
        loop_sizes, loop_trees = self.loop_sizes, self.loop_trees
        # the other contexts' loops: {context: (sizes, LoopTimes)}; none where a round lacks them (rounds of a
        # replay resumed from a runtime before them): those contexts then scale from the middle one
        elsewhere: dict[int, tuple[list[int], list[LoopTimes]]] = {}
        if all(len(r.get("context_loops") or ()) == len(self.context_runs) for r in rounds):
            for j, (c, n, _) in enumerate(self.context_runs):
                sizes, loops = elsewhere.setdefault(c, ([], []))
                sizes.append(n)
                loops.append(_loop_times([r["context_loops"][j] for r in rounds]))
        verify = _in_loop_verify(tight, cfg, self.mid, [1] + [t.num_nodes for t in loop_trees], times, elsewhere)
        plain_rest = times[0].rest
        # the plain step: its forward (the 1-node point of the verify table) plus the rest of a real plain step
        plain = [row[cfg.nodes.index(1)] + plain_rest if 1 in cfg.nodes else times[0].step for row in verify]
        shaped = times[1:1 + len(loop_sizes)]
        by_size = [t.heads for t in shaped]
        heads_ms = by_size[loop_sizes.index(min(loop_sizes, key=lambda n: abs(n - 16)))] if loop_sizes else 0.0
        fit = _fit_heads(loop_trees, [t.heads for t in times[1:]], heads.path_conditioned) if loop_trees else ()
        book_sizes = [1] + loop_sizes
        book = [plain_rest] + [t.rest for t in shaped]
        book_ms = book[book_sizes.index(min(book_sizes, key=lambda n: abs(n - 16)))]
        tight_prefill = [_central([r["prefill"][i] for r in rounds]) for i in range(len(self.prefill_tokens))]
        # back-to-back prefills find the prompt forward's weights in the caches; inside a decode run they come
        # after steps that streamed the decode weights: scale by the loops' own prefills (at their prompt length)
        in_loop = statistics.median(t.prefill for t in times)
        at_mid = float(np.interp(self.mid, self.prefill_tokens, tight_prefill))
        prefill = [p * in_loop / at_mid for p in tight_prefill]
        meta = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights,
                "heads": heads.num_heads,
                "machine": describe_machine(loaded), "device": str(loaded.device), "repeats": len(rounds),
                "note": "ms, interquartile means of rounds, each piece once per round in shuffled order; verify: "
                        "every (context, size) forward, mask building included, scaled per size to the verify "
                        "time of real decode loops (ratios of means over the rounds) at the same context (loops "
                        "of plain decoding and of the context loop sizes at every context, of every loop size at "
                        "the middle one); plain = the 1-node forward "
                        "+ the rest of a real plain decode step; heads and bookkeeping: real decode loops (shapes "
                        "by size, chains 1..K, mc_sim_7b_63) at the middle context, one generate per decoder per "
                        "round (heads_ms, bookkeeping_ms: the size nearest 16; heads_fit: least squares over "
                        "levels and rows); the loops of a round stepped in turn (one step of each, shuffled per "
                        "round); verify rows as measured (not smoothed in nodes); prefill = a generate "
                        "that stops after its first token, scaled to the loops' own prefills; lookup = drafting "
                        "and extending the n-gram index, per step; sampling_extra = a sampled step at T "
                        f"{SEARCH_TEMPERATURE} (plain sampling at 1 node, typical acceptance on the shapes) over "
                        "the greedy step of the same size, both in real decode loops of the same rounds",
                **(meta or {})}
        # each round's plain step against that round's floor
        floor = pairs_summary(step_weight_bytes(loaded, self.decoders[0].engine),
                              [r["floor"] for r in rounds if r.get("floor")],
                              generate_kv_bytes(loaded, self.mid, FLOOR_TOKENS))
        if floor:
            meta["bandwidth_floor"] = {**floor, "context": self.mid, "note": (
                f"each round: a plain generate alone ({FLOOR_TOKENS} tokens after a prompt of the middle context), ms "
                "per step, over (weight_bytes + kv_bytes, the KV cache at the generate's mean context) / the copy "
                "bandwidth (bytes read + written) measured right before and right after it; median over rounds, "
                "distribution-free 95 % interval of the median; plain_over_weights_floor: against the weights "
                "alone")}
        # a sampled step over the greedy step of the same size, both inside real decode loops of the same rounds
        # (a difference of two ~8 ms steps is noisy: made non-decreasing in nodes, since more parents never cost
        # less)
        extra = [max(0.0, t.step - g.step) for t, g in zip(sampled_times, [times[0]] + shaped)]
        sampling = (tuple(book_sizes), tuple(float(x) for x in _non_decreasing(np.asarray(extra))))
        batched = self.batched.table(rounds) if self.batched is not None else ((), (), (), 0)
        return LatencyProfile(tuple(cfg.nodes), tuple(cfg.contexts), tuple(verify), tuple(plain), heads_ms, book_ms,
                              meta, tuple(loop_sizes), tuple(by_size), tuple(book_sizes), tuple(book),
                              self.prefill_tokens, tuple(prefill), _lookup_ms(loaded, cfg), fit,
                              heads.path_conditioned, *sampling, *batched)


class BatchedSteps:
    """Whole batched decode steps (``medusa_runtime.decoding.batch``): the largest batch of requests joins at the
    shortest context each round; then every (B, n) cell, in shuffled order, times one step of the first B
    requests verifying a tree of n nodes (a realistic shape; n = 1: plain decoding), heads, forward of the
    B x n rows, acceptance and compaction included. Every tree runs on the same rows and caches."""

    def __init__(self, loaded: LoadedModel, heads: MedusaHeads, cfg: ProfileConfig):
        self.loaded, self.cfg = loaded, cfg
        self.context = min(cfg.contexts)
        steps = 1 + len(cfg.batch_sizes) * len(cfg.batch_nodes)  # the most steps a request takes in a round
        decode = DecodeConfig(max_new_tokens=steps * (heads.num_heads + 1) + 1, stop_on_eos=False)
        self.decoders = []
        for n in cfg.batch_nodes:
            tree = _shape_tree(n, heads.num_heads) if n > 1 else None
            self.decoders.append(MedusaDecoder(loaded, heads if tree else None, tree,
                                               config=replace(decode, topk=tree.max_rank + 1) if tree else decode))
        widest = max(self.decoders, key=lambda d: d.buffers.num_nodes)
        self.batch = BatchDecoder(widest, max(cfg.batch_sizes))
        self.gen = torch.Generator().manual_seed(1)
        self.sync = lambda: device_sync(loaded.device)

    @torch.inference_mode()
    def round(self, r: int, upto: int | None = None) -> list[float]:
        """ms of one step per cell, [batch_sizes x batch_nodes] flattened batch-major; with ``upto``, the cells of
        the batch sizes up to it alone."""
        batch, cfg = self.batch, self.cfg
        sizes = [b for b in cfg.batch_sizes if upto is None or b <= upto]
        for key in list(batch.rows):
            batch.drop(key)
        keys = list(range(max(sizes)))
        for key in keys:  # fresh requests: every round starts at the same context
            batch.admit(key, torch.randint(0, self.loaded.vocab_size, (self.context,), generator=self.gen).tolist(),
                        batch.decoder.config.max_new_tokens)
        cells = [(b, dec) for b in sizes for dec in self.decoders]
        out = [0.0] * len(cells)
        for i in next(_rounds(len(cells), 1, seed=40_000 + r)):
            b, dec = cells[i]
            out[i] = _time_ms(lambda b=b, dec=dec: batch.step(keys[:b], dec), self.sync)
        return out

    def table(self, rounds: list[dict]) -> tuple:
        """LatencyProfile's batch fields from ``rounds``: interquartile means per cell."""
        cfg = self.cfg
        width = len(cfg.batch_sizes) * len(cfg.batch_nodes)
        taken = [r["batch"] for r in rounds if len(r.get("batch") or ()) == width]
        if not taken:  # rounds kept from a run that timed no batched steps
            return (), (), (), 0
        return self.table_of(taken)

    def table_of(self, taken: list[list[float]], upto: int | None = None) -> tuple:
        """LatencyProfile's batch fields from rounds of ``round(r, upto)`` (each a list of its cells):
        interquartile means per cell."""
        cfg = self.cfg
        sizes = tuple(b for b in cfg.batch_sizes if upto is None or b <= upto)
        cells = np.asarray(taken, dtype=float)  # [rounds, cells]
        if cells.ndim != 2 or cells.shape[1] != len(sizes) * len(cfg.batch_nodes):
            raise ValueError(f"rounds of {len(sizes)} x {len(cfg.batch_nodes)} cells expected")
        means = [_central(list(cells[:, i])) for i in range(cells.shape[1])]
        table = tuple(tuple(means[j * len(cfg.batch_nodes):(j + 1) * len(cfg.batch_nodes)])
                      for j in range(len(sizes)))
        return sizes, tuple(cfg.batch_nodes), table, self.context


@torch.inference_mode()
def profile_latency(loaded: LoadedModel, heads: MedusaHeads, cfg: ProfileConfig = ProfileConfig(),
                    progress: bool = True) -> LatencyProfile:
    """Rounds back to back: ``cfg.warmup`` untimed, then ``max(3, cfg.repeats)`` timed."""
    profiler = Profiler(loaded, heads, cfg)
    rounds = cfg.warmup + max(3, cfg.repeats)
    taken = [profiler.round() for _ in tqdm(range(rounds), desc="latency profile", unit="round", disable=not progress)]
    return profiler.profile(taken[cfg.warmup:])


def _wide_trees(heads: MedusaHeads) -> list:
    """The official mc_sim_7b_63 tree where the heads can run it: wide as served trees are (many parents
    per level), where the shapes by size are narrow; it anchors the heads' fit at the wide end."""
    tree = load_tree("mc_sim_7b_63")
    return [tree] if tree.depth <= heads.num_heads else []


def _in_loop_verify(tight: np.ndarray, cfg: ProfileConfig, loop_context: int, loop_nodes: list[int],
                    loops: list[LoopTimes], elsewhere: dict[int, tuple[list[int], list[LoopTimes]]] | None = None
                    ) -> list[tuple[float, ...]]:
    """The verify table [contexts][nodes] as a decode pays it, from ratios of means over the rounds.

    Inside a real loop (after the heads and the bookkeeping of the step, with whatever they left in the
    caches) a verify costs otherwise, relative to a one-row verify, than the same forward repeated in a
    tight loop; so the level and the ratio of each looped size to one row come from the loops (``loops[0]``
    is plain decoding), the ratio of a size to the nearest looped size from the tight rounds (``tight``
    [contexts, nodes, rounds]). ``elsewhere``: {context: (sizes, their loops)}, plain decoding (size 1) among
    them, loops run at contexts other than ``loop_context``; such a context is priced from its own loops the
    same way. A context without loops scales from ``loop_context`` by the tight forwards' ratio between the
    two contexts, size by size: a noisier estimate (the tight one-row forward, measured once per round, read
    0.4 % dearer at context 464 than at 112 in a bench's profile where its attention alone adds ~5 %).
    Rows are kept as measured, not made non-decreasing in nodes: on the development CPU the C forward
    verified 5 rows faster than 3 or 4, in the profile's forwards and loops and in replays alike (chain:4's
    verify 9.6 ms against chain:2's 10.5 in the same replay), and pooling 4 and 5 priced chain:4 10 % high
    (docs/reports/verify-probes.md); the kernel's weight prefetch, from 5 rows then, starts at 3
    rows since (lockstep.md), and whatever dips remain are priced as measured."""
    at = int(np.argmin([abs(c - loop_context) for c in cfg.contexts]))
    looped = {at: (loop_nodes, loops)}
    for c, (sizes, times) in (elsewhere or {}).items():
        if c in cfg.contexts and 1 in sizes:
            looped[cfg.contexts.index(c)] = (sizes, times)
    rows = {c: _looped_row(tight[c], cfg.nodes, *looped[c]) for c in looped}
    return [tuple(float(x) for x in (rows[c] if c in rows else [
        rows[at][j] * _tight_ratio(tight[c, j], tight[at, j]) for j in range(len(cfg.nodes))]))
        for c in range(len(cfg.contexts))]


def _tight_ratio(a: ArrayLike, b: ArrayLike) -> float:
    """Two tight forwards' ratio: the interquartile mean of their ratio in each round. Pieces of a round run
    within a second of each other, so a round's ratio carries little of the machine's drift, and a piece slowed in
    one round (a stall, a spell) drops out of the middle half, where a ratio of means over a handful of rounds
    follows it: a bench's profile of 9 rounds priced 5 nodes at context 464 at 0.61 of one row and 8 at 0.75
    (more rows never cost less), and its search picked trees of 9-10 nodes on it (tested: one forward 10x slower
    in one round moves a ratio of means by a third, this by under 5 %)."""
    return _central(list(np.asarray(a, dtype=float) / np.asarray(b, dtype=float)))


def _looped_row(tight: np.ndarray, nodes: tuple[int, ...], loop_nodes: list[int], loops: list[LoopTimes]
                ) -> list[float]:
    """One context's verify row: the plain loop's level (the loop of size 1 in ``loop_nodes``) times each
    looped size's ratio of means to it, and a size not looped priced through the nearest looped size and
    the tight forwards' ratio between the two (``_tight_ratio``; ``tight`` [nodes, rounds] at this context)."""
    plain = np.asarray(loops[loop_nodes.index(1)].verify_rounds)
    level = _central(list(plain))  # one row inside a loop
    looped: dict[int, list[float]] = {1: [1.0]}
    for n, loop in zip(loop_nodes, loops):  # a size may run in more than one loop (a shape and a chain)
        if n in nodes and n != 1:
            looped.setdefault(n, []).append(_ratio_of_means(loop.verify_rounds, plain))
    sizes = sorted(looped)
    row = []
    for j, n in enumerate(nodes):
        near = min(sizes, key=lambda m: abs(m - n))
        to_near = _tight_ratio(tight[j], tight[nodes.index(near)]) if near in nodes else 1.0
        row.append(level * statistics.median(looped[near]) * to_near)
    return row


def _non_decreasing(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): what a sampled step adds
    over a greedy one grows with the parents it samples, so a size measured low next to a size measured high
    is noise both ways."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks])


FLOOR_TOKENS = 24  # new tokens of each decode loop's generate (the floor pairs' plain loop among them)


def _loop_cfg(topk: int = 10, seed: int | None = None) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=FLOOR_TOKENS, topk=topk, stop_on_eos=False, seed=seed)


def _lookup_ms(loaded: LoadedModel, cfg: ProfileConfig, draft_tokens: int = 4, steps: int = 200) -> float:
    """Per step of a decode with a lookup chain: the n-gram draft (root appended), laying it out for the
    verify, and extending the index by the committed tokens, on a prompt of repeated phrases."""
    rng = torch.Generator().manual_seed(1)
    phrase = torch.randint(0, loaded.vocab_size, (12,), generator=rng).tolist()
    dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(lookup=LookupConfig(draft_tokens)))
    hidden = torch.zeros(loaded.hidden_size, dtype=loaded.dtype)

    def run() -> None:
        index = NgramIndex(dec.config.lookup, phrase * 20)
        for i in range(steps):
            root = phrase[i % len(phrase)]
            dec.propose(hidden, root, index.draft(root))
            index.extend([root, phrase[(i + 1) % len(phrase)]])

    return _median_ms(run, lambda: None, max(3, cfg.repeats), 1) / steps


def _fit_heads(trees, times: list[float], path_conditioned: bool) -> tuple[float, float, float]:
    """Least squares ``ms = a + b * levels + c * rows`` over the timed trees (``treesearch.cost.head_rows``);
    heads that score one row per head have rows = levels, and then c = 0."""
    shape = np.array([head_rows(t, path_conditioned) for t in trees], dtype=float)  # [trees, 2]
    y = np.asarray(times, dtype=float)
    if np.array_equal(shape[:, 0], shape[:, 1]):
        (a, b), *_ = np.linalg.lstsq(np.column_stack([np.ones(len(y)), shape[:, 0]]), y, rcond=None)
        return float(a), float(b), 0.0
    (a, b, c), *_ = np.linalg.lstsq(np.column_stack([np.ones(len(y)), shape]), y, rcond=None)
    return float(a), float(b), float(c)
