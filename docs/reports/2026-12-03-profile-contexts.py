"""The same latency-profile rounds priced two ways: each context's verify row from decode loops at that context
(runtime revision 34), and from the middle context's loops scaled by the tight forwards' ratio between contexts
(before) (docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-profile-contexts.py [ROUNDS]
"""

import sys

import torch

from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import load_model
from medusa_runtime.profile import ProfileConfig, Profiler


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    torch.set_num_threads(2)
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    profiler = Profiler(loaded, heads, ProfileConfig(nodes=(1, 2, 3, 4, 5, 8, 16), contexts=(48, 112, 464)))
    profiler.round()  # warm-up
    taken = [profiler.round() for _ in range(rounds)]
    both = {"per-context loops": profiler.profile(taken),
            "tight ratio between contexts": profiler.profile(
                [{k: v for k, v in r.items() if k != "context_loops"} for r in taken])}
    for name, prof in both.items():
        print(name)
        for ctx, row in zip(prof.contexts, prof.verify_ms):
            print(f"  context {ctx}: " + " ".join(f"{n}:{v / row[0]:.3f}" for n, v in zip(prof.nodes, row))
                  + f"  (one row {row[0]:.2f} ms)")


if __name__ == "__main__":
    main()
