"""Heads in the layouts serving engines load: a vLLM Medusa model folder, a text-generation-inference (TGI)
Medusa folder, and the refusals that go with them.

vLLM's Medusa draft model (``vllm/model_executor/models/medusa.py``, config class
``vllm/transformers_utils/configs/medusa.py``) is, per head i::

    x = h;  for layer j:  x = x + SiLU(blocks[i].layers[j](x))      # nn.Linear(H, H), bias iff medusa_fc_bias
    logits_i = lm_heads[i](x)                                         # [vocab_size, H]
    draft_i  = argmax(logits_i)

so it proposes the top-1 *chain* of the heads (``num_speculative_tokens`` of them), never a tree.
The folder holds ``config.json`` (``model_type: medusa``, ``num_heads``, ``num_hidden_layers``,
``hidden_size``, ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``) and
``model.safetensors`` with ``blocks.{i}.layers.{j}.weight|bias`` and ``lm_heads.{i}.weight`` (only
``lm_heads.0.weight`` when ``original_lm_head``: every head then scores through the base model's
``lm_head``, as this project's shared format does). vLLM's config reads a truncated vocabulary
(``truncated_vocab_size`` < ``vocab_size`` with a ``token_map`` tensor), but its loader (0.32,
``Medusa.load_weights``) registers ``token_map`` as a parameter without reporting it loaded, and the model
loader then refuses the checkpoint ("Following weights were not initialized from checkpoint:
{'token_map'}"). So heads with a draft vocabulary are written over the whole vocabulary, as for TGI: vLLM
may then propose a token outside that vocabulary where this runtime would not.

TGI (``server/text_generation_server/models/__init__.py``: a model folder whose ``config.json`` has
``medusa_num_heads`` is Medusa heads for ``base_model_name_or_path``, weights ``medusa_lm_head.safetensors``;
``layers/speculative.py``: a config with an ``architectures`` entry is *not* taken for Medusa;
``layers/medusa.py``) loads the heads one of two ways, trying the first::

    V1  per head i: x = h; for j < L: x = x + SiLU(W_ij x + b_ij)    # keys "{i}.{j}.linear.weight|bias"
                    logits_i = O_i x                                  # key  "{i}.{L}.weight" [V, H]
    V2  L = 1 only, one SiLU layer per head, logits through the base lm_head (keys "{i}.0.linear.*")

(V1 is the official Medusa checkpoint layout.) It speculates the argmax of each head, a top-1 chain of
``--speculate`` (default: every) head, over the whole vocabulary: there is no token map, so heads with a
draft vocabulary are written with all rows, and TGI may propose a token outside that vocabulary where
this runtime would not.

Root- or path-conditioned heads read the step's root and parent tokens inside their first block; no
engine implements that, so they are refused with the reason rather than exported as heads that
would propose other tokens than they were trained to.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from medusa_runtime.heads.medusa import HeadsError, MedusaHeads, checkpoint_state_dict
from treesearch.fsutil import atomic_dir

VLLM_WEIGHTS = "model.safetensors"
VLLM_SPEC_FILE = "speculative_config.json"
TGI_WEIGHTS = "medusa_lm_head.safetensors"  # the one file TGI's get_model lists as the speculator's weights


BASE_DIR = "base"  # the adapted base written beside Medusa-2 heads (engines load the base by path)


def write_base(model, tokenizer, folder: Path, dtype: torch.dtype) -> None:
    """A transformers model folder an engine loads as the base: Medusa-2 heads decode on the base with
    their adapter merged, so an engine must serve that base, not the original."""
    if next(model.parameters()).dtype != dtype:  # on a copy: the caller's model keeps its dtype
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(str(folder), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


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
    """The tensors of a vLLM Medusa checkpoint: residual blocks and the heads' projections over the whole
    vocabulary (one shared ``lm_heads.0`` for shared-format heads); no ``token_map`` (see the module's text)."""
    cfg = heads.config
    out: dict[str, torch.Tensor] = {}
    for i, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            out[f"blocks.{i}.layers.{j}.weight"] = block.linear.weight.detach().to(dtype)
            out[f"blocks.{i}.layers.{j}.bias"] = block.linear.bias.detach().to(dtype)
    proj = heads.projection(lm_weight, use_draft_vocab=False)  # [V, H] shared, or [K, V, H] per head
    if cfg.shared_lm_head:
        out["lm_heads.0.weight"] = proj.detach().to(dtype)
    else:
        for i in range(cfg.num_heads):
            out[f"lm_heads.{i}.weight"] = proj[i].detach().to(dtype)
    return {k: v.contiguous().clone() for k, v in out.items()}


def vllm_config(heads: MedusaHeads, dtype: torch.dtype) -> dict:
    cfg = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "truncated_vocab_size": cfg.vocab_size, "medusa_fc_bias": True, "original_lm_head": cfg.shared_lm_head,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def vllm_speculative_config(folder: str | os.PathLike[str], num_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for the exported folder: a top-1 chain of ``num_tokens`` heads."""
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": num_tokens}


def export_vllm(heads: MedusaHeads, lm_weight: torch.Tensor, out_dir: str | os.PathLike[str],
                num_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16, base=None,
                warn: Callable[[str], None] | None = None) -> Path:
    """Write the vLLM Medusa folder (atomically) with its ``speculative_config.json``; refuse what vLLM
    cannot run. ``num_tokens``: the chain's length (default: every head). ``base``: a LoadedModel written
    to ``base/`` (the adapted base of Medusa-2 heads, which ``vllm serve`` must be given)."""
    reason = engine_refusal(heads, "vLLM")
    if reason:
        raise HeadsError(reason)
    if heads.draft_vocab is not None and warn is not None:
        warn(f"written over the whole vocabulary: vLLM's loader refuses a token_map, so the heads' "
             f"{heads.draft_vocab.numel()}-token draft vocabulary is dropped and vLLM may propose tokens outside it")
    k = heads.num_heads if num_tokens is None else num_tokens
    if not 1 <= k <= heads.num_heads:
        raise HeadsError(f"vLLM's Medusa drafts one token per head: num_speculative_tokens must be 1..{heads.num_heads}, "
                         f"got {k}")
    with atomic_dir(out_dir) as tmp:
        save_file(vllm_state_dict(heads, lm_weight, dtype), str(tmp / VLLM_WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(vllm_config(heads, dtype), indent=1) + "\n")
        spec = vllm_speculative_config(Path(out_dir).resolve(), k)
        (tmp / VLLM_SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
        if base is not None:
            write_base(base.model, base.tokenizer, tmp / BASE_DIR, dtype)
    return Path(out_dir)


def tgi_layout(heads: MedusaHeads) -> str:
    """``v2`` (residual blocks only, the base lm_head scores: small) where TGI's MedusaHeadV2 takes the heads
    (shared projection, one layer), else ``v1`` (each head with its own [V, H] projection)."""
    return "v2" if heads.proj is None and heads.config.num_layers == 1 else "v1"


def tgi_state_dict(heads: MedusaHeads, lm_weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors TGI reads: this project's checkpoint layouts are TGI's (``shared`` = V2, blocks only;
    ``official`` = V1, each head's full-vocabulary projection beside its blocks), in ``dtype``."""
    fmt = "shared" if tgi_layout(heads) == "v2" else "official"
    return {k: v.to(dtype) for k, v in checkpoint_state_dict(heads, fmt, lm_weight).items()}


def tgi_config(heads: MedusaHeads, base_model: str) -> dict:
    """``config.json`` as TGI reads it; no ``architectures`` key (TGI would take the folder for another
    kind of speculator)."""
    cfg = heads.config
    return {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
            "base_model_name_or_path": base_model, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}


TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"  # TensorRT-LLM's load_medusa_hf reads .pt, else this file


def trtllm_config(heads: MedusaHeads, base_model: str) -> dict:
    """``config.json`` of the heads folder as TensorRT-LLM reads it (``tensorrt_llm/models/medusa/config.py``:
    ``num_medusa_heads`` and ``medusa_num_layers``; its LLM API falls back to ``medusa_num_heads``)."""
    cfg = heads.config
    return {"medusa_num_heads": cfg.num_heads, "num_medusa_heads": cfg.num_heads,
            "medusa_num_layers": cfg.num_layers, "base_model_name_or_path": base_model,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}


def export_trtllm(heads: MedusaHeads, lm_weight: torch.Tensor, out_dir: str | os.PathLike[str], base_model: str,
                  dtype: torch.dtype = torch.float16, warn: Callable[[str], None] | None = None, base=None) -> Path:
    """Write the TensorRT-LLM Medusa folder (atomically): each head's blocks and its own full-vocabulary
    projection in the official layout (``{i}.{j}.linear.weight|bias``, ``{i}.{L}.weight``: what
    ``tensorrt_llm/models/medusa/weight.py`` reads per head and layer) and ``config.json``."""
    return _write_speculator(heads, "TensorRT-LLM", out_dir, base_model, base, dtype, warn, TRTLLM_WEIGHTS,
                             lambda: {k: v.to(dtype) for k, v in
                                      checkpoint_state_dict(heads, "official", lm_weight).items()},
                             lambda name: trtllm_config(heads, name))


def _write_speculator(heads: MedusaHeads, engine: str, out_dir: str | os.PathLike[str], base_model: str, base,
                      dtype: torch.dtype, warn: Callable[[str], None] | None, weights_file: str,
                      weights: Callable[[], dict[str, torch.Tensor]], config: Callable[[str], dict]) -> Path:
    """A heads folder an engine loads beside its base (TGI's and TensorRT-LLM's layouts), written atomically:
    refused where the engine cannot run the heads; the base it names is ``base/`` when the adapted base of
    Medusa-2 heads is written there; the whole vocabulary scored (engines have no token map)."""
    reason = engine_refusal(heads, engine)
    if reason:
        raise HeadsError(reason)
    if base is not None:
        base_model = str((Path(out_dir) / BASE_DIR).resolve())
    if not base_model:
        raise HeadsError(f"{engine} loads the base from the heads' config: name it (--base-model HUB_ID_OR_FOLDER)")
    if heads.draft_vocab is not None and warn is not None:
        warn(f"{engine} scores the whole vocabulary (no token map): the heads' {heads.draft_vocab.numel()}-token "
             f"draft vocabulary is dropped, so {engine} may propose tokens outside it")
    with atomic_dir(out_dir) as tmp:
        save_file(weights(), str(tmp / weights_file), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config(base_model), indent=1) + "\n")
        if base is not None:
            write_base(base.model, base.tokenizer, tmp / BASE_DIR, dtype)
    return Path(out_dir)


def export_tgi(heads: MedusaHeads, lm_weight: torch.Tensor, out_dir: str | os.PathLike[str], base_model: str,
               dtype: torch.dtype = torch.float16, warn: Callable[[str], None] | None = None, base=None) -> Path:
    """Write the TGI Medusa folder (atomically): ``config.json`` and ``medusa_lm_head.safetensors``;
    refuse what TGI cannot run. ``base_model``: what TGI loads as the base (a hub id or a folder);
    ``base``: a LoadedModel written to ``base/`` and named as the base instead (Medusa-2 heads' adapted base)."""
    return _write_speculator(heads, "TGI", out_dir, base_model, base, dtype, warn, TGI_WEIGHTS,
                             lambda: tgi_state_dict(heads, lm_weight, dtype), lambda name: tgi_config(heads, name))
