"""Medusa decoding of many requests at once, with continuous batching.

Every live request is a row of the batch with its own cache, its pending root token and its last hidden state.
One step::

    per row : tree tokens = propose(hidden, root, lookup draft)       # the row's own heads' top-k (or plain)
    together: ONE forward of all rows' trees (engines.rows)             # [sum of nodes, V] logits, argmax
    per row : acceptance (greedy | typical | sample) -> path, next root; compaction of the row's cache

With a schedule, the configuration a step runs follows the number of rows it verifies: each range of batch sizes
has its own decoder (tree, lookup chain, gate) over the same model and heads. A row's state (cache, root,
hidden state, n-gram index) belongs to the request, not to a tree, so a step may switch configurations without
losing anything, and greedy tokens stay the model's own whichever tree verified them.

A request joins between two steps (its prompt's forward alone, then its first token) and leaves when it stops
(EOS, its length cap, the context) or is dropped (a client gone): the other rows go on. Each row makes the
same calls the decoder's own loop (``MedusaDecoder.generate_steps``) makes for it alone, and the batched
forward gives a row what its own forward gives, so a request's tokens do not depend on the batch around it.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from medusa_runtime.decoding.acceptance import AcceptConfig, accept, first_token
from medusa_runtime.decoding.decode import GenerateStats, MedusaDecoder, emit_committed
from medusa_runtime.engines.base import EngineError
from medusa_runtime.engines.lean import LeanEngine
from medusa_runtime.engines.rows import Seq, forward_rows
from medusa_runtime.tree.buffers import TreeBuffers
from medusa_runtime.tree.lookup import LookupConfig, NgramIndex


@dataclass
class Row:
    """One request in the batch."""

    key: Hashable
    max_new_tokens: int
    cache: object
    cur_len: int  # committed positions in the cache
    root: int  # the next token, chosen, not yet committed
    hidden: torch.Tensor  # [H] the last committed position's hidden state (the heads read it)
    accept_cfg: AcceptConfig  # this request's acceptance rule and temperature
    gen: torch.Generator | None  # its own RNG (a seed gives the same sample whatever shares the batch)
    stats: GenerateStats
    ngrams: dict[LookupConfig, NgramIndex]  # one per lookup chain the configurations draft
    nodes: dict[int, torch.Tensor]  # per configuration with heads: path-conditioned heads write its tokens here
    out: list[int] = field(default_factory=list)
    stop: str = ""  # why it stopped (eos | max_new_tokens | context), "" while live
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class StepTokens:
    """What one step gave a request: its new tokens, and why it stopped ("" while it goes on)."""

    key: Hashable
    tokens: list[int]
    stop: str
    stats: GenerateStats | None = None  # the request's, once it stopped


def batches(decoder: MedusaDecoder) -> bool:
    """Whether the decoder's engine runs several requests in one forward (the lean engine's); others take one."""
    return isinstance(decoder.engine, LeanEngine)


@dataclass(frozen=True)
class Scheduled:
    """The decoder a step runs when it verifies ``first``..``last`` rows (inclusive)."""

    first: int
    last: int
    decoder: MedusaDecoder


class BatchDecoder:
    """Continuous batching over one ``MedusaDecoder``'s model, heads, tree, acceptance rule and engine, or over a
    schedule of decoders by batch size (ascending contiguous ranges from 1; beyond the last, the last's)."""

    def __init__(self, decoder: MedusaDecoder, max_batch: int = 16, schedule: Sequence[Scheduled] = ()):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch > 1 and not batches(decoder):
            raise EngineError(f"batched decoding runs on the lean engine (Llama-family models); {decoder.loaded.name} "
                              f"runs on '{decoder.engine.name}': use a batch of 1")
        expect = 1
        for s in schedule:
            if s.first != expect or s.last < s.first:
                raise ValueError(f"schedule ranges must run contiguously from 1: got [{s.first}, {s.last}]")
            if s.decoder.loaded is not decoder.loaded:
                raise ValueError("a schedule's decoders must share one model")
            expect = s.last + 1
        self.decoder, self.max_batch = decoder, max_batch
        self.schedule = tuple(schedule) or (Scheduled(1, max_batch, decoder),)
        decoders = [s.decoder for s in self.schedule]
        # every row's cache holds the largest tree; the forward runs on the engine sized for it
        self.widest = max(decoders, key=lambda d: d.buffers.num_nodes)
        self.depth = max(d.buffers.depth for d in decoders)
        self.lookups = sorted({d.config.lookup for d in decoders if d.config.lookup.num_tokens},
                              key=lambda c: c.num_tokens)
        self.rows: dict[Hashable, Row] = {}
        self.steps_by_range = [0] * len(self.schedule)  # steps each configuration ran

    def decoder_for(self, rows: int) -> MedusaDecoder:
        """The configuration a step of ``rows`` requests runs."""
        return self.schedule[self._range_of(rows)].decoder

    def _range_of(self, rows: int) -> int:
        return next((i for i, s in enumerate(self.schedule) if s.first <= rows <= s.last), len(self.schedule) - 1)

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows)

    def admit(self, key: Hashable, ids: Sequence[int], max_new_tokens: int, seed: int | None = None,
              accept_cfg: AcceptConfig | None = None) -> None:
        """A request joins: its prompt's forward alone into a cache of its own, its first token chosen. Its
        acceptance rule (default: the decoder's) may differ from the other rows': greedy and sampled requests
        share a batch."""
        dec = self.decoder
        rule = accept_cfg or dec.accept_cfg
        if key in self.rows:
            raise ValueError(f"request {key!r} is already in the batch")
        if not self.free:
            raise ValueError(f"the batch is full ({self.max_batch} rows)")
        prompt = torch.as_tensor(list(ids), dtype=torch.long, device=dec.device)
        if prompt.numel() == 0:
            raise ValueError("the prompt is empty")
        if prompt.numel() >= dec.loaded.max_length:
            raise ValueError(f"the prompt has {prompt.numel()} tokens; the model's context is {dec.loaded.max_length}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        gen = None
        if not rule.is_greedy:
            gen = torch.Generator()
            gen.manual_seed(seed if seed is not None else int(torch.seed()))
        t0 = time.perf_counter()
        capacity = min(dec.loaded.max_length, prompt.numel() + max_new_tokens) + self.widest.buffers.num_nodes
        cache = dec.new_cache(capacity)
        with torch.inference_mode():
            logits, hidden = dec.prefill(prompt, cache)
            root = first_token(logits[-1], rule, gen)
        stats = GenerateStats(prompt_tokens=int(prompt.numel()), tree_nodes=self.widest.buffers.num_nodes,
                              head_hits=[0] * self.depth, time_prefill=time.perf_counter() - t0)
        ngrams = {cfg: NgramIndex(cfg, prompt.tolist()) for cfg in self.lookups}
        self.rows[key] = Row(key, max_new_tokens, cache, int(prompt.numel()), root, hidden[-1], rule, gen, stats,
                             ngrams, {}, started=t0)

    def drop(self, key: Hashable) -> bool:
        """A request leaves before its end (its client is gone): its row and cache are freed."""
        return self.rows.pop(key, None) is not None

    def _stop_before_step(self, row: Row) -> str:
        """The decoder's own stop checks before a step: the pending root is emitted when the request stops."""
        eos, depth = self.decoder.eos, self.depth
        if row.root in eos:
            return "eos"
        if len(row.out) + 1 >= row.max_new_tokens:
            return "max_new_tokens"
        if row.cur_len + depth >= self.decoder.loaded.max_length:
            return "context"
        return ""

    def step(self, only: Collection[Hashable] | None = None, decoder: MedusaDecoder | None = None
             ) -> list[StepTokens]:
        """One decode step of every live row (or of the rows ``only`` names; the others wait): the tokens each
        request got, finished requests leave the batch. ``decoder``: this configuration instead of the
        schedule's (one over the same model, its tree no wider than the widest's: the latency profile times
        every tree on the same rows)."""
        if decoder is not None and (decoder.loaded is not self.decoder.loaded
                                    or decoder.buffers.num_nodes > self.widest.buffers.num_nodes):
            raise ValueError("a step's decoder must share the batch's model and be no wider than its widest tree")
        done, going = [], []
        rows = self.rows.values() if only is None else [self.rows[k] for k in only]
        for row in list(rows):
            stop = self._stop_before_step(row)
            if stop:
                row.out.append(row.root)
                self._finish(row, stop)
                done.append(StepTokens(row.key, [row.root], stop, row.stats))
            else:
                going.append(row)
        if going:
            with torch.inference_mode():
                done.extend(self._verify_and_accept(going, decoder))
        return done

    def _propose(self, dec: MedusaDecoder, row: Row) -> tuple[torch.Tensor, TreeBuffers]:
        lookup = dec.config.lookup
        draft = row.ngrams[lookup].draft(row.root) if lookup.num_tokens else []
        nodes = None
        if dec.tree is not None:
            nodes = row.nodes.get(id(dec))
            if nodes is None:
                nodes = row.nodes[id(dec)] = torch.empty(dec.tree.num_nodes, dtype=torch.long, device=dec.device)
        tokens = dec.propose(row.hidden, row.root, draft, nodes)
        # plain decoding's one token lives in the decoder's own root tensor, path-conditioned heads write row.nodes:
        # each row keeps its tokens until the batch's forward has read them all
        return tokens.clone(), dec.step_buffers

    def _propose_rows(self, dec: MedusaDecoder, rows: list[Row]) -> list[tuple[torch.Tensor, TreeBuffers]]:
        """Every row's tokens and buffers: where the heads run in the C library, all rows' trees in one call (the
        heads' weights read once per step, not once per row; each row gets the tokens its own call gives it)."""
        native = dec.native_heads
        if native is None or len(rows) < 2:
            return [self._propose(dec, row) for row in rows]
        lookup = dec.config.lookup
        drafts = [row.ngrams[lookup].draft(row.root) if lookup.num_tokens else [] for row in rows]
        nodes, chains = native.trees(torch.stack([row.hidden for row in rows]), [row.root for row in rows],
                                     dec.step_gate)
        return [(dec.lay_out_path(n, chain, draft), dec.step_buffers)
                for n, chain, draft in zip(nodes, chains, drafts)]

    def _verify_and_accept(self, rows: list[Row], dec: MedusaDecoder | None = None) -> list[StepTokens]:
        if dec is None:
            at_range = self._range_of(len(rows))
            self.steps_by_range[at_range] += 1
            dec = self.schedule[at_range].decoder
        t0 = time.perf_counter()
        proposed = self._propose_rows(dec, rows)
        seqs = [Seq(tokens, row.cur_len, row.cache) if tokens.shape[0] == 1 else
                Seq(tokens, row.cur_len, row.cache, buffers.attn_mask, row.cur_len + buffers.position_offsets)
                for row, (tokens, buffers) in zip(rows, proposed)]
        t1 = time.perf_counter()
        # greedy rows read each row's argmax alone (the C forward then may take it through the logits' int8 screen)
        out = forward_rows(self.widest.engine, seqs, argmax_only=all(row.accept_cfg.is_greedy for row in rows))
        t2 = time.perf_counter()
        results, at = [], 0
        for row, (tokens, buffers) in zip(rows, proposed):
            n = tokens.shape[0]
            logits = None if out.logits is None else out.logits[at:at + n]
            acc = accept(tokens, logits, buffers, row.accept_cfg, row.gen, None if out.pred is None else out.pred[at:at + n])
            candidates = tokens.tolist()
            committed = [candidates[i] for i in acc.path]
            for index in row.ngrams.values():
                index.extend(committed)
            self.widest.compact(row.cache, row.cur_len, acc.path)
            row.cur_len += len(acc.path)
            row.hidden = out.hidden[at + acc.path[-1]].clone()  # the forward's buffers serve the next step
            row.root = acc.next_token
            before = len(row.out)
            n_out, stop = emit_committed(row.out, committed, dec.eos, row.max_new_tokens)
            row.stats.count_step(n_out, (t1 - t0) / len(rows), t2 - t1, 0.0)
            if stop:
                self._finish(row, stop)
            results.append(StepTokens(row.key, row.out[before:], stop or "", row.stats if stop else None))
            at += n
        return results

    def _finish(self, row: Row, stop: str) -> None:
        row.stop = row.stats.stop_reason = stop
        row.stats.new_tokens = len(row.out)
        row.stats.time_total = time.perf_counter() - row.started
        del self.rows[row.key]


def generate_batched(decoder: MedusaDecoder, prompts: Iterable[Sequence[int]], max_new_tokens: int,
                     max_batch: int = 16) -> list[list[int]]:
    """Every prompt's new tokens, decoded ``max_batch`` at a time in the order given: a request joins as soon as
    a row is free (continuous batching)."""
    return run_batched(decoder, prompts, max_new_tokens, max_batch)[0]


def run_batched(decoder: MedusaDecoder, prompts: Iterable[Sequence[int]], max_new_tokens: int,
                max_batch: int = 16) -> tuple[list[list[int]], int]:
    """``generate_batched``'s tokens and the number of batched steps it took."""
    batch = BatchDecoder(decoder, max_batch)
    queue = list(enumerate(prompts))
    out: dict[int, list[int]] = {i: [] for i, _ in queue}
    queue.reverse()
    steps = 0
    while queue or batch.rows:
        while queue and batch.free:
            i, ids = queue.pop()
            batch.admit(i, ids, max_new_tokens)
        for got in batch.step():
            out[got.key].extend(got.tokens)
        steps += 1
    return [out[i] for i in sorted(out)], steps
