"""The base model's hidden states of a training set, computed once and kept on disk between runs
(``<cache>/hidden``, safetensors, written atomically, named by a hash of the model and the data)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from medusa_runtime.model import LoadedModel, cache_root, weights_fingerprint
from medusa_runtime.training.distill import Example
from treesearch.fsutil import atomic_file


@torch.inference_mode()
def cache_hidden_states(model, examples: Sequence[Example], max_len: int,
                        progress: bool = True) -> list[torch.Tensor]:
    """Last hidden state (after the final norm) of every example of a causal LM, once, in bf16: [T, H] each."""
    out = []
    device = next(model.parameters()).device
    for ex in tqdm(examples, desc="caching base hidden states", disable=not progress, unit="ex"):
        ids = torch.tensor([ex.input_ids[:max_len]], device=device)
        hs = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states[-1][0]
        out.append(hs.to(torch.bfloat16).cpu())
    return out


def hidden_cache_file(loaded: LoadedModel, examples: Sequence[Example], max_len: int, layer: int | None = None
                      ) -> Path:
    """Where the base hidden states of ``examples`` are kept: named by a hash of the model (name, dtype,
    weights fingerprint), ``max_len`` and every example's token ids, so any change makes another file.
    ``layer``: the residual stream entering that decoder layer instead of the last hidden state."""
    key = {"model": loaded.name, "dtype": str(loaded.dtype), "max_len": max_len,
           "weights": weights_fingerprint(loaded), "format": 1, **({"layer": layer} if layer is not None else {})}
    digest = hashlib.sha256(json.dumps(key).encode())
    for ex in examples:
        digest.update(np.asarray(ex.input_ids[:max_len], dtype=np.int64).tobytes() + b"|")
    prefix = "" if layer is None else f"layer{layer}-"
    return cache_root() / "hidden" / f"{prefix}{digest.hexdigest()[:16]}.safetensors"


def write_hidden_cache(path: Path, states: Sequence[torch.Tensor], lengths: list[int],
                       log: Callable[[str], None]) -> bool:
    """Keep states on disk (atomically); a full disk costs the next run the backbone again, not this run."""
    try:
        with atomic_file(path) as tmp:
            save_file({"hidden": torch.cat(list(states)), "lengths": torch.tensor(lengths, dtype=torch.int64)}, tmp)
    except OSError as exc:
        log(f"could not keep hidden states on disk ({exc}); training goes on")
        return False
    return True


def read_hidden_cache(path: Path, lengths: list[int], hidden_size: int) -> list[torch.Tensor] | None:
    """The cached states split per example, or None when the file is missing, unreadable or does not match."""
    if not path.is_file():
        return None
    try:
        data = load_file(path)
        flat, lens = data["hidden"], data["lengths"]
    except (OSError, KeyError, SafetensorError):
        return None
    if lens.tolist() != lengths or tuple(flat.shape) != (sum(lengths), hidden_size):
        return None
    return list(torch.split(flat, lengths))


def base_hidden_states(loaded: LoadedModel, examples: Sequence[Example], max_len: int, progress: bool = True,
                       use_cache: bool = True, log: Callable[[str], None] = print) -> list[torch.Tensor]:
    """``cache_hidden_states``, kept on disk between runs (``<cache>/hidden``, safetensors, written
    atomically): a rerun on the same data, another head shape or learning rate skips the backbone.
    Every example's states are one [T, H] bf16 tensor, as computed."""
    if not use_cache or not examples:
        return cache_hidden_states(loaded.model, examples, max_len, progress)
    path = hidden_cache_file(loaded, examples, max_len)
    lengths = [min(len(e.input_ids), max_len) for e in examples]
    cached = read_hidden_cache(path, lengths, loaded.hidden_size)
    if cached is not None:
        log(f"base hidden states of {len(examples)} examples reloaded from {path}")
        return cached
    states = cache_hidden_states(loaded.model, examples, max_len, progress)
    if not write_hidden_cache(path, states, lengths, log):
        return states
    log(f"base hidden states cached: {path} ({path.stat().st_size / 2**20:.0f} MiB; --no-hidden-cache skips this)")
    return states
