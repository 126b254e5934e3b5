"""Medusa-2 on the base's top layers: the heads and a LoRA adapter on the last L decoder layers, trained
together on self-distilled data, with the next-token loss replaced by self-distillation (KL to the
original model's distribution), as the Medusa paper's Medusa-2 recipe does.

Why the top layers. A full Medusa-2 step on this project's 2-core CPU (forward and backward through all
30 layers, plus a teacher forward) costs about 28 s per 2048 positions. With the bottom N - L layers
frozen, their output (the residual stream entering layer N - L) is the same at every step, so it is
computed once per example and kept on disk, as is the original model's last hidden state (the teacher,
which Medusa-1 caches anyway): a step then runs L layers forward and backward, the heads, and the
teacher's distribution from its cached state. What ships is the heads plus the adapter (a few MB), which
``apply_heads_adapter`` merges into the base once at load (no per-step cost); decoding then verifies
against the adapted base, and its greedy outputs equal the adapted base's plain decoding.

Shapes: prefix and teacher states [T, H] per example (bf16 on disk); the student's last hidden state
[T, H]; logits [n, V] at the n reply positions of a batch.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_runtime.heads.adapter import ADAPTER_DIR, base_digest, decoder_layers, load_peft, quiet_peft
from medusa_runtime.heads.medusa import ADAPTER_KEY, save_heads
from medusa_runtime.model import LoadedModel, cpu_autocast
from medusa_runtime.training import train as T
from medusa_runtime.training.distill import Example
from medusa_runtime.training.hidden_cache import hidden_cache_file, read_hidden_cache, write_hidden_cache
from medusa_runtime.training.losses import head_targets
from treesearch.fsutil import atomic_dir
from treesearch.tree import write_json_atomic

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------------------- cached inputs


@torch.inference_mode()
def layer_states(loaded: LoadedModel, examples: Sequence[Example], max_len: int, split: int,
                 progress: bool = True, log: Callable[[str], None] = print
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per example (the residual stream entering layer ``split`` [T, H], the model's last hidden state, final
    norm applied [T, H]), both bf16, from one forward each; kept on disk (``<cache>/hidden``) between runs,
    the last hidden states where Medusa-1 training keeps them (``train.base_hidden_states``)."""
    lengths = [min(len(e.input_ids), max_len) for e in examples]
    # the last hidden states in Medusa-1's own cache file: either trainer reuses what the other computed
    files = [hidden_cache_file(loaded, examples, max_len, split), hidden_cache_file(loaded, examples, max_len)]
    cached = [read_hidden_cache(f, lengths, loaded.hidden_size) for f in files]
    if all(c is not None for c in cached):
        log(f"layer {split} inputs and last hidden states of {len(examples)} examples reloaded from the cache")
        return cached[0], cached[1]
    prefix, last = [], []
    for ex in tqdm(examples, desc=f"caching layer-{split} inputs", disable=not progress, unit="ex"):
        ids = torch.tensor([ex.input_ids[:max_len]], device=loaded.device)
        hs = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
        prefix.append(hs[split][0].to(torch.bfloat16).cpu())
        last.append(hs[-1][0].to(torch.bfloat16).cpu())
    for f, states in zip(files, (prefix, last)):
        write_hidden_cache(f, states, lengths, log)
    return prefix, last


# ---------------------------------------------------------------------------- the student


class TopLayers(torch.nn.Module):
    """The base's last ``len(layers)`` decoder layers (a LoRA adapter on them) and its final norm, run on the
    cached residual stream entering them: ``forward(prefix [T, H]) -> last hidden [T, H]``."""

    def __init__(self, peft_model, split: int):
        super().__init__()
        inner = peft_model.base_model.model.model  # the transformers decoder under peft's wrappers
        self.layers = torch.nn.ModuleList(inner.layers[split:])
        self.norm, self.rotary = inner.norm, inner.rotary_emb

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        x = prefix[None]  # [1, T, H]
        pos = torch.arange(x.shape[1], device=x.device)[None]
        emb = self.rotary(x, pos)  # (cos, sin) [1, T, D]
        for layer in self.layers:  # no mask: causal attention over the example
            x = layer(x, attention_mask=None, position_ids=pos, position_embeddings=emb)
        return self.norm(x)[0]


def lora_student(loaded: LoadedModel, train_layers: int, rank: int):
    """(peft model over a float32 copy of the base, the adapted layer indices): LoRA on every linear of the
    top ``train_layers`` layers, nothing else trainable."""
    peft = load_peft()
    n = len(decoder_layers(loaded.model))
    if not 1 <= train_layers <= n:
        raise ValueError(f"--train-layers must be within 1..{n} for {loaded.name}, got {train_layers}")
    layers = tuple(range(n - train_layers, n))
    student = copy.deepcopy(loaded.model).float()
    student.requires_grad_(False)
    student.name_or_path = loaded.name  # what peft records as the adapter's base
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                          layers_to_transform=list(layers))
    with quiet_peft():
        return peft.get_peft_model(student, cfg), layers


def distill_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, lm_weight: torch.Tensor
                 ) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, mean over positions: hidden [n, H] each, both
    projected through the (frozen) lm_head [V, H]."""
    with torch.no_grad():
        t_logp = F.log_softmax((teacher_hidden.to(lm_weight.dtype) @ lm_weight.T).float(), -1)  # [n, V]
    s_logp = F.log_softmax((student_hidden.to(lm_weight.dtype) @ lm_weight.T).float(), -1)
    return F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")


# ---------------------------------------------------------------------------- training


def _student_hidden(top: TopLayers, prefix: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor], joint: bool
                    ) -> list[torch.Tensor]:
    """The student's last hidden states [T, H] per example: the top layers on the cached prefix when the base
    trains; during the heads-only warm-up the base is the original, whose states are the cached teacher's."""
    if not joint:
        return [t.float() for t in teacher]
    with cpu_autocast(prefix[0].device):
        return [top(p.float()).float() for p in prefix]


def joint_loss(trainer, top: TopLayers, prefix, teacher, labels, ids, lm_weight: torch.Tensor, cfg, joint: bool):
    """Head losses on the student's hidden states (their gradient into the base scaled by
    ``head_grad_to_base``), plus, when the base trains, ``distill_weight`` x KL(teacher || student) at the
    replies' next-token positions (and ``lm_weight`` x their cross-entropy, 0 in the paper's recipe)."""
    hidden = _student_hidden(top, prefix, teacher, joint)
    heads_in = [h.detach() + cfg.head_grad_to_base * (h - h.detach()) if joint else h for h in hidden]
    loss, stats = trainer.batch_loss(heads_in, labels, ids)
    if joint:
        pos = [head_targets(lab[None], 1) for lab in labels]  # (mask [1, T], targets [1, T]) per example
        s = torch.cat([h[m[0]] for h, (m, _) in zip(hidden, pos)])  # [n, H]
        t = torch.cat([te[m[0]] for te, (m, _) in zip(teacher, pos)]).float()
        if s.shape[0]:
            with cpu_autocast(s.device):
                loss = loss + cfg.distill_weight * distill_loss(s, t, lm_weight)
                if cfg.lm_weight > 0:
                    target = torch.cat([tg[0][m[0]] for m, tg in pos])
                    loss = loss + cfg.lm_weight * F.cross_entropy((s.to(lm_weight.dtype) @ lm_weight.T).float(), target)
    return loss, stats


@torch.no_grad()
def drift(top: TopLayers, prefix, teacher, labels, lm_weight: torch.Tensor) -> dict[str, float]:
    """On held-out examples: mean KL(original || adapted) per reply token, and the drop in log-likelihood of
    the reply tokens (the original's own greedy answers) from the original to the adapted base."""
    kl = drop = 0.0
    count = 0
    for p, te, lab in zip(prefix, teacher, labels):
        mask, target = head_targets(lab[None], 1)
        if not int(mask.sum()):
            continue
        with cpu_autocast(p.device):
            s = top(p.float()).float()[mask[0]]
        t_logp = F.log_softmax((te.float()[mask[0]].to(lm_weight.dtype) @ lm_weight.T).float(), -1)
        s_logp = F.log_softmax((s.to(lm_weight.dtype) @ lm_weight.T).float(), -1)
        tok = target[0][mask[0]]
        kl += float((t_logp.exp() * (t_logp - s_logp)).sum())
        drop += float((t_logp.gather(1, tok[:, None]) - s_logp.gather(1, tok[:, None])).sum())
        count += int(mask.sum())
    return {"kl_per_token": kl / max(1, count), "ll_drop_per_token": drop / max(1, count), "tokens": count}


def train_medusa2_top(loaded: LoadedModel, examples: Sequence[Example], cfg, out_dir: str | Path,
                      provenance: dict | None = None, resume: bool = False, progress: bool = True,
                      log: Callable[[str], None] = print, init: str | None = None):
    """Medusa-2 on the top ``cfg.train_layers`` layers (LoRA rank ``cfg.lora_rank``) and the heads (from
    ``init``, e.g. Medusa-1 heads as the paper's heads-only warm-up, or fresh ones, whose own warm-up is
    ``cfg.heads_warmup_ratio`` of the steps). Writes ``out/heads`` (the heads, with the adapter in
    ``heads/adapter``), ``training.json`` and checkpoints every ``checkpoint_every`` steps (``resume``
    continues on exactly the batches an uninterrupted run would take)."""
    out, train_ex, val_ex = T._start(examples, cfg, out_dir)
    peft_model, layers = lora_student(loaded, cfg.train_layers, cfg.lora_rank)
    top = TopLayers(peft_model, layers[0])
    adapter_params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}  # the LoRA matrices
    heads = T.initial_heads(loaded, cfg, init, log)
    lm_weight = loaded.model.get_output_embeddings().weight.detach().to(torch.bfloat16)  # frozen (tied)
    embed = loaded.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    subset = T._training_vocabulary(heads, train_ex, cfg, loaded.vocab_size, log)
    trainer = T.HeadTrainer(heads, lm_weight, cfg, subset, embed)
    pre_train, tea_train = layer_states(loaded, train_ex, cfg.max_len, layers[0], progress, log)
    ids_train, lab_train = T.ids_and_labels(train_ex, cfg.max_len)
    total = T.total_steps(train_ex, cfg)
    warm = int(cfg.heads_warmup_ratio * total)
    optimizer = torch.optim.AdamW([{"params": list(heads.parameters()), "lr": cfg.lr},
                                   {"params": list(adapter_params.values()), "lr": cfg.base_lr}],
                                  weight_decay=cfg.weight_decay)
    scheduler = T.cosine_schedule(optimizer, int(cfg.warmup_ratio * total), total)

    def loss(batch: list[int], step: int):
        joint = step >= warm
        top.train(joint)
        heads.train()
        return joint_loss(trainer, top, [pre_train[i] for i in batch], [tea_train[i] for i in batch],
                          [lab_train[i] for i in batch], [ids_train[i] for i in batch], lm_weight, cfg, joint)

    def restore(ckpt: Path) -> None:
        saved = torch.load(ckpt / "adapter.pt", weights_only=True)
        if set(saved) != set(adapter_params):
            raise ValueError(f"cannot resume from {ckpt}: its adapter does not match this run's")
        with torch.no_grad():
            for n, p in adapter_params.items():
                p.copy_(saved[n])

    method = T.Method("training (medusa2, top layers)", loss, record=lambda step: {"joint": step >= warm},
                      weights=lambda: {"adapter.pt": {n: p.detach() for n, p in adapter_params.items()}},
                      restore=restore, checkpoint_final=False)
    result = T.train_loop(method, heads, optimizer, scheduler, cfg, train_ex, total, out,
                          (loaded.hidden_size, loaded.vocab_size), resume, progress, log)
    top.eval()
    heads.eval()
    record_drift = {}
    if val_ex:  # the heads on the adapted base's hidden states (full vocabulary), and the base's drift
        pre_val, tea_val = layer_states(loaded, val_ex, cfg.max_len, layers[0], progress, log)
        ids_val, lab_val = T.ids_and_labels(val_ex, cfg.max_len)
        with torch.no_grad(), cpu_autocast(loaded.device):
            hid_val = [top(p.float()).to(torch.bfloat16) for p in pre_val]
        topk = T.evaluate_heads(T.HeadTrainer(heads, lm_weight, cfg, embed=embed), hid_val, lab_val, ids=ids_val)
        result.validation.append({"step": result.steps, "topk": topk})
        record_drift = drift(top, pre_val, tea_val, lab_val, lm_weight)
        log(f"held-out drift of the adapted base: KL {record_drift['kl_per_token']:.4f}, log-likelihood drop of the "
            f"original's replies {record_drift['ll_drop_per_token']:+.4f} nats/token")
    info = {"path": ADAPTER_DIR, "base_model": loaded.name, "layers": list(layers),
            "base_digest": base_digest(loaded.model, layers), "lora_rank": cfg.lora_rank}
    record = {"schema": "medusa-training/1", "method": cfg.method, "config": asdict(cfg),
              "examples": {"train": len(train_ex), "validation": len(val_ex),
                           "train_tokens": sum(len(e.input_ids) for e in train_ex)},
              "steps": result.steps, "train_seconds": result.seconds, "history": result.history,
              "validation": result.validation, "adapter": info, "drift": record_drift,
              **T.init_provenance(init), **(provenance or {})}
    save_adapted_heads(heads, peft_model, info, out / "heads")
    write_json_atomic(out / "training.json", record)
    log(f"medusa2: heads and the base adapter written to {out / 'heads'} (the adapter is merged at load)")
    return result


def save_adapted_heads(heads, peft_model, info: dict, folder: Path) -> Path:
    """The heads (shared format) with the adapter they need in ``folder/adapter`` (peft's own format:
    ``adapter_config.json``, ``adapter_model.safetensors``), and ``config.json`` naming it; one atomic swap."""
    with atomic_dir(folder) as tmp:
        save_heads(heads, tmp, fmt="shared")
        peft_model.save_pretrained(str(tmp / ADAPTER_DIR), save_embedding_layers=False)  # no hub lookup
        meta = json.loads((tmp / "config.json").read_text())
        meta[ADAPTER_KEY] = info
        (tmp / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
    return folder
