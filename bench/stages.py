"""What the bench's stages share with the commands that run them: the runtime revision that keys measured
stages, file and folder hashes, the stage cache (``stages.json``: a stage is skipped when its outputs exist and
the hash of its inputs matches) and the isolation of a replay's records by their inputs. The pipeline and the
command line both import it; neither imports the other for these."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from treesearch.tree import write_json_atomic

# bump when the runtime's speed changes, so that cached latency profiles and replays are measured again
# (stage keys hash the stages' inputs, not the code). 2: the lean engine. 3: heads' draft vocabulary,
# prepacked head projection. 4: latency profile timed in rounds across tree sizes, plain step from the same rounds.
# 5: the lean engine's C forward for bf16 decode steps. 6: workload calibration, profile by context and shape.
# 7: the C forward on AMX tiles. 8: heads level by level in the C library. 9: profile: monotone verify rows,
# prefill as paid inside decode runs. 10: calibration rollouts by the runtime's own decoding, ratios within rounds.
# 11: greedy acceptance on NumPy argmax (bookkeeping per step cut by half and more). 12: the C forward's AVX-512
# path on weights packed in blocks of 4 rows (a plain step ~30 % faster). 13: sampled steps draw by inverting the
# CDF (1 ms a step less); the profile times what typical acceptance adds to a step. 14: that addition timed inside
# real decode loops.
# 15: (reverted) verify probes. 16: the profile's pieces timed in rounds of all of them; the replay profiles
# again in rounds between questions. 17: verify rows kept as measured (5 rows verify faster than 4 here).
# 18: the gate on float32 scalars (a gated step 20 us cheaper); verify sizes priced by ratios of means over rounds.
# 19: the replay's runtime configurations and the profile's decode loops stepped in turn (lockstep).
# 20: software prefetch of the weights from 3 rows (was 5); a replay's profile rounds set aside with its records.
# 21: the C forward's calls of 3 or 4 rows in passes of 2 (a 3- or 4-node verify ~6 % cheaper).
# 22: 2-row calls in passes of 1 with the prefetch; the heads' whole tree in one C call; greedy argmax in C.
# 23: the heads' root and parent terms from tables over the draft vocabulary, the shipped heads' draft projection
# in int8, the heads' rows on the AVX-512 path also on AMX CPUs (a chain:4 tree after a forward 1.25 -> 0.66 ms).
# 24: attention on the AVX-512 path scores 16 keys at a time and takes a head for a pair of rows per task (4 rows
# at context 256: attention 0.97 -> 0.62, then 0.66 -> 0.52 ms, each against the build before); 2-row calls in
# one pass except on Zen 4; whole blocks of outputs stored as vectors; the profile's floor pairs.
# 25: decode steps as one C call (embedding, forward, logits, argmax: lean_decode), the heads' tree tokens written
# into the loop's own buffer (plain / chain:1 / a 4-node tree 4-5 / 2-3 / 1-4 % faster a step, alternated in one
# process); the floor counts the KV cache's bytes too.
# 26: attention's weighted sum in bf16 dot products of key pairs (weights rounded to bf16), keys and values
# prefetched (the 30 layers' attention at context 256: one row 0.44 -> 0.41 -> 0.33 ms, 4 rows 0.86 -> 0.84 ms).
# 27: up to 4 rows in one pass over each weight block except on Zen 4 (4 rows / one row at context 256: 1.107 ->
# 1.085 and 1.112 -> 1.051, 3 rows 1.093 -> 1.053, builds alternated in one process).
# 28: an attention task takes a row and up to 3 heads of one kv head (they share each key's and value's loads) when
# a call has rows enough (the 30 layers' attention at context 256, 2 / 3 / 4 rows 0.285 / 0.408 / 0.460 ->
# 0.250 / 0.297 / 0.348 ms, one row 0.234 / 0.235; same bits).
# 29: one-row calls prefetch the weights too, except on Zen 4 (one-row forwards on Zen 5 1-7 % faster).
# 30: a one-row step's attention shares a kv head's loads too (3 tasks on 2 threads; 0.27 -> 0.22 ms at 256).
# 31: the weights' software prefetch 8 KB ahead into L1 instead of 16 KB into L2, except on Zen 4 (whole forwards
# at context 256 on Zen 5, builds alternated: 4 rows 1-8 % faster, one row 0-9 % faster).
# 32: the packed weights (forward and heads) in one buffer advised for 2 MiB pages; the floor's copy probe in the
# same memory (whole forwards 1-4 % faster, alternated in one process; copies 38 -> 52 GB/s).
# 33: the heads' tree call passes five values to a struct built once (its Python side ran 0.05-0.10 ms on the cold
# caches after a verify forward, 0.02-0.04 now); the heads' SiLU, top-k and row quantisation 16 values at a time.
# 34: the profile runs plain decoding and 2- and 4-node trees in decode loops at every context, not only the middle
# one, and prices each context's verify row from its own loops (the runtime unchanged; its profiles measured anew).
# 35: greedy decode steps take their argmax through an int8 screen of the logits projection (its bytes 57 -> 29 MB
# a step; decode loops of plain decoding and chains 1-4 alternated: every step 7-9 % shorter, the same tokens).
# 36: the screen for calls of up to 5 rows (was 8: from 6 rows on it cost more than the full projection).
# 37: the profile's tight ratios as the interquartile mean of the rounds' ratios (revision 36's bench profile, 9
# rounds of ratios of means, priced 5 nodes at context 464 at 0.61 of one row, and its search picked 9-10 nodes).
# 38: the C forward's softmax sums as 16 lanes of seen positions instead of two scalar sums per pair of slots
# (the hot attention 4-6 % faster at context 464; other low bits in every bf16 C-forward output).
RUNTIME_REVISION = 38


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"


def folder_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


class StageCache:
    def __init__(self, out: Path):
        self.file = out / "stages.json"
        self.keys: dict[str, str] = json.loads(self.file.read_text()) if self.file.is_file() else {}

    @staticmethod
    def key_of(inputs: dict) -> str:
        return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def run(self, name: str, inputs: dict, outputs: list[Path], fn: Callable[[], None]) -> bool:
        key = self.key_of(inputs)
        if self.keys.get(name) == key and all(p.exists() for p in outputs):
            print(f"[bench] {name}: cached ({key})", flush=True)
            return False
        print(f"[bench] {name}: running ...", flush=True)
        t0 = time.perf_counter()
        fn()
        self.keys[name] = key
        write_json_atomic(self.file, self.keys)
        print(f"[bench] {name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        return True


def isolate_records(folder: Path, key: str) -> None:
    """Records resume only within one set of replay inputs (``replay`` and ``speed`` call this): records made
    under other inputs (another runtime revision, tree or heads) are moved aside to ``records.<their key>.jsonl``,
    never mixed in, and so are the latency profile's rounds taken during them (``profile_rounds.<key>.jsonl``):
    a new replay prices its predictions with rounds of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "inputs.key"
    old = marker.read_text().strip() if marker.is_file() else "unknown"
    if old != key:
        for name in ("records", "profile_rounds"):
            if (folder / f"{name}.jsonl").is_file():
                (folder / f"{name}.jsonl").rename(folder / f"{name}.{old}.jsonl")
    marker.write_text(key + "\n")
