"""The memory-bandwidth floor of a decode step: every byte it must read, streamed once at the measured copy
bandwidth. Those bytes are the weights (each tensor once; a greedy step of the C forward reads the int8 screen
of the logits projection instead of the projection) and the KV cache up to the step's context (every layer's
keys and values of every earlier position); the weights alone are the floor a step could reach with no
context, reported beside it.

The copy bandwidth of a shared VM moves by half between seconds, so the floor is only comparable with a step
timed at the same moment: a floor pair is a plain generate alone between two copy probes (``floor_pair``), and
the ratio of its step to its own floor, taken over many pairs, is the figure (``floor_summary``; the latency
profile takes one pair per round, ``medusa-bench speed`` a dozen after its replay, ``floor_pairs``).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.kernels import hugepages, q4_1
from medusa_runtime.model import LoadedModel, device_sync


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings are read once per step)."""
    seen, total = set(), 0
    for p in loaded.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def step_weight_bytes(loaded: LoadedModel, engine=None) -> int:
    """The weights' bytes a greedy decode step on ``engine`` streams: ``weight_bytes``, less the logits
    projection's and plus its int8 screen's where the engine takes a greedy step's argmax through one
    (``LeanEngine.logit_screen``: about half the projection's bytes); with Q4_1 weights (``LeanEngine.q4_1``),
    the layers' blocks and the projection's Q8_0 blocks in place of their dense weights."""
    head = loaded.model.get_output_embeddings().weight
    if getattr(engine, "q4_1", False):  # the layers' Q4_1 blocks and the logits projection's Q8_0 instead
        dense = sum(p.numel() * p.element_size() for name, p in loaded.model.model.layers.named_parameters()
                    if name.endswith("proj.weight"))
        return (weight_bytes(loaded) - dense - head.numel() * head.element_size() + q4_1.nbytes(engine._packed)
                + engine._logits_kernel.blocks.numel())
    screen = getattr(engine, "logit_screen", None)
    if screen is None:
        return weight_bytes(loaded)
    return weight_bytes(loaded) - head.numel() * head.element_size() + screen.nbytes


def kv_bytes_per_position(loaded: LoadedModel) -> int:
    """Bytes of keys and values one cached position holds over all layers (what a decode step reads per position
    of its context)."""
    cfg = loaded.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=loaded.dtype).element_size()


def generate_kv_bytes(loaded: LoadedModel, prompt_tokens: int, new_tokens: int) -> int:
    """The KV-cache bytes a decode step of a generate reads on average: its mean context, the prompt plus half of
    the steps after it (prompt + 1, ..., prompt + new_tokens - 1 positions)."""
    return round(kv_bytes_per_position(loaded) * (prompt_tokens + new_tokens / 2))


class FloorProbe:
    """Copies of one large buffer, kept between calls: ``gbs()`` is the copy bandwidth now (GB/s, bytes read plus
    bytes written, the median of ``repeats`` copies), the streaming rate the memory system sustains. On the CPU
    both buffers are in the memory the C forward packs its weights into (2 MiB pages where the system gives them,
    kernels.hugepages): copies on 4 KiB pages ran at 38 GB/s where the same copies on 2 MiB pages ran at 52, so
    a floor from those would have let a step on huge pages look faster than its memory."""

    def __init__(self, nbytes: int = 256 << 20, device: str | torch.device = "cpu"):
        if torch.device(device).type == "cpu":
            self.src, self.dst = hugepages.huge_buffer(nbytes).fill_(1), hugepages.huge_buffer(nbytes)
        else:
            self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
            self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # first touch outside the timing

    def gbs(self, repeats: int = 1) -> float:
        times = []
        for _ in range(repeats):
            device_sync(self.src.device)
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            device_sync(self.src.device)
            times.append(time.perf_counter() - t0)
        return 2 * self.src.numel() / statistics.median(times) / 1e9


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics X_(r) <= X_(n+1-r) (1-based) with
    P(X_(r) < median < X_(n+1-r)) = P(r <= B <= n - r) >= level for B ~ Binomial(n, 1/2), the narrowest
    such symmetric pair; the whole range when n is too small for the level."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    pmf = [math.comb(n, i) / 2 ** n for i in range(n + 1)]
    for r in range((n + 1) // 2, 0, -1):  # widen symmetrically from the middle until the coverage is reached
        if sum(pmf[r:n - r + 1]) >= level:
            return xs[r - 1], xs[n - r]
    return xs[0], xs[-1]


def floor_pair(probe: FloorProbe, decoder, prompt: torch.Tensor) -> tuple[float, float, float]:
    """One floor pair: a plain generate alone (``decoder``: no heads) between two copy probes a fraction of a
    second apart -> (its ms per decode step, GB/s before, GB/s after)."""
    before = probe.gbs()
    step_ms = decoder.generate(prompt).stats.step_ms
    return step_ms, before, probe.gbs()


def pairs_summary(weights: int, pairs: list, kv: int = 0) -> dict[str, object]:
    """``floor_summary`` of floor pairs, each pair's bandwidth the harmonic mean of its two probes (the mean of
    the two floors)."""
    return floor_summary(weights, [p[0] for p in pairs], [2 / (1 / p[1] + 1 / p[2]) for p in pairs], kv)


def floor_pairs(loaded: LoadedModel, rounds: int = 12, prompt_tokens: int = 128, new_tokens: int = 24) -> dict:
    """``rounds`` floor pairs on a random prompt, summarised by ``floor_summary`` (one warm-up generate first)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.vocab_size, (prompt_tokens,), generator=gen).to(loaded.device)
    decoder = MedusaDecoder(loaded, None, None, config=DecodeConfig(max_new_tokens=new_tokens, stop_on_eos=False))
    probe = FloorProbe(device=loaded.device)
    decoder.generate(prompt)
    pairs = [floor_pair(probe, decoder, prompt) for _ in range(rounds)]
    kv = generate_kv_bytes(loaded, prompt_tokens, new_tokens)
    return {**pairs_summary(step_weight_bytes(loaded, decoder.engine), pairs, kv), "context": prompt_tokens}


def floor_summary(weights: int, plain_ms: list[float], bandwidth_gbs: list[float], kv: int = 0) -> dict[str, object]:
    """Each round's plain step over that round's floor ((weights + kv bytes) / bandwidth), then the median of the
    ratios with its 95 % interval, and the same against the weights alone; rounds without a probe are left out."""
    pairs = [(p, b) for p, b in zip(plain_ms, bandwidth_gbs) if b and b > 0 and p > 0]
    if not pairs:
        return {}

    def ratios(nbytes: int) -> list[float]:
        return [p / (nbytes / (b * 1e9) * 1000) for p, b in pairs]

    full, weights_only = ratios(weights + kv), ratios(weights)
    return {"weight_bytes": weights, "kv_bytes": kv, "rounds": len(pairs),
            "bandwidth_gbs": statistics.median(b for _, b in pairs),
            "floor_ms": statistics.median((weights + kv) / (b * 1e9) * 1000 for _, b in pairs),
            "plain_ms": statistics.median(p for p, _ in pairs), "plain_over_floor": statistics.median(full),
            "plain_over_floor_95": list(median_interval(full)),
            "plain_over_weights_floor": statistics.median(weights_only),
            "plain_over_weights_floor_95": list(median_interval(weights_only))}


def floor_line(floor: dict) -> str:
    """One line for a ``floor_summary``: the plain step over its floor, and over the weights' alone."""
    lo, hi = floor["plain_over_floor_95"]
    wlo, whi = floor.get("plain_over_weights_floor_95", (math.nan, math.nan))
    return (f"plain step {floor['plain_ms']:.2f} ms = {floor['plain_over_floor']:.3f}x its bandwidth floor (95 % "
            f"{lo:.3f}-{hi:.3f}; {floor['weight_bytes'] / 1e6:.0f} MB of weights + {floor.get('kv_bytes', 0) / 1e6:.1f} "
            f"MB of KV cache in {floor['floor_ms']:.2f} ms at the median {floor['bandwidth_gbs']:.1f} GB/s of "
            f"{floor['rounds']} floor pairs), {floor.get('plain_over_weights_floor', math.nan):.3f}x the weights' "
            f"alone (95 % {wlo:.3f}-{whi:.3f})")
