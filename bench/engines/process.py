"""What every server process a bench run starts shares: waiting for its /health, and stopping it."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from bench.engines import EngineError

try:  # Linux: prctl(PR_SET_PDEATHSIG), looked up once here (a preexec_fn should only make the call)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (AttributeError, OSError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _dies_with_parent() -> None:
    """``subprocess.Popen``'s ``preexec_fn``: SIGTERM to the child when its parent dies. Does nothing off Linux."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_server(args: list[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen)`` for a process the bench starts and stops (an engine, a server, a
    worker): it gets SIGTERM when the bench dies, even by SIGKILL (the out-of-memory killer), so none is left
    holding memory and a port. The signal follows the starting thread: servers are started from the main thread."""
    return subprocess.Popen(args, preexec_fn=_dies_with_parent, **popen)


def wait_healthy(url: str, proc: subprocess.Popen, t0: float, timeout_s: float,
                 exited: Callable[[int], str] | None = None) -> None:
    """Until ``url``/health answers 200; EngineError, one line, when the process exits first (``exited`` gives the
    line from its exit status) or the time runs out."""
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise EngineError(exited(proc.returncode) if exited else
                              f"the server at {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise EngineError(f"the server at {url} did not become ready within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` seconds without an exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
