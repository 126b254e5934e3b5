"""The design study behind the int8 screen of the logits (docs/reports/2026-12-03-logit-screen.md), in PyTorch.

    python docs/reports/2026-12-03-logit-screen-study.py

The default model's final hidden states over four chat prompts and its own greedy answers (120 tokens each); the
lm_head's rows quantised to int8 (per row s_v = max|w_v| / 127). Two screens are compared by how many vocabulary
rows their rigorous error bound leaves to compute exactly (those whose upper bound reaches the best lower bound):
activations in int8 too (per row scale max|x| / 127) with the worst-case bound s_x s_v (|x8|_1 / 2 + |q_v|_1 / 2 +
in / 4), against activations kept exact with the Cauchy-Schwarz bound ||x||_2 ||w_v - s_v q_v||_2. Both bounds
are checked to hold against the float32 products.
"""

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.model import chat_template_ids, load_model

PROMPTS = ["Explain how photosynthesis works.", "Write a short story about a robot learning to paint.",
           "Give me three tips for writing clean Python code.", "What are the causes of the French revolution?"]


def candidates(estimates: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    low = (estimates - bound).amax(dim=1, keepdim=True)
    return ((estimates + bound) >= low).sum(dim=1).float()


def main() -> None:
    torch.set_num_threads(2)
    loaded = load_model("default", "bfloat16", log=lambda m: None)
    weight = loaded.model.lm_head.weight.detach().float()  # [V, H], the bf16 values
    decoder = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=120))
    states = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = chat_template_ids(loaded, [{"role": "user", "content": prompt}])
            full = torch.tensor(list(ids) + decoder.generate(ids).token_ids)[None]
            states.append(loaded.model.model(full).last_hidden_state[0])  # after the final norm
    x = torch.cat(states).float()  # [T, H], bf16 values
    hidden = x.shape[1]
    exact = x @ weight.T
    scale = weight.abs().amax(dim=1) / 127
    q = torch.round(weight / scale[:, None])
    residual = (weight - scale[:, None] * q).norm(dim=1)
    # activations in int8 as well, the worst-case bound
    sx = x.abs().amax(dim=1) / 127
    x8 = torch.round(x / sx[:, None])
    both = (x8 @ q.T) * (sx[:, None] * scale[None, :])
    worst = sx[:, None] * scale[None, :] * (0.5 * x8.abs().sum(1)[:, None] + 0.5 * q.abs().sum(1)[None, :] + hidden / 4)
    # activations exact, Cauchy-Schwarz (plus a float32 allowance far above the products' rounding)
    weights_only = (x @ q.T) * scale[None, :]
    cs = x.norm(dim=1)[:, None] * residual[None, :] * 1.0001 + 2e-5 * x.abs().sum(1)[:, None] * weight.abs().amax(1)
    print(f"{x.shape[0]} positions")
    for name, estimates, bound in (("int8 activations, worst case", both, worst),
                                   ("exact activations, Cauchy-Schwarz", weights_only, cs)):
        error = (exact - estimates).abs()
        assert bool((error <= bound).all()), name
        c = candidates(estimates, bound)
        print(f"{name}: candidates median {c.median():.0f}, mean {c.mean():.0f}, 90th percentile "
              f"{c.quantile(0.9):.0f}, max {c.max():.0f}; mean error {error.mean():.3f}, mean bound {bound.mean():.3f}")


if __name__ == "__main__":
    main()
