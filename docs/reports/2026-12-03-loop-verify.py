"""A tree's verify inside real decode loops against plain decoding's, stepped in turn (lockstep), with the heads
and with fixed draft tokens (no heads run), at one prompt length (docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-loop-verify.py DEPTH CONTEXT ROUNDS

A chain of DEPTH heads (DEPTH + 1 rows); each round a random prompt of CONTEXT tokens, 64 new tokens. Prints the
median ms per step of each loop's verify, heads and bookkeeping, and the ratio of the verify totals to plain's.
"""

import statistics as st
import sys

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.lockstep import lockstep
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import load_model
from treesearch.tree import make_tree


def main() -> None:
    depth, ctx, rounds = (int(a) for a in sys.argv[1:4])
    torch.set_num_threads(2)
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    tree = make_tree([(0,) * k for k in range(1, depth + 1)], name=f"chain:{depth}")
    cfg = DecodeConfig(max_new_tokens=64, topk=1, stop_on_eos=False)
    fixed = MedusaDecoder(loaded, heads, tree, config=cfg)
    drafts = torch.tensor([1000 + i for i in range(depth + 1)])

    def propose(hidden, root, draft=(), out=None):  # the tree's rows without running the heads
        drafts[0] = root
        fixed.step_buffers = fixed.variants[0]
        return drafts

    fixed.propose = propose
    decoders = {"plain": MedusaDecoder(loaded, None, None, config=cfg), "heads": MedusaDecoder(loaded, heads, tree, config=cfg),
                "fixed drafts": fixed}
    gen = torch.Generator().manual_seed(0)
    got = {k: [] for k in decoders}
    for r in range(rounds):
        prompt = torch.randint(0, loaded.vocab_size, (ctx,), generator=gen)

        def done(key, res):
            s = res.stats
            got[key].append((1000 * s.time_verify / s.steps, 1000 * s.time_heads / s.steps,
                             1000 * s.time_bookkeeping / s.steps, s.time_verify))

        lockstep({k: d.generate_steps(prompt) for k, d in decoders.items()}, f"r{r}", done)
    plain = sum(x[3] for x in got["plain"])
    for key, rows in got.items():
        print(f"{key}: verify {st.median(x[0] for x in rows):.3f} ms, heads {st.median(x[1] for x in rows):.3f}, "
              f"bookkeeping {st.median(x[2] for x in rows):.3f}; verify total / plain's "
              f"{sum(x[3] for x in rows) / plain:.3f}")


if __name__ == "__main__":
    main()
