"""The chat endpoint as an ASGI app (Starlette): requests in, the scheduler's tokens out, whole or streamed.

    POST /v1/chat/completions   the OpenAI contract (protocol.py); ``stream: true`` answers server-sent events
    POST /v1/completions        the same for a prompt as it is (text or token ids), no chat template
    GET  /v1/models             the one model served
    GET  /metrics               Prometheus text: running and waiting requests, tokens, accepted drafts by position
    GET  /health                200 while the server runs (never behind the API key)

Decoding happens on the scheduler's loop (``medusa_runtime.decoding.scheduler``; ``medusa-bench serve`` runs it on
the main thread and the app on another): a handler queues its request and awaits the tokens the scheduler hands
over after each step. A full queue answers 503 at once; a client that goes away (a closed stream, a dropped
connection while waiting) frees its row before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.batch import BatchDecoder, Scheduled, StepTokens, batches
from medusa_runtime.decoding.decode import DecodeConfig, GenerateStats, MedusaDecoder
from medusa_runtime.decoding.guided import guided_choice
from medusa_runtime.decoding.scheduler import Job, QueueFull, Scheduler
from medusa_runtime.model import LoadedModel, chat_template_ids
from medusa_runtime.server.protocol import (
    ChatRequest,
    Completion,
    RequestError,
    ServeConfig,
    TextStream,
    chunk_body,
    completion_body,
    error_body,
    new_id,
    parse_request,
    parse_text_request,
    text_completion_body,
    usage_body,
)
from medusa_runtime.tree.lookup import LookupConfig
from treesearch.replay import Decoding
from treesearch.schedule import read_schedule, schedule_decoding


class Metrics:
    """The server's Prometheus series, in a registry of its own."""

    def __init__(self, scheduler: Scheduler):
        self.registry = r = CollectorRegistry()
        Gauge("medusa_requests_running", "requests in the decoding batch", registry=r).set_function(
            lambda: scheduler.running)
        Gauge("medusa_requests_waiting", "requests queued for a row", registry=r).set_function(
            lambda: scheduler.waiting)
        self.tokens = Counter("medusa_generated_tokens", "tokens generated (all requests)", registry=r)
        self.steps = Counter("medusa_decode_steps", "decode steps of finished requests (one per row per step)",
                             registry=r)
        self.accepted = Counter("medusa_accepted_drafts", "draft tokens accepted at each tree depth (1: the first "
                                "head's), finished requests", ["position"], registry=r)
        self.requests = Counter("medusa_requests", "requests by outcome", ["outcome"], registry=r)
        ranges = Gauge("medusa_schedule_steps", "batched decode steps run by each configuration of the schedule "
                       "(one range: every step)", ["batch_sizes", "configuration"], registry=r)
        batch = scheduler.batch
        for i, s in enumerate(batch.schedule):
            label = s.decoder.tree.name if s.decoder.tree is not None else "plain"
            ranges.labels(batch_sizes=f"{s.first}-{s.last}", configuration=label).set_function(
                lambda i=i: batch.steps_by_range[i])

    def on_step(self, got: list[StepTokens]) -> None:
        self.tokens.inc(sum(len(s.tokens) for s in got))
        for s in got:
            if s.stats is not None:
                self.finished(s.stats)

    def finished(self, stats: GenerateStats) -> None:
        self.steps.inc(stats.steps)
        for depth, hits in enumerate(stats.head_hits, start=1):
            if hits:
                self.accepted.labels(position=str(depth)).inc(hits)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def schedule_ranges(schedule: list[dict], with_heads: bool) -> list[tuple[int, int, Decoding]]:
    """(first, last, decoding) of each range of a schedule read by ``treesearch.schedule.read_schedule``; a
    ValueError, one line, for a range that drafts with heads where the server has none."""
    out = []
    for entry in schedule:
        (first, last), decoding = entry["batch"], schedule_decoding(entry)
        if decoding.tree is not None and not with_heads:
            raise ValueError(f"the schedule's configuration for batch sizes {first}-{last} uses heads: serve it "
                             "with --heads")
        out.append((int(first), int(last), decoding))
    return out


class ChatServer:
    """The model, its heads and tree behind the endpoint: one decoder, batched by the scheduler."""

    def __init__(self, loaded: LoadedModel, heads, cfg: ServeConfig):
        if not getattr(loaded.tokenizer, "chat_template", None):
            raise ValueError(f"model {loaded.name} has no chat template, which a chat endpoint needs")
        self.loaded, self.cfg = loaded, cfg
        tree = cfg.tree if heads is not None else None
        schedule = self._schedule(heads) if cfg.schedule else []
        self.decoder = schedule[0].decoder if schedule else self._decoder(heads, tree, cfg.lookup, cfg.gate)
        self.max_batch = cfg.max_batch if batches(self.decoder) else 1  # one at a time on transformers' engine
        self.scheduler = Scheduler(BatchDecoder(self.decoder, self.max_batch, schedule), cfg.max_queue)
        self.metrics = Metrics(self.scheduler)
        self.scheduler.on_step = self.metrics.on_step

    def _decoder(self, heads, tree, lookup: int, gate: float) -> MedusaDecoder:
        cfg = self.cfg
        return MedusaDecoder(self.loaded, heads if tree else None, tree, AcceptConfig(),
                             DecodeConfig(max_new_tokens=cfg.max_new_tokens, topk=cfg.topk,
                                          lookup=LookupConfig(lookup), gate=gate if tree is not None else 0.0))

    def _schedule(self, heads) -> list[Scheduled]:
        """One decoder per range of the schedule file (``treesearch.schedule``), over these heads."""
        return [Scheduled(first, last, self._decoder(heads, d.tree, d.lookup, d.gate))
                for first, last, d in schedule_ranges(read_schedule(self.cfg.schedule), heads is not None)]

    # ------------------------------------------------------------------ the app

    def app(self, decode_on_own_thread: bool = True) -> Starlette:
        """The ASGI app. Its lifespan starts the scheduler on a thread of its own, or, with
        ``decode_on_own_thread=False``, leaves the loop to the caller (``Scheduler.run`` on the main thread while
        the app is served from another); it stops the scheduler either way when the app shuts down."""
        routes = [Route("/v1/chat/completions", self._guarded(self.chat), methods=["POST"]),
                  Route("/v1/completions", self._guarded(self.text), methods=["POST"]),
                  Route("/v1/models", self._guarded(self.models), methods=["GET"]),
                  Route("/metrics", self._guarded(self.prometheus), methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]

        @asynccontextmanager
        async def lifespan(app):
            if decode_on_own_thread:
                self.scheduler.start()
            try:
                yield
            finally:
                self.scheduler.stop()

        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})

    def _guarded(self, handler):
        """The handler behind the API key (when one is set)."""
        async def checked(request: Request) -> Response:
            if self.cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {self.cfg.api_key}":
                self.metrics.requests.labels(outcome="unauthorized").inc()
                return _error("a valid API key is required (Authorization: Bearer <key>)", HTTPStatus.UNAUTHORIZED,
                              "authentication_error")
            return await handler(request)
        return checked

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "running": self.scheduler.running, "waiting": self.scheduler.waiting})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.cfg.name, "object": "model",
                                                         "owned_by": "medusa-bench"}]})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, lambda body: parse_request(body, self.cfg))

    async def text(self, request: Request) -> Response:
        return await self._complete(request, lambda body: parse_text_request(body, self.cfg, self.loaded.vocab_size))

    async def _complete(self, request: Request, parse) -> Response:
        try:
            req = parse(await _json_body(request, self.cfg.max_body_bytes))
            ids = await run_in_threadpool(self._prompt_ids, req)
            if req.choices is not None:
                completion = await self._guided(ids, req.choices)
                return self._whole(completion, req) if not req.stream else self._stream_whole(completion, req)
            job, events = self._submit(req, ids)
        except RequestError as exc:
            self.metrics.requests.labels(outcome="refused" if exc.status == HTTPStatus.SERVICE_UNAVAILABLE
                                         else "invalid").inc()
            return _error(str(exc), exc.status, exc.kind)
        if req.stream:
            return StreamingResponse(self._sse(job, events, req, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._wait_whole(request, job, events, req, len(ids))

    # ------------------------------------------------------------------ a request's path

    def _prompt_ids(self, req: ChatRequest) -> list[int]:
        if req.messages is not None:
            ids = chat_template_ids(self.loaded, req.messages)
        elif isinstance(req.prompt, str):
            ids = list(self.loaded.tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
        else:
            ids = list(req.prompt)
        if len(ids) >= self.loaded.max_length:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.loaded.max_length}",
                               kind="context_length_exceeded")
        return ids

    async def _guided(self, ids: list[int], choices: tuple[str, ...]) -> Completion:
        """A guided-choice request: greedy over the choices' token paths (plain forwards, on the scheduler's thread)."""
        text = await asyncio.wrap_future(self.scheduler.call(lambda: guided_choice(self.loaded, ids, choices)))
        n = len(self.loaded.tokenizer.encode(text, add_special_tokens=False))
        self.metrics.requests.labels(outcome="ok").inc()
        return Completion(text, len(ids), n, "stop", n, 1.0)

    def _submit(self, req: ChatRequest, ids: list[int]) -> tuple[Job, asyncio.Queue]:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        rule = AcceptConfig() if req.temperature == 0 else AcceptConfig(rule="sample", temperature=req.temperature)
        room = self.loaded.max_length - len(ids)
        job = Job(ids, min(req.max_tokens, room),
                  lambda tokens, stop, stats: loop.call_soon_threadsafe(events.put_nowait, (tokens, stop, stats)),
                  rule, req.seed)
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise RequestError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, "server_busy") from None
        return job, events

    def _completion(self, tokens: list[int], text: str, stop: str, stats: GenerateStats | None,
                    prompt_tokens: int) -> Completion:
        steps, tau = (stats.steps, stats.tau) if stats is not None else (0, 0.0)
        return Completion(text, prompt_tokens, len(tokens), "stop" if stop == "eos" else "length", steps, tau)

    async def _wait_whole(self, request: Request, job: Job, events: asyncio.Queue, req: ChatRequest,
                          prompt_tokens: int) -> Response:
        """A non-streamed request: its tokens until it stops, or nothing if its client disconnects first."""
        gone = asyncio.ensure_future(_disconnected(request))
        tokens: list[int] = []
        try:
            while True:
                got = asyncio.ensure_future(events.get())
                await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not got.done():
                    got.cancel()
                    self.scheduler.cancel(job)
                    self.metrics.requests.labels(outcome="disconnected").inc()
                    return Response(status_code=499)  # nobody reads it
                new, stop, stats = got.result()
                tokens.extend(new)
                if stop.startswith("error"):
                    self.metrics.requests.labels(outcome="failed").inc()
                    return _error(f"decoding failed: {stop.removeprefix('error: ')}", HTTPStatus.INTERNAL_SERVER_ERROR,
                                  "server_error")
                if stop:
                    break
        finally:
            gone.cancel()
        self.metrics.requests.labels(outcome="ok").inc()
        text = self.loaded.tokenizer.decode(tokens, skip_special_tokens=True)
        return self._whole(self._completion(tokens, text, stop, stats, prompt_tokens), req)

    def _whole(self, completion: Completion, req: ChatRequest) -> Response:
        body = completion_body if req.kind == "chat.completion" else text_completion_body
        return JSONResponse(body(completion, self.cfg.name))

    async def _sse(self, job: Job, events: asyncio.Queue, req: ChatRequest, prompt_tokens: int
                   ) -> AsyncIterator[str]:
        """A streamed request: a role chunk, a chunk per step with new text, the finish chunk, the usage chunk
        (when asked), then [DONE]. Closing the stream early (the client left) cancels the request."""
        cid, created, model, kind = new_id(), int(time.time()), self.cfg.name, req.kind
        text, tokens, finished = TextStream(self.loaded.tokenizer), [], False
        try:
            if kind == "chat.completion":
                yield _event(chunk_body(cid, created, model, {"role": "assistant", "content": ""}))
            while True:
                new, stop, stats = await events.get()
                if stop.startswith("error"):
                    finished = True
                    self.metrics.requests.labels(outcome="failed").inc()
                    yield _event(error_body(f"decoding failed: {stop.removeprefix('error: ')}",
                                            HTTPStatus.INTERNAL_SERVER_ERROR, "server_error"))
                    break
                tokens.extend(new)
                piece = text.push(new) + (text.finish() if stop else "")
                if piece:
                    yield _event(chunk_body(cid, created, model, {"content": piece}, kind=kind))
                if stop:
                    finished = True
                    done = self._completion(tokens, text.sent, stop, stats, prompt_tokens)
                    self.metrics.requests.labels(outcome="ok").inc()
                    yield _event(chunk_body(cid, created, model, {}, done.finish_reason, kind=kind))
                    if req.include_usage:
                        yield _event(chunk_body(cid, created, model, {}, usage=usage_body(done), choices=False,
                                                kind=kind))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.scheduler.cancel(job)
                self.metrics.requests.labels(outcome="disconnected").inc()

    def _stream_whole(self, completion: Completion, req: ChatRequest) -> StreamingResponse:
        """A guided choice asked as a stream: its whole reply in one chunk."""
        cid, created, model = new_id(), int(time.time()), self.cfg.name

        async def events() -> AsyncIterator[str]:
            yield _event(chunk_body(cid, created, model, {"role": "assistant", "content": completion.text}))
            yield _event(chunk_body(cid, created, model, {}, completion.finish_reason))
            if req.include_usage:
                yield _event(chunk_body(cid, created, model, {}, usage=usage_body(completion), choices=False))
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")


async def _json_body(request: Request, limit: int) -> object:
    """The request's JSON body, refused when over ``limit`` bytes or not JSON. An oversize body is read to its end
    (up to 16 times the limit) and dropped, so that the client, still sending, reads the 413 rather than a broken
    connection."""
    body, size = bytearray(), 0
    async for part in request.stream():
        size += len(part)
        if size <= limit:
            body += part
        elif size > 16 * limit:
            break
    if size > limit:
        raise RequestError(f"the body is over {limit} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    try:
        return json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("the body is not JSON") from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the body already read, the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(message: str, status: HTTPStatus, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, status, kind), status_code=status.value)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = f"no route {request.url.path}" if exc.status_code == 404 else str(exc.detail)
    return JSONResponse(error_body(message, HTTPStatus(exc.status_code), kind), status_code=exc.status_code)
