"""The memory-bandwidth floor of one decode step: weight bytes / measured copy bandwidth."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from medusa_runtime.model import LoadedModel, device_sync


@dataclass(frozen=True)
class BandwidthFloor:
    weight_bytes: int  # bytes of parameters read per step
    bandwidth_gbs: float  # measured copy bandwidth, GB/s, bytes read + bytes written
    floor_ms: float  # weight_bytes / bandwidth


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 7, device: str = "cpu") -> float:
    """Median GB/s of copying a large buffer, counting bytes read plus bytes written (the streaming
    rate the memory system sustains; a step must at least stream every weight byte once at it)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        device_sync(src.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        device_sync(src.device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def bandwidth_floor(loaded: LoadedModel) -> BandwidthFloor:
    seen, total = set(), 0
    for p in loaded.model.parameters():  # tied embeddings are read once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    bw = copy_bandwidth(device=str(loaded.device))
    return BandwidthFloor(total, bw, total / (bw * 1e9) * 1000)
