"""Latency profile: median time of a verify step against tree size, the heads, and a plain step.

Timing hygiene: warm-up excluded, device synchronised, ``perf_counter``, medians of repeats taken in
rounds across the tree sizes (a slow spell of a shared machine hits every size alike). The
verify step is timed through the decoder's own ``verify`` (mask writing included) on top of a
real KV cache of the given context length, which is cropped back after every forward.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from treesearch.cost import LatencyProfile, head_rows
from treesearch.optimal import IndependentModel, optimal_tree
from treesearch.tree import chain, load_tree
from treesearch.typical import SEARCH_TEMPERATURE

from .acceptance import AcceptConfig
from .decode import DecodeConfig, MedusaDecoder
from .engine import c_forward_status
from .heads import MedusaHeads
from .kernels import cpuinfo_line
from .lookup import LookupConfig, NgramIndex
from .model import LoadedModel


@dataclass(frozen=True)
class ProfileConfig:
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # tree sizes, root included
    contexts: tuple[int, ...] = (128, 512)  # KV-cache lengths
    repeats: int = 7  # timed repeats per point (median)
    warmup: int = 2  # untimed repeats first
    prefill: tuple[int, ...] = ()  # prompt lengths whose prefill is timed (empty: the contexts)
    loop_nodes: tuple[int, ...] = (2, 4, 8, 16, 32, 64)  # tree sizes also run in real decode loops (heads, bookkeeping)

    def __post_init__(self) -> None:
        for name in ("nodes", "contexts", "prefill", "loop_nodes"):
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
    else:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def _shape_tree(num_nodes: int, depth: int):
    """A realistic tree shape of ``num_nodes`` nodes: the optimum under geometric head accuracies."""
    ranks = 0.5 ** np.arange(1, 33)
    marginal = np.stack([ranks * (0.6 ** j) for j in range(depth)])
    tree, _ = optimal_tree(IndependentModel(marginal / marginal.sum(1, keepdims=True) * 0.9), num_nodes - 1)
    return tree


def _median_ms(fn, sync, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


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


def _interleaved_samples(fns, sync, repeats: int, warmup: int, bar=None) -> np.ndarray:
    """ms of each of ``fns`` per round [pieces, rounds], timed in rounds of one call each in shuffled order:
    drift on a shared machine then hits every piece alike within a round, and ratios taken within rounds
    cancel it (see :func:`_paired`)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = np.zeros((len(fns), repeats))
    for r, order in enumerate(_rounds(len(fns), repeats)):
        for i in order:
            sync()
            t0 = time.perf_counter()
            fns[i]()
            sync()
            times[i, r] = (time.perf_counter() - t0) * 1000
        if bar is not None:
            bar.update(1)
    return times


def _interleaved_ms(fns, sync, repeats: int, warmup: int, bar=None) -> list[float]:
    """ms of each of ``fns`` (interquartile mean over rounds, see :func:`_interleaved_samples`)."""
    return [_central(list(row)) for row in _interleaved_samples(fns, sync, repeats, warmup, bar)]


def _paired(a: np.ndarray, b: np.ndarray) -> float:
    """a / b from samples taken in the same rounds: the interquartile mean of the rounds' own ratios, so that a
    slow spell, which slows both pieces of its round, cancels instead of landing on one of them."""
    return _central(list(np.asarray(a, dtype=float) / np.asarray(b, dtype=float)))


@dataclass(frozen=True)
class LoopTimes:
    """ms per step of real generate calls (interquartile mean over rounds), split as the decode loop times it."""

    step: float  # the whole step (the loop's time after prefill, per step)
    heads: float  # drafting and the heads (propose)
    verify: float  # the forward of the verified nodes
    rest: float  # acceptance, compaction, the loop: everything else
    prefill: float  # the generate's prefill (new cache, prompt forward, first token), ms per generate
    verify_rounds: tuple[float, ...] = ()  # the verify per step of each round (for ratios within rounds)


def _loop_rounds(decoders: list[MedusaDecoder], prompt: torch.Tensor, cfg: ProfileConfig, bar=None
                 ) -> list[LoopTimes]:
    """Real decode loops, one generate per decoder per round (drift hits every decoder alike): the heads'
    time inside a real step, after a verify has streamed the weights through the caches, is what a decode
    pays, and a tight loop of heads alone (weights staying cached) underestimates it."""
    samples: list[list[tuple[float, float, float, float, float]]] = [[] for _ in decoders]
    for r, order in enumerate(_rounds(len(decoders), cfg.warmup + max(3, cfg.repeats), seed=1)):
        for i in order:
            st = decoders[i].generate(prompt).stats
            if r < cfg.warmup:
                continue
            steps = max(1, st.steps)
            loop = 1000 * (st.time_total - st.time_prefill) / steps
            heads, verify = 1000 * st.time_heads / steps, 1000 * st.time_verify / steps
            samples[i].append((loop, heads, verify, loop - heads - verify, 1000 * st.time_prefill))
        if bar is not None:
            bar.update(1)
    return [LoopTimes(*(_central(list(col)) for col in zip(*rows)), tuple(row[2] for row in rows)) for rows in samples]


@torch.inference_mode()
def profile_latency(loaded: LoadedModel, heads: MedusaHeads, cfg: ProfileConfig = ProfileConfig(),
                    progress: bool = True) -> LatencyProfile:
    dev = loaded.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    trees = {n: _shape_tree(n, heads.num_heads) for n in cfg.nodes if n > 1}
    verifiers = {n: MedusaDecoder(loaded, heads, t, config=DecodeConfig(topk=t.max_rank + 1)) for n, t in trees.items()}
    plain_dec = MedusaDecoder(loaded, None, None)
    bar = tqdm(total=cfg.repeats + cfg.warmup + max(3, cfg.repeats), desc="latency profile", unit="round",
               disable=not progress)

    # 1. verify forwards: every (context, size) once per round, all contexts in the same rounds
    steps = []
    for ctx in cfg.contexts:
        cache = plain_dec.new_cache(ctx + max(cfg.nodes))
        plain_dec.prefill(torch.randint(0, loaded.vocab_size, (ctx,), generator=gen).to(dev), cache)
        for n in cfg.nodes:
            dec = verifiers.get(n, plain_dec)
            tokens = torch.randint(0, loaded.vocab_size, (n,), generator=gen).to(dev)

            def step(dec=dec, tokens=tokens, ctx=ctx, cache=cache):
                dec.verify(tokens, ctx, cache)
                dec.compact(cache, ctx, [])  # drop the tree again

            steps.append(step)
    tight = _interleaved_samples(steps, sync, cfg.repeats, cfg.warmup, bar).reshape(
        len(cfg.contexts), len(cfg.nodes), cfg.repeats)  # [contexts, nodes, rounds] ms

    # 2. real decode loops, interleaved: plain decoding, the profile's shapes up to a size, and chains 1..K
    loop_sizes = sorted(n for n in cfg.loop_nodes if n > 1)
    loop_trees = [trees.get(n) or _shape_tree(n, heads.num_heads) for n in loop_sizes] + \
        [chain(d) for d in range(1, heads.num_heads + 1)] + _wide_trees(heads)
    loops = [MedusaDecoder(loaded, None, None, config=_loop_cfg())] + \
        [MedusaDecoder(loaded, heads, t, config=_loop_cfg(t.max_rank + 1)) for t in loop_trees]
    # the same steps sampled (plain sampling, typical acceptance on the shapes), in the same rounds
    typical = AcceptConfig(rule="typical", temperature=SEARCH_TEMPERATURE)
    sampled = [MedusaDecoder(loaded, None, None, AcceptConfig(rule="sample", temperature=SEARCH_TEMPERATURE),
                             _loop_cfg(seed=0))] + \
        [MedusaDecoder(loaded, heads, t, typical, _loop_cfg(t.max_rank + 1, seed=0)) for t in loop_trees[:len(loop_sizes)]]
    mid = sorted(cfg.contexts)[len(cfg.contexts) // 2]
    times = _loop_rounds(loops + sampled, torch.randint(0, loaded.vocab_size, (mid,), generator=gen).to(dev), cfg,
                         bar=bar)
    times, sampled_times = times[:len(loops)], times[len(loops):]
    bar.close()
    verify = _in_loop_verify(tight, cfg, mid, [1] + [t.num_nodes for t in loop_trees], times)
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
    prefill_tokens = tuple(sorted(cfg.prefill or cfg.contexts))
    tight_prefill = _prefill_ms(loaded, prefill_tokens, gen, sync, cfg)
    # back-to-back prefills find the prompt forward's weights in the caches; inside a decode run they come
    # after steps that streamed the decode weights: scale by the loops' own prefills (at their prompt length)
    in_loop = statistics.median(t.prefill for t in times)
    at_mid = float(np.interp(mid, prefill_tokens, tight_prefill))
    prefill = [p * in_loop / at_mid for p in tight_prefill]
    meta = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "heads": heads.num_heads,
            "machine": describe_machine(loaded), "device": str(dev), "repeats": cfg.repeats,
            "note": "ms, interquartile means of rounds in shuffled order; verify: every (context, size) forward "
                    "once per round, mask building included, scaled per size to the verify time of real decode "
                    "loops; plain = the 1-node forward + the rest of a real plain decode step; heads and "
                    "bookkeeping: real decode loops (shapes by size, chains 1..K, mc_sim_7b_63) at the middle "
                    "context, one generate per decoder per round (heads_ms, bookkeeping_ms: the size nearest 16; "
                    "heads_fit: least squares over levels and rows); verify rows made non-decreasing in nodes; "
                    "prefill = a generate that stops after its first token, scaled to the loops' own prefills; "
                    "lookup = drafting and extending the n-gram index, per step; sampling_extra = a sampled step "
                    f"at T {SEARCH_TEMPERATURE} (plain sampling at 1 node, typical acceptance on the shapes) over "
                    "the greedy step of the same size, both in real decode loops of the same rounds"}
    # a sampled step over the greedy step of the same size, both inside real decode loops of the same rounds
    # (a difference of two ~8 ms steps is noisy: made non-decreasing in nodes, as the verify rows are, since more
    # parents never cost less)
    extra = [max(0.0, t.step - g.step) for t, g in zip(sampled_times, [times[0]] + shaped)]
    sampling = (tuple(book_sizes), tuple(float(x) for x in _non_decreasing(np.asarray(extra))))
    return LatencyProfile(tuple(cfg.nodes), tuple(cfg.contexts), tuple(verify), tuple(plain), heads_ms, book_ms, meta,
                          tuple(loop_sizes), tuple(by_size), tuple(book_sizes), tuple(book), prefill_tokens,
                          tuple(prefill), _lookup_ms(loaded, cfg), fit, heads.path_conditioned, *sampling)


def _wide_trees(heads: MedusaHeads) -> list:
    """The official mc_sim_7b_63 tree where the heads can run it: wide as served trees are (many parents
    per level), where the shapes by size are narrow; it anchors the heads' fit at the wide end."""
    tree = load_tree("mc_sim_7b_63")
    return [tree] if tree.depth <= heads.num_heads else []


def _in_loop_verify(tight: np.ndarray, cfg: ProfileConfig, loop_context: int, loop_nodes: list[int],
                    loops: list[LoopTimes]) -> list[tuple[float, ...]]:
    """The verify table [contexts][nodes] as a decode pays it, from ratios taken within rounds.

    Inside a real loop (after the heads and the bookkeeping of the step, with whatever they left in the
    caches) a verify costs otherwise, relative to a one-row verify, than the same forward repeated in a
    tight loop; so the level and the ratio of each looped size to one row come from the loops (``loops[0]``
    is plain decoding), the ratio of a size to the nearest looped size and of a context to the loops'
    context from the tight rounds (``tight`` [contexts, nodes, rounds]). Each context's row is then made
    non-decreasing in nodes."""
    at = int(np.argmin([abs(c - loop_context) for c in cfg.contexts]))
    plain = np.asarray(loops[0].verify_rounds)
    level = _central(list(plain))  # one row inside a loop, at the loops' context
    looped: dict[int, list[float]] = {}
    for n, loop in zip(loop_nodes[1:], loops[1:]):  # a size may run in more than one loop (a shape and a chain)
        if n in cfg.nodes:
            looped.setdefault(n, []).append(_paired(np.asarray(loop.verify_rounds), plain))
    looped[1] = [1.0]
    sizes = sorted(looped)
    row = []
    for n in cfg.nodes:
        near = min(sizes, key=lambda m: abs(m - n))
        to_near = _paired(tight[at, cfg.nodes.index(n)], tight[at, cfg.nodes.index(near)]) if near in cfg.nodes else 1.0
        row.append(level * statistics.median(looped[near]) * to_near)
    table = [[row[j] * _paired(tight[c, j], tight[at, j]) for j in range(len(cfg.nodes))]
             for c in range(len(cfg.contexts))]
    return [tuple(float(x) for x in _non_decreasing(np.asarray(r))) for r in table]


def _non_decreasing(values: np.ndarray) -> np.ndarray:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a verify of more nodes
    never costs less, so a size measured low next to a size measured high is noise both ways."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return np.concatenate([np.full(int(c), t / c) for t, c in blocks])


def _loop_cfg(topk: int = 10, seed: int | None = None) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=24, topk=topk, stop_on_eos=False, seed=seed)


def _prefill_ms(loaded: LoadedModel, lengths: tuple[int, ...], gen: torch.Generator, sync, cfg: ProfileConfig
                ) -> list[float]:
    """Median ms of a generate that stops after its first token (new cache, prompt forward, first token),
    per prompt length, in rounds."""
    dec = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=1, stop_on_eos=False))
    prompts = [torch.randint(0, loaded.vocab_size, (n,), generator=gen) for n in lengths]
    return _interleaved_ms([lambda p=p: dec.generate(p) for p in prompts], sync, cfg.repeats, cfg.warmup)


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
