"""The load generator: the same requests sent to an OpenAI-compatible server at a fixed concurrency (or as Poisson
arrivals at a request rate), each streamed, every chunk timed.

A request is a text completion with the prompt as token ids (``/v1/completions``: the runtime's server,
llama.cpp's ``llama-server`` and vLLM's OpenAI server all take it), greedy, ``max_tokens`` new tokens at most,
``stream_options.include_usage`` for the server's own token count. Per request it keeps::

    ttft      first chunk with text - send           (time to first token)
    itl       gaps between chunks with text          (inter-token latency; a chunk may carry several tokens)
    tpot      (latency - ttft) / (tokens - 1)        (time per output token after the first)

Traffic goes to the URL given (the bench starts its servers on 127.0.0.1) and stops by itself: every request
has a timeout, and the run ends when the last request has ended.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import openai

try:
    import uvloop  # a dependency except on Windows, where it does not build
except ImportError:
    uvloop = None


@dataclass(frozen=True)
class LoadRequest:
    key: str  # the question's id (a turn of it)
    prompt: tuple[int, ...]  # token ids, chat template applied
    max_tokens: int


def enough(requests: list[LoadRequest], concurrency: int, per_client: int = 2) -> list[LoadRequest]:
    """The requests, cycled to at least ``per_client`` per client: a closed loop of c clients keeps c requests
    decoding together for most of a run only when it has several times c of them. A repeat's key is the
    question's with ``#k`` (``question_key`` gives the question back)."""
    out = list(requests)
    for i in range(len(requests), per_client * concurrency):
        r = requests[i % len(requests)]
        out.append(replace(r, key=f"{r.key}#{i // len(requests)}"))
    return out


def question_key(key: str) -> str:
    return key.split("#", 1)[0]


@dataclass
class RequestRecord:
    key: str
    ok: bool = False
    error: str = ""
    sent: float = 0.0  # perf_counter at send
    chunks: list[float] = field(default_factory=list)  # perf_counter of each chunk with text
    ended: float = 0.0
    text: str = ""
    tokens: int = 0  # completion tokens (the server's usage, else the tokenizer's count of the text)
    finish_reason: str | None = None
    reconnects: int = 0  # connections that failed before any reply, each followed by a new one

    @property
    def latency(self) -> float:
        return self.ended - self.sent

    @property
    def ttft(self) -> float:
        return (self.chunks[0] if self.chunks else self.ended) - self.sent

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(frozen=True)
class LoadPlan:
    concurrency: int | None = None  # clients, each sending its next request when its last ended
    rate: float | None = None  # or: requests per second, Poisson arrivals (exponential gaps, seeded)
    seed: int = 0
    timeout_s: float = 600.0  # one request's time at most
    api_key: str = "none"

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a load plan has a concurrency or a request rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


RECONNECTS = 1  # new connections a request may take after one failed before any reply


async def _stream(client: openai.AsyncOpenAI, model: str, req: LoadRequest, rec: RequestRecord):
    """The request's stream. A connection that fails before any reply (a pooled keep-alive connection that the
    server closed just as the request went out on it) is replaced by a new one, up to RECONNECTS times, and counted
    in ``rec.reconnects``; its time stays in the request's latency. A timeout, an error status and any error once
    the reply began stand."""
    while True:
        try:
            return await client.completions.create(model=model, prompt=list(req.prompt), max_tokens=req.max_tokens,
                                                   temperature=0.0, stream=True,
                                                   stream_options={"include_usage": True})
        except openai.APITimeoutError:
            raise
        except openai.APIConnectionError:
            if rec.reconnects >= RECONNECTS:
                raise
            rec.reconnects += 1


async def _one(client: openai.AsyncOpenAI, model: str, req: LoadRequest, count_tokens) -> RequestRecord:
    rec = RequestRecord(req.key, sent=time.perf_counter())
    pieces: list[str] = []
    try:
        stream = await _stream(client, model, req, rec)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                rec.chunks.append(time.perf_counter())
                pieces.append(chunk.choices[0].text)
            if chunk.choices and chunk.choices[0].finish_reason:
                rec.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                rec.tokens = chunk.usage.completion_tokens
        rec.ok = True
    except (TimeoutError, openai.APIError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    rec.ended = time.perf_counter()
    rec.text = "".join(pieces)
    if rec.ok and not rec.tokens:
        rec.tokens = count_tokens(rec.text)
    return rec


async def run_load(base_url: str, model: str, requests: Sequence[LoadRequest], plan: LoadPlan,
                   count_tokens=lambda text: 0, progress=None) -> list[RequestRecord]:
    """Every request sent once, in order, under the plan; their records in the same order."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=plan.api_key, timeout=plan.timeout_s, max_retries=0)
    records: list[RequestRecord | None] = [None] * len(requests)

    async def send(i: int) -> None:
        records[i] = await _one(client, model, requests[i], count_tokens)
        if progress is not None:
            progress(1)

    try:
        if plan.concurrency is not None:
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for i in queue:  # a shared iterator: each index is taken once
                    await send(i)

            await asyncio.gather(*(worker() for _ in range(min(plan.concurrency, len(requests)))))
        else:
            rng, tasks = random.Random(plan.seed), []
            for i in range(len(requests)):
                tasks.append(asyncio.create_task(send(i)))
                await asyncio.sleep(rng.expovariate(plan.rate))
            await asyncio.gather(*tasks)
    finally:
        await client.close()
    return [r for r in records if r is not None]


def run_load_sync(base_url: str, model: str, requests: Sequence[LoadRequest], plan: LoadPlan,
                  count_tokens=lambda text: 0, progress=None) -> list[RequestRecord]:
    """``run_load`` on uvloop's event loop where it is installed: every chunk wakes the client, and on a machine
    that also runs the server the client's CPU per chunk is taken from the decoding it measures, so the leaner
    loop is the one to measure with."""
    coro = run_load(base_url, model, requests, plan, count_tokens, progress)
    return uvloop.run(coro) if uvloop is not None else asyncio.run(coro)
