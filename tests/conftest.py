"""Shared fixtures: tiny random models built in the test, the real default model, oracle heads."""

from __future__ import annotations

import gzip
import json
import random
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from medusa_runtime.model import LoadedModel, load_model
from medusa_runtime.prompts import builtin_prompts
from medusa_runtime.training.distill import DistillConfig, build_distill_data

DATA = Path(__file__).resolve().parent / "data"  # vendored reference data, see data/README.md


def post_json(url: str, data: bytes, key: str | None = None, timeout: float = 300) -> tuple[int, dict]:
    """POST a JSON body: the status and the JSON reply, an error's included."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def read_lines(path: Path) -> list[str]:
    """Non-empty lines of a text file, gzipped (``.gz``) or not."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [line for line in text.splitlines() if line.strip()]


def tiny_llama(vocab: int = 64, seed: int = 0, max_pos: int = 256) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return LoadedModel(model, None, "tiny-llama", torch.float32, torch.device("cpu"))


def tiny_gpt2(vocab: int = 64, seed: int = 1) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2,
                     bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return LoadedModel(model, None, "tiny-gpt2", torch.float32, torch.device("cpu"))


def tiny_gemma3(vocab: int = 64, seed: int = 2, window: int = 6) -> LoadedModel:
    """Gemma 3's architecture (the second packaged model's), tiny: sliding-window layers (window 6 positions, so
    every test sequence runs past it) between global ones, its own norms, GELU and embedding scale."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                           sliding_window=window, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                           tie_word_embeddings=False)  # (tied, this tiny random model repeats one token)
    model = Gemma3ForCausalLM(cfg).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return LoadedModel(model, None, "tiny-gemma3", torch.float32, torch.device("cpu"))


def random_heads(loaded: LoadedModel, condition: str, seed: int, num_heads: int = 3):
    """Heads with random weights (std 0.3: far from the base's own head), unconditioned, root- or path-conditioned."""
    from medusa_runtime.heads.medusa import HeadsConfig, MedusaHeads

    torch.manual_seed(seed)
    heads = MedusaHeads(HeadsConfig(num_heads, 1, loaded.hidden_size, loaded.vocab_size, True,
                                    root_conditioned=condition != "none", path_conditioned=condition == "path"))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads


def hf_greedy(loaded: LoadedModel, prompt: list[int], n: int) -> list[int]:
    """Reference: transformers' own generate, greedy, stopping at the model's EOS if it has one."""
    eos = list(loaded.eos_token_ids) or None
    ids = torch.tensor([prompt], device=loaded.device)
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0] if eos else 0, top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist()


class OracleHeads(nn.Module):
    """Heads that know the greedy continuation: head j puts the true token t+j+2 at a random rank.

    The decoder calls ``heads(hidden, lm_head)`` with the hidden state of the last accepted token;
    the oracle recognises the position by the nearest stored hidden state of the reference
    sequence, so it works through the unmodified decode loop. With probability ``miss`` a head
    leaves the true token out entirely, so rejections happen too.
    """

    def __init__(self, loaded: LoadedModel, sequence: list[int], num_heads: int, topk: int,
                 max_rank: int, miss: float = 0.2, seed: int = 0):
        super().__init__()
        with torch.no_grad():
            out = loaded.model(torch.tensor([sequence]), output_hidden_states=True)
        self.ref_hidden = out.hidden_states[-1][0].float()  # [T, H]
        self.sequence = sequence
        self.num_heads, self.topk, self.max_rank, self.miss = num_heads, topk, max_rank, miss
        self.vocab = loaded.vocab_size
        self.rng = random.Random(seed)
        self.calls = 0

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        self.calls += 1
        t = int(torch.cdist(hidden.float()[None], self.ref_hidden).argmin())
        logits = torch.full((self.num_heads, self.vocab), -1e4)
        for j in range(self.num_heads):
            target = t + j + 2
            truth = self.sequence[target] if target < len(self.sequence) else None
            ranked = [v for v in self.rng.sample(range(self.vocab), self.topk + 1) if v != truth][: self.topk]
            if truth is not None and self.rng.random() >= self.miss:
                ranked.insert(self.rng.randrange(self.max_rank + 1), truth)
            for r, tok in enumerate(ranked[: self.topk]):
                logits[j, tok] = 100.0 - r
        return logits


def tiny_chat_model() -> LoadedModel:
    """A tiny random Llama that speaks through the default model's tokenizer and chat template."""
    tok = load_model("default", "float32", log=lambda m: None).tokenizer
    tiny = tiny_llama(vocab=len(tok), seed=5)
    tiny.model.generation_config.eos_token_id = tok.eos_token_id
    return LoadedModel(tiny.model, tok, "tiny-chat", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_examples(tmp_path_factory):
    loaded = tiny_chat_model()  # loads the default tokenizer from the real cache first
    mp = pytest.MonkeyPatch()
    mp.setenv("MEDUSA_BENCH_CACHE", str(tmp_path_factory.mktemp("cache")))  # distill cache of this test only
    prompts = builtin_prompts()[:24]
    examples, store = build_distill_data(loaded, prompts, DistillConfig(max_new_tokens=24, batch_size=8),
                                         progress=False)
    yield loaded, prompts, examples, store
    mp.undo()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model("default", "float32", log=lambda m: None)


@pytest.fixture(scope="session")
def default_bf16() -> LoadedModel:
    return load_model("default", "bfloat16", log=lambda m: None)


@pytest.fixture(scope="session")
def mt_bench_first_turns() -> list[dict]:
    return [json.loads(line) for line in read_lines(DATA / "mt_bench" / "question.jsonl")]


def fake_stage_runs(monkeypatch, pipeline) -> list:
    """The jobs the pipeline runs, captured instead of run; each writes an empty JSON at its ``out`` so that
    its stage counts as done (and is cached on a second run)."""
    ran: list = []

    def fake_run(job):
        ran.append(job)
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        Path(job.out).write_text("{}")

    monkeypatch.setattr(pipeline, "run_job", fake_run)
    monkeypatch.setenv("MEDUSA_BENCH_WORKERS", "1")  # in this process, where the fake runs
    return ran


def search_inputs(folder: Path) -> tuple[Path, Path]:
    """Placeholder acceptance and latency files: what the search stage keys on (its runs are faked)."""
    acc, lat = folder / "acceptance.json", folder / "latency.json"
    acc.write_text("{}")
    lat.write_text("{}")
    return acc, lat
