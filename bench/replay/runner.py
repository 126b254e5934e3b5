"""One runner contract for every decoding method, and the interleaved, resumable MT-Bench replay.

Every configuration becomes a callable ``run(prompt_ids, max_new_tokens) -> RunOutput``; the replay
calls them question by question, after an untimed warm-up, the runtime's configurations of a question
one step each in turn (``medusa_runtime.decoding.lockstep``: machine drift hits all alike), and appends one
JSON record per (configuration, question, turn, repeat) to ``records.jsonl``. Records already in the file are skipped, so an
interrupted replay resumes where it stopped. Speed-ups are computed afterwards from the records.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.replay.mtbench import Question
from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder, run_to_end
from medusa_runtime.decoding.lockstep import lockstep
from medusa_runtime.heads.medusa import MedusaHeads
from medusa_runtime.model import LoadedModel, chat_template_ids, chat_template_name, device_sync, software_versions
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.tree import load_tree
from treesearch.typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD

RECORD_SCHEMA = "medusa-record/1"
PEER_METHODS = ("vllm", "llama.cpp")  # MethodConfig.method of a serving engine's configuration (bench.engines)
METHODS = ("generate", "prompt_lookup", "plain", "medusa", *PEER_METHODS)  # the last ones: engines (bench.engines)
# FastChat's MT-Bench sampling temperatures per category (fastchat/llm_judge/common.py); 0 = greedy
FASTCHAT_TEMPERATURES = {"writing": 0.7, "roleplay": 0.7, "extraction": 0.0, "math": 0.0, "coding": 0.0,
                         "reasoning": 0.0, "stem": 0.1, "humanities": 0.1}


@dataclass(frozen=True)
class MethodConfig:
    name: str  # label in tables and plots
    method: str  # generate | prompt_lookup | plain | medusa
    tree: str | None = None  # medusa: preset, chain:N or tree file
    accept: str = "greedy"  # medusa: greedy | typical | sample
    temperature: float = 0.0
    posterior_threshold: float = POSTERIOR_THRESHOLD
    posterior_alpha: float = POSTERIOR_ALPHA
    prompt_lookup_tokens: int = 10  # prompt_lookup: transformers' prompt_lookup_num_tokens
    engine: str = "auto"  # plain / medusa: the runtime's forward engine (lean | lean-torch | hf | auto)
    lookup_tokens: int = 0  # plain / medusa: prompt-lookup draft chain in the tree (0: off)
    temperature_policy: str = "fixed"  # fixed: 'temperature' everywhere | fastchat: FastChat's per category
    gate: float = 0.0  # medusa: confidence gate on the tree's levels (see DecodeConfig.gate; 0: off)
    question_ids: tuple[int, ...] | None = None  # run on these questions only (a fold's search pick); None: all
    # the heads this configuration decodes with (a folder, 'default', 'medusa1'), and so the base as they decode
    # with it (Medusa-2 heads: their adapter merged; for plain decoding, that base alone); None: the replay's own
    heads: str | None = None
    samples: int = 1  # sampled configurations: answers drawn per (question, turn), each with a seed of its own
    # engines (method vllm | llama.cpp, bench.engines): what the peer loads and how it speculates
    weights: str | None = None  # vllm: a transformers model folder; llama.cpp: a GGUF file
    speculative: str | None = None  # vllm: medusa | ngram; llama.cpp: ngram (its prompt lookup); None: plain
    draft_tokens: int = 0  # tokens a speculative engine drafts per step
    draft_model: str | None = None  # vllm + medusa: the heads folder exported for vLLM
    build: str | None = None  # llama.cpp: the build that runs it (native | no-amx: bench.engines.llamacpp.BUILDS)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"configuration {self.name!r}: samples must be >= 1, got {self.samples}")
        if self.question_ids is not None:  # lists from JSON / YAML configuration files
            object.__setattr__(self, "question_ids", tuple(int(i) for i in self.question_ids))
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.method == "medusa" and not self.tree:
            raise ValueError(f"configuration {self.name!r}: medusa needs a tree")
        if self.method in PEER_METHODS and not self.weights:
            raise ValueError(f"configuration {self.name!r}: an engine needs the weights it loads")
        if self.temperature_policy not in ("fixed", "fastchat"):
            raise ValueError(f"configuration {self.name!r}: temperature_policy must be fixed or fastchat, "
                             f"got {self.temperature_policy!r}")
        samples = self.temperature > 0 or self.temperature_policy == "fastchat"
        if samples and self.method == "medusa" and self.accept == "greedy":
            raise ValueError(f"configuration {self.name!r} samples at temperature > 0: use accept typical or "
                             "sample for Medusa (greedy acceptance would ignore the temperature)")

    def temperature_for(self, category: str) -> float:
        if self.temperature_policy == "fastchat":
            return FASTCHAT_TEMPERATURES.get(category, 0.0)
        return self.temperature

    @property
    def digest(self) -> str:
        fields = asdict(self)
        # fields added later, at their defaults, leave a configuration's digest (and so its records) as it was
        for name, default in (("samples", 1), ("weights", None), ("speculative", None), ("draft_tokens", 0),
                              ("draft_model", None), ("build", None)):
            if fields[name] == default:
                del fields[name]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class RunOutput:
    token_ids: list[int]
    wall_time: float  # seconds, synchronised
    steps: int  # forward passes after prefill (generate: one per token)
    accept_lengths: list[int] = field(default_factory=list)
    prefill_time: float | None = None  # seconds of the prompt forward (the runtime's methods only)
    split: dict[str, float] = field(default_factory=dict)  # the runtime's methods: seconds in heads, verify, bookkeeping
    counters: dict = field(default_factory=dict)  # engines: the engine's own speculative counters for this answer


Runner = Callable[..., RunOutput]  # (prompt ids, new tokens, temperature, seed=None)


def sample_seed(question_id: int, turn: int, sample: int) -> int:
    """The RNG seed of one sampled answer: fixed by (question, turn, sample), whatever ran before it."""
    return int(hashlib.sha256(f"{question_id}/{turn}/{sample}".encode()).hexdigest()[:8], 16)


def make_runner(cfg: MethodConfig, loaded: LoadedModel, heads: MedusaHeads | None, topk: int = 10,
                shared: dict | None = None) -> Runner:
    """The callable for one of the runtime's or transformers' configurations (decoders and buffers built once,
    here); an engine's comes from its pool of warm engines (``peer_runner``). ``shared``: greedy decoders of the
    same decoding (base, heads, tree paths, lookup chain, gate, engine) shared among the runners given the same
    dict, as the folds' searched configurations often are: a decoder holds tens of MB (its heads' packed
    weights and tables), and one answer at a time runs on it (a lockstep step is never interrupted)."""
    if cfg.method in ("generate", "prompt_lookup"):
        extra = {"prompt_lookup_num_tokens": cfg.prompt_lookup_tokens} if cfg.method == "prompt_lookup" else {}
        eos = list(loaded.eos_token_ids) or None

        @torch.inference_mode()
        def run_hf(prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> RunOutput:
            ids = torch.tensor([prompt], device=loaded.device)
            # FastChat samples when temperature >= 1e-4, with top_p 1 and no top-k
            sampling = {"do_sample": True, "temperature": temperature, "top_k": None, "top_p": None} \
                if temperature >= 1e-4 else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
            torch.manual_seed(0 if seed is None else seed)
            device_sync(loaded.device)
            t0 = time.perf_counter()
            out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, eos_token_id=eos,
                                        pad_token_id=eos[0] if eos else 0, **sampling, **extra)
            device_sync(loaded.device)
            new = out[0, len(prompt):].tolist()
            return RunOutput(new, time.perf_counter() - t0, len(new))

        return run_hf
    use_heads = heads if cfg.method == "medusa" else None
    decoders: dict[tuple[int, float], MedusaDecoder] = {}

    def accept_at(temperature: float) -> AcceptConfig:
        # plain decoding has no candidates: at temperature > 0 it simply samples from the warped distribution
        rule = "sample" if temperature > 0 and cfg.method == "plain" and cfg.accept == "greedy" else cfg.accept
        return AcceptConfig(rule=rule, temperature=temperature, posterior_threshold=cfg.posterior_threshold,
                            posterior_alpha=cfg.posterior_alpha)

    def decoder(n: int, temperature: float) -> MedusaDecoder:
        tree = load_tree(cfg.tree) if use_heads is not None else None
        rule, config = accept_at(temperature), DecodeConfig(max_new_tokens=n, topk=topk, seed=0, engine=cfg.engine,
                                                           lookup=LookupConfig(cfg.lookup_tokens), gate=cfg.gate)
        if shared is None or not rule.is_greedy:  # a sampled decoder's RNG is its own runner's
            return MedusaDecoder(loaded, use_heads, tree, rule, config)
        key = (id(loaded), id(use_heads), tree.paths if tree is not None else None, rule, config)
        if key not in shared:
            shared[key] = MedusaDecoder(loaded, use_heads, tree, rule, config)
        return shared[key]

    def run_steps(prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None
                  ) -> Generator[None, None, RunOutput]:
        key = (n, temperature)
        if key not in decoders:
            decoders[key] = decoder(n, temperature)
        if seed is not None:
            decoders[key].generator.manual_seed(seed)
        res = yield from decoders[key].generate_steps(prompt)
        st = res.stats
        return RunOutput(res.token_ids, st.time_total, st.steps, st.accept_lengths, st.time_prefill,
                         {"time_heads": st.time_heads, "time_verify": st.time_verify,
                          "time_bookkeeping": st.time_bookkeeping})

    return SteppedRunner(run_steps)


def peer_runner(cfg: MethodConfig, peers) -> Runner:
    """An engine configuration's callable, from the pool of warm engines (``bench.engines.peers.PeerPool``)."""
    if peers is None:
        raise ValueError(f"configuration {cfg.name!r} runs an engine: the replay needs its engines started")
    return peers.runner(cfg)


@dataclass(frozen=True)
class SteppedRunner:
    """The runtime's runner: called, it decodes to the end; ``steps(...)`` is the same run as a generator that
    pauses after the prefill and every step and returns the RunOutput (``medusa_runtime.decoding.lockstep``), timing
    only its own time."""

    steps: Callable[..., Generator[None, None, RunOutput]]

    def __call__(self, prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> RunOutput:
        return run_to_end(self.steps(prompt, n, temperature, seed))


def chat_ids(loaded: LoadedModel, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
    """User turns interleaved with the model's own earlier answers, through the chat template."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return chat_template_ids(loaded, messages)


def record_key(r: dict) -> tuple:
    # the configuration's hash too: a record made under the same name with other settings is not reused
    return (r["config"], r.get("config_hash"), r["question_id"], r["turn"], r["repeat"])


def load_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a crash: that record is redone
            continue
    return out


@dataclass(frozen=True)
class ReplayConfig:
    max_new_tokens: int = 128  # per turn
    turns: int = 2  # 1 = first turns only
    repeats: int = 1  # timed repeats per (configuration, question, turn)
    warmup_tokens: int = 16  # untimed warm-up generation per configuration
    # the runtime's configurations of one (question, turn, repeat) stepped in turn (medusa_runtime.decoding.lockstep);
    # False: each answer decoded whole, one configuration after another
    lockstep: bool = True


# what run_order and the replay do (a fixed order, then whole answers shuffled per question, before); replay
# cache keys name it, so records timed under another schedule are not resumed
REPLAY_ORDER = "lockstep per question: the runtime's configurations one step each in turn, shuffled per round"
SEQUENTIAL_ORDER = "shuffled per question"


def run_order(configs: Sequence[MethodConfig], question_id: int, turn: int, repeat: int) -> list[MethodConfig]:
    """The configurations in the order one (question, turn, repeat) runs them: shuffled, seeded by those three,
    as the latency profile's rounds are. In a fixed order each configuration always follows the same
    neighbour, and a heavy one (a 64-node tree, seconds of compute-bound verify) may leave the machine slower
    or faster for the next; shuffling spreads that over all of them. Within the order, the runtime's
    configurations run in lockstep (``replay``), transformers' methods whole."""
    order = list(configs)
    random.Random(f"{question_id}/{turn}/{repeat}").shuffle(order)
    return order


def _record(c: MethodConfig, q: Question, turn: int, rep: int, prompt: list[int], temperature: float,
            seed: int | None, out: RunOutput, answer: str) -> dict:
    """One answer's record (the replay adds the provenance: versions, model, device, heads)."""
    return {"schema": RECORD_SCHEMA, "config": c.name, "config_hash": c.digest, "method": c.method, "tree": c.tree,
            "accept": c.accept, "temperature": temperature, "lookup_tokens": c.lookup_tokens, "gate": c.gate,
            "question_id": q.question_id, "category": q.category, "turn": turn, "repeat": rep, "seed": seed,
            "prompt_tokens": len(prompt), "new_tokens": len(out.token_ids), "steps": out.steps,
            "accept_lengths": out.accept_lengths, "wall_time": out.wall_time, "prefill_time": out.prefill_time,
            **out.split, **({"engine_counters": out.counters} if out.counters else {}),
            "token_ids": out.token_ids, "answer": answer}


def replay(loaded: LoadedModel, heads: MedusaHeads | None, configs: Sequence[MethodConfig],
           questions: Sequence[Question], cfg: ReplayConfig, out_file: str | Path, progress: bool = True,
           extra: dict | None = None, variants: dict[str, tuple[LoadedModel, MedusaHeads | None]] | None = None,
           between: Callable[[int, int, int, int], None] | None = None, peers=None) -> list[dict]:
    """Run every configuration on every question (interleaved: per (question, turn, repeat) transformers'
    methods one whole answer after another in a shuffled order, then the runtime's configurations stepped in
    turn, ``medusa_runtime.decoding.lockstep``, unless ``cfg.lockstep`` is off), appending records; resumable. ``variants``:
    per heads spec that a configuration names (``MethodConfig.heads``), the base and heads it decodes with.
    ``between(index, question_id, turn, repeat)`` runs before each (question, turn, repeat) that has records
    to take, ``index`` being its place in the whole matrix (the same on a resumed run): between records,
    never inside one (``bench.replay.profile_rounds``: the latency profile taken while the replay runs). ``peers``: the
    warm engines of the engines' configurations (``bench.engines.peers.PeerPool``), whose answers run whole,
    as transformers' do, and whose records name the base they ran (the original weights)."""
    path = Path(out_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = load_records(path)
    done = {record_key(r): r for r in records}
    variants = variants or {}
    missing = {c.heads for c in configs if c.heads is not None} - set(variants)
    if missing:
        raise ValueError(f"configurations name heads {sorted(missing)[0]!r}, which the replay was not given")
    own = {c.digest: variants.get(c.heads, (loaded, heads)) if c.heads is not None else (loaded, heads)
           for c in configs}  # (base, heads) of each configuration
    shared: dict = {}  # greedy decoders of the same decoding, one for all the configurations that run it
    runners = {c.digest: peer_runner(c, peers) if c.method in PEER_METHODS else
               make_runner(c, *own[c.digest], shared=shared) for c in configs}  # one name may run per fold
    # a sampled configuration's repeats are its samples (each answer drawn with a seed of its own)
    rounds = max([cfg.repeats] + [c.samples for c in configs])
    todo = [(q, t, r, c) for q in questions for t in range(min(cfg.turns, len(q.turns))) for r in range(rounds)
            for c in run_order(configs, q.question_id, t, r) if r < max(cfg.repeats, c.samples)
            and (c.name, c.digest, q.question_id, t, r) not in done
            and (c.question_ids is None or q.question_id in c.question_ids)]
    if not todo:
        return records
    warm = chat_ids(loaded, [questions[0].turns[0]], [])
    for c in configs:  # warm-up, excluded from the records
        runners[c.digest](warm, cfg.warmup_tokens, c.temperature_for(questions[0].category))
    meta = {"versions": software_versions(), "dtype": str(loaded.dtype).removeprefix("torch."), "weights": loaded.weights,
            "model": loaded.name,
            "device": str(loaded.device), "chat_template": chat_template_name(loaded), **(extra or {})}
    # a configuration with heads of its own says so, and which base (name) decoded it
    own_meta = {c.digest: {"model": own[c.digest][0].name, "heads": c.heads} for c in configs if c.heads is not None}
    own_meta |= {c.digest: {"model": peers.base_name, "heads": None, "engine": c.method} for c in configs
                 if c.method in PEER_METHODS and peers is not None}
    groups = {(q.question_id, t, r): i for i, (q, t, r) in enumerate(
        (q, t, r) for q in questions for t in range(min(cfg.turns, len(q.turns))) for r in range(rounds))}
    bar = tqdm(total=len(todo), desc="replay", disable=not progress, unit="run")
    with path.open("a") as fh:

        def write(c: MethodConfig, q: Question, turn: int, rep: int, prompt: list[int], temperature: float,
                  seed: int | None, out: RunOutput) -> None:
            rec = _record(c, q, turn, rep, prompt, temperature, seed, out,
                          loaded.tokenizer.decode(out.token_ids, skip_special_tokens=True))
            rec.update(meta, **own_meta.get(c.digest, {}))
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            done[record_key(rec)] = rec
            records.append(rec)
            bar.update(1)

        for group, items in itertools.groupby(todo, key=lambda item: (item[0].question_id, item[1], item[2])):
            if between is not None:
                between(groups[group], *group)
            stepped, inputs = {}, {}
            for q, turn, rep, c in items:
                # a second turn follows this repeat's (this sample's) own first answer
                earlier = [done[(c.name, c.digest, q.question_id, t, rep)]["answer"] for t in range(turn)]
                prompt = chat_ids(loaded, q.turns[: turn + 1], earlier)
                temperature = c.temperature_for(q.category)
                seed = sample_seed(q.question_id, turn, rep) if temperature > 0 else None
                run = runners[c.digest]
                if cfg.lockstep and isinstance(run, SteppedRunner):
                    stepped[c.digest] = run.steps(prompt, cfg.max_new_tokens, temperature, seed)
                    inputs[c.digest] = (c, q, turn, rep, prompt, temperature, seed)
                else:  # transformers' methods (or a sequential replay): whole answers in the shuffled order
                    out = run(prompt, cfg.max_new_tokens, temperature, seed)
                    write(c, q, turn, rep, prompt, temperature, seed, out)
            lockstep(stepped, "/".join(map(str, group)), lambda digest, out: write(*inputs[digest], out))
    bar.close()
    return records
