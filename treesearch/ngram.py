"""Prompt lookup's n-gram drafts, in pure Python: the decoder and the replay of rollouts share this code.

The last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up among earlier positions
of prompt + output; the tokens that followed the most recent earlier occurrence are the draft. The
runtime hangs them under the tree's root as a chain of nodes (``medusa_runtime.tree.lookup``); the search
replays the same drafts on calibration rollouts (``treesearch.replay``), which is why this module has
no torch in it: one implementation, so the replay is the decoder's drafting by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOOKUP = 8  # longest lookup chain the search considers


@dataclass(frozen=True)
class LookupConfig:
    num_tokens: int = 0  # draft tokens from prompt lookup per step (0: off)
    max_ngram: int = 3  # longest suffix tried first
    min_ngram: int = 2  # shortest suffix still trusted

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"lookup tokens must be >= 0, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


class NgramIndex:
    """Latest earlier occurrence of every n-gram (n in [min, max]) of a growing token sequence.

    ``index[gram] = e`` means ``tokens[e - n:e] == gram`` and ``e < len(tokens)``: at least one
    token followed it. Updates are incremental: O(max_ngram) dictionary writes per new token.
    """

    def __init__(self, cfg: LookupConfig, tokens: list[int] | None = None):
        self.cfg = cfg
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        if tokens:
            self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        for tok in new:
            end = len(self.tokens)  # n-grams ending here now have a follower: `tok`
            for n in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
                if end >= n:
                    self.index[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(tok)

    def draft(self, suffix_extra: int | None = None) -> list[int]:
        """Up to ``num_tokens`` tokens predicted to follow the sequence (plus ``suffix_extra``)."""
        seq = self.tokens if suffix_extra is None else self.tokens + [suffix_extra]
        last = len(self.tokens)  # with suffix_extra, the n-gram ending here has a follower but is not indexed yet
        for n in range(self.cfg.max_ngram, self.cfg.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            gram = seq[len(seq) - n:]
            if suffix_extra is not None and last >= n and self.tokens[last - n:] == gram:
                end = last
            else:
                end = self.index.get(tuple(gram))
            if end is not None and end < len(seq):
                return seq[end:end + self.cfg.num_tokens]
        return []
