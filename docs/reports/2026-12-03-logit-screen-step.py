"""Decode steps with the full logits projection and through the int8 screen, alternated in one process on one
cache, chains of 1 / 2 / 4 / 5 rows (or ROWS) of random tokens (docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-logit-screen-step.py CONTEXT ROUNDS [ROWS]     (ROWS: e.g. 1,2,4,5, the default)

Each round takes every (screen or not, rows) step once in shuffled order at the same cache position, checks that
both ways give the same argmax rows, and prints the medians.
"""

import random
import statistics as st
import sys
import time

import torch

from medusa_runtime.engine import make_engine
from medusa_runtime.model import load_model


def main() -> None:
    torch.set_num_threads(2)
    ctx, rounds = int(sys.argv[1]), int(sys.argv[2])
    rows = tuple(int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4,5").split(","))
    engine = make_engine(load_model("default", "bfloat16", log=lambda m: None), "lean", max_nodes=16)
    cache = engine.new_cache(ctx + 32)
    gen = torch.Generator().manual_seed(0)
    engine.forward(torch.randint(100, 40000, (ctx,), generator=gen), 0, cache)
    times = {(s, n): [] for s in (False, True) for n in rows}
    keys, mismatches = list(times), 0
    for _ in range(rounds):
        random.shuffle(keys)
        ids = {n: torch.randint(100, 40000, (n,), generator=gen) for n in rows}
        preds = {}
        for screen, n in keys:
            tree = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
            start = time.perf_counter()
            step = engine.decode_step(ids[n], ctx, cache, tree, torch.arange(n) if n > 1 else None, argmax_only=screen)
            times[(screen, n)].append(time.perf_counter() - start)
            preds[(screen, n)] = list(step.pred)
        mismatches += sum(preds[(False, n)] != preds[(True, n)] for n in rows)
    print(f"argmax mismatches: {mismatches}")
    for n in rows:
        full, screened = (1000 * st.median(times[(s, n)]) for s in (False, True))
        print(f"{n} rows: full {full:.3f} ms, screened {screened:.3f} ms, x{screened / full:.3f}")


if __name__ == "__main__":
    main()
