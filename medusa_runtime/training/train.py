"""Medusa head training on self-distilled data: Medusa-1 (frozen base) and Medusa-2 (joint, with KL).

Loss of head j (0-based): cross-entropy of the head's logits at position t against the token at
t + j + 2, over reply tokens only, weighted by ``loss_decay ** (j + 1)``; a head with no valid
position in a batch contributes nothing (it is skipped, never fed an empty tensor).

Medusa-1 caches the frozen base's last hidden states once (bf16), then trains only the heads over
them for several epochs. Medusa-2 trains base and heads together: next-token loss on the replies,
the head losses, and a KL term to the original model's next-token distribution (self-distillation
keeps next-token quality), with a higher learning rate for the heads and a heads-only warm-up.
Checkpoints are written atomically every ``checkpoint_every`` steps, so Ctrl-C or a crash leaves
the last complete one usable, and ``resume`` continues from it.
"""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads, heads_folder, resolve_heads, save_heads
from medusa_runtime.model import LoadedModel, cpu_autocast
from medusa_runtime.training.distill import Example
from medusa_runtime.training.hidden_cache import (  # noqa: F401 (re-exported)
    base_hidden_states,
    cache_hidden_states,
    hidden_cache_file,
    read_hidden_cache,
    write_hidden_cache,
)
from medusa_runtime.training.loop import (  # noqa: F401 (re-exported: the loop's pieces callers knew from here)
    RESUMABLE_CHANGES,
    Method,
    TrainResult,
    batch_stream,
    cosine_schedule,
    token_batches,
    total_steps,
    train_loop,
)
from medusa_runtime.training.losses import (  # noqa: F401 (re-exported)
    TOPK_LOGGED,
    HeadStats,
    HeadTrainer,
    accumulate_topk,
    ce_and_accuracy,
    evaluate_heads,
    head_targets,
    medusa_loss,
    topk_rates,
)
from treesearch.tree import write_json_atomic

CONDITIONS = ("none", "root", "path")  # what the heads read besides the hidden state (see heads.py)


@dataclass(frozen=True)
class TrainConfig:
    method: str = "medusa1"  # medusa1 (frozen base) | medusa2 (base and heads together)
    num_heads: int = 4  # K
    num_layers: int = 1  # residual blocks per head
    epochs: float = 2.0  # passes over the training examples
    lr: float = 1e-3  # heads' learning rate (AdamW)
    base_lr: float = 2e-5  # medusa2: base model's learning rate
    warmup_ratio: float = 0.05  # linear warm-up share of the steps, then cosine decay
    weight_decay: float = 0.0
    loss_decay: float = 0.8  # head j's loss weight is loss_decay ** (j + 1)
    batch_tokens: int = 2048  # positions per optimiser step
    max_len: int = 768  # examples are cut to this many tokens
    val_fraction: float = 0.05  # share of prompts kept for validation
    seed: int = 0
    checkpoint_every: int = 25  # steps between checkpoints
    eval_every: int = 200  # medusa1: steps between validations (and at the end); each scores the full vocabulary
    heads_warmup_ratio: float = 0.3  # medusa2: share of steps that train only the heads
    distill_weight: float = 1.0  # medusa2: weight of KL(original || trained) on next-token distributions
    lm_weight: float = 1.0  # medusa2: weight of the next-token loss
    head_grad_to_base: float = 0.2  # medusa2: share of the head losses' gradient that reaches the base
    lora_rank: int = 0  # medusa2: LoRA rank on the base (peft), 0 = full fine-tuning
    train_layers: int = 0  # medusa2: adapt only the top L decoder layers (LoRA; their inputs cached), 0 = all
    official_format: bool = True  # also write the official per-head-projection format
    vocab: str = "full"  # heads' training softmax: full | replies (only tokens the replies contain: faster)
    draft_size: int = 0  # vocab replies: keep only the S most frequent reply tokens (0: all of them)
    soft_targets: float = 0.0  # weight of the base's own next-token distribution as head j's target (0..1)
    # none | root: heads also read the embedding of the token at t + 1 | path: and head j that of t + j + 1
    # (its parent in the tree); see heads.py
    condition: str = "none"

    def __post_init__(self) -> None:
        if self.method not in ("medusa1", "medusa2"):
            raise ValueError(f"unknown training method {self.method!r}; use medusa1 or medusa2")
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError("need at least one head and one residual layer")
        if self.epochs <= 0 or self.batch_tokens < 16:
            raise ValueError("epochs must be > 0 and batch_tokens >= 16")
        if self.checkpoint_every < 1 or self.eval_every < 1:
            raise ValueError("checkpoint_every and eval_every must be >= 1")
        if self.vocab not in ("full", "replies"):
            raise ValueError(f"vocab must be 'full' or 'replies', got {self.vocab!r}")
        if self.draft_size < 0 or (self.draft_size and self.vocab != "replies"):
            raise ValueError("draft_size (the S most frequent reply tokens) needs vocab 'replies' and S >= 0")
        if not 0.0 <= self.head_grad_to_base <= 1.0:
            raise ValueError(f"head_grad_to_base must be within [0, 1], got {self.head_grad_to_base}")
        if not 0.0 <= self.soft_targets <= 1.0:
            raise ValueError(f"soft_targets must be within [0, 1], got {self.soft_targets}")
        if self.train_layers < 0 or (self.train_layers and (self.method != "medusa2" or self.lora_rank < 1)):
            raise ValueError("train_layers (the top layers Medusa-2 adapts) needs method medusa2 and a LoRA rank >= 1")
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {', '.join(CONDITIONS)}, got {self.condition!r}")

    @property
    def root_conditioned(self) -> bool:
        return self.condition in ("root", "path")

    @property
    def path_conditioned(self) -> bool:
        return self.condition == "path"


# ---------------------------------------------------------------------------- data


def split_examples(examples: Sequence[Example], val_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Split by prompt, so both turns of a conversation land on the same side."""
    prompts = sorted({e.prompt_index for e in examples})
    random.Random(seed).shuffle(prompts)
    held = set(prompts[: int(round(len(prompts) * val_fraction))])
    return [e for e in examples if e.prompt_index not in held], [e for e in examples if e.prompt_index in held]


def labels_for(example: Example, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(example.input_ids[:max_len])
    labels = ids.clone()
    labels[: example.reply_start] = -100
    return ids, labels


def ids_and_labels(examples: Sequence[Example], max_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``labels_for`` of every example, split into the token ids [T] and the labels [T] (empty lists for none)."""
    pairs = [labels_for(e, max_len) for e in examples]
    return [ids for ids, _ in pairs], [lab for _, lab in pairs]


# ---------------------------------------------------------------------------- Medusa-1


def write_outputs(out_dir: Path, heads: MedusaHeads, lm_head: torch.nn.Module, cfg: TrainConfig,
                  record: dict) -> dict[str, Path]:
    """Final heads in the shared format (and the official one, which root-conditioned heads lack), plus
    training.json."""
    paths = {}
    if heads.proj is None:
        paths["shared"] = save_heads(heads, out_dir / "heads", fmt="shared", lm_head=lm_head)
    if (cfg.official_format or heads.proj is not None) and not heads.root_conditioned:
        paths["official"] = save_heads(heads, out_dir / "heads-official", fmt="official", lm_head=lm_head)
    write_json_atomic(out_dir / "training.json", record)
    return paths


def _start(examples: Sequence[Example], cfg: TrainConfig, out_dir: str | Path
           ) -> tuple[Path, list[Example], list[Example]]:
    """Output folder, seeded torch RNG and the train/validation split shared by both methods."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    train_ex, val_ex = split_examples(examples, cfg.val_fraction, cfg.seed)
    if not train_ex:
        raise ValueError("no training examples")
    return out, train_ex, val_ex


def _training_vocabulary(heads: MedusaHeads, train_ex: Sequence[Example], cfg: TrainConfig, vocab_size: int,
                         log: Callable[[str], None]) -> torch.Tensor | None:
    """``vocab: replies``: the token ids the training replies contain ([S], sorted), also set as the
    heads' draft vocabulary (saved with them: they propose only tokens they were trained on)."""
    if cfg.vocab != "replies":
        return None
    # the base model's own replies use a small part of the vocabulary; a softmax over those tokens
    # costs a fraction of the full projection (validation still scores the full vocabulary)
    counts = Counter(t for e in train_ex for t in e.input_ids[e.reply_start:cfg.max_len])
    if cfg.draft_size:  # the S most frequent (ties: first seen first); a smaller projection at every step
        subset = torch.tensor(sorted(t for t, _ in counts.most_common(cfg.draft_size)))
        share = sum(counts[int(t)] for t in subset) / max(1, sum(counts.values()))
        log(f"training vocabulary: the {len(subset)} most frequent reply tokens of {len(counts)} "
            f"({share:.1%} of the reply tokens)")
        heads.set_draft_vocab(subset)
        return subset
    kept = set() if heads.draft_vocab is None else set(heads.draft_vocab.tolist())  # heads trained before (--init)
    subset = torch.tensor(sorted(set(counts) | kept))
    grown = f", {len(subset) - len(kept)} more than the starting heads' draft vocabulary" if kept else ""
    log(f"training vocabulary: {len(subset)} of {vocab_size} tokens (those the replies contain{grown})")
    heads.set_draft_vocab(subset)
    return subset


def initial_heads(loaded: LoadedModel, cfg: TrainConfig, init: str | None = None,
                  log: Callable[[str], None] = print) -> MedusaHeads:
    """Fresh heads of ``cfg``'s shape, or (``init``: a heads folder or ``default``) heads trained before,
    to go on training on other data; those must have the shape ``cfg`` asks for."""
    shape = HeadsConfig(cfg.num_heads, cfg.num_layers, loaded.hidden_size, loaded.vocab_size, shared_lm_head=True,
                        base_model=loaded.name, root_conditioned=cfg.root_conditioned,
                        path_conditioned=cfg.path_conditioned)
    if init is None:
        return MedusaHeads(shape)
    heads = resolve_heads(init, loaded.hidden_size, loaded.vocab_size, loaded.name)
    if heads is None:
        raise ValueError("--init needs a heads folder or 'default'")

    def describe(c: HeadsConfig) -> str:
        cond = "path" if c.path_conditioned else "root" if c.root_conditioned else "none"
        fmt = "shared" if c.shared_lm_head else "official"
        return f"{c.num_heads} heads x {c.num_layers} layers, --condition {cond}, {fmt} format"

    if describe(heads.config) != describe(shape):
        raise ValueError(f"--init heads {init} are {describe(heads.config)}; this run asks for {describe(shape)} "
                         f"(set --num-heads, --layers and --condition to match)")
    log(f"starting from the heads in {init} ({describe(shape)})")
    return heads


def init_provenance(init: str | None) -> dict:
    """What training.json records of the heads a run started from: their folder and, where it lies beside
    them, the configuration and data of the run that made them."""
    if init is None:
        return {}
    folder = heads_folder(init)
    record = {"heads": init}
    made = folder.parent / "training.json" if folder is not None else None
    if made is not None and made.is_file():
        try:
            before = json.loads(made.read_text())
            record.update({k: before[k] for k in ("config", "data", "profile", "steps", "examples", "init")
                           if k in before})
        except (OSError, json.JSONDecodeError):
            pass
    return {"init": record}


def train_medusa1(loaded: LoadedModel, examples: Sequence[Example], cfg: TrainConfig, out_dir: str | Path,
                  provenance: dict | None = None, resume: bool = False, progress: bool = True,
                  log: Callable[[str], None] = print, hidden_cache: bool = True, init: str | None = None
                  ) -> TrainResult:
    """Heads only, over the frozen base's hidden states (kept on disk between runs unless ``hidden_cache``
    is off: see ``base_hidden_states``). ``init``: start from heads trained before (``initial_heads``)."""
    out, train_ex, val_ex = _start(examples, cfg, out_dir)
    lm_head = loaded.model.get_output_embeddings()
    lm_weight = lm_head.weight.detach().to(torch.bfloat16)
    heads = initial_heads(loaded, cfg, init, log)
    embed = loaded.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    hid_train = base_hidden_states(loaded, train_ex, cfg.max_len, progress, hidden_cache, log)
    ids_train, lab_train = ids_and_labels(train_ex, cfg.max_len)
    hid_val = base_hidden_states(loaded, val_ex, cfg.max_len, progress, hidden_cache, log)
    ids_val, lab_val = ids_and_labels(val_ex, cfg.max_len)
    total = total_steps(train_ex, cfg)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = cosine_schedule(optimizer, int(cfg.warmup_ratio * total), total)
    subset = _training_vocabulary(heads, train_ex, cfg, loaded.vocab_size, log)
    trainer = HeadTrainer(heads, lm_weight, cfg, subset, embed)
    evaluator = HeadTrainer(heads, lm_weight, cfg, embed=embed)
    running = [[0.0] * (1 + TOPK_LOGGED) for _ in range(cfg.num_heads)]

    def loss(batch: list[int], step: int):
        heads.train()
        value, stats = trainer.batch_loss([hid_train[i] for i in batch], [lab_train[i] for i in batch],
                                          [ids_train[i] for i in batch])
        accumulate_topk(running, stats)
        return value, stats

    def validate(step: int, total: int, result: TrainResult) -> None:
        # a validation costs about 0.6 s per held-out example here (4 heads x 49k-token softmax)
        if hid_val and (step % cfg.eval_every == 0 or step == total):
            heads.eval()
            result.validation.append({"step": step, "topk": evaluate_heads(evaluator, hid_val, lab_val,
                                                                           ids=ids_val)})

    method = Method("training heads (medusa1)", loss, record=lambda step: {"lr": scheduler.get_last_lr()[0]},
                    after_step=validate)
    result = train_loop(method, heads, optimizer, scheduler, cfg, train_ex, total, out,
                        (loaded.hidden_size, loaded.vocab_size), resume, progress, log)
    record = {"schema": "medusa-training/1", "method": cfg.method, "config": asdict(cfg),
              "examples": {"train": len(train_ex), "validation": len(val_ex),
                           "train_tokens": sum(len(e.input_ids) for e in train_ex)},
              "steps": result.steps, "train_seconds": result.seconds, "history": result.history,
              "validation": result.validation, "train_topk": topk_rates(running), **init_provenance(init),
              **(provenance or {})}
    write_outputs(out, heads, lm_head, cfg, record)
    return result


# ---------------------------------------------------------------------------- Medusa-2


def padded_batch(examples: Sequence[Example], max_len: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], labels [B, T] (-100 on prompts and padding) and attention mask [B, T]."""
    rows = [labels_for(e, max_len) for e in examples]
    t = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    attn = torch.zeros(len(rows), t, dtype=torch.long)
    for b, (i, lab) in enumerate(rows):
        ids[b, : len(i)], labels[b, : len(i)], attn[b, : len(i)] = i, lab, 1
    return ids.to(device), labels.to(device), attn.to(device)


def _last_hidden(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden state (final norm applied) [B, T, H], without the vocabulary projection."""
    return model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state


def _medusa2_loss(student, teacher, trainer: HeadTrainer, ids: torch.Tensor, labels: torch.Tensor,
                  attn: torch.Tensor, cfg: TrainConfig, joint: bool) -> tuple[torch.Tensor, list[HeadStats | None]]:
    """Head losses on the student's hidden states (+ next-token loss and KL to the teacher when joint)."""
    with cpu_autocast(ids.device), torch.set_grad_enabled(joint):
        hidden = _last_hidden(student, ids, attn).float()  # [B, T, H]
    lengths = attn.sum(1).tolist()
    # the heads see the same values; their gradient reaches the base scaled by head_grad_to_base
    # (at 1 the head losses, about 2.4x the next-token loss in weight, pull the base off its answers)
    heads_in = hidden.detach() + cfg.head_grad_to_base * (hidden - hidden.detach()) if joint else hidden
    loss, stats = trainer.batch_loss([heads_in[b, :n] for b, n in enumerate(lengths)],
                                     [labels[b, :n] for b, n in enumerate(lengths)],
                                     [ids[b, :n] for b, n in enumerate(lengths)])
    mask, targets = head_targets(labels, 1)  # next-token positions of the replies
    if joint and int(mask.sum()):
        with torch.no_grad():
            t_logits = teacher.get_output_embeddings()(_last_hidden(teacher, ids, attn)[mask]).float()  # [n, V]
        with cpu_autocast(ids.device):
            s_logits = student.get_output_embeddings()(hidden[mask]).float()  # [n, V]
        lm_loss = F.cross_entropy(s_logits, targets[mask])
        kl = F.kl_div(F.log_softmax(s_logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="batchmean")
        loss = loss + cfg.lm_weight * lm_loss + cfg.distill_weight * kl
    return loss, stats


def _student(teacher: torch.nn.Module, lora_rank: int) -> torch.nn.Module:
    """The model Medusa-2 trains: a float32 copy of the base, with LoRA adapters on its attention projections when
    ``lora_rank`` > 0 (else every weight trains)."""
    student = copy.deepcopy(teacher).float()
    if lora_rank == 0:
        return student
    try:
        from peft import LoraConfig, get_peft_model  # peft: only Medusa-2 training with LoRA needs it
    except ImportError:
        raise RuntimeError("--lora-rank needs peft: pip install peft") from None
    return get_peft_model(student, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def _validate_medusa2(student: torch.nn.Module, heads: MedusaHeads, trainer: HeadTrainer, val_ex: Sequence[Example],
                      cfg: TrainConfig, device: torch.device, progress: bool) -> list[list[float]]:
    """The heads' top-k accuracy on the validation examples, read from the trained base's hidden states."""
    with cpu_autocast(device):
        hid_val = cache_hidden_states(student, val_ex, cfg.max_len, progress)
    ids_val, lab_val = ids_and_labels(val_ex, cfg.max_len)
    return evaluate_heads(trainer, hid_val, lab_val, ids=ids_val)


def train_medusa2(loaded: LoadedModel, examples: Sequence[Example], cfg: TrainConfig, out_dir: str | Path,
                  provenance: dict | None = None, resume: bool = False, progress: bool = True,
                  log: Callable[[str], None] = print) -> TrainResult:
    """Joint training. The original model is kept as a frozen teacher for the KL term.

    Each step: the batch's examples right-padded into one forward of the student (bf16 autocast on CPU,
    float32 master weights); the heads read its last hidden states at the usable positions only (on the
    replies' vocabulary with ``vocab: replies``, through the student's current lm_head, not trained by
    the heads); after the heads-only warm-up, the next-token loss and KL(teacher || student) at the reply
    positions join, and gradients reach the base.

    Checkpoints (every ``checkpoint_every`` steps, atomic) hold the heads, the base's trainable weights
    (float32: the whole base, or the LoRA adapters), the optimiser and the progress; ``resume`` continues
    from the last one on exactly the batches an uninterrupted run would have taken.
    """
    out, train_ex, val_ex = _start(examples, cfg, out_dir)
    teacher = loaded.model
    student = _student(teacher, cfg.lora_rank)
    for p in student.parameters():
        p.requires_grad_(False)
    trainable = {n: p for n, p in student.named_parameters() if cfg.lora_rank == 0 or "lora_" in n}
    trainable_base = list(trainable.values())
    heads = MedusaHeads(HeadsConfig(cfg.num_heads, cfg.num_layers, loaded.hidden_size, loaded.vocab_size,
                                    shared_lm_head=True, base_model=loaded.name,
                                    root_conditioned=cfg.root_conditioned,
                                    path_conditioned=cfg.path_conditioned))
    subset = _training_vocabulary(heads, train_ex, cfg, loaded.vocab_size, log)
    lm_weight = student.get_output_embeddings().weight
    embed = student.get_input_embeddings().weight.detach()  # views: follow the student's updates
    trainer = HeadTrainer(heads, lm_weight.detach(), cfg, subset, embed)
    total = total_steps(train_ex, cfg)
    warm = int(cfg.heads_warmup_ratio * total)
    optimizer = torch.optim.AdamW([{"params": list(heads.parameters()), "lr": cfg.lr},
                                   {"params": trainable_base, "lr": cfg.base_lr}], weight_decay=cfg.weight_decay)
    scheduler = cosine_schedule(optimizer, int(cfg.warmup_ratio * total), total)

    def loss(batch: list[int], step: int):
        joint = step >= warm  # heads-only warm-up first, then the base learns too
        for p in trainable_base:
            p.requires_grad_(joint)
        student.train(joint)
        heads.train()
        ids, labels, attn = padded_batch([train_ex[i] for i in batch], cfg.max_len, loaded.device)
        return _medusa2_loss(student, teacher, trainer, ids, labels, attn, cfg, joint)

    def restore(ckpt: Path) -> None:
        base_state = torch.load(ckpt / "base.pt", weights_only=True)
        missing = set(trainable) - set(base_state)
        if missing:
            raise ValueError(f"cannot resume from {ckpt}: its base weights lack {sorted(missing)[0]}")
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(base_state[n])

    method = Method("training (medusa2)", loss, record=lambda step: {"joint": step >= warm},
                    weights=lambda: {"base.pt": {n: p.detach() for n, p in trainable.items()}},  # float32, by name
                    restore=restore, checkpoint_final=False)
    result = train_loop(method, heads, optimizer, scheduler, cfg, train_ex, total, out,
                        (loaded.hidden_size, loaded.vocab_size), resume, progress, log)
    student.eval()
    heads.eval()
    if val_ex:  # the heads on the trained base's hidden states, full vocabulary (as Medusa-1 reports)
        result.validation.append({"step": result.steps, "topk": _validate_medusa2(
            student, heads, HeadTrainer(heads, lm_weight.detach().to(torch.bfloat16), cfg, embed=embed), val_ex, cfg,
            loaded.device, progress)})
    if cfg.lora_rank > 0:
        student = student.merge_and_unload()
    student = student.to(loaded.dtype).eval()
    student.save_pretrained(out / "base")
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out / "base")
    record = {"schema": "medusa-training/1", "method": cfg.method, "config": asdict(cfg),
              "examples": {"train": len(train_ex), "validation": len(val_ex),
                           "train_tokens": sum(len(e.input_ids) for e in train_ex)}, "steps": result.steps,
              "train_seconds": result.seconds, "history": result.history, "validation": result.validation,
              **(provenance or {})}
    write_outputs(out, heads, student.get_output_embeddings(), cfg, record)
    log(f"medusa2: base model written to {out / 'base'} (use it with --model {out / 'base'})")
    return result

