"""Self-distillation data: the base model's own replies to training prompts, cached on disk.

Each example is one assistant turn: the chat-formatted context and the model's greedy reply.
Prompts with a follow-up give a second example whose context holds the model's first reply. The
cache is a JSONL file named by a hash of everything that determines it (model, prompts, lengths);
lines are appended batch by batch, so an interrupted run keeps what it generated and a rerun only
generates what is missing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .calibrate import greedy_rollouts
from .model import LoadedModel, cache_root
from .prompts import Prompt


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


def _chat_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def cache_file(loaded: LoadedModel, prompts: Sequence[Prompt], cfg: DistillConfig) -> Path:
    emb = loaded.model.get_input_embeddings().weight
    fingerprint = [float(x) for x in emb.flatten()[:64].float()]  # same name, other weights: other cache
    key = hashlib.sha256(json.dumps({"model": loaded.name, "dtype": str(loaded.dtype), "cfg": asdict(cfg),
                                     "weights": fingerprint, "prompts": [p.turns for p in prompts]}
                                    ).encode()).hexdigest()[:16]
    return cache_root() / "distill" / f"{key}.jsonl"


def _read_cache(path: Path) -> dict[tuple[int, int], Example]:
    done: dict[tuple[int, int], Example] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash: regenerate it
                continue
            done[(r["prompt_index"], r["turn"])] = Example(tuple(r["input_ids"]), r["reply_start"], r["prompt_index"],
                                                          r["turn"])
    return done


def _generate_turn(loaded: LoadedModel, contexts: dict[int, list[int]], turn: int, cfg: DistillConfig,
                   path: Path, done: dict, progress: bool) -> None:
    todo = [i for i in contexts if (i, turn) not in done]
    chunk = cfg.batch_size * 4  # write to disk every few batches
    bar = tqdm(total=len(todo), desc=f"self-distillation turn {turn + 1}", disable=not progress, unit="prompt")
    for s in range(0, len(todo), chunk):
        part = todo[s:s + chunk]
        replies = greedy_rollouts(loaded, [contexts[i] for i in part], cfg.max_new_tokens, cfg.batch_size,
                                  progress=False)
        with path.open("a") as fh:
            for i, reply in zip(part, replies):
                ex = Example(tuple(contexts[i] + reply), len(contexts[i]), i, turn)
                done[(i, turn)] = ex
                fh.write(json.dumps({"prompt_index": i, "turn": turn, "reply_start": ex.reply_start,
                                     "input_ids": list(ex.input_ids)}) + "\n")
        bar.update(len(part))
    bar.close()


def build_distill_data(loaded: LoadedModel, prompts: Sequence[Prompt], cfg: DistillConfig = DistillConfig(),
                       progress: bool = True) -> tuple[list[Example], Path]:
    """Generate (or reload) the examples for ``prompts``; returns them and the cache file."""
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise ValueError(f"model {loaded.name} has no chat template, which self-distillation needs")
    path = cache_file(loaded, prompts, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _read_cache(path)
    first = {i: _chat_ids(loaded, [{"role": "user", "content": p.turns[0]}]) for i, p in enumerate(prompts)}
    _generate_turn(loaded, first, 0, cfg, path, done, progress)
    if cfg.follow_ups:
        second = {}
        for i, p in enumerate(prompts):
            if len(p.turns) > 1:
                ex = done[(i, 0)]
                reply = loaded.tokenizer.decode(ex.input_ids[ex.reply_start:], skip_special_tokens=True)
                second[i] = _chat_ids(loaded, [{"role": "user", "content": p.turns[0]},
                                               {"role": "assistant", "content": reply},
                                               {"role": "user", "content": p.turns[1]}])
        _generate_turn(loaded, second, 1, cfg, path, done, progress)
    examples = [done[k] for k in sorted(done) if k[0] < len(prompts)]
    return examples, path
