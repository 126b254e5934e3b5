"""The C forward on packed weights in 2 MiB pages against 4 KiB pages, alternated in one process
(docs/reports/2026-12-03-prefetch-l1.md).

    python docs/reports/2026-12-03-huge-pages-ab.py CONTEXT ROUNDS      (NS=1,2,4 picks the row counts)

Loads the default model twice in bf16 and builds a lean engine on each, one with MEDUSA_HUGE_PAGES=0 (its packed
weights in ordinary PyTorch memory, 4 KiB pages) and one without (one buffer advised for huge pages); per round,
in shuffled order, each engine's verify forward of n rows (a chain) at the context. Prints the median forward per
row count and engine, the huge-page one over the other per round (median and the rounds' 2.5-97.5 % range), and
how much of each process's memory is in huge pages.
"""
import os
import random
import re
import statistics as st
import sys
import time

import torch

from medusa_runtime.engine import make_engine
from medusa_runtime.kernels import hugepages
from medusa_runtime.model import load_model


def anon_huge_kb() -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+)", open("/proc/self/smaps_rollup").read()).group(1))


def main() -> None:
    torch.set_num_threads(2)
    ctx, rounds = int(sys.argv[1]), int(sys.argv[2])
    ns = [int(x) for x in os.environ.get("NS", "1,2,4").split(",")]
    engines, caches = {}, {}
    for name, switch in (("4KiB", "0"), ("2MiB", "1")):
        os.environ[hugepages.ENV_SWITCH] = switch
        before = anon_huge_kb()
        engines[name] = make_engine(load_model("default", "bfloat16", log=lambda m: None), "lean", max_nodes=16)
        caches[name] = engines[name].new_cache(ctx + 32)
        engines[name].forward(torch.randint(100, 40000, (ctx,)), 0, caches[name])
        print(f"{name}: {(anon_huge_kb() - before) / 1024:.0f} MB more in huge pages after packing")
    times = {(e, n): [] for e in engines for n in ns}
    keys = list(times)
    for _ in range(rounds):
        random.shuffle(keys)
        for e, n in keys:
            tokens = torch.randint(100, 40000, (n,))
            start = time.perf_counter()
            engines[e].forward(tokens, ctx, caches[e], tree=torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1
                               else None, positions=torch.arange(ctx, ctx + n))
            times[(e, n)].append(time.perf_counter() - start)
    for n in ns:
        ratio = sorted(b / a for a, b in zip(times[("4KiB", n)], times[("2MiB", n)]))
        lo, hi = ratio[int(0.025 * len(ratio))], ratio[int(0.975 * (len(ratio) - 1))]
        print(f"context {ctx}, {n} rows: 4 KiB {1e3 * st.median(times[('4KiB', n)]):.3f} ms, 2 MiB "
              f"{1e3 * st.median(times[('2MiB', n)]):.3f} ms, 2 MiB / 4 KiB per round {st.median(ratio):.3f} "
              f"({lo:.3f}-{hi:.3f})")
    for e in engines:
        one = st.median(times[(e, 1)])
        print(f"{e}: " + "  ".join(f"{n} rows / 1: {st.median(times[(e, n)]) / one:.3f}" for n in ns))


if __name__ == "__main__":
    main()
