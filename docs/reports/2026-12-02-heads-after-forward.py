"""The heads' tree (chain:3, the shipped heads, C path) timed right after a 4-node verify forward, with and
without the draft projection read first, against back-to-back calls; bf16 on the default model.

    python docs/reports/2026-12-02-heads-after-forward.py
"""
import statistics as st
import time

import torch

from medusa_runtime import kernels
from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import chat_template_ids, load_model
from treesearch.tree import make_tree

torch.set_num_threads(2)
loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                             log=lambda m: None)
heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
dec = MedusaDecoder(loaded, heads, make_tree([(0,), (0, 0), (0, 0, 0)], name="chain:3"),
                    config=DecodeConfig(max_new_tokens=160, topk=1))
native = dec.drafter.native
assert native is not None, "the C heads path does not run here"
ids = torch.tensor(chat_template_ids(loaded, [{"role": "user", "content": "Explain how photosynthesis works."}]))
cache = dec.new_cache(512)
_, hidden = dec.prefill(ids, cache)
cur, tokens = ids.shape[0], torch.tensor([1000, 1001, 1002, 1003])
x = hidden[-1].to(torch.bfloat16).contiguous().view(1, -1)
y = torch.empty(1, native.vocab, dtype=torch.bfloat16)


def touch():  # read the packed draft projection once (one row through it)
    native.lib.lean_linear(native.projection.data_ptr(), x.data_ptr(), 1, native.vocab, native.hidden_size,
                           y.data_ptr(), None, kernels.OUT_BF16, 2)


times = {"after a forward": [], "after a forward and the projection read": [], "the projection read itself": []}
for _ in range(60):
    for mode in times:
        _, states = dec.verify(tokens, cur, cache, dec.variants[-1])
        if mode == "the projection read itself":
            t0 = time.perf_counter()
            touch()
            times[mode].append(time.perf_counter() - t0)
            continue
        if mode != "after a forward":
            touch()
        t0 = time.perf_counter()
        native.tree(states[0], 1000)
        times[mode].append(time.perf_counter() - t0)
back_to_back = []
for _ in range(100):
    t0 = time.perf_counter()
    native.tree(states[0], 1000)
    back_to_back.append(time.perf_counter() - t0)
times["back to back"] = back_to_back
for mode, v in times.items():
    v = sorted(v)[5:]
    print(f"{mode:42s} median {1e3 * st.median(v):.3f} ms (quartiles {1e3 * v[len(v) // 4]:.3f}-"
          f"{1e3 * v[3 * len(v) // 4]:.3f})")
