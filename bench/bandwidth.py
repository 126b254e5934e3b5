"""The memory-bandwidth floor of one decode step: weight bytes / measured copy bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from medusa_runtime.bandwidth import copy_bandwidth, weight_bytes
from medusa_runtime.model import LoadedModel


@dataclass(frozen=True)
class BandwidthFloor:
    weight_bytes: int  # bytes of parameters read per step
    bandwidth_gbs: float  # measured copy bandwidth, GB/s, bytes read + bytes written
    floor_ms: float  # weight_bytes / bandwidth


def bandwidth_floor(loaded: LoadedModel) -> BandwidthFloor:
    """The floor from one bandwidth measurement now (the latency profile pairs each round with its own)."""
    total, bw = weight_bytes(loaded), copy_bandwidth(device=str(loaded.device))
    return BandwidthFloor(total, bw, total / (bw * 1e9) * 1000)
