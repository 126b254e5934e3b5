"""Training prompts without a dataset: the model writes its own user turns (Magpie, Xu et al. 2024).

The chat template is rendered up to where a user's message would begin and left open; sampled from there,
the model writes something a user might ask, and stops at the template's end of turn. What comes back is
cleaned and filtered: length in words, mostly Latin letters (the default model is English), no template
markup, no exact or near duplicate of another generated prompt, and no overlap with the questions a bench
replays (MT-Bench, HumanEval or any suite given): a prompt sharing a word n-gram with one of them is
dropped, so that heads are never trained on what they are measured on.

Generation runs in shards (``shard-NNNNN.jsonl``, each seeded by its index) recorded in ``manifest.json``
once written whole, so a stopped run continues at the first missing shard and gives the same prompts.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from medusa_runtime.prompts import Prompt
from treesearch.fsutil import atomic_file

SOURCE = "medusa-bench/self"
MANIFEST = "manifest.json"
SCHEMA = "medusa-self-prompts/1"
_SENTINEL = "\u2063MEDUSA-USER-TURN\u2063"  # an invisible separator no template writes
_MARKUP = re.compile(r"<\|[^|>]*\|>|\[/?INST\]|<start_of_turn>|<end_of_turn>|<s>|</s>")


@dataclass(frozen=True)
class SelfPromptConfig:
    count: int = 1000  # prompts kept (after filtering), at most
    shard_size: int = 256  # prompts sampled per shard
    max_shards: int = 0  # stop after this many shards even if short of count (0: count / shard_size * 4)
    temperature: float = 1.0
    top_p: float = 0.99
    max_prompt_tokens: int = 96  # a user turn's length cap while sampling
    batch_size: int = 64  # sequences sampled together
    seed: int = 0
    min_words: int = 4
    max_words: int = 150
    min_latin: float = 0.9  # share of letters that are Latin
    ngram: int = 8  # word n-gram length of the overlap checks
    near_duplicate: float = 0.6  # Jaccard similarity of word 3-gram sets above which a prompt is a near duplicate

    def __post_init__(self) -> None:
        if self.count < 1 or self.shard_size < 1 or self.batch_size < 1:
            raise ValueError("count, shard_size and batch_size must be >= 1")
        if not 0 < self.temperature <= 2 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be in (0, 2] and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if not 1 <= self.min_words <= self.max_words or self.ngram < 2:
            raise ValueError("need 1 <= min_words <= max_words and ngram >= 2")


# ------------------------------------------------------------------ text filters (no model needed)

def words(text: str) -> list[str]:
    """Lower-case word tokens (letters and digits), the unit of the length and overlap checks."""
    return re.findall(r"\w+", unicodedata.normalize("NFKC", text).lower())


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """Word n-grams of ``tokens``; a text shorter than n is one n-gram of all its words."""
    if len(tokens) < n:
        return {tuple(tokens)} if tokens else set()
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def reference_ngrams(texts: Iterable[str], n: int) -> set[tuple[str, ...]]:
    """The n-grams of every reference text (a replayed suite's questions): what no training prompt may share."""
    out: set[tuple[str, ...]] = set()
    for t in texts:
        out |= ngrams(words(t), n)
    return out


def overlaps(text: str, reference: set[tuple[str, ...]], n: int) -> bool:
    """Whether ``text`` shares a word n-gram with the reference (a text shorter than n: as one whole n-gram)."""
    return not ngrams(words(text), n).isdisjoint(reference)


def latin_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum("LATIN" in unicodedata.name(c, "") for c in letters) / len(letters)


def clean(text: str) -> str:
    """A sampled user turn as a prompt: template markup and a leading role label removed, spaces collapsed."""
    text = _MARKUP.sub(" ", text)
    text = re.sub(r"^\s*(user|human|question)\s*[:\n]\s*", "", text, flags=re.IGNORECASE)
    return re.sub(r"[ \t]+", " ", text).strip()


def rejection(text: str, cfg: SelfPromptConfig) -> str | None:
    """Why a cleaned prompt is dropped (None: kept): length, script or leftover markup."""
    n = len(words(text))
    if n == 0:
        return "empty or unfinished"
    if n < cfg.min_words:
        return "short"
    if n > cfg.max_words:
        return "long"
    if latin_share(text) < cfg.min_latin:
        return "language"
    if _MARKUP.search(text) or _SENTINEL in text:
        return "markup"
    return None


class PromptFilter:
    """Keeps a prompt that passes ``rejection``, is no exact or near duplicate of one kept before, and shares
    no n-gram with the reference questions; counts why the others went."""

    def __init__(self, cfg: SelfPromptConfig, reference: Iterable[str] = ()):
        self.cfg = cfg
        self.reference = reference_ngrams(reference, cfg.ngram)
        self.seen: set[str] = set()
        self.kept_trigrams: list[set[tuple[str, ...]]] = []
        self.dropped: dict[str, int] = {}

    def _drop(self, why: str) -> bool:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        return False

    def keep(self, text: str) -> bool:
        if (why := rejection(text, self.cfg)) is not None:
            return self._drop(why)
        key = " ".join(words(text))
        if key in self.seen:
            return self._drop("duplicate")
        if overlaps(text, self.reference, self.cfg.ngram):
            return self._drop("overlaps a replayed question")
        tri = ngrams(words(text), 3)
        if any(len(tri & k) / len(tri | k) >= self.cfg.near_duplicate for k in self.kept_trigrams):
            return self._drop("near duplicate")
        self.seen.add(key)
        self.kept_trigrams.append(tri)
        return True


# ------------------------------------------------------------------ the open user turn

def open_user_turn(tokenizer) -> tuple[str, str]:
    """(the chat template rendered up to a user message's text, the text that ends a user turn)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("self-generated prompts need a chat template (the model writes the user's turn)")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in rendered:
        raise ValueError("the chat template does not show the user's message verbatim")
    prefix, suffix = rendered.split(_SENTINEL, 1)
    end = suffix.split("\n", 1)[0] or suffix[:1]
    if not end.strip():
        raise ValueError("the chat template has no end-of-turn marker after the user's message")
    return prefix, end


# ------------------------------------------------------------------ shards and the manifest

def _read_manifest(out: Path, cfg: SelfPromptConfig) -> dict:
    path = out / MANIFEST
    if not path.is_file():
        return {"schema": SCHEMA, "config": asdict(cfg), "shards": {}}
    manifest = json.loads(path.read_text())
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a self-prompt manifest ({SCHEMA})")
    sampling = {k: v for k, v in manifest["config"].items() if k != "count"}
    if sampling != {k: v for k, v in asdict(cfg).items() if k != "count"}:
        raise ValueError(f"{out} was generated with other settings; pass them again or use another folder")
    return manifest


def _write_json(path: Path, obj) -> None:
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=1) + "\n")


def generate_prompts(sample_shard: Callable[[int, int], list[str]], out: str | Path, cfg: SelfPromptConfig,
                     reference: Iterable[str] = (), log: Callable[[str], None] = print) -> list[Prompt]:
    """Shards of sampled user turns (``sample_shard(index, size)`` -> raw texts) until ``cfg.count`` prompts
    pass the filter; each shard's raw texts are written whole before the manifest names it, so a rerun
    samples only the shards the manifest lacks. Returns the kept prompts; the manifest records the counts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(out, cfg)
    filt = PromptFilter(cfg, reference)
    kept: list[Prompt] = []
    limit = cfg.max_shards or -(-cfg.count // cfg.shard_size) * 4
    for index in range(limit):
        name = f"shard-{index:05d}.jsonl"
        if name not in manifest["shards"]:
            texts = sample_shard(index, cfg.shard_size)
            with atomic_file(out / name) as tmp:
                Path(tmp).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            manifest["shards"][name] = len(texts)
            _write_json(out / MANIFEST, manifest)
        raw = [json.loads(line)["text"] for line in (out / name).read_text().splitlines() if line.strip()]
        for i, text in enumerate(raw):
            text = clean(text)
            if filt.keep(text) and len(kept) < cfg.count:
                kept.append(Prompt((text,), "self", SOURCE, f"{index}:{i}"))
        if len(kept) >= cfg.count:
            break
    manifest["config"]["count"] = cfg.count
    manifest.update(kept=len(kept), dropped=filt.dropped, excluded_ngrams=len(filt.reference))
    _write_json(out / MANIFEST, manifest)
    with atomic_file(out / "prompts.jsonl") as tmp:
        Path(tmp).write_text("".join(json.dumps({"id": p.id, "category": p.category, "turns": list(p.turns)}) + "\n"
                                     for p in kept))
    log(f"self-generated prompts: {len(kept)} kept of {sum(manifest['shards'].values())} sampled "
        f"({', '.join(f'{k} {v}' for k, v in sorted(filt.dropped.items())) or 'none dropped'}) -> {out / 'prompts.jsonl'}")
    return kept


def model_sampler(loaded, cfg: SelfPromptConfig) -> Callable[[int, int], list[str]]:
    """``sample_shard`` for a loaded model: user turns sampled from the open template, ``cfg.batch_size`` at a
    time, seeded by the shard's index (a shard's texts do not depend on what ran before it)."""
    import torch  # torch: the prompts' configuration stays light for the command line

    tok = loaded.tokenizer
    prefix, end = open_user_turn(tok)
    prefix_ids = tok(prefix, add_special_tokens=False, return_tensors="pt").input_ids.to(loaded.device)
    end_ids = tok(end, add_special_tokens=False).input_ids
    stop = [i for i in {end_ids[0] if end_ids else None, tok.eos_token_id} if i is not None]

    def sample(index: int, size: int) -> list[str]:
        torch.manual_seed(cfg.seed * 1_000_003 + index)
        texts: list[str] = []
        for start in range(0, size, cfg.batch_size):
            n = min(cfg.batch_size, size - start)
            ids = prefix_ids.expand(n, -1)
            with torch.inference_mode():
                out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                            temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                            max_new_tokens=cfg.max_prompt_tokens, eos_token_id=stop,
                                            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else stop[0])
            for row in out[:, ids.shape[1]:].tolist():
                cut = next((k for k, t in enumerate(row) if t in stop), None)
                if cut is None:  # ran past the length cap: no finished user turn
                    texts.append("")
                    continue
                texts.append(tok.decode(row[:cut], skip_special_tokens=True))
        return texts

    return sample
