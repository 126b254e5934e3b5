"""The shipped heads' tree (chain:D, or a preset) timed right after a verify forward and back to back, with the
draft projection in bf16 and in int8 (the same heads otherwise); bf16 on the default model, C path.

    python docs/reports/2026-12-02-heads-bytes.py 4        # chain:4
    python docs/reports/2026-12-02-heads-bytes.py mc_sim_7b_63
"""
import dataclasses
import statistics as st
import sys
import time

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import chat_template_ids, load_model
from treesearch.tree import load_tree, make_tree

torch.set_num_threads(2)
loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"), log=lambda m: None)
spec = sys.argv[1]
tree = make_tree([(0,) * d for d in range(1, int(spec) + 1)], name="c") if spec.isdigit() else load_tree(spec)
decs = {}
for mode in ("bf16", "int8"):
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    heads.config = dataclasses.replace(heads.config, projection_int8=(mode == "int8"))
    decs[mode] = MedusaDecoder(loaded, heads, tree, config=DecodeConfig(max_new_tokens=160, topk=10))
ids = torch.tensor(chat_template_ids(loaded, [{"role": "user", "content": "Explain how photosynthesis works."}]))
dec = decs["bf16"]
cache = dec.new_cache(512)
_, hidden = dec.prefill(ids, cache)
cur, tokens = ids.shape[0], torch.arange(1000, 1000 + tree.num_nodes)
after = {k: [] for k in decs}
warm = {k: [] for k in decs}
for _ in range(40):
    for k, d in decs.items():
        nat = d.drafter.native
        _, states = dec.verify(tokens, cur, cache, dec.variants[-1])
        for times in (after[k], warm[k]):  # right after the forward, then again at once
            t0 = time.perf_counter()
            nat.tree(states[0], 1000)
            times.append(time.perf_counter() - t0)
for k in decs:
    print(f"{spec} {k}: after forward {1e3*st.median(after[k]):.3f} ms   warm {1e3*st.median(warm[k]):.3f} ms")
