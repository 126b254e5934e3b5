"""lean_decode's phases with the full logits projection and through the int8 screen, 1 and 4 rows (or ROWS) of
random tokens, at context 112
(docs/reports/2026-12-03-logit-screen.md).

    python docs/reports/2026-12-03-logit-screen-phases.py ROUNDS [ROWS]     (ROWS: e.g. 1,4, the default)

The checkout's lean_cpu.c (runtime revision 35 on) is instrumented: a barrier and a time-stamp counter read after
the layers, the screen's row quantisation, its int8 pass, its pass for the best lower bound, its exact
candidates, and the full projection; built, and swapped into one lean engine of the default model in bf16. Each
round takes the four steps in shuffled order; prints the medians in ms.
"""

import ctypes
import random
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from medusa_runtime import kernels
from medusa_runtime.engine import make_engine
from medusa_runtime.model import load_model

TIMERS = r'''
#include <x86intrin.h>
double lp_t[8];
unsigned long long lp_t0;
void lp_reset(void) { for (int i = 0; i < 8; ++i) lp_t[i] = 0; }
double lp_get(int i) { return lp_t[i]; }
unsigned long long lp_tsc(void) { return __rdtsc(); }
#define LPM(i) do { _Pragma("omp barrier") if (omp_get_thread_num() == 0) { unsigned long long _t = __rdtsc(); \
    lp_t[i] += (double)(_t - lp_t0); lp_t0 = _t; } } while (0)
'''
NAMES = ["layers", "row quantisation", "int8 pass", "lower bound pass", "exact candidates", "full projection"]


def instrumented(src: str) -> str:
    at = src.index("/* ------------------------------------------------------------------ greedy logits")
    src = src[:at] + TIMERS + src[at:]

    def after(key: str, text: str, within: str) -> None:
        nonlocal src
        j = src.index(key, src.index(within)) + len(key)
        src = src[:j] + text + src[j:]

    screen, decode = "static int screen_argmax_in_team(", "int lean_decode(const LeanModel *m"
    after("        rows[r].ok = finite && isfinite(rows[r].xn2) && isfinite(rows[r].g);\n    }", " LPM(1);", screen)
    after("    screen_blocks(m->screen_q, m->screen_scale, xp, tr, n, in2, V, b0, b1, a);", " LPM(2);", screen)
    after("        part[t][r].lmax = lmax;\n        part[t][r].bad = bad;\n    }", " LPM(3);", screen)
    after("        part[t][r].at = at;\n        part[t][r].bad = bad;\n    }", " LPM(4);", screen)
    after("#pragma omp parallel num_threads(m->nthreads)\n    {", " if (omp_get_thread_num() == 0) lp_t0 = __rdtsc();",
          decode)
    after("m->nthreads, m->amx, m->xv);", " LPM(0);", decode)
    after("linear_any(m->amx, m->lm_head, hidden, n, m->vocab, m->hsz, logits, NULL, OUT_F32, m->xv, 0);",
          " if (!screened) LPM(5);", decode)
    return src


def build(out_dir: str) -> ctypes.CDLL:
    c_file, so_file = Path(out_dir, "screen_phases.c"), Path(out_dir, "screen_phases.so")
    c_file.write_text(instrumented(kernels.SOURCE.read_text()))
    subprocess.run(["gcc", *kernels.FLAGS, *kernels.tuning_flags(), "-o", str(so_file), str(c_file), "-lm"],
                   check=True)
    lib = kernels._declare(ctypes.CDLL(str(so_file)))
    lib.lp_get.restype, lib.lp_get.argtypes = ctypes.c_double, [ctypes.c_int]
    lib.lp_tsc.restype = ctypes.c_ulonglong
    return lib


def main() -> None:
    rounds, ctx = int(sys.argv[1]), 112
    sizes = [int(n) for n in (sys.argv[2] if len(sys.argv) > 2 else "1,4").split(",")]
    torch.set_num_threads(2)
    lib = build(tempfile.mkdtemp())
    t0, c0 = time.perf_counter(), lib.lp_tsc()
    time.sleep(0.2)
    per_ms = (lib.lp_tsc() - c0) / (time.perf_counter() - t0) / 1e3  # counter ticks per ms
    engine = make_engine(load_model("default", "bfloat16", log=lambda m: None), "lean", max_nodes=16)
    engine.lib = lib
    cache = engine.new_cache(ctx + 32)
    engine.forward(torch.randint(100, 40000, (ctx,)), 0, cache)
    keys = [(screen, n) for screen in (False, True) for n in sizes]
    got = {k: [] for k in keys}
    for _ in range(rounds):
        random.shuffle(keys)
        for screen, n in keys:
            ids = torch.randint(100, 40000, (n,))
            tree = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
            lib.lp_reset()
            start = time.perf_counter()
            engine.decode_step(ids, ctx, cache, tree, torch.arange(n) if n > 1 else None, argmax_only=screen)
            whole = (time.perf_counter() - start) * 1e3
            got[(screen, n)].append([whole] + [lib.lp_get(i) / per_ms for i in range(len(NAMES))])
    for (screen, n), rows in sorted(got.items()):
        med = [st.median(r[i] for r in rows) for i in range(len(NAMES) + 1)]
        print(f"{'screen' if screen else 'full  '} {n} row(s): whole step {med[0]:.3f}; "
              + ", ".join(f"{name} {v:.3f}" for name, v in zip(NAMES, med[1:]) if v > 0))


if __name__ == "__main__":
    main()
