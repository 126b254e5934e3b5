"""Latency profile: median time of a verify step against tree size, the heads, and a plain step.

Timing hygiene: warm-up excluded, device synchronised, ``perf_counter``, medians of repeats taken in
rounds across the tree sizes (a slow spell of a shared machine hits every size alike). The
verify step is timed through the decoder's own ``verify`` (mask writing included) on top of a
real KV cache of the given context length, which is cropped back after every forward.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from treesearch.cost import LatencyProfile
from treesearch.optimal import IndependentModel, optimal_tree

from .decode import DecodeConfig, MedusaDecoder
from .engine import c_forward_status
from .heads import MedusaHeads
from .model import LoadedModel


@dataclass(frozen=True)
class ProfileConfig:
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # tree sizes, root included
    contexts: tuple[int, ...] = (128, 512)  # KV-cache lengths
    repeats: int = 7  # timed repeats per point (median)
    warmup: int = 2  # untimed repeats first


def describe_machine(loaded: LoadedModel) -> dict[str, object]:
    info: dict[str, object] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
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


def _interleaved_ms(fns, sync, repeats: int, warmup: int, bar=None) -> list[float]:
    """Median ms of each of ``fns``, timed in rounds of one call each: drift on a shared machine then
    hits every tree size alike, instead of whichever size was measured during a slow spell."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[i].append((time.perf_counter() - t0) * 1000)
        if bar is not None:
            bar.update(1)
    return [statistics.median(t) for t in times]


def _loop_cfg(topk: int = 10) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=24, topk=topk, stop_on_eos=False)


def _loop_ms(dec: MedusaDecoder, prompt: torch.Tensor, cfg: ProfileConfig) -> tuple[float, float]:
    """(median ms per step, median ms per step outside heads and verify) of real generate calls."""
    per_step, other = [], []
    for i in range(cfg.warmup + max(3, cfg.repeats // 2)):
        st = dec.generate(prompt).stats
        if i >= cfg.warmup and st.steps:
            loop = st.time_total - st.time_prefill
            per_step.append(1000 * loop / st.steps)
            other.append(1000 * (loop - st.time_heads - st.time_verify) / st.steps)
    return statistics.median(per_step), statistics.median(other)


@torch.inference_mode()
def profile_latency(loaded: LoadedModel, heads: MedusaHeads, cfg: ProfileConfig = ProfileConfig(),
                    progress: bool = True) -> LatencyProfile:
    dev = loaded.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    verify = []
    plain = []
    bar = tqdm(total=len(cfg.contexts) * cfg.repeats, desc="latency profile", unit="round", disable=not progress)
    decoders = {}
    for n in cfg.nodes:
        if n > 1:
            tree = _shape_tree(n, heads.num_heads)
            decoders[n] = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(topk=tree.max_rank + 1))
    plain_dec = MedusaDecoder(loaded, None, None)
    for ctx in cfg.contexts:
        cache = plain_dec.new_cache(ctx + max(cfg.nodes))
        prompt = torch.randint(0, loaded.vocab_size, (1, ctx), generator=gen).to(dev)
        plain_dec.prefill(prompt[0], cache)
        steps = []
        for n in cfg.nodes:
            dec = decoders.get(n, plain_dec)
            tokens = torch.randint(0, loaded.vocab_size, (n,), generator=gen).to(dev)

            def step(dec=dec, tokens=tokens):
                dec.verify(tokens, ctx, cache)
                dec.compact(cache, ctx, [])  # drop the tree again

            steps.append(step)
        row = _interleaved_ms(steps, sync, cfg.repeats, cfg.warmup, bar)
        verify.append(tuple(row))
        # the plain step: its forward (the 1-node point of the same rounds, when profiled) plus the rest of
        # a real plain decode step (argmax, cache bookkeeping, loop), so that plain and tree steps are
        # compared on forwards timed side by side
        step_ms, rest_ms = _loop_ms(MedusaDecoder(loaded, None, None, config=_loop_cfg()), prompt[0], cfg)
        plain.append(row[cfg.nodes.index(1)] + rest_ms if 1 in cfg.nodes else step_ms)
    bar.close()

    hidden = torch.randn(loaded.hidden_size, generator=gen).to(dev, loaded.dtype)
    heads_ms = book_ms = 0.0
    sizes = sorted(decoders)
    by_size: list[float] = []
    if decoders:
        # heads + top-k per tree size, in rounds: path-conditioned heads score one row per parent node
        by_size = _interleaved_ms([lambda dec=decoders[n]: dec.propose(hidden, 0) for n in sizes], sync,
                                  cfg.repeats * 3, cfg.warmup)
        mid_n = min(sizes, key=lambda n: abs(n - 16))
        mid = decoders[mid_n]
        heads_ms = by_size[sizes.index(mid_n)]
        # everything of a real Medusa step that is neither heads nor verify: acceptance, compaction, loop
        book_ms = _loop_ms(MedusaDecoder(loaded, heads, mid.tree, config=_loop_cfg(mid.buffers.topk)),
                           prompt[0, : cfg.contexts[0]], cfg)[1]
    meta = {"model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "heads": heads.num_heads,
            "machine": describe_machine(loaded), "device": str(dev), "repeats": cfg.repeats,
            "note": "medians in ms of rounds across tree sizes; verify includes mask building; heads per tree size "
                    "(heads_ms: the size nearest 16); plain = the 1-node "
                    "forward + the rest of a real plain decode step; bookkeeping = a real Medusa step minus heads "
                    "and verify"}
    return LatencyProfile(tuple(cfg.nodes), tuple(cfg.contexts), tuple(verify), tuple(plain), heads_ms, book_ms, meta,
                          tuple(sizes), tuple(by_size))
