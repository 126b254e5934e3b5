"""A heads folder's base adapter, on the inference side: Medusa-2 heads were trained with a LoRA adapter on the
base's top layers (``medusa_runtime.training.medusa2``), which is merged into the base once at load, so that decoding
verifies against the base the heads were trained with. Refused in one line when the base is another one (a
digest of the adapted layers' stored weights). Imports nothing of training.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from medusa_runtime.heads.medusa import HeadsError, adapter_entry
from medusa_runtime.model import LoadedModel

ADAPTER_DIR = "adapter"  # inside a heads folder: the LoRA adapter (peft's format) the heads were trained with


@dataclass(frozen=True)
class AdapterInfo:
    """What a heads folder records of the adapter its heads need (``config.json`` ``medusa_base_adapter``)."""

    path: Path  # the peft adapter folder
    base_model: str  # the base it was trained on (as the user named it)
    layers: tuple[int, ...]  # decoder layers it adapts
    base_digest: str  # sha256 of those layers' original weights (bf16), so another base is refused


def load_peft():
    try:
        import peft  # peft: only heads that ship a base adapter need it
    except ImportError:
        raise RuntimeError("Medusa-2 adapters need peft: pip install peft") from None
    return peft


@contextmanager
def quiet_peft():
    """peft 0.21 reads a model attribute that transformers 5.x announces as renamed: not ours to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (Llama, Mistral, Qwen2 ... layout: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise HeadsError(f"Medusa-2 on the top layers needs a model.model.layers stack, not {type(model).__name__}")
    return layers


def base_digest(model, layers: Sequence[int]) -> str:
    """sha256 of the adapted layers' weights rounded to bf16, taken from the values stored in the model's
    checkpoint where it has them (so the same for a float32, bf16 or float16 load, on any device; a float16
    cast would round some of them otherwise), else from the loaded values."""
    h = hashlib.sha256()
    stack = decoder_layers(model)
    full = {id(p): name for name, p in model.named_parameters()}
    stored = _stored_tensors(model, [full[id(p)] for i in layers for _, p in stack[i].named_parameters()])
    for i in layers:
        for name, p in sorted(stack[i].named_parameters()):
            value = stored.get(full[id(p)], p.detach())
            h.update(name.encode())
            h.update(value.to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _stored_tensors(model, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors as the model's own safetensors checkpoint stores them (none where it was not loaded
    from a local folder of safetensors files)."""
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return {}

    out: dict[str, torch.Tensor] = {}
    wanted = set(names)
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in wanted.intersection(fh.keys()):
                out[key] = fh.get_tensor(key)
    return out


def adapter_info(folder: str | Path) -> AdapterInfo | None:
    """The adapter a heads folder needs, None when its heads need none; a folder that names an adapter
    it lacks is refused in one line (HeadsError)."""
    folder = Path(folder)
    entry = adapter_entry(folder)
    if entry is None:
        return None
    path = folder / entry.get("path", ADAPTER_DIR)
    if not (path / "adapter_config.json").is_file():
        raise HeadsError(f"heads {folder} need the base adapter {path}, which is missing (copy the whole heads "
                         "folder, adapter included)")
    return AdapterInfo(path, str(entry.get("base_model", "")), tuple(int(i) for i in entry["layers"]),
                       str(entry["base_digest"]))


def apply_heads_adapter(loaded: LoadedModel, folder: str | Path, log: Callable[[str], None] = print) -> LoadedModel:
    """The base with the heads' adapter merged into its weights once (nothing per step), or the base as it
    is when the heads need none. Refuses in one line an adapter trained on another base."""
    info = adapter_info(folder)
    if info is None:
        return loaded
    layers = decoder_layers(loaded.model)
    if max(info.layers) >= len(layers) or base_digest(loaded.model, info.layers) != info.base_digest:
        raise HeadsError(f"the adapter of heads {folder} was trained on another base ({info.base_model!r}), not "
                         f"the {loaded.name!r} loaded; use the heads with their base")
    peft = load_peft()
    with quiet_peft():  # on a copy: the caller's model stays the original
        model = peft.PeftModel.from_pretrained(copy.deepcopy(loaded.model), str(info.path)).merge_and_unload()
    model.eval().requires_grad_(False)
    log(f"base adapted: the Medusa-2 adapter of {folder} merged into layers {info.layers[0]}-{info.layers[-1]}")
    return LoadedModel(model, loaded.tokenizer, f"{loaded.name}+adapter:{info.base_digest[:8]}", loaded.dtype,
                       loaded.device, loaded.weights)
