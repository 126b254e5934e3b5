"""Two or more builds of lean_cpu.c against each other in one process (docs/reports/2026-12-03-verify-roofline.md).

    python docs/reports/2026-12-03-build-ab.py loops ROUNDS A.c B.c ...   (LONG=400: prompts of >= 400 tokens)
    python docs/reports/2026-12-03-build-ab.py bits A.c B.c ...

``loops``: decode loops of the default model in bf16 with its heads (plain, chain:1, chain:3; 96 new tokens) on
every build, all stepped in turn (lockstep) on the same MT-Bench chat prompt each round (several questions joined
until LONG tokens with LONG set); prints each build's median ms per step and per verify, the ratio of each
build's generate time to the first build's, and each build's verify of chain:1 / chain:3 over plain's.
``bits``: the same decode steps (1-5, 8 and 16 rows after a 200-token prompt) on every build; prints whether the
hidden states, logits and argmaxes equal the first build's bit for bit.
"""

import ctypes
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from medusa_runtime import kernels
from medusa_runtime.decode import DecodeConfig, MedusaDecoder, encode_prompt
from medusa_runtime.engine import make_engine
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.lockstep import lockstep
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import load_model
from treesearch.tree import make_tree

QUESTIONS = Path(__file__).resolve().parents[2] / "tests" / "data" / "mt_bench" / "question.jsonl"


def build(source: str, out_dir: str, index: int):
    so = Path(out_dir, f"build{index}.so")
    subprocess.run(["gcc", *kernels.FLAGS, *kernels.tuning_flags(), "-o", str(so), source, "-lm"], check=True)
    return kernels._declare(ctypes.CDLL(str(so)))


def prompt_text(questions: list[dict], r: int, loaded, long: int) -> torch.Tensor:
    text, k = questions[(7 * r) % len(questions)]["turns"][0], 1
    while len(encode_prompt(loaded, text, chat=True)) < long:  # earlier questions before it, up to LONG tokens
        text = questions[(7 * r + k) % len(questions)]["turns"][0] + "\n\n" + text
        k += 1
    return torch.tensor(encode_prompt(loaded, text, chat=True))


def loops(rounds: int, sources: list[str], libs: list) -> None:
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    trees = {"plain": None, **{f"chain:{d}": make_tree([(0,) * k for k in range(1, d + 1)], name=f"chain:{d}")
                               for d in (1, 3)}}
    decoders = {}
    for b, lib in enumerate(libs):
        for name, tree in trees.items():
            cfg = DecodeConfig(max_new_tokens=96, topk=1, stop_on_eos=False)
            decoder = MedusaDecoder(loaded, heads if tree else None, tree, config=cfg)
            decoder.engine.lib = lib  # before its first cache: the step buffers are made by this build
            decoders[(b, name)] = decoder
    got: dict = {}
    for r in range(rounds):
        prompt = prompt_text(questions, r, loaded, int(os.environ.get("LONG", "0")))

        def done(key, res):
            s = res.stats
            got.setdefault(key, []).append((s.step_ms, 1000 * s.time_verify / s.steps, s.time_total))

        lockstep({k: d.generate_steps(prompt) for k, d in decoders.items()}, f"r{r}", done)
    for name in trees:
        for b, source in enumerate(sources):
            rows = got[(b, name)]
            line = (f"{source} {name}: step {st.median(x[0] for x in rows):.3f} ms, verify "
                    f"{st.median(x[1] for x in rows):.3f}")
            if b:
                ratio = [x[2] / y[2] for x, y in zip(rows, got[(0, name)])]
                line += f"; generate time over {sources[0]}'s: median {st.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})"
            print(line)
    for b, source in enumerate(sources):
        plain = got[(b, "plain")]
        print(f"{source}: verify over plain's, median of rounds: " + ", ".join(
            f"{name} {st.median(x[1] / y[1] for x, y in zip(got[(b, name)], plain)):.3f}" for name in trees
            if name != "plain"))


def bits(sources: list[str], libs: list) -> None:
    loaded = load_model("default", "bfloat16", log=lambda m: None)
    steps = []
    for lib in libs:
        engine = make_engine(loaded, "lean", max_nodes=16)
        engine.lib = lib
        gen = torch.Generator().manual_seed(0)
        cache = engine.new_cache(400)
        engine.forward(torch.randint(100, 40000, (200,), generator=gen), 0, cache)
        start, outs = 200, []
        for n in (1, 2, 3, 4, 5, 8, 16):
            ids = torch.randint(100, 40000, (n,), generator=gen)
            tree = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
            step = engine.decode_step(ids, start, cache, tree, torch.arange(n) if n > 1 else None)
            outs.append((n, step.hidden.clone(), step.logits.clone(), list(step.pred)))
            start += n
        steps.append(outs)
    for b in range(1, len(libs)):
        for (n, h0, l0, p0), (_, h, lg, p) in zip(steps[0], steps[b]):
            print(f"{sources[b]} against {sources[0]}, {n} row(s): hidden {torch.equal(h0, h)}, logits "
                  f"{torch.equal(l0, lg)}, argmax {p0 == p}")


def main() -> None:
    mode = sys.argv[1]
    torch.set_num_threads(2)
    sources = sys.argv[3:] if mode == "loops" else sys.argv[2:]
    out = tempfile.mkdtemp()
    libs = [build(s, out, i) for i, s in enumerate(sources)]
    if mode == "loops":
        loops(int(sys.argv[2]), sources, libs)
    elif mode == "bits":
        bits(sources, libs)
    else:
        sys.exit(f"unknown mode {mode!r}: loops or bits")


if __name__ == "__main__":
    main()
