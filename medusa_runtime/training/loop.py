"""The one training loop every method runs (Medusa-1, Medusa-2, Medusa-2 on the top layers): resume from the
last checkpoint, the batches in the order an uninterrupted run takes them, the optimiser step and schedule,
the step's record and progress bar, checkpoints, and what Ctrl-C leaves behind. A method supplies only what
differs (``Method``): its loss on a batch, its fields of the step record, the weights it checkpoints beside
the heads, a hook after each step.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from medusa_runtime.heads.medusa import MedusaHeads, load_heads, save_heads
from medusa_runtime.training.distill import Example
from treesearch.fsutil import atomic_dir

# configuration fields a resumed run may change: a longer run continues a shorter one's checkpoint
RESUMABLE_CHANGES = ("epochs", "checkpoint_every", "eval_every")


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    history: list[dict] = field(default_factory=list)  # per step: loss, the method's fields, per-head top-1
    validation: list[dict] = field(default_factory=list)  # per evaluation: per-head top-1..5
    seconds: float = 0.0


@dataclass
class Method:
    """What a training method adds to the loop."""

    label: str  # the progress bar's description
    loss: Callable[[list[int], int], tuple[torch.Tensor, list]]  # (batch indices, step) -> loss, per-head stats
    record: Callable[[int], dict]  # step -> the method's fields of that step's record (after the schedule step)
    weights: Callable[[], dict[str, object]] = dict  # files saved beside the heads in a checkpoint, by name
    restore: Callable[[Path], None] = lambda ckpt: None  # those files read back on resume
    after_step: Callable[[int, int, TrainResult], None] = lambda step, total, result: None  # e.g. validation
    checkpoint_final: bool = True  # also checkpoint the last step (Medusa-2 writes its result instead)


def token_batches(examples: Sequence[Example], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of example indices holding about ``batch_tokens`` tokens each."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches, cur, cur_tokens = [], [], 0
    for i in order:
        n = min(len(examples[i].input_ids), max_len)
        if cur and cur_tokens + n > batch_tokens:
            batches.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += n
    if cur:
        batches.append(cur)
    return batches


def total_steps(train_ex: Sequence[Example], cfg) -> int:
    """Optimiser steps of a run: ``cfg.epochs`` over the batches of one epoch, at least one."""
    per_epoch = len(token_batches(train_ex, cfg.batch_tokens, cfg.max_len, random.Random(0)))
    return max(1, int(round(per_epoch * cfg.epochs)))


def batch_stream(train_ex: Sequence[Example], cfg, start_step: int = 0) -> Iterator[list[int]]:
    """The training batches from step ``start_step`` on, endlessly, in the order an uninterrupted run
    takes them: one seeded shuffle per epoch, the epochs already done replayed (cheap: index lists only),
    so that a resumed run trains on exactly the batches the interrupted one had left."""
    rng = random.Random(cfg.seed)
    step = 0
    while True:
        for batch in token_batches(train_ex, cfg.batch_tokens, cfg.max_len, rng):
            if step >= start_step:
                yield batch
            step += 1


def cosine_schedule(optimizer, warmup: int, total: int):
    """Linear warm-up over ``warmup`` steps, then a cosine decay to zero at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def save_checkpoint(out_dir: Path, heads: MedusaHeads, optimizer, scheduler, step: int, state: dict, cfg,
                    num_train: int, extra: dict[str, object] | None = None) -> None:
    """checkpoint/ = heads (shared or official format) + optimiser + progress (+ ``extra`` files, each
    saved with torch.save under its name), swapped in atomically: all of one step or none of it."""
    with atomic_dir(out_dir / "checkpoint") as tmp:
        save_heads(heads, tmp / "heads", fmt="shared" if heads.proj is None else "official")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "config": asdict(cfg), "num_train": num_train, **state}, tmp / "trainer.pt")
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / name)


def load_checkpoint(ckpt: Path, heads: MedusaHeads, optimizer, scheduler, cfg, num_train: int,
                    hidden_size: int, vocab_size: int) -> dict:
    """Restore heads, optimiser and scheduler from ``ckpt``; the rest of its state is returned.

    Refuses, in one line, a checkpoint made with another configuration or another number of examples.
    """
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    saved = state.get("config")
    if saved is not None:
        now, defaults = asdict(cfg), asdict(type(cfg)())  # fields added since a checkpoint read as defaults
        changed = [k for k in now if k not in RESUMABLE_CHANGES and saved.get(k, defaults[k]) != now[k]]
        if changed:
            k = changed[0]
            raise ValueError(f"cannot resume from {ckpt}: it was trained with {k}={saved.get(k)!r}, this run "
                             f"has {k}={now[k]!r} (only {', '.join(RESUMABLE_CHANGES)} may change)")
    if state.get("num_train", num_train) != num_train:
        raise ValueError(f"cannot resume from {ckpt}: it was trained on {state['num_train']} examples, "
                         f"this run has {num_train}")
    heads.load_state_dict(load_heads(ckpt / "heads", hidden_size, vocab_size).state_dict())
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state


def train_loop(method: Method, heads: MedusaHeads, optimizer, scheduler, cfg, train_ex: Sequence[Example],
               total: int, out: Path, sizes: tuple[int, int], resume: bool = False, progress: bool = True,
               log: Callable[[str], None] = print) -> TrainResult:
    """``total`` optimiser steps of ``method`` (``total_steps``, which the scheduler was made for; from
    ``out``/checkpoint with ``resume``); sizes: the base's (hidden size, vocabulary size), to read checkpointed
    heads. Returns the steps, history and validation (the method's ``after_step`` appends to
    ``result.validation``: see ``Method``) and the time."""
    result = TrainResult(out, 0)
    step, ckpt = 0, out / "checkpoint"
    if resume and ckpt.is_dir():
        state = load_checkpoint(ckpt, heads, optimizer, scheduler, cfg, len(train_ex), *sizes)
        method.restore(ckpt)
        step = state["step"]
        result.history, result.validation = state["history"], state.get("validation", [])
        log(f"resuming from step {step}/{total}")
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=step, desc=method.label, disable=not progress, unit="step")
    batches = batch_stream(train_ex, cfg, step)
    try:
        while step < total:
            loss, stats = method.loss(next(batches), step)
            if loss.requires_grad:  # a batch without any usable position has nothing to learn from
                loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            top1 = [s.topk_correct[0] / s.positions if s else None for s in stats]
            result.history.append({"step": step + 1, "loss": float(loss.detach()), **method.record(step),
                                   "top1": top1})
            step += 1
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1_h0=f"{(top1[0] or 0):.3f}")
            bar.update(1)
            method.after_step(step, total, result)
            due = step % cfg.checkpoint_every == 0 or step == total
            if due and (step < total or method.checkpoint_final):
                save_checkpoint(out, heads, optimizer, scheduler, step,
                                {"history": result.history, "validation": result.validation}, cfg, len(train_ex),
                                extra=method.weights())
    except KeyboardInterrupt:
        log(f"interrupted at step {step}; the last checkpoint in {ckpt} is complete and --resume continues")
        raise
    finally:
        bar.close()
    result.steps, result.seconds = step, time.perf_counter() - t0
    return result
