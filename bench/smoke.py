"""What ``nox -s bench`` runs until the full pipeline lands: decode a few prompts on the default model.

Configurations (plain decoding, Medusa with untrained heads on two trees, transformers
``generate``) are interleaved per prompt after one warm-up, so that machine drift hits them alike.
Prints a Markdown table and writes it with the raw numbers under ``results/smoke/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa_runtime.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.heads import fresh_heads
from medusa_runtime.model import load_model
from treesearch.tree import write_json_atomic

PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List four tips for writing clean Python code.",
)


@dataclass(frozen=True)
class SmokeConfig:
    max_new_tokens: int = 64  # tokens per answer
    dtype: str = "float32"  # model dtype
    out_dir: str = "results/smoke"  # where the table and JSON go


def _hf_generate(loaded, prompt: list[int], n: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt], device=loaded.device)
    t0 = time.perf_counter()
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def run(cfg: SmokeConfig) -> list[dict[str, object]]:
    loaded = load_model("default", cfg.dtype)
    heads = fresh_heads(5, 1, loaded.hidden_size, loaded.vocab_size, base_model="default")
    dcfg = DecodeConfig(max_new_tokens=cfg.max_new_tokens)
    decoders = {
        "runtime plain": MedusaDecoder(loaded, None, None, config=dcfg),
        "medusa fresh:5 chain:4": MedusaDecoder(loaded, heads, "chain:4", config=dcfg),
        "medusa fresh:5 mc_sim_7b_63": MedusaDecoder(loaded, heads, "mc_sim_7b_63", config=dcfg),
    }
    prompts = [encode_prompt(loaded, p, chat=True) for p in PROMPTS]
    for dec in decoders.values():  # warm-up, excluded
        dec.generate(prompts[0][:8])
    rows: dict[str, dict[str, list]] = {name: {"tokens": [], "time": [], "tau": [], "same": []}
                                        for name in ["transformers generate", *decoders]}
    for prompt in prompts:
        ref, t = _hf_generate(loaded, prompt, cfg.max_new_tokens)
        rows["transformers generate"]["tokens"].append(len(ref))
        rows["transformers generate"]["time"].append(t)
        rows["transformers generate"]["tau"].append(1.0)
        rows["transformers generate"]["same"].append(True)
        for name, dec in decoders.items():
            res = dec.generate(prompt)
            rows[name]["tokens"].append(res.stats.new_tokens)
            rows[name]["time"].append(res.stats.time_total)
            rows[name]["tau"].append(res.stats.tau)
            rows[name]["same"].append(res.token_ids == ref)
    base = sum(rows["transformers generate"]["tokens"]) / sum(rows["transformers generate"]["time"])
    table = []
    for name, r in rows.items():
        tps = sum(r["tokens"]) / sum(r["time"])
        table.append({"configuration": name, "tokens": sum(r["tokens"]), "tokens_per_s": tps,
                      "speedup_vs_generate": tps / base, "tau": statistics.mean(r["tau"]),
                      "greedy_equal": f"{sum(r['same'])}/{len(r['same'])}"})
    return table


def to_markdown(table: list[dict[str, object]]) -> str:
    head = "| configuration | tokens | tokens/s | speedup vs generate | tau | greedy output = generate |"
    lines = [head, "|---|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['configuration']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_generate']:.2f}x | {r['tau']:.2f} | {r['greedy_equal']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=SmokeConfig.max_new_tokens)
    parser.add_argument("--dtype", default=SmokeConfig.dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=SmokeConfig.out_dir)
    args = parser.parse_args()
    cfg = SmokeConfig(args.max_new_tokens, args.dtype, args.out)
    table = run(cfg)
    md = to_markdown(table)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(md + "\n")
    write_json_atomic(out / "summary.json", {"schema": "medusa-smoke/1", "config": cfg.__dict__, "rows": table})
    print(md)
    print(f"\nwritten: {out / 'summary.md'}, {out / 'summary.json'}")
    print("note: fresh (untrained) heads accept almost nothing; trained heads come with the training issue.")


if __name__ == "__main__":
    main()
