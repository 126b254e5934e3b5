"""The verify step inside decode loops against the same step in tight calls, all stepped in one lockstep
(docs/reports/2026-12-03-head-groups.md).

    python docs/reports/2026-12-03-loop-vs-tight.py NEW_TOKENS GENERATES [whole]

A plain and a chain:3 decode loop (the shipped heads, their adapter merged, bf16, a 256-token prompt) and two
tight decode steps (one row, and a 4-node chain, at context 256 on a cache of their own) are advanced in an
order shuffled every round; each verify is timed. Prints the median verify of each and the ratios.
With ``whole``: no lockstep and no tight steps; whole generates of plain decoding, chain:3 and the profile's
4-node shape, in an order shuffled per repeat, each generate's verify per step (medians over repeats).
"""

import random
import statistics as st
import sys
import time
import types

import torch

from bench.commands.common import _model_and_heads
from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.profile import _shape_tree
from treesearch.tree import chain


def whole_generates(loaded, heads, prompt, new_tokens: int, repeats: int) -> None:
    cfg = DecodeConfig(max_new_tokens=new_tokens, stop_on_eos=False, topk=10)
    decs = {"plain": MedusaDecoder(loaded, None, None, config=cfg),
            "chain:3": MedusaDecoder(loaded, heads, chain(3), config=cfg),
            "4-node shape": MedusaDecoder(loaded, heads, _shape_tree(4, heads.num_heads), config=cfg)}
    verify = {k: [] for k in decs}
    for _ in range(repeats):
        for k in random.sample(list(decs), len(decs)):
            stats = decs[k].generate(prompt).stats
            verify[k].append(1000 * stats.time_verify / stats.steps)
    med = {k: st.median(v) for k, v in verify.items()}
    print("  ".join(f"{k} {v:.3f} ms" for k, v in med.items()))
    print(f"verify over plain's: chain:3 {med['chain:3'] / med['plain']:.3f}, "
          f"4-node shape {med['4-node shape'] / med['plain']:.3f}")


def main() -> None:
    new_tokens, generates = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    loaded, heads = _model_and_heads(types.SimpleNamespace(model="default", dtype="bfloat16", device="cpu",
                                                           heads="default"))
    prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0))
    if sys.argv[3:] == ["whole"]:
        whole_generates(loaded, heads, prompt, new_tokens, generates)
        return
    cfg = DecodeConfig(max_new_tokens=new_tokens, stop_on_eos=False, topk=2)
    decs = {"plain loop": MedusaDecoder(loaded, None, None, config=cfg),
            "chain:3 loop": MedusaDecoder(loaded, heads, chain(3), config=cfg)}
    times = {k: [] for k in [*decs, "tight 1", "tight 4"]}
    for name, dec in decs.items():
        def timed(tokens, cur_len, cache, buffers, orig=dec.verify_step, name=name):
            t0 = time.perf_counter()
            out = orig(tokens, cur_len, cache, buffers)
            times[name].append(time.perf_counter() - t0)
            return out
        dec.verify_step = timed
    tight = decs["chain:3 loop"]
    cache = tight.new_cache(256 + 8)
    tight.prefill(prompt, cache)
    rows = {1: torch.randint(100, 40000, (1,)), 4: torch.randint(100, 40000, (4,))}

    def tight_step(n: int) -> None:
        t0 = time.perf_counter()
        if n == 1:
            tight.engine.decode_step(rows[1], 256, cache)
        else:
            tight.engine.decode_step(rows[4], 256, cache, tight.buffers.attn_mask, tight.buffers.position_offsets)
        times[f"tight {n}"].append(time.perf_counter() - t0)

    for _ in range(generates):
        alive = {k: d.generate_steps(prompt) for k, d in decs.items()}
        while alive:
            order = [*alive, 1, 4]
            random.shuffle(order)
            for k in order:
                if isinstance(k, int):
                    tight_step(k)
                    continue
                try:
                    next(alive[k])
                except StopIteration:
                    del alive[k]
    med = {k: st.median(v) * 1e3 for k, v in times.items()}
    print("  ".join(f"{k} {v:.3f} ms" for k, v in med.items()))
    print(f"in loops chain:3 / plain {med['chain:3 loop'] / med['plain loop']:.3f}; tight 4 / 1 "
          f"{med['tight 4'] / med['tight 1']:.3f}; plain loop / tight 1 {med['plain loop'] / med['tight 1']:.3f}")


if __name__ == "__main__":
    main()
