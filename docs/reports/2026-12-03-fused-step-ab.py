"""The decode loop with the one-call step (B, ``LeanEngine.decode_step``) against forward + logits + argmax (A, the
path engines without it take), alternated in one process (docs/reports/2026-12-03-fused-step.md).

    python docs/reports/2026-12-03-fused-step-ab.py loops CONTEXT ROUNDS    # ms per step, A and B, 3 trees
    python docs/reports/2026-12-03-fused-step-ab.py floor CONTEXT ROUNDS    # plain step over its floor, A and B

``loops``: per round, a generate (48 new tokens, greedy) of each decoder in shuffled order: plain, chain:1 and the
4-node tree [0], [1], [0, 0] with the shipped heads; prints the median ms per step of A and B, the median of B / A
per round with its distribution-free 95 % interval, the heads / verify / bookkeeping split, and whether A and B
wrote the same tokens. ``floor``: floor pairs (a plain generate of 24 tokens between two copy probes) of A and B in
alternating order; the step over the floor of the weights + KV cache and of the weights alone.
"""

import random
import statistics as st
import sys

import torch

from medusa_runtime.bandwidth import (FloorProbe, floor_pair, generate_kv_bytes, median_interval, pairs_summary,
                                      weight_bytes)
from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import load_heads, shipped_heads_dir
from medusa_runtime.model import load_model
from treesearch.tree import make_tree


def unfused(dec: MedusaDecoder) -> MedusaDecoder:
    dec._fused = False  # forward, then the logits and argmax_rows as separate calls
    dec._root_np = None  # the root written with fill_ (a tensor op), as before
    return dec


def loops(loaded, prompt, rounds):
    heads = load_heads(shipped_heads_dir("default"), loaded.hidden_size, loaded.vocab_size)
    cfg = DecodeConfig(max_new_tokens=48, stop_on_eos=False)
    trees = [None, "chain:1", make_tree([(0,), (1,), (0, 0)], name="t4")]
    decs = {(i, f): MedusaDecoder(loaded, heads if t else None, t, config=cfg) for i, t in enumerate(trees)
            for f in (False, True)}
    for (i, f), d in decs.items():
        if not f:
            unfused(d)
    times, parts, outs = {k: [] for k in decs}, {k: [] for k in decs}, {}
    for r in range(rounds):
        keys = list(decs)
        random.Random(r).shuffle(keys)
        for k in keys:
            g = decs[k].generate(prompt)
            s = g.stats
            times[k].append(s.step_ms)
            parts[k].append([1000 * x / s.steps for x in (s.time_heads, s.time_verify, s.time_bookkeeping)])
            outs.setdefault(k[0], set()).add(tuple(g.token_ids))
    for i, t in enumerate(trees):
        a, b = times[(i, False)], times[(i, True)]
        ratio = [y / x for x, y in zip(a, b)]
        lo, hi = median_interval(ratio)
        split = {f: [round(st.median(p[j] for p in parts[(i, f)]), 3) for j in range(3)] for f in (False, True)}
        print(f"{getattr(t, 'name', t)!s:8s} A {st.median(a):.3f}  B {st.median(b):.3f} ms  B/A {st.median(ratio):.4f} "
              f"[{lo:.4f}, {hi:.4f}]  heads/verify/bookkeeping A {split[False]} B {split[True]}  "
              f"same tokens: {len(outs[i]) == 1}")


def floor(loaded, prompt, rounds):
    cfg = DecodeConfig(max_new_tokens=24, stop_on_eos=False)
    a, b = unfused(MedusaDecoder(loaded, None, None, config=cfg)), MedusaDecoder(loaded, None, None, config=cfg)
    probe = FloorProbe()
    a.generate(prompt), b.generate(prompt)
    pairs = {"A": [], "B": []}
    for r in range(rounds):
        for name in ("AB" if r % 2 == 0 else "BA"):
            pairs[name].append(floor_pair(probe, a if name == "A" else b, prompt))
    kv = generate_kv_bytes(loaded, prompt.numel(), 24)
    for name, p in pairs.items():
        s = pairs_summary(weight_bytes(loaded), p, kv)
        print(f"{name}: {s['bandwidth_gbs']:.1f} GB/s, plain {s['plain_ms']:.3f} ms, over the floor "
              f"{s['plain_over_floor']:.4f} {[round(x, 4) for x in s['plain_over_floor_95']]}, over the weights' "
              f"{s['plain_over_weights_floor']:.4f} {[round(x, 4) for x in s['plain_over_weights_floor_95']]}")


def main():
    mode, ctx, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    loaded = load_model("default", dtype="bfloat16", device="cpu")
    prompt = torch.randint(0, loaded.vocab_size, (ctx,), generator=torch.Generator().manual_seed(0))
    {"loops": loops, "floor": floor}[mode](loaded, prompt, rounds)


if __name__ == "__main__":
    main()
