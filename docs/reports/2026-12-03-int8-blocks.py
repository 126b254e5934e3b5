"""What int8 residual blocks would cost the shipped heads in accuracy (tried and dropped, runtime revision 33;
docs/reports/2026-12-03-heads-call.md). PyTorch only: each block's linear layer scored as the int8 projection is
(heads.Int8Projection: per output row and per input row a scale of max|.| / 127, int32 sums), bias added in float32
before the bf16 rounding; every head's top-1 over the draft vocabulary against the token it should propose, on the
greedy answers (120 tokens) of eight prompts, teacher-forced (root and parents the answer's own tokens).

    python docs/reports/2026-12-03-int8-blocks.py
"""

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import Int8Projection, ResBlock, heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import chat_template_ids, load_model

PROMPTS = ["Write a short story about a robot learning to paint.", "Explain how photosynthesis works.",
           "Give me three tips for writing clean Python code.", "What are the causes of the French revolution?",
           "Compose a haiku about autumn and explain it.", "Describe the water cycle to a child.",
           "How do I make a good cup of coffee?", "Summarize the plot of Romeo and Juliet."]


def main() -> None:
    torch.set_num_threads(2)
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size).to(torch.bfloat16)
    plain = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=120))
    model = loaded.model
    embed, lm = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    bf16_forward, int8_of = ResBlock.forward, {}

    def int8_forward(self, x, extra=None):  # x + SiLU(bf16(x8 . q * (sx * sw) + b) [+ extra])
        q = int8_of.setdefault(id(self), Int8Projection(self.linear.weight))
        x8, sx = q.quantize_rows(x)
        z = ((x8 @ q.q.T) * (sx * q.scale) + self.linear.bias.float()).to(x.dtype)
        return x + self.act(z if extra is None else z + extra)

    hits = {mode: [[0, 0] for _ in range(heads.num_heads)] for mode in ("bf16", "int8")}
    same = total = 0
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = chat_template_ids(loaded, [{"role": "user", "content": prompt}])
            seq = torch.tensor(list(ids) + plain.generate(ids).token_ids)
            hidden = model(seq[None], output_hidden_states=True).hidden_states[-1][0]  # [T, H]
            tops = {}
            for mode in hits:
                ResBlock.forward = bf16_forward if mode == "bf16" else int8_forward
                rows = []
                for t in range(len(ids) - 1, seq.shape[0] - heads.num_heads - 2):
                    parents = embed[seq[t + 2:t + heads.num_heads + 1]]  # head j >= 1's parent: token t + j + 1
                    states = heads.head_states(hidden[t], embed[seq[t + 1]], parents)  # [K, H]
                    top = heads.token_ids(heads.draft_logits(states, lm).float().argmax(-1))  # [K]
                    rows.append(top)
                    for j in range(heads.num_heads):
                        hits[mode][j][0] += int(top[j] == seq[t + j + 2])
                        hits[mode][j][1] += 1
                tops[mode] = torch.stack(rows)
            same += int((tops["bf16"] == tops["int8"]).sum())
            total += tops["bf16"].numel()
    ResBlock.forward = bf16_forward
    for mode, per_head in hits.items():
        print(f"{mode} blocks: " + ", ".join(f"head {j} top-1 {a / b:.3f}" for j, (a, b) in enumerate(per_head)))
    print(f"the same top-1 with int8 and bf16 blocks: {same / total:.4f} of {total}")


if __name__ == "__main__":
    main()
