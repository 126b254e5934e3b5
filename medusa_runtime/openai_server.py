"""An OpenAI-compatible chat endpoint on the runtime: Medusa decoding (or plain) behind ``/v1/chat/completions``.

    medusa-bench serve --model default --heads default --tree chain:2 --port 8000
    curl localhost:8000/v1/chat/completions -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}]}'

What it serves, per the OpenAI chat-completions contract (the fields a client such as the bench's judge or
the ``openai`` package reads):

* ``POST /v1/chat/completions``: ``model``, ``messages`` (system/user/assistant, through the model's chat
  template), ``max_tokens`` or ``max_completion_tokens``, ``temperature`` (0: greedy, lossless Medusa
  acceptance; above 0: exact tree sampling, distributed as plain sampling), ``seed``; ``n`` must be 1 and
  ``stream`` false. ``structured_outputs: {"choice": [...]}`` (vLLM's extension; its earlier spelling
  ``guided_choice``, a list of strings) makes the reply one of them, by
  greedy decoding constrained to their tokens (``medusa_runtime.decoding.guided``). Reply: ``choices[0].message.content``, ``finish_reason`` ("stop" at EOS, "length" at the
  cap) and ``usage``; plus a ``medusa`` object with the steps and tau of the request.
* ``GET /v1/models``: the one model served. Anything else: a JSON error with the HTTP status.

Requests are decoded one at a time (one model, one cache); the HTTP server takes connections in threads.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from medusa_runtime.decoding.acceptance import AcceptConfig
from medusa_runtime.decoding.decode import DecodeConfig, MedusaDecoder
from medusa_runtime.decoding.guided import check_choices, guided_choice
from medusa_runtime.model import LoadedModel, chat_template_ids
from medusa_runtime.tree.lookup import LookupConfig


@dataclass(frozen=True)
class ServeConfig:
    name: str  # the model id clients send and /v1/models lists
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the server's .server_address says which)
    max_new_tokens: int = 128  # a reply's length at most: a request's max_tokens may ask for fewer (the judge asks 2048)
    tree: str | None = None  # the heads' tree (None: plain decoding)
    topk: int = 10
    lookup: int = 0  # prompt-lookup draft tokens beside the tree (0: none)
    gate: float = 0.0  # confidence gate on the tree's levels (DecodeConfig.gate; 0: off)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be within 0-65535, got {self.port}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.lookup < 0:
            raise ValueError(f"lookup must be >= 0, got {self.lookup}")
        if not 0.0 <= self.gate <= 1.0:
            raise ValueError(f"gate must be within [0, 1], got {self.gate}")


class RequestError(ValueError):
    """A request the endpoint refuses: the HTTP status and OpenAI's error type go with the message."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    max_tokens: int
    temperature: float
    seed: int | None = None
    choices: tuple[str, ...] | None = None  # guided_choice: the reply is one of these


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    steps: int
    tau: float


class ChatService:
    """The model (with its heads and tree) answering chat requests, one at a time."""

    def __init__(self, loaded: LoadedModel, heads, cfg: ServeConfig):
        if not getattr(loaded.tokenizer, "chat_template", None):
            raise ValueError(f"model {loaded.name} has no chat template, which a chat endpoint needs")
        self.loaded, self.heads, self.cfg = loaded, heads, cfg
        self._decoders: dict[float, MedusaDecoder] = {}  # by temperature (buffers built once each)
        self._lock = threading.Lock()

    def _decoder(self, temperature: float) -> MedusaDecoder:
        if temperature not in self._decoders:
            rule = "greedy" if temperature == 0 else "sample"
            tree = self.cfg.tree if self.heads is not None else None
            self._decoders[temperature] = MedusaDecoder(self.loaded, self.heads, tree,
                                                        AcceptConfig(rule=rule, temperature=temperature),
                                                        DecodeConfig(topk=self.cfg.topk,
                                                                     lookup=LookupConfig(self.cfg.lookup),
                                                                     gate=self.cfg.gate if tree is not None else 0.0))
        return self._decoders[temperature]

    def complete(self, req: ChatRequest) -> Completion:
        tok = self.loaded.tokenizer
        ids = chat_template_ids(self.loaded, req.messages)
        room = self.loaded.max_length - len(ids)
        if room < 1:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.loaded.max_length}",
                               kind="context_length_exceeded")
        if req.choices is not None:
            return self._choose(ids, req.choices)
        n = min(req.max_tokens, room)
        seed = req.seed
        with self._lock:
            dec = self._decoder(req.temperature)
            dec.config = replace(dec.config, max_new_tokens=n)  # the buffers do not depend on the length
            if seed is not None:  # the same seed, the same sample (whatever was asked before)
                dec.generator.manual_seed(seed)
            result = dec.generate(ids)
        new = result.token_ids
        eos = set(self.loaded.eos_token_ids)
        finish = "stop" if new and new[-1] in eos or len(new) < n else "length"
        return Completion(tok.decode(new, skip_special_tokens=True), len(ids), len(new), finish, result.stats.steps,
                          result.stats.tau)

    def _choose(self, ids: list[int], choices: tuple[str, ...]) -> Completion:
        """A guided_choice request: greedy over the choices' token paths (plain forwards, no heads)."""
        with self._lock:
            text = guided_choice(self.loaded, ids, choices)
        n = len(self.loaded.tokenizer.encode(text, add_special_tokens=False))
        return Completion(text, len(ids), n, "stop", n, 1.0)


def _field(body: dict, name: str, kind: type | tuple[type, ...], default=None):
    """body[name] when it has the type (a JSON true is not an integer here), the default when absent."""
    value = body.get(name, default)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise RequestError(f"'{name}' has the wrong type ({type(value).__name__})")
    return value


def parse_request(body: object, cfg: ServeConfig) -> ChatRequest:
    """The request a chat-completions body makes, or a RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    model = _field(body, "model", str)
    if model is None:
        raise RequestError("'model' is required")
    if model != cfg.name:
        raise RequestError(f"the model '{model}' does not exist here (served: {cfg.name})", HTTPStatus.NOT_FOUND,
                           "model_not_found")
    messages = _field(body, "messages", list)
    if not messages:
        raise RequestError("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise RequestError("each message needs a role (system, user, assistant) and a string content")
    if _field(body, "stream", bool, False):
        raise RequestError("streaming is not supported (stream must be false)")
    if _field(body, "n", int, 1) != 1:
        raise RequestError("only n = 1 is supported")
    max_tokens = _field(body, "max_completion_tokens", int) or _field(body, "max_tokens", int) or cfg.max_new_tokens
    if max_tokens < 1:
        raise RequestError("max_tokens must be >= 1")
    temperature = float(_field(body, "temperature", (int, float), 1.0))  # OpenAI's default is 1
    if not 0 <= temperature <= 2:
        raise RequestError("temperature must be within [0, 2]")
    seed = _field(body, "seed", int)
    choices = _field(body, "guided_choice", list)
    structured = _field(body, "structured_outputs", dict)  # today's vLLM spelling: {"choice": [...]}
    if structured is not None:
        if set(structured) - {"choice"}:
            raise RequestError("structured_outputs: only 'choice' is supported")
        choices = structured.get("choice") if choices is None else choices
        if not isinstance(choices, list):
            raise RequestError("structured_outputs.choice must be a list of strings")
    if choices is not None:
        try:
            check_choices(choices)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
    return ChatRequest([{"role": m["role"], "content": m["content"]} for m in messages],
                       min(max_tokens, cfg.max_new_tokens), temperature, seed, tuple(choices) if choices else None)


def completion_body(c: Completion, model: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                      "total_tokens": c.prompt_tokens + c.completion_tokens},
            "medusa": {"steps": c.steps, "tau": c.tau}}


def make_server(service: ChatService) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving: call ``serve_forever``) bound to the service's host and port."""
    cfg = service.cfg

    class Handler(BaseHTTPRequestHandler):
        server_version = "medusa-bench"

        def _send(self, status: HTTPStatus, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: HTTPStatus, message: str, kind: str = "invalid_request_error") -> None:
            self._send(status, {"error": {"message": message, "type": kind, "code": status.value}})

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") == "/v1/models":
                self._send(HTTPStatus.OK, {"object": "list", "data": [{"id": cfg.name, "object": "model",
                                                                       "owned_by": "medusa-bench"}]})
            elif self.path.rstrip("/") == "/health":
                self._send(HTTPStatus.OK, {"status": "ok"})
            else:
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}", "not_found")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                completion = service.complete(parse_request(body, cfg))
            except json.JSONDecodeError:
                self._error(HTTPStatus.BAD_REQUEST, "the body is not JSON")
            except RequestError as exc:
                self._error(exc.status, str(exc), exc.kind)
            except Exception as exc:  # noqa: BLE001 - the client gets a JSON error, the server keeps serving
                self.log_error("request failed: %s", exc)
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"decoding failed: {str(exc).splitlines()[0]}",
                            "server_error")
            else:
                self._send(HTTPStatus.OK, completion_body(completion, cfg.name))

    return ThreadingHTTPServer((cfg.host, cfg.port), Handler)
