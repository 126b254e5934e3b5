"""The heads' tree (chain:4, the shipped heads, C path) right after a 5-row verify forward ("cold") and called a
second time ("warm"), each phase of a tree level timed inside the C library, and the time from Python's call to
the C function's entry (docs/reports/2026-12-03-heads-call.md).

    python docs/reports/2026-12-03-heads-phases.py [ROUNDS]

Runs in any checkout from runtime revision 32 on (the tree call's Python side changed in 33, not its arguments):
the checkout's lean_cpu.c is instrumented (a barrier and a time-stamp counter read after every phase of
heads_level_in_team, counters at lean_heads_tree's entry, in its parallel region and at its return), built, and
swapped into the decoder's heads. Prints medians over the rounds, in ms: the whole call seen from Python, the
phases summed over the 4 levels, the projection per level (levels 1-3: level 0's comes from DRAM), the time from
Python's call to the C entry, the parallel region's start and the C call's own time.
"""

import ctypes
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from medusa_runtime import kernels
from medusa_runtime.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads import heads_folder, resolve_heads
from medusa_runtime.medusa2 import apply_heads_adapter
from medusa_runtime.model import chat_template_ids, load_model
from treesearch.tree import make_tree

TIMERS = '''
#include <x86intrin.h>
double lean_prof_t[16];
int lean_prof_level;
void lean_prof_reset(void) { for (int i = 0; i < 16; ++i) lean_prof_t[i] = 0; lean_prof_level = 0; }
double lean_prof_get(int i) { return lean_prof_t[i]; }
unsigned long long lean_prof_tsc(void) { return __rdtsc(); }
#define PROF_MARK(i) do { _Pragma("omp barrier") if (omp_get_thread_num() == 0) { unsigned long long _t = __rdtsc(); \\
    lean_prof_t[i] += (double)(_t - _pt); _pt = _t; } } while (0)
'''
PHASES = ["e (root and parent terms)", "block 0", "blocks 1.. (with their SiLU)", "block 0's SiLU", "projection",
          "top-k", "row quantisation"]


def insert(src: str, key: str, text: str, start: int, after: bool = False) -> tuple[str, int]:
    i = src.index(key, start) + (len(key) if after else 0)
    return src[:i] + text + src[i:], i + len(text)


def instrumented(src: str) -> str:
    at = src.index("/* ------------------------------------------------------------------ Medusa heads, one tree level")
    src = src[:at] + TIMERS + src[at:]
    f0 = src.index("static void heads_level_in_team(")
    src, i = insert(src, "{", "\n    unsigned long long _pt = __rdtsc();", f0, after=True)
    src, i = insert(src, "/* block 0 on the step's hidden state", "PROF_MARK(0);\n", i)
    src, i = insert(src, "silu_residual_rows(x, z, ep, rows, hsz, 1);", "PROF_MARK(1); ", i)
    src, i = insert(src, "silu_residual_rows(x, z, ep, rows, hsz, 1);", " PROF_MARK(3);", i, after=True)
    src, i = insert(src, "    if (proj->scale) {", "PROF_MARK(2);\n", i)
    src, i = insert(src, "linear_i8_rows((const int8_t *)proj->w", "PROF_MARK(6);\n", i)
    src, i = insert(src, "#pragma omp for schedule(static)\n    for (int i = 0; i < rows; ++i) topk_row(",
                    "{ unsigned long long _p0 = _pt; PROF_MARK(4); if (omp_get_thread_num() == 0) "
                    "lean_prof_t[8 + lean_prof_level] += (double)(_pt - _p0); }\n", i)
    src, i = insert(src, "\n}", "\n PROF_MARK(5); if (omp_get_thread_num() == 0) ++lean_prof_level;",
                    src.index("topk_row(logits", i))
    tree = src.index("int lean_heads_tree(")
    src, i = insert(src, "{", " lean_prof_t[12] = (double)__rdtsc();", tree, after=True)
    src, i = insert(src, "        float product = 1.0f;",
                    " if (omp_get_thread_num() == 0) lean_prof_t[13] = (double)__rdtsc();\n", i)
    src, i = insert(src, "    return done;", " lean_prof_t[14] = (double)__rdtsc();\n", i)
    return src


def build(out_dir: str) -> ctypes.CDLL:
    c_file, so_file = Path(out_dir, "heads_phases.c"), Path(out_dir, "heads_phases.so")
    c_file.write_text(instrumented(kernels.SOURCE.read_text()))
    subprocess.run(["gcc", *kernels.FLAGS, *kernels.tuning_flags(), "-o", str(so_file), str(c_file), "-lm"],
                   check=True)
    lib = kernels._declare(ctypes.CDLL(str(so_file)))
    lib.lean_prof_get.restype, lib.lean_prof_get.argtypes = ctypes.c_double, [ctypes.c_int]
    lib.lean_prof_tsc.restype = ctypes.c_ulonglong
    return lib


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    torch.set_num_threads(2)
    lib = build(tempfile.mkdtemp())
    t0, c0 = time.perf_counter(), lib.lean_prof_tsc()
    time.sleep(0.2)
    per_ms = (lib.lean_prof_tsc() - c0) / (time.perf_counter() - t0) / 1e3  # counter ticks per ms
    loaded = apply_heads_adapter(load_model("default", "bfloat16", log=lambda m: None), heads_folder("default"),
                                 log=lambda m: None)
    heads = resolve_heads("default", loaded.hidden_size, loaded.vocab_size)
    dec = MedusaDecoder(loaded, heads, make_tree([(0,) * k for k in range(1, 5)], name="chain:4"),
                        config=DecodeConfig(max_new_tokens=160, topk=1))
    native = dec.drafter.native
    assert native is not None, "the C heads path does not run here"
    native.lib = lib
    ids = torch.tensor(chat_template_ids(loaded, [{"role": "user", "content": "Explain how photosynthesis works."}]))
    cache = dec.new_cache(512)
    dec.prefill(ids, cache)
    tokens, out = torch.tensor([1000, 1001, 1002, 1003, 1004]), torch.empty(5, dtype=torch.long)
    res: dict[str, list[list[float]]] = {"cold": [], "warm": []}
    for _ in range(rounds):
        for mode in res:
            _, states = dec.verify(tokens, ids.shape[0], cache, dec.variants[-1])
            hidden = states[0]
            if mode == "warm":
                native.tree(hidden, 1000, 0.0, out)
            lib.lean_prof_reset()
            c_call, start = lib.lean_prof_tsc(), time.perf_counter()
            native.tree(hidden, 1000, 0.0, out)
            whole = (time.perf_counter() - start) * 1e3
            get = lib.lean_prof_get
            res[mode].append([whole] + [get(i) / per_ms for i in range(12)] +
                             [(get(12) - c_call) / per_ms, (get(13) - get(12)) / per_ms, (get(14) - get(12)) / per_ms])
    for mode, rows in res.items():
        med = [st.median(r[i] for r in rows[5:]) for i in range(len(rows[0]))]
        print(f"{mode}: whole call {med[0]:.3f} ms; Python to the C entry {med[13]:.3f}, parallel region's start "
              f"{med[14]:.3f}, the C call {med[15]:.3f}")
        print("    " + ", ".join(f"{name} {v:.3f}" for name, v in zip(PHASES, med[1:8])) +
              f"; projection per level {' / '.join(f'{v:.3f}' for v in med[9:13])}")


if __name__ == "__main__":
    main()
