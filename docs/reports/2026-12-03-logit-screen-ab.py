"""Decode loops with and without the int8 screen of the logits, stepped in turn (lockstep), bf16, default model and
heads (docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-logit-screen-ab.py [ROUNDS] [chains|mc]

Each configuration (plain decoding, and chains 1-4, or with ``mc`` the trees of the first 4-7 paths of mc_sim_7b_63:
5-8 nodes) runs twice: on an engine with the screen (greedy steps' argmax
through it, the default) and on one without (logit_screen set to None before its first cache: the full bf16
projection and its argmax). Every question's tokens must be the same both ways. Prints ms per step split as the
decode loop times it (heads, verify, the rest), tokens per second, and the screen's step over the full one.
"""

import sys

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.lockstep import lockstep
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import chat_template_ids, load_model
from treesearch.tree import load_tree, make_tree

PROMPTS = ["Write a short story about a robot learning to paint.", "Explain how photosynthesis works.",
           "Give me three tips for writing clean Python code.", "What are the causes of the French revolution?",
           "Compose a haiku about autumn and explain it.", "Describe the water cycle to a child."]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    torch.set_num_threads(2)
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    if (sys.argv[2] if len(sys.argv) > 2 else "chains") == "mc":
        paths = load_tree("mc_sim_7b_63").paths
        shapes = {f"mc_sim {k + 1} nodes": make_tree(paths[:k], name=f"mc{k}") for k in (4, 5, 6, 7)}
    else:
        shapes = {f"chain:{d}": make_tree([(0,) * k for k in range(1, d + 1)], name=f"chain:{d}") for d in (1, 2, 3, 4)}
    trees = {"plain": None, **shapes}
    decs = {}
    for name, tree in trees.items():
        for screen in (True, False):
            dec = MedusaDecoder(loaded, heads if tree else None, tree,
                                config=DecodeConfig(max_new_tokens=160, topk=tree.max_rank + 1 if tree else 10))
            if not screen:
                dec.engine.logit_screen = None  # before any cache: its steps take the full projection
            decs[(name, screen)] = dec
    agg = {k: [] for k in decs}
    tokens = {}
    for r in range(rounds):
        for i, p in enumerate(PROMPTS):
            ids = chat_template_ids(loaded, [{"role": "user", "content": p}])

            def done(key, res, i=i):
                s = res.stats
                agg[key].append((s.steps, s.time_heads, s.time_verify, s.time_bookkeeping,
                                 s.time_total - s.time_prefill, s.new_tokens))
                tokens.setdefault((key[0], i), set()).add(tuple(res.token_ids))

            lockstep({k: d.generate_steps(ids) for k, d in decs.items()}, f"{r}/{i}", done)
    assert all(len(v) == 1 for v in tokens.values()), "the screen changed an output"
    for name in trees:
        line = []
        for screen in (False, True):
            rows = agg[(name, screen)]
            steps = sum(x[0] for x in rows)
            ms = [1000 * sum(x[j] for x in rows) / steps for j in (1, 2, 3, 4)]
            tps = sum(x[5] for x in rows) / sum(x[4] for x in rows)
            line.append((ms, tps))
        (f_ms, f_tps), (s_ms, s_tps) = line
        print(f"{name:16s} full: step {f_ms[3]:.3f} (heads {f_ms[0]:.3f} verify {f_ms[1]:.3f} rest {f_ms[2]:.3f}) "
              f"{f_tps:.1f} tok/s | screen: step {s_ms[3]:.3f} (heads {s_ms[0]:.3f} verify {s_ms[1]:.3f} rest "
              f"{s_ms[2]:.3f}) {s_tps:.1f} tok/s | step x{s_ms[3] / f_ms[3]:.3f}")


if __name__ == "__main__":
    main()
