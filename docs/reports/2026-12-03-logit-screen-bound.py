"""How tight the int8 screen of the logits is on the default model's own answers (docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-logit-screen-bound.py [QUESTIONS] [TOKENS]

Greedy plain decoding of the first QUESTIONS MT-Bench first turns (TOKENS new tokens each), one row a step: each
step is taken twice on the same cache state, with the full projection (the exact float32 logits) and through the
screen (its estimates, left in the step's logits buffer). Per position, from the screen's tensors in float64:
the bound of lean_cpu.c before its slack, the estimates' largest error over it, and the candidates (rows whose
upper bound reaches the best lower bound: those the screen computes exactly). Prints their distribution.
"""

import sys

import numpy as np
import torch

from bench.suites import load_suite
from medusa_runtime.decode import encode_prompt
from medusa_runtime.engine import LeanEngine
from medusa_runtime.model import load_model


def main() -> None:
    questions = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    torch.set_num_threads(2)
    loaded = load_model("default", "bfloat16", log=lambda m: None)
    engine = LeanEngine(loaded, use_kernels=True)
    screen = engine.logit_screen
    assert screen is not None, "no screen here (the tile path, or no C forward)"
    hidden = loaded.hidden_size
    err, csum, maxw = (t.double() for t in (screen.err, screen.csum, screen.maxw))
    candidates, worst, margins = [], 0.0, []
    with torch.inference_mode():
        for q in load_suite("mt-bench", log=lambda m: None)[:questions]:
            prompt = torch.tensor(encode_prompt(loaded, q.turns[0], chat=True))
            cache = engine.new_cache(len(prompt) + new + 1)
            logits, _ = engine.forward(prompt, 0, cache, last_only=True)
            token = int(np.argmax(logits[-1].numpy()))
            for i in range(new):
                ids, at = torch.tensor([token]), len(prompt) + i
                full = engine.decode_step(ids, at, cache).logits[0].double()
                step = engine.decode_step(ids, at, cache, argmax_only=True)
                estimates = cache.native.logits[0].double()
                x = step.hidden[0].double()
                t = float(x.abs().max().float() / 16383)
                bound = x.norm() * err + 0.51 * t * csum + 2 * hidden * 2.0 ** -23 * x.abs().sum() * maxw
                worst = max(worst, float(((full - estimates).abs() / bound).max()))
                low = float((estimates - bound).max())
                candidates.append(int(((estimates + bound) >= low).sum()))
                top2 = full.topk(2).values
                margins.append(float(top2[0] - top2[1]))
                token = step.pred[0]
    c = np.array(candidates)
    print(f"{len(c)} positions: candidates median {np.median(c):.0f}, mean {c.mean():.1f}, 90th percentile "
          f"{np.percentile(c, 90):.0f}, max {c.max()}; largest error / bound {worst:.3f}; "
          f"top-1 minus top-2 logit median {np.median(margins):.2f}")


if __name__ == "__main__":
    main()
