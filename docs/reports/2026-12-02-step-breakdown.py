"""Per-step breakdown: plain and chains 1..4 with the default heads, interleaved (lockstep), bf16."""
import sys, time, statistics as st, random
import torch
from medusa_runtime.model import load_model
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.decode import MedusaDecoder, DecodeConfig, run_to_end
from medusa_runtime.lockstep import lockstep
from medusa_runtime.model import chat_template_ids
from treesearch.tree import make_tree

torch.set_num_threads(2)
loaded = load_model("default", "bfloat16", log=lambda m: None)
loaded = apply_heads_adapter(loaded, heads_folder("default"), log=lambda m: None)
heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
prompts = ["Write a short story about a robot learning to paint.", "Explain how photosynthesis works.",
           "Give me three tips for writing clean Python code.", "What are the causes of the French revolution?",
           "Compose a haiku about autumn and explain it.", "Describe the water cycle to a child."]
trees = {"plain": None, **{f"chain:{d}": make_tree([(0,) * k for k in range(1, d + 1)], name=f"chain:{d}") for d in (1, 2, 3, 4)}}
decs = {n: MedusaDecoder(loaded, heads if t else None, t, config=DecodeConfig(max_new_tokens=160, topk=1 if t else 10))
        for n, t in trees.items()}
agg = {n: [] for n in trees}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for p in prompts:
        ids = chat_template_ids(loaded, [{"role": "user", "content": p}])
        runs = {n: d.generate_steps(ids) for n, d in decs.items()}
        def done(n, res):
            s = res.stats
            agg[n].append((s.steps, s.time_heads, s.time_verify, s.time_bookkeeping, s.time_total - s.time_prefill, s.new_tokens))
        lockstep(runs, f"{r}", done)
base = None
for n, rows in agg.items():
    steps = sum(x[0] for x in rows)
    h, v, b, tot, toks = (sum(x[i] for x in rows) for i in (1, 2, 3, 4, 5))
    per = lambda t: 1000 * t / steps
    if base is None: base = per(tot)
    print(f"{n:8s} step {per(tot):6.3f} heads {per(h):5.3f} verify {per(v):6.3f} book {per(b):5.3f} "
          f"other {per(tot-h-v-b):5.3f} tau {toks/steps:4.2f} tok/s {toks/tot:6.1f}  (heads+book)/plain {(per(h)+per(b))/base*100:4.1f}%")
