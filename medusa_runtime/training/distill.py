"""Self-distillation data: the base model's own replies to training prompts, kept on disk in shards.

Each example is one assistant turn: the chat-formatted context and the model's greedy reply.
Prompts with a follow-up give a second example whose context holds the model's first reply.

The replies live in an answer store: a folder of JSONL shards and a ``manifest.json``. The store is
named by what determines a reply (model, weights, dtype, reply length), and each line holds the user
turns it answers, so any prompt set reuses the replies already made for its prompts. Each shard is
written whole and atomically, then entered in the manifest with where and how fast it was made; a
stopped run keeps every finished shard and a rerun generates only what is missing. A store made on
another machine (a GPU) is read the same way when its settings match the model loaded here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medusa_runtime.decoding.batched import batched_greedy, batched_support
from medusa_runtime.kernels import cpuinfo_line
from medusa_runtime.measure.calibrate import greedy_rollouts
from medusa_runtime.model import LoadedModel, cache_root, chat_template_ids, weights_fingerprint
from medusa_runtime.prompts import Prompt
from treesearch.fsutil import atomic_file
from treesearch.tree import write_json_atomic

STORE_SCHEMA = "medusa-distill/1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = 192  # reply length cap per turn
    batch_size: int = 32  # prompts generated together
    follow_ups: bool = True  # also generate second turns
    shard_size: int = 256  # replies per shard file: a stopped run loses at most the shard in progress

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.shard_size < 1:
            raise ValueError("max_new_tokens, batch_size and shard_size must be >= 1")


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]  # context + reply
    reply_start: int  # first reply token; the loss only sees reply tokens
    prompt_index: int
    turn: int


Conversation = tuple[str, ...]  # the user turns up to and including the one answered
Reply = tuple[tuple[int, ...], int]  # context + reply token ids, index of the first reply token


def store_settings(loaded: LoadedModel, cfg: DistillConfig) -> dict:
    """What determines a reply: the store's identity (a store with other settings is another store)."""
    weights = hashlib.sha256(json.dumps(weights_fingerprint(loaded)).encode()).hexdigest()[:16]
    return {"model": loaded.name, "dtype": str(loaded.dtype), "weights": weights, "max_new_tokens": cfg.max_new_tokens}


def default_store(loaded: LoadedModel, cfg: DistillConfig) -> Path:
    key = hashlib.sha256(json.dumps({**store_settings(loaded, cfg), "format": 3}).encode()).hexdigest()[:16]
    return cache_root() / "distill" / key


def legacy_cache_file(loaded: LoadedModel, cfg: DistillConfig) -> Path:
    """The single JSONL file earlier releases appended replies to (read, never written)."""
    old = {"max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size, "follow_ups": cfg.follow_ups}
    key = hashlib.sha256(json.dumps({"model": loaded.name, "dtype": str(loaded.dtype), "cfg": old,
                                     "weights": weights_fingerprint(loaded), "format": 2}).encode()).hexdigest()[:16]
    return cache_root() / "distill" / f"{key}.jsonl"


def device_label(device: torch.device) -> str:
    """Where a shard was made, for its manifest entry: the GPU's name, or the CPU's model and cores."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    line = cpuinfo_line("model name")
    name = line.split(":", 1)[1].strip() if line and ":" in line else "cpu"
    return f"cpu ({name}, {os.cpu_count()} cores)"


def _read_lines(path: Path) -> dict[Conversation, Reply]:
    """Replies of one JSONL file; a line cut by a crash (legacy append-only files) is skipped."""
    done: dict[Conversation, Reply] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
            done[tuple(r["turns"])] = (tuple(r["input_ids"]), int(r["reply_start"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


class AnswerStore:
    """A folder of reply shards (``shard-00000.jsonl``...) and ``manifest.json`` (schema ``medusa-distill/1``:
    the settings, and per shard its replies, reply tokens, seconds, batch size, device and generator)."""

    def __init__(self, root: str | Path, settings: dict, legacy: Path | None = None):
        self.root = Path(root)
        self.settings = settings
        manifest = self._read_manifest()
        if manifest is not None and manifest.get("settings") != settings:
            theirs = {k: v for k, v in manifest.get("settings", {}).items() if k != "weights"}
            ours = {k: v for k, v in settings.items() if k != "weights"}
            same_weights = manifest.get("settings", {}).get("weights") == settings["weights"]
            raise ValueError(f"answer store {self.root} holds replies made with {theirs}"
                             f"{'' if same_weights else ' on other weights'}, not {ours}")
        self.shards: list[dict] = list(manifest["shards"]) if manifest else []
        self.replies: dict[Conversation, Reply] = {}
        if legacy is not None and legacy.is_file():
            self.replies.update(_read_lines(legacy))
        listed = {s["file"] for s in self.shards}
        for shard in self.shards:
            self.replies.update(_read_lines(self.root / shard["file"]))
        for path in sorted(self.root.glob("shard-*.jsonl")):  # written, but the manifest entry was lost
            if path.name not in listed:
                found = _read_lines(path)
                self.replies.update(found)
                self.shards.append({"file": path.name, "replies": len(found), "adopted": True})

    def _read_manifest(self) -> dict | None:
        path = self.root / MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{path} is not valid JSON (a manifest of answer shards)") from None
        if manifest.get("schema") != STORE_SCHEMA:
            raise ValueError(f"{path} is not an answer-store manifest (schema {manifest.get('schema')!r})")
        return manifest

    def add_shard(self, rows: Sequence[tuple[Conversation, Reply]], seconds: float, batch_size: int,
                  device: str, generator: str | None = None) -> dict:
        """Write ``rows`` as the next shard (atomically), then enter it in the manifest (atomically)."""
        taken = [int(p.stem.split("-")[1]) for p in self.root.glob("shard-*.jsonl")]
        name = f"shard-{max(taken, default=-1) + 1:05d}.jsonl"
        with atomic_file(self.root / name) as tmp:
            tmp.write_text("".join(json.dumps({"turns": list(conv), "reply_start": start, "input_ids": list(ids)})
                                   + "\n" for conv, (ids, start) in rows))
        tokens = sum(len(ids) - start for _, (ids, start) in rows)
        entry = {"file": name, "replies": len(rows), "reply_tokens": tokens, "seconds": round(seconds, 3),
                 "batch_size": batch_size, "device": device, **({"generator": generator} if generator else {})}
        self.shards.append(entry)
        self.replies.update(rows)
        write_json_atomic(self.root / MANIFEST, self.manifest())
        return entry

    def manifest(self) -> dict:
        return {"schema": STORE_SCHEMA, "settings": self.settings, "shards": self.shards,
                "replies": len(self.replies), "reply_tokens": self.reply_tokens()}

    def reply_tokens(self) -> int:
        return sum(len(ids) - start for ids, start in self.replies.values())

    def summary(self) -> dict:
        """Totals and where the shards were made (device -> replies), for a training record."""
        made = Counter()
        for s in self.shards:
            made[s.get("device", "unknown")] += s.get("replies", 0)
        return {"store": str(self.root), "replies": len(self.replies), "reply_tokens": self.reply_tokens(),
                "shards": len(self.shards), "made_on": dict(made)}


def read_replies(path: str | Path) -> dict[Conversation, Reply]:
    """The replies of an answer store folder, or of one JSONL file of replies (one shard, a legacy cache)."""
    path = Path(path)
    if path.is_dir():
        if not (path / MANIFEST).is_file() and not list(path.glob("shard-*.jsonl")):
            raise FileNotFoundError(f"{path} is not an answer store (no {MANIFEST}, no shard-*.jsonl)")
        manifest = json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else {}
        return AnswerStore(path, manifest.get("settings", {})).replies
    if not path.is_file():
        raise FileNotFoundError(f"no such replies file or answer store: {path}")
    return _read_lines(path)


def reply_token_counts(path: str | Path, max_len: int = 768, limit: int | None = None) -> tuple[Counter, int]:
    """(token id -> count over the replies, replies read) of an answer store or a replies JSONL (its first
    ``limit`` replies where given), reply tokens cut at ``max_len`` positions as training cuts them."""
    replies = list(read_replies(path).values())[:limit]
    if not replies:
        raise ValueError(f"{path} holds no replies (expected JSONL lines with 'turns', 'input_ids', 'reply_start')")
    counts = Counter(t for ids, start in replies for t in ids[start:max_len])
    return counts, len(replies)


def generate_replies(loaded: LoadedModel, contexts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int
                     ) -> tuple[list[list[int]], str]:
    """Greedy replies and what made them: ``batched`` (medusa_runtime.decoding.batched: continuous batching on the lean
    engine's weights) where the lean engine runs the model, else ``transformers`` (its generate, padded batches)."""
    if batched_support(loaded) is None:
        return batched_greedy(loaded, contexts, max_new_tokens, rows=batch_size, progress=False), "batched"
    return greedy_rollouts(loaded, contexts, max_new_tokens, batch_size, progress=False), "transformers"


def _generate_turn(loaded: LoadedModel, contexts: dict[Conversation, list[int]], cfg: DistillConfig,
                   store: AnswerStore, desc: str, progress: bool, log: Callable[[str], None]) -> None:
    todo = [c for c in contexts if c not in store.replies]
    if not todo:
        return
    device = device_label(loaded.device)
    bar = tqdm(total=len(todo), desc=desc, disable=not progress, unit="reply")
    for s in range(0, len(todo), cfg.shard_size):
        part = todo[s:s + cfg.shard_size]
        start = time.perf_counter()
        replies, generator = generate_replies(loaded, [contexts[c] for c in part], cfg.max_new_tokens, cfg.batch_size)
        rows = [(conv, (tuple(contexts[conv] + reply), len(contexts[conv]))) for conv, reply in zip(part, replies)]
        entry = store.add_shard(rows, time.perf_counter() - start, cfg.batch_size, device, generator)
        bar.update(len(part))
        bar.set_postfix(tok_s=f"{entry['reply_tokens'] / max(entry['seconds'], 1e-9):.0f}")
    bar.close()
    log(f"{desc}: {len(todo)} replies generated; the store holds {len(store.replies)} "
        f"({store.reply_tokens()} reply tokens)")


def open_store(loaded: LoadedModel, cfg: DistillConfig, store: str | Path | None = None) -> AnswerStore:
    """The answer store of ``loaded`` and ``cfg``: ``store`` where given, else the cache's (which also reads the
    single-file cache of earlier releases)."""
    settings = store_settings(loaded, cfg)
    if store is not None:
        return AnswerStore(store, settings)
    return AnswerStore(default_store(loaded, cfg), settings, legacy=legacy_cache_file(loaded, cfg))


def build_distill_data(loaded: LoadedModel, prompts: Sequence[Prompt], cfg: DistillConfig = DistillConfig(),
                       progress: bool = True, store: str | Path | None = None,
                       log: Callable[[str], None] = lambda m: None) -> tuple[list[Example], AnswerStore]:
    """Generate (or reload) the examples for ``prompts``; returns them and their answer store."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise ValueError(f"model {loaded.name} has no chat template, which self-distillation needs")
    answers = open_store(loaded, cfg, store)
    first = {p.turns[:1]: chat_template_ids(loaded, [{"role": "user", "content": p.turns[0]}]) for p in prompts}
    _generate_turn(loaded, first, cfg, answers, "self-distillation turn 1", progress, log)
    done = answers.replies
    examples = [Example(*done[p.turns[:1]], i, 0) for i, p in enumerate(prompts)]
    if cfg.follow_ups:
        second = {}
        for p in prompts:
            if len(p.turns) > 1:
                ids, start = done[p.turns[:1]]
                reply = loaded.tokenizer.decode(ids[start:], skip_special_tokens=True)
                second[p.turns[:2]] = chat_template_ids(loaded, [{"role": "user", "content": p.turns[0]},
                                                         {"role": "assistant", "content": reply},
                                                         {"role": "user", "content": p.turns[1]}])
        _generate_turn(loaded, second, cfg, answers, "self-distillation turn 2", progress, log)
        examples += [Example(*done[p.turns[:2]], i, 1) for i, p in enumerate(prompts) if len(p.turns) > 1]
    examples.sort(key=lambda e: (e.prompt_index, e.turn))
    return examples, answers
