"""Heads in the layouts serving engines load: a vLLM Medusa model folder, and the refusals that go with it.

vLLM's Medusa draft model (``vllm/model_executor/models/medusa.py``, config class
``vllm/transformers_utils/configs/medusa.py``) is, per head i::

    x = h;  for layer j:  x = x + SiLU(blocks[i].layers[j](x))      # nn.Linear(H, H), bias iff medusa_fc_bias
    logits_i = lm_heads[i](x)                                         # [truncated_vocab_size, H]
    draft_i  = argmax(logits_i)  (scattered back through token_map when the vocabulary is truncated)

so it proposes the top-1 *chain* of the heads (``num_speculative_tokens`` of them), never a tree.
The folder holds ``config.json`` (``model_type: medusa``, ``num_heads``, ``num_hidden_layers``,
``hidden_size``, ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``) and
``model.safetensors`` with ``blocks.{i}.layers.{j}.weight|bias``, ``lm_heads.{i}.weight`` (only
``lm_heads.0.weight`` when ``original_lm_head``: every head then scores through the base model's
``lm_head``, as this project's shared format does) and ``token_map`` (the draft vocabulary's token
ids) where the heads carry one.

Root- or path-conditioned heads read the step's root and parent tokens inside their first block; no
engine implements that, so they are refused with the reason rather than exported as heads that
would propose other tokens than they were trained to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .fsutil import atomic_dir
from .heads import HeadsError, MedusaHeads

VLLM_WEIGHTS = "model.safetensors"
VLLM_SPEC_FILE = "speculative_config.json"


def engine_refusal(heads: MedusaHeads, engine: str) -> str | None:
    """Why ``engine`` cannot serve these heads (None: it can)."""
    if heads.root_conditioned:
        kind = "path" if heads.path_conditioned else "root"
        return (f"these heads are {kind}-conditioned (their first block reads the step's root"
                f"{' and parent' if kind == 'path' else ''} token), which {engine} does not implement; "
                "train unconditioned heads for it (medusa-bench train --condition none)")
    if heads.config.num_layers < 1:
        return f"{engine} needs at least one residual layer per head"
    return None


def vllm_state_dict(heads: MedusaHeads, lm_weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of a vLLM Medusa checkpoint: residual blocks, the heads' projections over the draft
    vocabulary (one shared ``lm_heads.0`` for shared-format heads) and ``token_map``."""
    cfg = heads.config
    out: dict[str, torch.Tensor] = {}
    for i, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            out[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach().to(dtype)
            out[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach().to(dtype)
    proj = heads.projection(lm_weight)  # [S, H] shared, or [K, S, H] per head (S = V without a draft vocabulary)
    if cfg.shared_lm_head:
        out["lm_heads.0.weight"] = proj.detach().to(dtype)
    else:
        for i in range(cfg.num_heads):
            out[f"lm_heads.{i}.weight"] = proj[i].detach().to(dtype)
    if heads.draft_vocab is not None:
        out["token_map"] = heads.draft_vocab.clone().long()
    return {k: v.contiguous().clone() for k, v in out.items()}


def vllm_config(heads: MedusaHeads, dtype: torch.dtype) -> dict:
    cfg = heads.config
    vocab = cfg.vocab_size if heads.draft_vocab is None else int(heads.draft_vocab.numel())
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "truncated_vocab_size": vocab, "medusa_fc_bias": True, "original_lm_head": cfg.shared_lm_head,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def vllm_speculative_config(folder: str | os.PathLike[str], num_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for the exported folder: a top-1 chain of ``num_tokens`` heads."""
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": num_tokens}


def export_vllm(heads: MedusaHeads, lm_weight: torch.Tensor, out_dir: str | os.PathLike[str],
                num_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the vLLM Medusa folder (atomically) with its ``speculative_config.json``; refuse what vLLM
    cannot run. ``num_tokens``: the chain's length (default: every head)."""
    reason = engine_refusal(heads, "vLLM")
    if reason:
        raise HeadsError(reason)
    k = heads.num_heads if num_tokens is None else num_tokens
    if not 1 <= k <= heads.num_heads:
        raise HeadsError(f"vLLM's Medusa drafts one token per head: num_speculative_tokens must be 1..{heads.num_heads}, "
                         f"got {k}")
    with atomic_dir(out_dir) as tmp:
        save_file(vllm_state_dict(heads, lm_weight, dtype), str(tmp / VLLM_WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(vllm_config(heads, dtype), indent=1) + "\n")
        spec = vllm_speculative_config(Path(out_dir).resolve(), k)
        (tmp / VLLM_SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
    return Path(out_dir)
