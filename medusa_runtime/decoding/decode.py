"""The Medusa decode loop on a transformers causal LM, and plain decoding as its degenerate case.

One step::

    root = next token (chosen last step)      heads(hidden of last accepted node) -> top-k per head
    tree tokens  = [root, head0 top-k, head1 top-k, ...][candidate_index]          # [N]
    verify       = ONE forward of the N nodes on top of the KV cache, 4D tree mask, positions len+depth
    acceptance   = path of accepted nodes + next token (rule: greedy | typical | sample)
    compaction   = keep only the path's keys/values in the cache (gather, no recompute)

Plain decoding is the same loop with a root-only tree (one token per step, same cache code).

Path-conditioned heads (heads.py) read each node's parent token, so level d of the tree is scored once
per parent node of level d - 1 (head d-1 on [parents, H] states) and the tree tokens are laid out in
node order directly rather than gathered from one top-k per head.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Generator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import torch
from torch import nn

from medusa_runtime.decoding.acceptance import AcceptConfig, accept, first_token
from medusa_runtime.decoding.drafter import Drafter, make_drafter
from medusa_runtime.engines import make_engine
from medusa_runtime.engines.base import DecodeStep
from medusa_runtime.model import LoadedModel, chat_template_ids, device_sync
from medusa_runtime.tree.buffers import TreeBuffers
from medusa_runtime.tree.compiler import compile_tree, path_plan  # noqa: F401 (path_plan: re-exported)
from medusa_runtime.tree.lookup import LookupConfig, NgramIndex
from treesearch.replay import gated_depth
from treesearch.tree import Tree, load_tree

# transformers 5.x announces a rename of ``past_key_values`` to ``cache``, but in 5.23 a cache passed
# as ``cache=`` is not filled; the old keyword is the one that works (engine 'hf'), so its notice is silenced.
warnings.filterwarnings("ignore", message=r".*past_key_values.*deprecated.*", category=FutureWarning)

R = TypeVar("R")


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128  # stop after this many new tokens
    topk: int = 10  # candidates read from each head's top-k
    seed: int | None = None  # RNG seed for typical / sample, set once per decoder (None: random)
    stop_on_eos: bool = True  # stop at the model's EOS token(s)
    engine: str = "auto"  # lean | lean-torch | hf | auto (lean where the model is Llama-family); see engine.py
    lookup: LookupConfig = LookupConfig()  # prompt-lookup draft chain beside the heads (num_tokens 0: off)
    # confidence gate on the heads' levels: each step verifies only the tree's levels 1..d where d is the
    # deepest level whose top-1 chain has an estimated probability (product of the heads' top-1 softmax
    # probabilities, over the draft vocabulary when the heads carry one) >= gate; 0 = always the whole tree.
    # Acceptance stays exact: only fewer nodes are tried.
    gate: float = 0.0
    # heads that carry a draft vocabulary (heads.draft_vocab) score only those tokens; False: the whole vocabulary
    draft_vocab: bool = True
    # root/path-conditioned heads level by level in the C library where the C forward runs (False: PyTorch ops)
    native_heads: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.gate <= 1.0:
            raise ValueError(f"gate must be within [0, 1], got {self.gate}")


@dataclass
class GenerateStats:
    """What one generate did and where its time went (seconds)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # verify forwards after prefill
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per step (root incl.)
    head_hits: list[int] = field(default_factory=list)  # steps in which depth j+1 was accepted
    tree_nodes: int = 1
    time_prefill: float = 0.0
    time_heads: float = 0.0
    time_verify: float = 0.0
    time_bookkeeping: float = 0.0
    time_total: float = 0.0
    stop_reason: str = ""  # eos | max_new_tokens | context

    def count_step(self, committed: int, heads_s: float, verify_s: float, bookkeeping_s: float) -> None:
        """One decode step: the tokens it put into the output (a path cut by EOS or the length limit counts what was
        kept), the depths it reached, and where its time went."""
        self.steps += 1
        self.accept_lengths.append(committed)
        for j in range(committed - 1):
            self.head_hits[j] += 1
        self.time_heads += heads_s
        self.time_verify += verify_s
        self.time_bookkeeping += bookkeeping_s

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def head_acceptance(self) -> list[float]:
        """Per head j: fraction of steps whose accepted path reached depth j+1."""
        return [h / self.steps if self.steps else 0.0 for h in self.head_hits]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def step_ms(self) -> float:
        """Milliseconds per decode step: the time after the prefill over the steps (at least one)."""
        return 1000 * (self.time_total - self.time_prefill) / max(1, self.steps)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out.update(tau=self.tau, head_acceptance=self.head_acceptance, tokens_per_second=self.tokens_per_second)
        return out


@dataclass
class GenerateResult:
    token_ids: list[int]  # new tokens only
    stats: GenerateStats


def run_to_end(steps: Generator[None, None, R]) -> R:
    """Drive a generator that pauses between steps (``MedusaDecoder.generate_steps``) to its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class MedusaDecoder:
    """Decoding with a fixed model, heads, tree, acceptance rule and engine. Buffers are built once."""

    def __init__(self, loaded: LoadedModel, heads: nn.Module | None = None, tree: Tree | str | None = None,
                 accept_cfg: AcceptConfig = AcceptConfig(), config: DecodeConfig = DecodeConfig()):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.accept_cfg = accept_cfg
        self.config = config
        self.heads = heads
        self.tree = None if heads is None or tree is None else load_tree(tree)
        # every layout a step may verify: the tree with lookup chains of 0..L tokens, its gated cuts
        compiled = compile_tree(self.tree, heads.num_heads if self.tree else 0, config.topk,
                                config.lookup.num_tokens, config.gate, self.device)
        if self.tree is not None:
            heads.to(device=self.device, dtype=loaded.dtype).eval()
            heads.requires_grad_(False)
        self.variants: list[TreeBuffers] = compiled.variants  # [k]: with a lookup chain of k tokens
        self.gated: list[list[TreeBuffers]] | None = compiled.gated  # [d][k]: cut below level d (a gate)
        self.buffers: TreeBuffers = self.variants[-1]
        self.step_buffers: TreeBuffers = self.buffers  # what the last propose laid its tokens out for
        self.engine = make_engine(loaded, config.engine, max_nodes=self.buffers.num_nodes)
        self._fused = getattr(self.engine, "fused_steps", False)  # decode steps as one C call (verify_step)
        # the heads' candidates (None: plain decoding), built once: batched blocks, prepacked projection
        self.drafter: Drafter | None = None if self.tree is None else make_drafter(
            heads, self.model, self.engine, self.tree, config.topk, self.device, config.draft_vocab,
            config.native_heads)
        self._root = torch.zeros(1, dtype=torch.long, device=self.device)
        # on the CPU the root is written through a NumPy view: an item store, not a tensor op (fill_)
        self._root_np = self._root.numpy() if self.device.type == "cpu" else None
        self.eos = set(loaded.eos_token_ids) if config.stop_on_eos else set()
        # one RNG per decoder: a seeded decoder replays the same sequence of generate calls
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed if config.seed is not None else int(torch.seed()))

    def _gated_depth(self, head_logits: torch.Tensor) -> int:
        """Deepest level whose top-1 chain probability (product of the heads' top-1 probabilities) passes the gate."""
        return self._gated_depth_of(torch.softmax(head_logits.float(), dim=-1).amax(dim=-1).tolist())

    def _gated_depth_of(self, top1: Sequence[float]) -> int:
        """The same from the heads' top-1 probabilities (float32 values): the replay's own rule
        (``treesearch.replay.gated_depth``, float32 products), on plain numbers, not a chain of tensor ops."""
        return gated_depth(top1, len(top1), self.config.gate)

    # ------------------------------------------------------------------ model calls

    def _sync(self) -> None:
        device_sync(self.device)

    def new_cache(self, capacity: int):
        """An empty KV cache with room for ``capacity`` positions (the lean engine preallocates it)."""
        return self.engine.new_cache(capacity)

    def prefill(self, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids [n] into an empty cache -> logits [1, V] and hidden [1, H] of the last position."""
        return self.engine.forward(ids, 0, cache, last_only=True)

    def propose(self, hidden: torch.Tensor, root: int, draft: Sequence[int] = (), out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Tree tokens [N] from the root token, the heads' top-k on one hidden state [H] and a lookup draft.

        The buffers the tokens are laid out for (the full tree, or its gated cut) are left in ``step_buffers``.
        ``out``: an int64 tensor of the tree's nodes that path-conditioned heads may write into (the loop's own).
        """
        buffers = self.step_buffers = self.variants[len(draft)]
        if self.tree is None:
            if not draft:
                if self._root_np is not None:
                    self._root_np[0] = root
                    return self._root
                return self._root.fill_(root)
            return torch.tensor([root, *draft], device=self.device)[buffers.candidate_index]
        if self.drafter.in_node_order:
            return self._propose_path(hidden, root, draft, out)
        top, logits = self.drafter.top(hidden, root)  # [depth, topk] token ids, [depth, S]
        if self.gated is not None:
            buffers = self.step_buffers = self.gated[self._gated_depth(logits)][len(draft)]
        self._root.fill_(root)
        parts = [self._root, top.flatten()]
        if draft:
            parts.append(torch.tensor(list(draft), device=self.device))
        return torch.cat(parts)[buffers.candidate_index]

    def _propose_path(self, hidden: torch.Tensor, root: int, draft: Sequence[int], out: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Path-conditioned heads: tree tokens in node order, level by level (each level's parents known)."""
        nodes, chain = self.drafter.nodes(hidden, root, self.step_gate, out)
        return self.lay_out_path(nodes, chain, draft)

    @property
    def step_gate(self) -> float:
        """The gate a step's heads read (0: this decoder verifies its whole tree)."""
        return self.config.gate if self.gated is not None else 0.0

    @property
    def native_heads(self):
        """The C library's heads (``NativeHeadLevels``) where this decoder drafts its tree through them, else None:
        a batched step then drafts every row's tree in one call (``NativeHeadLevels.trees``)."""
        if self.tree is None or not self.drafter.in_node_order:
            return None
        return getattr(self.drafter, "native", None)

    def lay_out_path(self, nodes: torch.Tensor, chain: Sequence[float], draft: Sequence[int]) -> torch.Tensor:
        """Path-conditioned heads' tree tokens [N] (node order) and their top-1 chain -> the step's tokens: the tree
        cut where the gate stops it, then the lookup draft; its buffers left in ``step_buffers``."""
        buffers = self.step_buffers = (self.gated[self._gated_depth_of(chain)][len(draft)]
                                       if self.gated is not None else self.variants[len(draft)])
        tree_nodes = buffers.num_nodes - len(draft)  # a gated cut keeps a prefix of the nodes (official order)
        if not draft:
            return nodes if tree_nodes == nodes.shape[0] else nodes[:tree_nodes]
        return torch.cat([nodes[:tree_nodes], torch.tensor(list(draft), device=self.device)])

    def verify(self, tokens: torch.Tensor, cur_len: int, cache, buffers: TreeBuffers | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the tree's N tokens on top of ``cur_len`` cached positions -> logits [N, V], hidden [N, H]."""
        if tokens.shape[0] == 1:
            return self.engine.forward(tokens, cur_len, cache)
        buffers = buffers or self.variants[-1]
        positions = cur_len + buffers.position_offsets
        return self.engine.forward(tokens, cur_len, cache, tree=buffers.attn_mask, positions=positions)

    def verify_step(self, tokens: torch.Tensor, cur_len: int, cache, buffers: TreeBuffers) -> DecodeStep:
        """``verify`` as the decode loop takes it: logits, hidden, each row's argmax (None where the engine does
        not give it) and hidden's rows. Where the C forward runs, one call that also embeds, projects the logits
        and takes the argmax (``LeanEngine.decode_step``: the same values, into buffers the cache keeps; under a
        greedy rule its argmax alone, through the int8 screen of the logits, and no logits)."""
        if self._fused:  # greedy acceptance reads the argmax alone (the step's logits are then None)
            greedy = self.accept_cfg.is_greedy
            if tokens.shape[0] == 1:
                return self.engine.decode_step(tokens, cur_len, cache, argmax_only=greedy)
            return self.engine.decode_step(tokens, cur_len, cache, buffers.attn_mask, buffers.position_offsets,
                                           argmax_only=greedy)
        logits, hidden = self.verify(tokens, cur_len, cache, buffers)
        return DecodeStep(logits, hidden, None, hidden)

    def compact(self, cache, cur_len: int, path: Sequence[int]) -> None:
        """Keep the cache's first ``cur_len`` entries plus the accepted tree nodes, in order."""
        self.engine.compact(cache, cur_len, path)

    # ------------------------------------------------------------------ the loop

    def generate(self, input_ids: Sequence[int] | torch.Tensor) -> GenerateResult:
        """Decode ``input_ids`` to the end: the new tokens and where the time went."""
        return run_to_end(self.generate_steps(input_ids))

    @torch.inference_mode()
    def generate_steps(self, input_ids: Sequence[int] | torch.Tensor) -> Generator[None, None, GenerateResult]:
        """``generate`` as a generator that pauses after the prefill and after every step; its return value
        (``StopIteration.value``) is the GenerateResult. Time spent paused is not this run's: the stats
        count only its own time, so a caller may step several decoders in turn (``medusa_runtime.decoding.lockstep``,
        configurations compared on the same moments of a noisy machine)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).flatten()
        if ids.numel() == 0:
            raise ValueError("the prompt is empty")
        cfg, stats = self.config, GenerateStats(prompt_tokens=int(ids.numel()), tree_nodes=self.buffers.num_nodes)
        depth = self.buffers.depth
        stats.head_hits = [0] * depth
        gen = self.generator if not self.accept_cfg.is_greedy else None
        max_len = self.loaded.max_length
        if ids.numel() >= max_len:
            raise ValueError(f"the prompt has {ids.numel()} tokens; the model's context is {max_len}")

        t_start = time.perf_counter()
        # tree slots may run past the model's context (their positions never do): no clamp on the node part
        capacity = min(max_len, ids.numel() + cfg.max_new_tokens) + self.buffers.num_nodes
        cache = self.new_cache(capacity)
        logits, hidden = self.prefill(ids, cache)
        root = first_token(logits[-1], self.accept_cfg, gen)
        hidden = hidden[-1]
        cur_len = int(ids.numel())
        out: list[int] = []
        ngrams = NgramIndex(cfg.lookup, ids.tolist()) if cfg.lookup.num_tokens else None
        # this generate's tree tokens, written in place by path-conditioned heads (no allocation per step)
        nodes = torch.empty(self.tree.num_nodes, dtype=torch.long, device=self.device) if self.tree else None
        self._sync()
        stats.time_prefill = time.perf_counter() - t_start
        paused = 0.0  # seconds between a yield and the resume: another run's time

        while True:
            t_pause = time.perf_counter()
            yield
            paused += time.perf_counter() - t_pause
            # stop checks: the pending root is always emitted when we stop
            if root in self.eos or len(out) + 1 >= cfg.max_new_tokens or cur_len + depth >= max_len:
                out.append(root)
                stats.stop_reason = ("eos" if root in self.eos else "max_new_tokens"
                                     if len(out) >= cfg.max_new_tokens else "context")
                break
            t0 = time.perf_counter()
            draft = ngrams.draft(root) if ngrams is not None else []
            tokens = self.propose(hidden, root, draft, nodes)
            buffers = self.step_buffers
            self._sync()
            t1 = time.perf_counter()
            step = self.verify_step(tokens, cur_len, cache, buffers)
            self._sync()
            t2 = time.perf_counter()
            acc = accept(tokens, step.logits, buffers, self.accept_cfg, gen, pred=step.pred)
            # list lookups, not a tensor index: right after a forward that streamed the weights through the
            # caches, each distinct torch op costs ~20-130 us of cold code (~5-15 warm)
            candidates = tokens.tolist()
            committed = [candidates[i] for i in acc.path]
            if ngrams is not None:
                ngrams.extend(committed)
            self.compact(cache, cur_len, acc.path)
            cur_len += len(acc.path)
            hidden = step.rows[acc.path[-1]]
            root = acc.next_token
            n_out, stop = emit_committed(out, committed, self.eos, cfg.max_new_tokens)
            stats.count_step(n_out, t1 - t0, t2 - t1, time.perf_counter() - t2)
            if stop:
                stats.stop_reason = stop
                break
        self._sync()
        stats.time_total = time.perf_counter() - t_start - paused
        stats.new_tokens = len(out)
        return GenerateResult(out, stats)


def emit_committed(out: list[int], committed: Sequence[int], eos: set[int],
                   max_new_tokens: int) -> tuple[int, str | None]:
    """Append a step's committed tokens to ``out`` up to an EOS or the length limit: (tokens appended, why it
    stopped or None)."""
    n_out = 0
    for t in committed:
        out.append(t)
        n_out += 1
        if t in eos:
            return n_out, "eos"
        if len(out) >= max_new_tokens:
            return n_out, "max_new_tokens"
    return n_out, None


def encode_prompt(loaded: LoadedModel, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt, through the model's chat template when ``chat``."""
    tok = loaded.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"model {loaded.name} has no chat template; drop --chat")
        return chat_template_ids(loaded, [{"role": "user", "content": prompt}])
    return list(tok(prompt, add_special_tokens=True)["input_ids"])
