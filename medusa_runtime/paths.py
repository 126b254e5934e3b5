"""Where the project keeps what it builds and downloads (model weights, compiled kernels, datasets, caches)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$MEDUSA_BENCH_CACHE`` or ``~/.cache/medusa-bench``."""
    env = os.environ.get("MEDUSA_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "medusa-bench"
