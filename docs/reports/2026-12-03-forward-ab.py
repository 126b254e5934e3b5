"""Builds of the C forward alternated in one process, each phase of a layer timed
(docs/reports/2026-12-03-verify-rows.md).

    python docs/reports/2026-12-03-forward-ab.py CONTEXTS ROUNDS A.c B.c ...    (NS=1,2,4,5 picks the row counts)

PHASES=0 builds the sources as they are (the per-phase barriers of the instrumented builds would hide a change
that removes barriers) and prints whole forwards only.
Each source is instrumented (a barrier and a time-stamp counter read after every phase of every layer: norm1, qkv,
rope, attn, o, norm2, gate_up, silu, down), built, and swapped into one lean engine of the default model in bf16; a
verify forward of n rows (a chain) at each context is timed per build in shuffled order per round. Prints the
median whole forward (logits included) per row count, its ratio to one row, and the median ms of each phase.
"""

import ctypes
import hashlib
import os
import random
import re
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

PHASES = ["rmsnorm_rows(x, w->ln1", "linear_any(amx, w->qkv", "rope_rows(qkv", "attention_rows(q, kc",
          "linear_any(amx, w->o,", "rmsnorm_rows(x, w->ln2", "linear_any(amx, w->gate_up", "silu_mul_rows(gu",
          "linear_any(amx, w->down"]
NAMES = ["norm1", "qkv", "rope", "attn", "o", "norm2", "gate_up", "silu", "down"]
TIMERS = '''
#include <x86intrin.h>
double lean_prof_t[16];
void lean_prof_reset(void) { for (int i = 0; i < 16; ++i) lean_prof_t[i] = 0; }
double lean_prof_get(int i) { return lean_prof_t[i]; }
unsigned long long lean_prof_tsc(void) { return __rdtsc(); }
#define PROF_MARK(i) do { _Pragma("omp barrier") if (omp_get_thread_num() == 0) { unsigned long long _t = __rdtsc(); \\
    lean_prof_t[i] += (double)(_t - _pt); _pt = _t; } } while (0)
'''


def instrumented(source: str) -> str:
    src = open(source).read()
    at = src.index("/* ------------------------------------------------------------------ the forward")
    src = src[:at] + TIMERS + src[at:]
    for k, call in enumerate(PHASES):
        end = src.index(";", src.index(call)) + 1
        src = src[:end] + f" PROF_MARK({k});" + src[end:]
    # the layer loop (in lean_forward up to e3f16ad, in layers_in_team since, one indent level less)
    loop = re.search(r"\n( +)for \(int l = 0; l < num_layers; \+\+l\) \{\n +const LeanLayer \*w = layers \+ l;", src)
    return src[:loop.start()] + f"\n{loop.group(1)}unsigned long long _pt = __rdtsc();" + src[loop.start():]


# what sources before runtime revision 25 lack for kernels._declare (their forward needs 4 floats a slot per thread)
SHIMS = {"lean_scratch_size": "size_t lean_scratch_size(int t, int rows, int nh, int cap, int amx) "
                              "{ return ((size_t)4 * t + (amx ? (size_t)rows * nh : 0)) * cap; }\n",
         "lean_forward_work_size": "size_t lean_forward_work_size(int n, int h, int nh, int nkv, int d, int i, "
                                   "int amx) { size_t r = amx ? (n + 15) / 16 * 16 : n; "
                                   "return r * (h + (nh + 2 * nkv) * d + 2 * nh * d + 3 * i); }\n",
         "lean_decode_work_size": "size_t lean_decode_work_size(int n, int h, int nh, int nkv, int d, int i, int amx) "
                                  "{ return 0; }\nint lean_decode(const void *m, const int64_t *ids, int n, "
                                  "const int64_t *off, int start, const uint8_t *tree, void *h, float *l, int64_t *p) "
                                  "{ return -1; }\n"}


def build(source: str, out_dir: str, phases: bool) -> ctypes.CDLL:
    text = instrumented(source) if phases else open(source).read()
    text += "".join(shim for name, shim in SHIMS.items() if name not in text)
    stem = hashlib.sha256(text.encode()).hexdigest()[:12]
    c_file, so_file = Path(out_dir, f"{stem}.c"), Path(out_dir, f"{stem}.so")
    c_file.write_text(text)
    subprocess.run(["gcc", *kernels.FLAGS, *kernels.tuning_flags(), "-o", str(so_file), str(c_file), "-lm"],
                   check=True)
    lib = kernels._declare(ctypes.CDLL(str(so_file)))
    if phases:
        lib.lean_prof_get.restype, lib.lean_prof_get.argtypes = ctypes.c_double, [ctypes.c_int]
        lib.lean_prof_tsc.restype = ctypes.c_ulonglong
    return lib


def main() -> None:
    torch.set_num_threads(2)
    ctxs, rounds, sources = [int(c) for c in sys.argv[1].split(",")], int(sys.argv[2]), sys.argv[3:]
    ns = [int(x) for x in os.environ.get("NS", "1,2,3,4,5").split(",")]
    phased = os.environ.get("PHASES", "1") != "0"
    tmp = tempfile.mkdtemp()
    libs = [build(s, tmp, phased) for s in sources]
    tsc = 1.0
    if phased:
        t0, c0 = time.perf_counter(), libs[0].lean_prof_tsc()
        time.sleep(0.2)
        tsc = (libs[0].lean_prof_tsc() - c0) / (time.perf_counter() - t0)  # counter ticks per second
    loaded = load_model("default", "bfloat16", log=lambda m: None)  # kept: the engine's packed weights live with it
    engine = make_engine(loaded, "lean", max_nodes=16)
    caches = {}
    for c in ctxs:
        caches[c] = engine.new_cache(c + 32)
        engine.forward(torch.randint(100, 40000, (c,)), 0, caches[c])
    whole = {(b, c, n): [] for b in range(len(libs)) for c in ctxs for n in ns}
    phases = {k: [] for k in whole}
    keys = list(whole)
    for _ in range(rounds):
        random.shuffle(keys)
        for b, c, n in keys:
            engine.lib = libs[b]
            if phased:
                libs[b].lean_prof_reset()
            start = time.perf_counter()
            engine.forward(torch.randint(100, 40000, (n,)), c, caches[c],
                           tree=torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None,
                           positions=torch.arange(c, c + n))
            whole[(b, c, n)].append(time.perf_counter() - start)
            if phased:
                phases[(b, c, n)].append([libs[b].lean_prof_get(i) / tsc * 1000 for i in range(len(PHASES))])
    for c in ctxs:
        for b, source in enumerate(sources):
            one = st.median(whole[(b, c, 1)])
            meds = {n: st.median(whole[(b, c, n)]) for n in ns}
            print(f"{Path(source).name} context {c}: " + "  ".join(
                f"{n}: {1000 * m:.3f} ms x{m / one:.3f}" for n, m in meds.items()))
            for n in ns if phased else ():
                med = [st.median(x[i] for x in phases[(b, c, n)]) for i in range(len(PHASES))]
                print(f"    n={n} " + " ".join(f"{a} {v:.3f}" for a, v in zip(NAMES, med)) + f"  sum {sum(med):.3f}")


if __name__ == "__main__":
    main()
