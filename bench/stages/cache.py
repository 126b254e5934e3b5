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

# bump when the runtime's speed changes, so that cached latency profiles and replays are measured again (stage
# keys hash the stages' inputs, not the code); docs/changelog.md says what each revision changed
RUNTIME_REVISION = 39


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

    def fresh(self, name: str, inputs: dict, outputs: list[Path]) -> bool:
        """Whether the stage's outputs exist under the same key (then it is skipped, and says so)."""
        key = self.key_of(inputs)
        if self.keys.get(name) == key and all(p.exists() for p in outputs):
            print(f"[bench] {name}: cached ({key})", flush=True)
            return True
        return False

    def record(self, name: str, inputs: dict) -> None:
        """The stage ran to the end under these inputs."""
        self.keys[name] = self.key_of(inputs)
        write_json_atomic(self.file, self.keys)

    def run(self, name: str, inputs: dict, outputs: list[Path], fn: Callable[[], None]) -> bool:
        if self.fresh(name, inputs, outputs):
            return False
        print(f"[bench] {name}: running ...", flush=True)
        t0 = time.perf_counter()
        fn()
        self.record(name, inputs)
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
