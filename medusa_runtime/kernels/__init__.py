"""The lean engine's C forward (``lean_cpu.c``): compiled once per machine with the system's C
compiler, cached in the project's cache folder, loaded with ctypes.

``load()`` returns the library, or ``None`` with the reason in ``unavailable_reason()`` (no C
compiler, a failed build, ``MEDUSA_LEAN_KERNELS=0``). The engine then keeps its PyTorch path, so the
kernels are a speed-up only, never a requirement. ``amx_path()`` says whether the linear layers run on
the AMX tile unit (a CPU with AMX-BF16 whose kernel grants the tile state; ``MEDUSA_LEAN_AMX=0`` turns
it off), else on AVX-512 BF16 dot products. The build is keyed by the source, the compiler's
version and the CPU's flags (``-march=native``), written to a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the library binds to)

from medusa_runtime.paths import cache_root
from treesearch.fsutil import atomic_file

SOURCE = Path(__file__).with_name("lean_cpu.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")
ENV_SWITCH = "MEDUSA_LEAN_KERNELS"
AMX_SWITCH = "MEDUSA_LEAN_AMX"

# output kinds of lean_linear (enum in lean_cpu.c)
OUT_BF16, OUT_BF16_RESIDUAL, OUT_F32, OUT_BF16_BIAS = 0, 1, 2, 3
HEAD_MAX_BLOCKS = 8  # residual blocks a head may have in lean_heads_level


class LeanLayer(ctypes.Structure):
    """Addresses of one layer's weights, as ``LeanLayer`` in lean_cpu.c: bf16 (packed), and GGUF Q4_1 blocks for the
    linear layers that have them (``*_q4``; unset: the bf16 weight)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("ln1", "qkv", "o", "ln2", "gate_up", "down",
                                                     "qkv_q4", "o_q4", "gate_up_q4", "down_q4")]


class LeanModel(ctypes.Structure):
    """The constant part of a ``lean_decode`` call (weights, shapes, one cache, its buffers), as ``LeanModel`` in
    lean_cpu.c."""

    _fields_ = [("layers", ctypes.POINTER(LeanLayer)),
                *[(name, ctypes.c_int) for name in ("num_layers", "hsz", "nh", "nkv", "d", "inter", "vocab")],
                ("eps", ctypes.c_float),
                *[(name, ctypes.c_void_p) for name in ("norm_w", "embed", "lm_head", "cos_t", "sin_t")],
                *[(name, ctypes.c_int) for name in ("rope_len", "cap", "nthreads", "amx")],
                *[(name, ctypes.c_void_p) for name in ("kcache", "vcache", "work", "xv", "scratch")],
                *[(name, ctypes.c_void_p) for name in ("screen_q", "screen_scale", "screen_err", "screen_csum", "screen_maxw",
                                                       "lm_head_q8")]]


class LeanSeq(ctypes.Structure):
    """One sequence of a batched step (``lean_decode_rows``): its rows, first slot, cache and tree mask, as ``LeanSeq``
    in lean_cpu.c."""

    _fields_ = [("n", ctypes.c_int), ("start", ctypes.c_int), ("cap", ctypes.c_int), ("kcache", ctypes.c_void_p),
                ("vcache", ctypes.c_void_p), ("tree", ctypes.c_void_p)]


class LeanHead(ctypes.Structure):
    """Addresses of one root-conditioned head's weights, as ``LeanHead`` in lean_cpu.c."""

    _fields_ = [("root_w", ctypes.c_void_p), ("parent_w", ctypes.c_void_p),
                ("w", ctypes.c_void_p * HEAD_MAX_BLOCKS), ("b", ctypes.c_void_p * HEAD_MAX_BLOCKS),
                ("root_table", ctypes.c_void_p), ("parent_table", ctypes.c_void_p)]


class LeanProj(ctypes.Structure):
    """The heads' projection, as ``LeanProj`` in lean_cpu.c: bf16 weights (``scale`` NULL) or int8 ones with per-row
    scales and sums."""

    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("sum", ctypes.c_void_p)]


class LeanLevel(ctypes.Structure):
    """One tree level for ``lean_heads_tree``: its parents and children (node ids), as ``LeanLevel`` in lean_cpu.c."""

    _fields_ = [("parents", ctypes.c_int), ("parent_nodes", ctypes.c_void_p), ("children", ctypes.c_int),
                ("child_nodes", ctypes.c_void_p), ("child_parent", ctypes.c_void_p), ("child_rank", ctypes.c_void_p)]


class LeanTreeCall(ctypes.Structure):
    """What stays the same between a decoder's ``lean_heads_tree`` calls, as ``LeanTreeCall`` in lean_cpu.c."""

    _fields_ = [("heads", ctypes.POINTER(LeanHead)), ("levels", ctypes.POINTER(LeanLevel)),
                *[(name, ctypes.c_int) for name in ("depth", "blocks", "hsz", "vocab")],
                ("proj", ctypes.POINTER(LeanProj)), ("embed", ctypes.c_void_p), ("embed_rows", ctypes.c_int64),
                *[(name, ctypes.c_void_p) for name in ("draft_ids", "draft_row", "rows")], ("k", ctypes.c_int),
                ("chain", ctypes.c_void_p), ("work", ctypes.c_void_p), ("amx", ctypes.c_int), ("nthreads", ctypes.c_int)]


_state: dict[str, object] = {}


def cpuinfo_line(field: str) -> str | None:
    """The first line of Linux's /proc/cpuinfo that starts with ``field`` (e.g. ``flags``, ``model name``),
    None where there is no such file or line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    return cpuinfo_line("flags") or platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def tuning_flags() -> tuple[str, ...]:
    """Defines that pick a measured variant for this CPU: on AMD family 25 (Zen 4, the only AVX-512 CPUs of that
    family) a linear layer takes 2 rows in two passes over its weights and 3-4 rows in passes of 2 (SPLIT_PASSES,
    see linear_rows_pf in lean_cpu.c), a one-row call leaves the weights to the hardware prefetcher
    (ROWS4_PREFETCH_FROM=2) and the others prefetch 16 KB ahead into L2; elsewhere up to 4 rows share one pass and
    every call prefetches 8 KB ahead into L1 (measured on Zen 5; see ROWS4_PREFETCH)."""
    vendor, family = cpuinfo_line("vendor_id") or "", cpuinfo_line("cpu family") or ""
    zen4 = "AuthenticAMD" in vendor and family.split(":")[-1].strip() == "25"
    return ("-DSPLIT_PASSES=1", "-DROWS4_PREFETCH_FROM=2", "-DROWS4_PREFETCH=16384",
            "-DROWS4_HINT=_MM_HINT_T1") if zen4 else ()


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + tuning_flags()), version,
                                    _cpu_flags()]).encode())
    return cache_root() / "kernels" / f"lean_cpu-{key.hexdigest()[:16]}.so"


def _build(cc: str, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    with atomic_file(target, suffix=".so") as tmp:
        done = subprocess.run([cc, *FLAGS, *tuning_flags(), *extra_flags, "-o", str(tmp), str(SOURCE), "-lm"],
                              capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, f, z = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
    lib.lean_has_avx512bf16.restype = i
    lib.lean_int8_dot_path.restype = i
    lib.lean_amx_available.restype = i
    lib.lean_linear.argtypes = [p, p, i, i, i, p, p, i, i]
    lib.lean_linear.restype = None
    lib.lean_linear_amx.argtypes = [p, p, i, i, i, p, p, i, p, i]
    lib.lean_linear_amx.restype = i
    lib.lean_pack_rows4.argtypes = [p, i, i, p]
    lib.lean_pack_rows4.restype = None
    lib.lean_rows4_packed_size.argtypes = [i, i]
    lib.lean_rows4_packed_size.restype = z
    lib.lean_pack_amx.argtypes = [p, i, i, p]
    lib.lean_pack_amx.restype = None
    lib.lean_amx_packed_size.argtypes = [i, i]
    lib.lean_amx_packed_size.restype = z
    lib.lean_amx_scratch_size.argtypes = [i, i]
    lib.lean_amx_scratch_size.restype = z
    lib.lean_forward.argtypes = [ctypes.POINTER(LeanLayer), i, i, i, i, i, i, f, p, p, i, p, i, p, p, i, p, p, p,
                                 p, p, p, i, i, p]
    lib.lean_forward.restype = i
    lib.lean_decode.argtypes = [ctypes.POINTER(LeanModel), p, i, p, i, p, p, p, p, i]
    lib.lean_decode.restype = i
    lib.lean_decode_rows.argtypes = [ctypes.POINTER(LeanModel), p, i, p, ctypes.POINTER(LeanSeq), i, p, p, p, i]
    lib.lean_decode_rows.restype = i
    lib.lean_decode_work_size.argtypes = [i, i, i, i, i, i, i]
    lib.lean_decode_work_size.restype = z
    lib.lean_forward_work_size.argtypes = [i, i, i, i, i, i, i]
    lib.lean_forward_work_size.restype = z
    lib.lean_scratch_size.argtypes = [i, i, i, i, i]
    lib.lean_scratch_size.restype = z
    lib.lean_pack_i8.argtypes = [p, i, i, p]
    lib.lean_pack_i8.restype = None
    lib.lean_i8_packed_size.argtypes = [i, i]
    lib.lean_i8_packed_size.restype = z
    lib.lean_linear_i8.argtypes = [p, p, p, p, i, i, i, p, p, p, i]
    lib.lean_linear_i8.restype = None
    lib.lean_heads_level.argtypes = [ctypes.POINTER(LeanHead), i, i, i, ctypes.POINTER(LeanProj), p, p, p, i, i, p, p,
                                     p, i, i]
    lib.lean_heads_level.restype = i
    lib.lean_heads_work_size.argtypes = [i, i, i]
    lib.lean_heads_work_size.restype = z
    lib.lean_heads_tree.argtypes = [p, p, ctypes.c_int64, f, p]  # the LeanTreeCall's address, hidden, root, gate, nodes
    lib.lean_heads_tree.restype = i
    lib.lean_topk_rows.argtypes = [p, i, i, i, p, p]
    lib.lean_topk_rows.restype = i
    lib.lean_heads_tree_work_size.argtypes = [i, i, i, i]
    lib.lean_heads_tree_work_size.restype = z
    # the LeanTreeCall's address, requests, hidden [R, H], roots [R], gate, nodes [R, N], chains, done, work, rows
    lib.lean_heads_trees.argtypes = [p, i, p, p, f, p, p, p, p, p]
    lib.lean_heads_trees.restype = i
    lib.lean_heads_trees_work_size.argtypes = [i, i, i, i, i]
    lib.lean_heads_trees_work_size.restype = z
    lib.lean_argmax_rows.argtypes = [p, i, i, i, p]
    lib.lean_argmax_rows.restype = None
    lib.lean_linear_q4_1.argtypes = [p, p, i, i, i, p, p, i, p, i]
    lib.lean_linear_q4_1.restype = None
    lib.lean_linear_q8_0.argtypes = [p, p, i, i, i, p, p, i]
    lib.lean_linear_q8_0.restype = None
    lib.lean_q8_scratch_bytes.argtypes = [i, i]
    lib.lean_q4_1_packed_bytes.argtypes = lib.lean_q8_0_packed_bytes.argtypes = [i, i]
    lib.lean_q4_1_packed_bytes.restype = lib.lean_q8_0_packed_bytes.restype = z
    lib.lean_pack_q4_1.argtypes = lib.lean_pack_q8_0.argtypes = [p, i, i, p]
    lib.lean_pack_q4_1.restype = lib.lean_pack_q8_0.restype = None
    lib.lean_q8_scratch_bytes.restype = z
    lib.lean_compact.argtypes = [p, p, i, i, i, i, p, i]
    lib.lean_compact.restype = None
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None; the outcome is remembered per process."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib, why = None, None
    if os.environ.get(ENV_SWITCH, "1") == "0":
        why = f"disabled by {ENV_SWITCH}=0"
    elif platform.machine().lower() not in ("x86_64", "amd64"):
        why = f"not an x86-64 CPU ({platform.machine()})"
    elif (cc := _compiler()) is None:
        why = "no C compiler (cc/gcc) on PATH"
    else:
        try:
            path = _library_path(cc)
            if not path.exists():
                _build(cc, path)
            lib = _declare(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            why = f"build failed: {err}"
    _state["lib"], _state["why"] = lib, why
    return lib


def unavailable_reason() -> str | None:
    load()
    return _state["why"]  # type: ignore[return-value]


def amx_path() -> bool:
    """True when the library runs its linear layers on AMX tiles here (CPU, kernel permission, not switched off)."""
    lib = load()
    return bool(lib is not None and os.environ.get(AMX_SWITCH, "1") != "0" and lib.lean_amx_available())


INT8_DOT_PATHS = ("the portable loop", "AVX2 (maddubs)", "AVX512-VNNI (vpdpbusd)")


def int8_dot_path() -> str | None:
    """How this build's Q4_1 / Q8_0 block products sum their bytes (the same results on every path), None without
    the library."""
    lib = load()
    return None if lib is None else INT8_DOT_PATHS[lib.lean_int8_dot_path()]


def fast_path() -> bool:
    """True when the library is loaded and uses the CPU's AVX-512 BF16 dot instructions (without
    them it still runs, exactly as specified, but slower than oneDNN)."""
    lib = load()
    return bool(lib is not None and lib.lean_has_avx512bf16())
