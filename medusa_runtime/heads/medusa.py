"""Medusa heads: K heads of L residual blocks, then a vocabulary projection; two checkpoint formats.

* ``official`` (FasterDecoding/Medusa): each head owns a projection initialised from the base
  ``lm_head``; ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``; weights ``medusa_lm_head.safetensors`` (or ``.pt``) with keys
  ``{head}.{block}.linear.weight|bias`` and ``{head}.{L}.weight``.
* ``shared`` (text-generation-inference's MedusaHeadV2): residual blocks only, keys
  ``{head}.{block}.linear.weight|bias``; logits come from the base model's own ``lm_head``.

Head j reads the hidden state at position t and proposes the token at t + j + 2.

*Root-conditioned* heads (``train --condition root``, this project's extension, shared format only)
also read the token at t + 1, the step's root, which the decoder knows before it runs the heads (it
is the base model's choice from the same hidden state): head j's first block becomes
``x + SiLU(W x + b + U_j e)`` with e the base model's input embedding of the root and U_j [H, H]
zero-initialised (so a fresh conditioned head equals a plain one). Keys ``{head}.root.weight``,
``config.json`` ``medusa_root_conditioned: true``. The official code would ignore the extra weights,
so such heads are never written in the official format.

*Path-conditioned* heads (``train --condition path``) go one step further: head j >= 1 also reads its
parent, the token at t + j + 1 (the candidate one level up in the tree): ``+ P_j e_parent`` inside the
same activation, P_j [H, H] zero-initialised (head 0's parent is the root, already read through U_0).
The decoder then scores head j once per parent node of tree level j (one small batched matmul per
level), so sibling subtrees get their own candidates. Keys ``{head}.parent.weight`` for heads 1..K-1,
``config.json`` ``medusa_path_conditioned: true``.

Either format may carry a *draft vocabulary* (``draft_vocab.json``: sorted token ids): heads trained
on a part of the vocabulary (``train --vocab replies``) propose only those tokens, so the projection
costs S rows instead of V (12,101 of 49,152 for the shipped heads). Verification is unchanged, so
outputs stay exact; only the candidates come from the smaller set.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from treesearch.fsutil import atomic_dir

FORMATS = ("official", "shared")
WEIGHT_NAMES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")
DRAFT_VOCAB_FILE = "draft_vocab.json"


class HeadsError(ValueError):
    """Heads that cannot be loaded or do not fit the model, with a one-line reason."""


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int  # K: Medusa heads (head j proposes token t+j+2)
    num_layers: int  # L: residual blocks per head
    hidden_size: int  # H: base model hidden size
    vocab_size: int  # V: base model vocabulary
    shared_lm_head: bool  # True: logits through the base lm_head (format 'shared')
    base_model: str = ""  # base_model_name_or_path written to config.json
    root_conditioned: bool = False  # heads also read the input embedding of the token at t + 1 (the root)
    path_conditioned: bool = False  # head j >= 1 also reads its parent, the token at t + j + 1 (needs root)
    # the draft projection scored in int8 (Int8Projection): half the bytes a tree level reads, which is most of
    # the heads' time on a CPU; config.json "medusa_draft_projection": "int8"
    projection_int8: bool = False


class Int8Projection:
    """A projection W [S, H] (or [K, S, H], one per head) scored in int8, as the C library scores it: per output row
    a scale sw = max|w| / 127 and q = round(w / sw); per input row sx = max|x| / 127 and x8 = round(x / sx) (ties
    to even; an all-zero row gives zeros); ``logits = bf16(float32(x8 . q) * (sx * sw))`` in the states' dtype. The
    integer sums are exact in float32 (|x8 . q| <= 127 * 127 * H < 2^24 for H up to 1040), so this equals the C
    library's int32 sums bit for bit whatever the summation order."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        self.scale = w.abs().amax(-1) / 127  # [S] or [K, S]
        self.q = torch.where(self.scale[..., None] > 0, torch.round(w / self.scale[..., None].clamp_min(1e-30)),
                             torch.zeros_like(w))  # integers in [-127, 127], as float32
        if w.shape[-1] * 127 * 127 >= 2 ** 24:
            raise HeadsError(f"an int8 projection needs a hidden size below 1041, got {w.shape[-1]}")

    @staticmethod
    def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] -> (x8 [..., H] float32 integers, sx [..., 1])."""
        x = x.float()
        sx = x.abs().amax(-1, keepdim=True) / 127
        return torch.where(sx > 0, torch.round(x / sx.clamp_min(1e-30)), torch.zeros_like(x)), sx

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """states [..., H] (shared) or [..., K, H] (one projection per head) -> logits [..., S] / [..., K, S]."""
        x8, sx = self.quantize_rows(states)
        if self.q.dim() == 2:
            acc = x8 @ self.q.T
        else:
            acc = torch.einsum("...kh,kvh->...kv", x8, self.q)
        return (acc * (sx * self.scale)).to(states.dtype)


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``, zero-initialised so that a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """``extra`` (root-conditioned heads' first block): added inside the activation."""
        z = self.linear(x)
        return x + self.act(z if extra is None else z + extra)


class MedusaHeads(nn.Module):
    """All heads together. ``forward(hidden [..., H], lm_head) -> logits [..., K, V]``."""

    def __init__(self, config: HeadsConfig):
        super().__init__()
        if config.num_heads < 1 or config.num_layers < 0:
            raise HeadsError(f"need at least one head and zero or more layers, got {config}")
        if config.root_conditioned and config.num_layers < 1:
            raise HeadsError("root-conditioned heads need at least one residual layer")
        if config.path_conditioned and not config.root_conditioned:
            raise HeadsError("path-conditioned heads are root-conditioned too (set both)")
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        # official format: one projection per head, [K, V, H]; shared format uses the base lm_head
        self.proj = None
        if not config.shared_lm_head:
            self.proj = nn.Parameter(torch.zeros(config.num_heads, config.vocab_size, config.hidden_size))
        # root-conditioned heads: U [K, H, H] maps the root token's input embedding into each first block
        self.root_weight = None
        if config.root_conditioned:
            self.root_weight = nn.Parameter(torch.zeros(config.num_heads, config.hidden_size, config.hidden_size))
        # path-conditioned heads: P [K-1, H, H]; P[j-1] maps head j's parent token embedding (heads 1..K-1)
        self.parent_weight = None
        if config.path_conditioned and config.num_heads > 1:
            self.parent_weight = nn.Parameter(
                torch.zeros(config.num_heads - 1, config.hidden_size, config.hidden_size))
        self.draft_vocab: torch.Tensor | None = None  # [S] sorted token ids the heads propose from (None: all)

    def set_draft_vocab(self, ids: torch.Tensor | list[int] | None) -> None:
        """Restrict proposals to these token ids (None: the whole vocabulary)."""
        if ids is None:
            self.draft_vocab = None
            return
        vocab = torch.as_tensor(ids, dtype=torch.long).flatten().unique()  # sorted, no repeats
        if vocab.numel() == 0 or int(vocab[0]) < 0 or int(vocab[-1]) >= self.config.vocab_size:
            raise HeadsError(f"a draft vocabulary needs 1 or more token ids within [0, {self.config.vocab_size})")
        self.draft_vocab = vocab

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def root_conditioned(self) -> bool:
        return self.root_weight is not None

    @property
    def path_conditioned(self) -> bool:
        return self.config.path_conditioned

    def init_projection_from(self, lm_head: nn.Module) -> None:
        """Official recipe: every head's projection starts as a copy of the base lm_head."""
        if self.proj is not None:
            with torch.no_grad():
                self.proj.copy_(lm_head.weight.detach().unsqueeze(0).expand_as(self.proj))

    def head_states(self, hidden: torch.Tensor, root_embedding: torch.Tensor | None = None,
                    parent_embeddings: torch.Tensor | None = None) -> torch.Tensor:
        """[..., H] -> [..., K, H]: each head's residual stack applied to the same hidden state.

        ``root_embedding`` [..., H]: the input embedding of the token after each position (needed, and
        only read, by root-conditioned heads). ``parent_embeddings`` [..., K-1, H]: for head j >= 1 the
        embedding of the token at t + j + 1 (path-conditioned heads only)."""
        if self.root_weight is None:
            return torch.stack([blocks(hidden) for blocks in self.blocks], dim=-2)
        if self.path_conditioned and self.num_heads > 1 and parent_embeddings is None:
            raise HeadsError("path-conditioned heads need each head's parent token embedding")
        states = [self.conditioned_state(j, hidden, root_embedding,
                                         None if j == 0 or parent_embeddings is None else parent_embeddings[..., j - 1, :])
                  for j in range(self.num_heads)]
        return torch.stack(states, dim=-2)

    def conditioned_state(self, j: int, hidden: torch.Tensor, root_embedding: torch.Tensor | None,
                          parent_embedding: torch.Tensor | None = None) -> torch.Tensor:
        """Head j's state [..., H] of a root-conditioned head: its first block reads
        ``U_j e_root (+ P_j e_parent for path-conditioned heads, j >= 1)`` inside the activation.
        The three inputs broadcast: one hidden state [H] and root [H] with several parents [P, H] give [P, H]."""
        if root_embedding is None:
            raise HeadsError("root-conditioned heads need the root token's embedding")
        extra = root_embedding @ self.root_weight[j].T.to(root_embedding.dtype)  # [..., H]
        if self.path_conditioned and j > 0:
            if parent_embedding is None:
                raise HeadsError(f"path-conditioned head {j} needs its parent token's embedding")
            extra = extra + parent_embedding @ self.parent_weight[j - 1].T.to(parent_embedding.dtype)
        blocks = self.blocks[j]
        x = blocks[0](hidden, extra)
        for block in blocks[1:]:
            x = block(x)
        return x

    def stacked_blocks(self, num_heads: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``num_heads`` heads' blocks stacked per level, for one batched matmul per level:
        ``[(W^T [K, H, H], b [K, 1, H]), ...]`` so that ``s = s + silu(baddbmm(b, s, W^T))`` on s [K, 1, H]."""
        k = self.num_heads if num_heads is None else num_heads
        levels = []
        for level in range(self.config.num_layers):
            blocks = [self.blocks[j][level].linear for j in range(k)]
            weight = torch.stack([b.weight.detach().t() for b in blocks]).contiguous()
            bias = torch.stack([b.bias.detach() for b in blocks])[:, None, :].contiguous()
            levels.append((weight, bias))
        return levels

    def projection(self, lm_weight: torch.Tensor | None, num_heads: int | None = None,
                   use_draft_vocab: bool = True) -> torch.Tensor:
        """The vocabulary rows the first ``num_heads`` heads score: ``[S, H]`` (shared format, the base
        ``lm_head`` rows of the draft vocabulary, or all V) or ``[K, S, H]`` (each head's own projection)."""
        k = self.num_heads if num_heads is None else num_heads
        vocab = self.draft_vocab if use_draft_vocab else None
        if self.proj is None:
            if lm_weight is None:
                raise HeadsError("shared-format heads need the base model's lm_head")
            return lm_weight if vocab is None else lm_weight[vocab.to(lm_weight.device)]
        proj = self.proj[:k]
        return proj if vocab is None else proj[:, vocab.to(proj.device)]

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Map indices into the projection's rows back to token ids."""
        return index if self.draft_vocab is None else self.draft_vocab.to(index.device)[index]

    def draft_logits(self, states: torch.Tensor, lm_weight: torch.Tensor | None) -> torch.Tensor:
        """Head states [..., K, H] -> logits over the draft vocabulary [..., K, S] (S = V without one)."""
        w = self.projection(lm_weight, states.shape[-2])
        if self.config.projection_int8:
            return Int8Projection(w)(states)
        if w.dim() == 2:
            return states @ w.T  # one matmul for all heads
        return torch.einsum("...kh,kvh->...kv", states, w)  # [..., K, H] x [K, S, H]

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None,
                root_embedding: torch.Tensor | None = None, parent_embeddings: torch.Tensor | None = None
                ) -> torch.Tensor:
        """hidden [..., H] -> logits [..., K, V]; tokens outside the draft vocabulary get -inf."""
        logits = self.draft_logits(self.head_states(hidden, root_embedding, parent_embeddings),
                                   None if lm_head is None else lm_head.weight)
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(logits.device), logits)


# ---------------------------------------------------------------------------- checkpoint I/O


def checkpoint_state_dict(heads: MedusaHeads, fmt: str, lm_weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The tensors of a heads checkpoint in ``fmt``: the blocks under ``{i}.{j}.linear.weight|bias`` (and the
    root / parent matrices of conditioned heads); ``official`` adds each head's projection ``{i}.{L}.weight``
    (a copy of ``lm_weight``, the base lm_head, for shared heads)."""
    out: dict[str, torch.Tensor] = {}
    cfg = heads.config
    for i, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            out[f"{i}.{j}.linear.weight"] = block.linear.weight.detach()
            out[f"{i}.{j}.linear.bias"] = block.linear.bias.detach()
        if heads.root_weight is not None:
            out[f"{i}.root.weight"] = heads.root_weight[i].detach()
        if heads.parent_weight is not None and i > 0:
            out[f"{i}.parent.weight"] = heads.parent_weight[i - 1].detach()
        if fmt == "official":
            if heads.proj is not None:
                out[f"{i}.{cfg.num_layers}.weight"] = heads.proj[i].detach()
            elif lm_weight is not None:  # shared heads written in the official layout get lm_head copies
                out[f"{i}.{cfg.num_layers}.weight"] = lm_weight.detach()
            else:
                raise HeadsError("writing shared heads in the official format needs the base lm_head")
    return {k: v.contiguous().clone() for k, v in out.items()}


def save_heads(heads: MedusaHeads, out_dir: str | os.PathLike[str], fmt: str = "shared",
               lm_head: nn.Module | None = None) -> Path:
    """Write ``config.json`` + ``medusa_lm_head.safetensors`` atomically (temp dir, then rename)."""
    if fmt not in FORMATS:
        raise HeadsError(f"unknown head format {fmt!r}; use one of {FORMATS}")
    cfg = heads.config
    if fmt == "shared" and heads.proj is not None:
        raise HeadsError("heads with their own projections cannot be saved in the shared format "
                         "(the projections would be lost); save them as 'official'")
    if fmt == "official" and heads.root_conditioned:
        raise HeadsError("root-conditioned heads have no official-format layout (the official code would "
                         "ignore their root weights); save them as 'shared'")
    with atomic_dir(out_dir) as tmp:
        save_file(checkpoint_state_dict(heads, fmt, None if lm_head is None else lm_head.weight),
                  str(tmp / "medusa_lm_head.safetensors"))
        meta = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                "base_model_name_or_path": cfg.base_model, "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size, "medusa_format": fmt}
        if cfg.root_conditioned:
            meta["medusa_root_conditioned"] = True
        if cfg.path_conditioned:
            meta["medusa_path_conditioned"] = True
        if cfg.projection_int8:
            meta["medusa_draft_projection"] = "int8"
        (tmp / "config.json").write_text(json.dumps(meta, indent=1) + "\n")
        if heads.draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps(heads.draft_vocab.tolist()) + "\n")
    return Path(out_dir)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_NAMES:
        f = folder / name
        if f.is_file():
            sd = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                 weights_only=True)
            # checkpoints saved from a full MedusaModel carry a 'medusa_head.' prefix
            return {k.removeprefix("medusa_head."): v for k, v in sd.items() if not k.startswith("base_model")}
    raise HeadsError(f"no head weights in {folder} (looked for {', '.join(WEIGHT_NAMES)})")


def _heads_in_weights(sd: dict[str, torch.Tensor], configured: int, cfg_file: Path) -> int:
    """The number of heads the weights hold (keys ``{head}.{...}``); published checkpoints exist whose
    ``medusa_num_heads`` disagrees with their weights: the weights win, with a warning."""
    found = {int(key.split(".", 1)[0]) for key in sd if key.split(".", 1)[0].isdigit()}
    if not found or found != set(range(len(found))) or len(found) == configured:
        return configured
    warnings.warn(f"{cfg_file} says medusa_num_heads={configured} but the weights hold {len(found)} heads; "
                  f"loading {len(found)}", stacklevel=3)
    return len(found)


def _conditioning_weights(sd: dict[str, torch.Tensor], path: Path, kind: str, heads: range,
                          hidden_size: int) -> torch.Tensor:
    """The ``{head}.{kind}.weight`` matrices of these heads stacked, [len(heads), H, H]; missing or
    mis-sized ones refused (kind: root | parent)."""
    try:
        weights = torch.stack([sd[f"{i}.{kind}.weight"] for i in heads])
    except KeyError as exc:
        condition = {"root": "root", "parent": "path"}[kind]
        raise HeadsError(f"{path} lacks {kind} weight {exc.args[0]!r} (config says {condition}-conditioned)") from None
    if weights.shape[1:] != (hidden_size, hidden_size):
        raise HeadsError(f"{kind} weights in {path} are {tuple(weights.shape[1:])}, "
                         f"the model needs ({hidden_size}, {hidden_size})")
    return weights


def load_heads(folder: str | os.PathLike[str], hidden_size: int, vocab_size: int) -> MedusaHeads:
    """Load either format; refuse heads whose sizes do not match the base model."""
    path = Path(folder)
    if not path.is_dir():
        raise HeadsError(f"heads folder not found: {folder}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HeadsError(f"heads folder {folder} has no config.json")
    try:
        meta = json.loads(cfg_file.read_text())
        k, num_layers = int(meta["medusa_num_heads"]), int(meta["medusa_num_layers"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HeadsError(f"{cfg_file} is not a Medusa config ({exc.__class__.__name__}: {exc})") from None
    sd = _read_weights(path)
    k = _heads_in_weights(sd, k, cfg_file)
    shared = f"0.{num_layers}.weight" not in sd
    if num_layers > 0:
        w = sd.get("0.0.linear.weight")
        if w is None:
            raise HeadsError(f"{path} lacks key '0.0.linear.weight' for {num_layers} residual layers")
        if w.shape[-1] != hidden_size:
            raise HeadsError(f"heads in {folder} have hidden size {w.shape[-1]}, the model has {hidden_size}")
    if not shared:
        v, h = sd[f"0.{num_layers}.weight"].shape
        if h != hidden_size:
            raise HeadsError(f"heads in {folder} have hidden size {h}, the model has {hidden_size}")
        if v != vocab_size:
            raise HeadsError(f"heads in {folder} have vocabulary {v}, the model has {vocab_size}")
    conditioned = bool(meta.get("medusa_root_conditioned", False))
    path_cond = bool(meta.get("medusa_path_conditioned", False))
    if path_cond and not conditioned:
        raise HeadsError(f"{cfg_file} says path-conditioned but not root-conditioned")
    projection = meta.get("medusa_draft_projection", "bf16")
    if projection not in ("bf16", "int8"):
        raise HeadsError(f"{cfg_file}: medusa_draft_projection must be 'bf16' or 'int8', got {projection!r}")
    heads = MedusaHeads(HeadsConfig(k, num_layers, hidden_size, vocab_size, shared,
                                    str(meta.get("base_model_name_or_path", "")), conditioned, path_cond,
                                    projection == "int8"))
    own = {}
    for i in range(k):
        for j in range(num_layers):
            for part in ("weight", "bias"):
                key = f"{i}.{j}.linear.{part}"
                if key not in sd:
                    raise HeadsError(f"{path} lacks key {key!r} (config says {k} heads x {num_layers} layers)")
                own[f"blocks.{i}.{j}.linear.{part}"] = sd[key]
    if not shared:
        try:
            own["proj"] = torch.stack([sd[f"{i}.{num_layers}.weight"] for i in range(k)])
        except KeyError as exc:
            raise HeadsError(f"{path} lacks projection {exc.args[0]!r}") from None
    if conditioned:
        own["root_weight"] = _conditioning_weights(sd, path, "root", range(k), hidden_size)
    if path_cond and k > 1:
        own["parent_weight"] = _conditioning_weights(sd, path, "parent", range(1, k), hidden_size)
    heads.load_state_dict({k_: v.float() for k_, v in own.items()})
    vocab_file = path / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        try:
            ids = json.loads(vocab_file.read_text())
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError("not a list of token ids")
        except ValueError as exc:
            raise HeadsError(f"{vocab_file} is not a list of token ids ({exc})") from None
        heads.set_draft_vocab(ids)
    return heads


def fresh_heads(num_heads: int, num_layers: int, hidden_size: int, vocab_size: int,
                base_model: str = "") -> MedusaHeads:
    """Untrained shared-format heads (every head starts as a copy of the base next-token head)."""
    return MedusaHeads(HeadsConfig(num_heads, num_layers, hidden_size, vocab_size, True, base_model))


# names of the shipped head sets, their folders: the default; the Medusa-1 heads kept beside Medusa-2 ones;
# unconditioned heads, which serving engines can load (the others read root and parent tokens)
SHIPPED = {"default": "default_heads", "medusa1": "medusa1_heads", "unconditioned": "unconditioned_heads"}


def shipped_heads_dir(name: str = "default") -> Path | None:
    """A head set this project trained and ships for the default model (shared-lm_head format), if any:
    ``default`` (what ``--heads default`` loads), ``medusa1`` (Medusa-1 heads, kept beside Medusa-2 ones
    for comparison; the default set itself where that needs no adapter, i.e. is Medusa-1) or
    ``unconditioned`` (heads an engine without root/parent conditioning serves)."""
    data = Path(__file__).resolve().parents[1] / "data"  # medusa_runtime/data
    own, default = data / SHIPPED[name] / "heads", data / SHIPPED["default"] / "heads"
    if (own / "config.json").is_file():
        return own
    if name == "medusa1" and (default / "config.json").is_file() and adapter_entry(default) is None:
        return default
    return None


ADAPTER_KEY = "medusa_base_adapter"  # config.json entry of heads trained with a base adapter (medusa2.py)


def adapter_entry(folder: Path) -> dict | None:
    """The ``medusa_base_adapter`` entry of a heads folder's config.json, None where there is none (or no
    readable config: loading the heads says what is wrong with it)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get(ADAPTER_KEY) or None
    except (OSError, json.JSONDecodeError):
        return None


def frequent_draft_vocab(heads: MedusaHeads, counts: dict[int, int], size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``counts`` among those the heads propose now (their draft
    vocabulary, else every token), sorted; ties keep the lower id. A smaller projection at every step: on the
    shipped heads, 4096 of 12101 tokens cut the heads' time per step by 40 % at the same tau (see
    docs/reports/drift-probe-and-draft-vocab.md)."""
    allowed = set(range(heads.config.vocab_size)) if heads.draft_vocab is None else set(heads.draft_vocab.tolist())
    if not 1 <= size < len(allowed):
        raise HeadsError(f"a cut draft vocabulary needs 1 <= size < {len(allowed)} (the heads' tokens now), got {size}")
    ranked = sorted((t for t in allowed if counts.get(t, 0) > 0), key=lambda t: (-counts[t], t))
    if len(ranked) < size:
        raise HeadsError(f"the replies hold only {len(ranked)} of the heads' tokens, fewer than {size}")
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def auto_heads(spec: str | None, model: str) -> str | None:
    """``auto``: the shipped heads (``default``) on the default model, ``none`` on any other (the shipped heads
    belong to the default model); any other spec as it is."""
    if spec != "auto":
        return spec
    return "default" if model == "default" else "none"


def heads_folder(spec: str | None) -> Path | None:
    """The folder a heads spec names (``default``, ``medusa1``: shipped heads), None for no heads or fresh ones."""
    if spec is None or spec.lower() in ("", "none") or spec.startswith("fresh:"):
        return None
    return shipped_heads_dir(spec) if spec in SHIPPED else Path(spec)


def resolve_heads(spec: str | None, hidden_size: int, vocab_size: int, base_model: str = "") -> MedusaHeads | None:
    """``None``/``none`` -> no heads; ``default`` -> the shipped heads; ``fresh:K[:L]`` -> untrained;
    anything else -> a folder in either format."""
    if spec is None or spec.lower() in ("", "none"):
        return None
    if spec in SHIPPED:
        shipped = shipped_heads_dir(spec)
        if shipped is None:
            raise HeadsError(f"no shipped '{spec}' heads in this installation; train some with 'medusa-bench train'")
        return load_heads(shipped, hidden_size, vocab_size)
    if spec.startswith("fresh:"):
        parts = spec.split(":")[1:]
        try:
            k = int(parts[0])
            num_layers = int(parts[1]) if len(parts) > 1 else 1
        except (ValueError, IndexError):
            raise HeadsError(f"bad heads spec {spec!r}: use fresh:K or fresh:K:L") from None
        if k < 1 or num_layers < 0:
            raise HeadsError(f"bad heads spec {spec!r}: need K >= 1 and L >= 0")
        return fresh_heads(k, num_layers, hidden_size, vocab_size, base_model)
    return load_heads(spec, hidden_size, vocab_size)
