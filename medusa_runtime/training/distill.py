"""Self-distillation data: the base model's own replies to training prompts, cached on disk.

Each example is one assistant turn: the chat-formatted context and the model's greedy reply.
Prompts with a follow-up give a second example whose context holds the model's first reply. The
cache is a JSONL file named by a hash of everything that determines a reply but the prompt (model,
weights, dtype, lengths); each line holds the user turns it answers, so any prompt set reuses the
replies already generated for its prompts. Lines are appended batch by batch, so an interrupted run
keeps what it generated and a rerun only generates what is missing.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..calibrate import greedy_rollouts
from ..model import LoadedModel, cache_root, chat_template_ids, weights_fingerprint
from ..prompts import Prompt


@dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = 192  # reply length cap per turn
    batch_size: int = 32  # prompts generated together
    follow_ups: bool = True  # also generate second turns


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]  # context + reply
    reply_start: int  # first reply token; the loss only sees reply tokens
    prompt_index: int
    turn: int


def cache_file(loaded: LoadedModel, cfg: DistillConfig) -> Path:
    key = hashlib.sha256(json.dumps({"model": loaded.name, "dtype": str(loaded.dtype), "cfg": asdict(cfg),
                                     "weights": weights_fingerprint(loaded), "format": 2}).encode()).hexdigest()[:16]
    return cache_root() / "distill" / f"{key}.jsonl"


Conversation = tuple[str, ...]  # the user turns up to and including the one answered


def _read_cache(path: Path) -> dict[Conversation, tuple[tuple[int, ...], int]]:
    """Cached replies: user turns -> (context + reply token ids, index of the first reply token)."""
    done: dict[Conversation, tuple[tuple[int, ...], int]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                done[tuple(r["turns"])] = (tuple(r["input_ids"]), int(r["reply_start"]))
            except (json.JSONDecodeError, KeyError, TypeError):  # a line cut by a crash: regenerate it
                continue
    return done


def reply_token_counts(path: str | Path, max_len: int = 768, limit: int | None = None) -> tuple[Counter, int]:
    """(token id -> count over the replies, replies read) of a self-distillation cache file (what
    ``build_distill_data`` writes; its first ``limit`` lines where given), reply tokens cut at ``max_len``
    positions as training cuts them. One-line errors for a missing file or one without replies."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such replies file: {path}")
    replies = list(_read_cache(path).values())[:limit]
    if not replies:
        raise ValueError(f"{path} holds no replies (expected JSONL lines with 'turns', 'input_ids', 'reply_start')")
    counts = Counter(t for ids, start in replies for t in ids[start:max_len])
    return counts, len(replies)


def _generate_turn(loaded: LoadedModel, contexts: dict[Conversation, list[int]], cfg: DistillConfig, path: Path,
                   done: dict, desc: str, progress: bool) -> None:
    todo = [c for c in contexts if c not in done]
    chunk = cfg.batch_size * 4  # write to disk every few batches
    bar = tqdm(total=len(todo), desc=desc, disable=not progress, unit="prompt")
    for s in range(0, len(todo), chunk):
        part = todo[s:s + chunk]
        replies = greedy_rollouts(loaded, [contexts[c] for c in part], cfg.max_new_tokens, cfg.batch_size,
                                  progress=False)
        with path.open("a") as fh:
            for conv, reply in zip(part, replies):
                done[conv] = (tuple(contexts[conv] + reply), len(contexts[conv]))
                fh.write(json.dumps({"turns": list(conv), "reply_start": len(contexts[conv]),
                                     "input_ids": done[conv][0]}) + "\n")
        bar.update(len(part))
    bar.close()


def build_distill_data(loaded: LoadedModel, prompts: Sequence[Prompt], cfg: DistillConfig = DistillConfig(),
                       progress: bool = True) -> tuple[list[Example], Path]:
    """Generate (or reload) the examples for ``prompts``; returns them and the cache file."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise ValueError(f"model {loaded.name} has no chat template, which self-distillation needs")
    path = cache_file(loaded, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_cache(path)
    first = {p.turns[:1]: chat_template_ids(loaded, [{"role": "user", "content": p.turns[0]}]) for p in prompts}
    _generate_turn(loaded, first, cfg, path, done, "self-distillation turn 1", progress)
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
        _generate_turn(loaded, second, cfg, path, done, "self-distillation turn 2", progress)
        examples += [Example(*done[p.turns[:2]], i, 1) for i, p in enumerate(prompts) if len(p.turns) > 1]
    examples.sort(key=lambda e: (e.prompt_index, e.turn))
    return examples, path
