"""What ``medusa-bench load`` runs (its parser: bench.commands.serve): the bench under concurrency, through servers.

    reference : each question's first turn decoded alone by the runtime, plain greedy (what every server's
                answer is compared with)
    servers   : the runtime's, plain and each Medusa configuration (one process each, batches up to the largest
                concurrency); where the heads carry an adapter (Medusa-2), also plain decoding on their base, the
                same model the Medusa rows decode with; with --engines llama.cpp, llama-server on the bf16 GGUF
                with as many slots as clients
    load      : per server and concurrency, the same requests through the OpenAI completions API, streamed
                (bench.load.client), cycled to two per client at least (so that c requests decode together for
                most of the run), in --rounds rounds of the runtime's and vLLM's servers in turn (the order
                rotated each round, the rounds' requests pooled; llama-server once, started per concurrency); rows with throughput, latency percentiles, agreement,
                accepted drafts; with --schedule, the profile's batched steps timed in this process right before
                and right after each run of the schedule's server and of plain decoding on its base
                (bench.load.step_costs), which its predictions are priced with
    load.json : ``medusa-load/1`` (docs/formats.md), written after every row (a killed run keeps its rows)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from bench.engines import EngineError, EngineSettings, llamacpp
from bench.engines.stage import model_folder
from bench.engines.vllm_engine import vllm_python
from bench.load.client import LoadPlan, LoadRequest, RequestRecord, enough, run_load_sync
from bench.load.prediction import ON_CALIBRATION, SchedulePredictor, schedule_predictor
from bench.load.servers import LlamaSlots, OwnServer, VllmServer, counter_delta
from bench.load.step_costs import StepsDuringLoad
from bench.load.summary import HEADS_BASE_PLAIN, SCHEMA, add_speedups, load_row, stops_paying
from bench.replay.analyze import to_markdown
from bench.replay.runner import MethodConfig
from bench.replay.suites import load_suite
from bench.replay.workload import spread_over_categories
from bench.stages import defaults
from bench.stages.common import adapted, log, show
from bench.stages.jobs import LoadJob, read_replay_config
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.heads.medusa import resolve_heads
from medusa_runtime.measure.profile import describe_machine
from medusa_runtime.model import chat_template_ids, load_model, software_versions
from treesearch.fsutil import atomic_file
from treesearch.replay import Decoding
from treesearch.schedule import read_schedule, schedule_decoding
from treesearch.tree import load_tree, write_json_atomic


def cmd_load(args: argparse.Namespace) -> int:
    return show(args, load_stage, LoadJob.from_namespace(args, progress=not args.json))


@dataclass(frozen=True)
class Served:
    """A configuration of the runtime's server: plain decoding (tree None), or a tree with its lookup chain and
    gate."""

    name: str
    tree: str | None = None
    lookup: int = 0
    gate: float = 0.0
    schedule: str | None = None  # a tree.json whose schedule the server follows (tree, lookup, gate unused)


SCHEDULE = "schedule"  # the name of the row that follows tree.json's schedule


def served_configurations(job: LoadJob) -> list[Served]:
    """Plain decoding, then each --tree (with --lookup), or the greedy Medusa configurations of --config; and the
    --schedule."""
    extra = [Served(SCHEDULE, schedule=job.schedule)] if job.schedule else []
    if job.config is None:
        return [Served("plain"), *[Served(t, t, job.lookup) for t in job.tree], *extra]
    configs = [MethodConfig(**c) for c in read_replay_config(job.config).get("configurations", [])]
    configs = [c for c in configs if c.method == "medusa" and c.temperature == 0 and c.accept == "greedy"]
    if not configs:
        raise ValueError(f"{job.config}: no greedy Medusa configuration to serve")
    return [Served("plain"), *[Served(c.name, c.tree, c.lookup_tokens, c.gate) for c in configs], *extra]


def load_stage(job: LoadJob) -> tuple[dict, str]:
    served = served_configurations(job)
    for s in served[1:]:  # a bad tree or schedule fails before anything starts
        if s.schedule is None:
            load_tree(s.tree)
    schedule = read_schedule(job.schedule) if job.schedule else []
    if not job.concurrency and not job.rate:
        raise ValueError("give at least one --concurrency or --rate")
    if min(job.concurrency, default=1) < 1 or min(job.rate, default=1.0) <= 0 or job.rounds < 1:
        raise ValueError("concurrencies and rounds must be >= 1 and rates > 0")
    job = replace(job, max_new_tokens=defaults.new_tokens(job.max_new_tokens))
    requests, references, tokenizer, meta, heads_base = _requests_and_references(job)
    schedule_base = "plain"  # the row of plain decoding on the model the heads (and the schedule) decode
    if references[True] is not references[False]:  # Medusa-2 heads: plain decoding of the model they decode
        served.insert(1, Served(HEADS_BASE_PLAIN, "none"))
        schedule_base = HEADS_BASE_PLAIN
    out = Path(job.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "concurrencies": list(job.concurrency), "rates": list(job.rate),
           "questions": [r.key for r in requests], "max_new_tokens": job.max_new_tokens, **meta, "rows": [],
           "left_out": []}
    predict = schedule_predictor(job.schedule, schedule, [len(r.prompt) for r in requests], job.max_new_tokens) \
        if job.schedule else None
    if predict is not None:
        doc["schedule_predicted_for"] = predict.basis
        if predict.why_not:
            log(f"[load] the schedule's predictions are tree.json's, for {ON_CALIBRATION}: {predict.why_not}")
    steps = _steps_during_load(job, heads_base, predict, schedule) if predict and predict.latency else None
    run = _Run(job, requests, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]), doc, out,
               predict, steps, schedule_base, schedule)
    servers = _own_servers(job, served, requests, doc, out)
    if "vllm" in job.engines:
        servers += _vllm_server(job, requests, doc, out)
    try:
        for i, c in enumerate(job.concurrency):  # configurations interleaved: each concurrency measures all in turn
            pooled: dict[int, Measured] = {}  # by the server's index
            for r in range(job.rounds):
                k = (i + r) % len(servers)
                for j in list(range(k, len(servers))) + list(range(k)):
                    config, server = servers[j]
                    # step costs on either side of the schedule's runs and its plain reference's
                    timed = steps is not None and server.engine == "own" and config in (SCHEDULE, schedule_base)
                    if timed:
                        steps.take(c, config)
                    got = run.collect(server, config, LoadPlan(concurrency=c), f"round {r + 1}/{job.rounds}"
                                      if job.rounds > 1 else "", f"#r{r}" if job.rounds > 1 else "")
                    if timed:
                        steps.take(c, config)
                    pooled[j] = pooled[j].plus(got) if j in pooled else got
            for j, (config, server) in enumerate(servers):
                reference = references[config != "plain" and server.engine == "own"]  # the base it decodes
                run.add_row(server, config, reference, LoadPlan(concurrency=c), pooled[j])
            if "llama.cpp" in job.engines:
                _llamacpp_at(run, c, references[False])
        for rate in job.rate:
            for config, server in [(c, s) for c, s in servers if s.engine == "own"]:
                run.measure(server, config, references[config != "plain"], LoadPlan(rate=rate, seed=0))
    finally:
        for _, server in servers:
            server.close()
    add_speedups(doc["rows"], run.records)
    doc["stops_paying"] = stops_paying(doc["rows"])
    run.write()
    return doc, _table(doc)


def _requests_and_references(job: LoadJob) -> tuple[list[LoadRequest], dict[bool, dict[str, str]], object, dict,
                                                    object]:
    """The requests (first turns, chat template applied); each one's text under the runtime's plain greedy decoding
    alone, on the base plain decoding serves (False) and on the base the heads decode with (True: the same but
    for Medusa-2 heads, whose adapter is merged into it); the tokenizer; the machine and versions; the heads'
    base."""

    questions = spread_over_categories(load_suite(job.questions, log=log), job.limit)
    loaded = load_model(job.model, job.dtype, job.device, log=log, weights=job.weights)
    requests = [LoadRequest(f"{q.question_id}", tuple(chat_template_ids(loaded, [{"role": "user",
                                                                                  "content": q.turns[0]}])),
                            job.max_new_tokens) for q in questions]

    def alone(model) -> dict[str, str]:
        plain = MedusaDecoder(model, None, None, config=DecodeConfig(max_new_tokens=job.max_new_tokens))
        return {r.key: model.tokenizer.decode(plain.generate(list(r.prompt)).token_ids, skip_special_tokens=True)
                for r in tqdm(requests, desc=f"plain greedy alone ({model.name})", disable=not job.progress,
                              unit="q")}

    base = alone(loaded)
    name = loaded.name
    heads_base = adapted(loaded, job.heads) if job.tree and job.heads != "none" else loaded
    meta = {"model": job.model, "dtype": str(loaded.dtype).removeprefix("torch."), "weights": job.weights, "machine": describe_machine(loaded),
            "heads_base": heads_base.name, "versions": software_versions()}
    return requests, {False: base, True: base if heads_base.name == name else alone(heads_base)}, \
        loaded.tokenizer, meta, heads_base


def _steps_during_load(job: LoadJob, heads_base, predict: SchedulePredictor, schedule: list[dict]
                       ) -> StepsDuringLoad | None:
    """The batched steps the schedule's predictions are priced with, timed during the load (bench.load.step_costs);
    None (the search's profile prices them, and the log says why) where they cannot be built."""
    try:
        heads = resolve_heads(job.heads, heads_base.hidden_size, heads_base.vocab_size, base_model=job.model) \
            if any(e["configuration"].get("uses_heads") for e in schedule) else None
        return StepsDuringLoad(heads_base, heads, predict.latency, schedule, job.concurrency)
    except (ValueError, OSError) as exc:
        log(f"[load] the schedule's step costs are the search's profile's: {exc}")
        return None


@dataclass(frozen=True)
class Measured:
    """What one server returned under one plan: the requests' records and its counters' growth (None: no
    counters, another engine's server)."""

    records: list[RequestRecord]
    counters: dict | None

    def plus(self, other: Measured) -> Measured:
        """Two runs pooled: their records together, their counters summed."""
        if self.counters is None or other.counters is None:
            return Measured(self.records + other.records, None)
        a, b = self.counters, other.counters
        return Measured(self.records + other.records, {
            "tokens": a["tokens"] + b["tokens"], "steps": a["steps"] + b["steps"],
            "accepted": {p: a["accepted"].get(p, 0.0) + b["accepted"].get(p, 0.0)
                         for p in a["accepted"].keys() | b["accepted"].keys()}})


def schedule_range(schedule: Sequence[dict], batch: int, base: str) -> dict | None:
    """The schedule's range holding ``batch`` as load.json names it: its batch sizes, its configuration, and the
    runtime's row that decodes as it does where it runs plain decoding (``base``: plain decoding on the schedule's
    model), else null."""
    for entry in schedule:
        first, last = entry["batch"]
        if first <= batch <= last:
            return {"batch": [first, last], "config": entry["configuration"].get("config"),
                    "same_as": base if schedule_decoding(entry) == Decoding() else None}
    return None


class _Run:
    """A load run's rows and records, written after each row."""

    def __init__(self, job: LoadJob, requests: list[LoadRequest], count, doc: dict, out: Path,
                 predict: SchedulePredictor | None = None, steps: StepsDuringLoad | None = None,
                 schedule_base: str = "plain", schedule: Sequence[dict] = ()):
        self.job, self.requests, self.count, self.doc, self.out = job, requests, count, doc, out
        self.predict, self.steps, self.schedule_base, self.schedule = predict, steps, schedule_base, schedule
        self.records: dict[tuple[str, str, int], list[RequestRecord]] = {}

    def measure(self, server, config: str, reference: dict[str, str], plan: LoadPlan, build: str | None = None
                ) -> None:
        """The requests once through a running server under the plan: a row, written at once."""
        self.add_row(server, config, reference, plan, self.collect(server, config, plan), build)

    def collect(self, server, config: str, plan: LoadPlan, label: str = "", tag: str = "") -> Measured:
        """The requests once through a running server under the plan (their keys ending in ``tag``)."""
        where = f"concurrency {plan.concurrency}" if plan.concurrency is not None else f"rate {plan.rate:g}/s"
        requests = enough(self.requests, plan.concurrency) if plan.concurrency else self.requests
        requests = [replace(r, key=r.key + tag) for r in requests] if tag else requests
        before = server.counters()
        with tqdm(total=len(requests), desc=f"{server.engine} {config} at {where} {label}".rstrip(),
                  disable=not self.job.progress, unit="req") as bar:
            got = run_load_sync(server.url + "/v1", server.model, requests, plan, self.count, bar.update)
        return Measured(got, counter_delta(before, server.counters()) if before is not None else None)

    def add_row(self, server, config: str, reference: dict[str, str], plan: LoadPlan, got: Measured,
                build: str | None = None) -> None:
        """A row of what ``collect`` measured (one run or pooled rounds), written at once."""
        scheduled = config == SCHEDULE and server.engine == "own"
        priced = scheduled and plan.concurrency and self.predict is not None
        during = self.steps.profile_at(plan.concurrency, SCHEDULE) if priced and self.steps is not None else None
        plain = self._plain_row(plan.concurrency) if during is not None else None
        beside_plain = self.steps.profile_at(plan.concurrency, plain["config"]) if plain is not None else None
        if beside_plain is not None:  # serving's cost per step: plain decoding served against its steps timed here
            served = self.predict.served_as(plan.concurrency, beside_plain, plain["output_tokens_per_s"])
            during = replace(during, serving_step_ms=served.serving_step_ms, serving_chunk_ms=0.0)
        predicted = self.predict(plan.concurrency, during) if priced else None
        row = load_row(config, server.engine, plan.concurrency or 0, got.records, reference, got.counters, build,
                       scheduled, predicted)
        if during is not None:  # beside it: the same priced at the search's profile's speed, and the steps timed
            row["predicted_output_tokens_per_s_at_search"] = self.predict(plan.concurrency)
            row["step_costs_during"] = {**self.steps.as_json(plan.concurrency, SCHEDULE),
                                        "serving_step_ms": round(during.serving_step_ms, 3),
                                        "serving_chunk_ms": round(during.serving_chunk_ms, 3),
                                        "serving_from": plain["config"] if beside_plain is not None else None,
                                        "beside_plain": self.steps.as_json(plan.concurrency, plain["config"])
                                        if beside_plain is not None else None}
        if scheduled and plan.concurrency:  # what the schedule runs at a live batch of that many requests
            row["schedule_range"] = schedule_range(self.schedule, plan.concurrency, self.schedule_base)
        if plan.rate is not None:
            row["rate"] = plan.rate
        else:
            self.records[(config, server.engine, plan.concurrency)] = got.records
        self.doc["rows"].append(row)
        self.write()

    def _plain_row(self, concurrency: int) -> dict | None:
        """The runtime's plain decoding row at ``concurrency`` on the schedule's base, where it was measured."""
        return next((r for r in self.doc["rows"] if r["engine"] == "own" and "rate" not in r
                     and r["concurrency"] == concurrency and r["config"] == self.schedule_base
                     and r.get("output_tokens_per_s")), None)

    def write(self) -> None:
        self.doc["written"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json_atomic(self.out, self.doc)
        lines = [json.dumps({"config": k[0], "engine": k[1], "concurrency": k[2], "key": r.key, "ok": r.ok,
                             "error": r.error, "reconnects": r.reconnects, "tokens": r.tokens, "latency": r.latency,
                             "ttft": r.ttft, "itl": r.itl, "text": r.text}) for k, rs in self.records.items() for r in rs]
        with atomic_file(self.out.with_name(self.out.stem + "-records.jsonl"), suffix=".jsonl") as tmp:
            tmp.write_text("".join(line + "\n" for line in lines))


def _warm(server, requests) -> None:
    """One request before the timed ones (first-call costs: allocations, kernel builds)."""
    run_load_sync(server.url + "/v1", server.model, requests[:1], LoadPlan(concurrency=1))


def _own_servers(job: LoadJob, served: list[Served], requests: list[LoadRequest], doc: dict, out: Path
                 ) -> list[tuple[str, OwnServer]]:
    """The runtime's servers, plain and each configuration, started together and warmed (idle ones cost no CPU)."""
    servers = []
    for s in served:
        try:
            server = OwnServer(job.model, job.heads, s.tree, max(job.concurrency, default=16), job.max_new_tokens,
                               job.dtype, s.lookup, s.gate, log_file=out.with_name(f"load-server-{_slug(s.name)}.log"),
                               schedule=s.schedule, weights=job.weights)
            _warm(server, requests)
        except EngineError as exc:
            doc["left_out"].append(f"the runtime's {s.name} server: {exc}")
            log(f"[load] {doc['left_out'][-1]}")
            continue
        servers.append((s.name, server))
    return servers


def _vllm_server(job: LoadJob, requests: list[LoadRequest], doc: dict, out: Path) -> list[tuple[str, VllmServer]]:
    """vLLM's OpenAI server on the same weights (its own environment: --vllm-python / MEDUSA_VLLM_PYTHON), plain
    decoding, batches up to the largest concurrency; none, with the reason in load.json, where it cannot start."""
    settings = EngineSettings()
    try:
        folder, _ = model_folder(job.model, log)
        server = VllmServer(vllm_python(settings), folder, max(job.concurrency, default=16), settings,
                            log_file=out.with_name("load-vllm-server.log"))
        _warm(server, requests)
    except EngineError as exc:
        doc["left_out"].append(f"vLLM: {exc}")
        log(f"[load] {doc['left_out'][-1]}")
        return []
    return [("plain", server)]


def _llamacpp_at(run: _Run, c: int, reference: dict[str, str]) -> None:
    """llama-server on the bf16 GGUF of the same weights with ``c`` slots, on the first build that runs it (native,
    else without AMX); what keeps it from running is said in load.json, the other rows go on."""

    doc = run.doc
    try:
        folder, name = model_folder(run.job.model, log)
        llamacpp.build(log)
        gguf = llamacpp.bf16_gguf(folder, name, log)
        variant, notes = llamacpp.working_build([gguf], log)
        doc["left_out"] += [n for n in notes if n not in doc["left_out"]]
        server = LlamaSlots(gguf, c, log_file=run.out.with_name(f"load-llama-server-{c}.log"), build=variant)
    except EngineError as exc:
        doc["left_out"].append(f"llama.cpp at concurrency {c}: {exc}")
        log(f"[load] {doc['left_out'][-1]}")
        return
    try:
        _warm(server, run.requests)
        run.measure(server, "plain", reference, LoadPlan(concurrency=c), build=variant)
    finally:
        server.close()


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _table(doc: dict) -> str:
    cols = ["config", "engine", "concurrency", "output_tokens_per_s", "speedup_vs_plain", "speedup_vs_heads_base_plain",
            "per_request_tokens_per_s", "accepted_per_step", "identical_to_plain", "failed"]
    df = pd.DataFrame([{k: r.get(k) for k in cols} | {"ttft_p50_ms": (r.get("ttft_ms") or {}).get("p50"),
                                                        "tpot_p50_ms": (r.get("tpot_ms") or {}).get("p50")}
                       for r in doc["rows"]])
    lines = [to_markdown(df.round(3)) if not df.empty else "(no rows)"]
    for config, s in doc.get("stops_paying", {}).items():
        at = s["stops_paying_at"]
        lines.append(f"{config}: " + (f"stops paying at concurrency {at}" + (" (its interval below 1)" if s["certain"]
                                                                          else " (its interval reaches 1)")
                                      if at is not None else "pays at every concurrency measured"))
    lines += [f"left out: {x}" for x in doc["left_out"]]
    return "\n".join(lines)
