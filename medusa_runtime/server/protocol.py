"""The OpenAI chat-completions contract as the server speaks it: what a request may ask, the replies' bodies.

* ``POST /v1/chat/completions``: ``model``, ``messages`` (system/user/assistant, through the model's chat
  template), ``max_tokens`` or ``max_completion_tokens``, ``temperature`` (0: greedy, lossless Medusa
  acceptance; above 0: exact tree sampling, distributed as plain sampling), ``seed``, ``n`` (1 only),
  ``stream`` (server-sent events: ``chat.completion.chunk`` bodies, then ``data: [DONE]``) with
  ``stream_options.include_usage`` (a last chunk with the usage). ``structured_outputs: {"choice": [...]}``
  (vLLM's extension; its earlier spelling ``guided_choice``, a list of strings) makes the reply one of them, by
  greedy decoding constrained to their tokens (``medusa_runtime.decoding.guided``). Reply:
  ``choices[0].message.content``, ``finish_reason`` ("stop" at EOS, "length" at the cap) and ``usage``; plus a
  ``medusa`` object with the steps and tau of the request.
* ``POST /v1/completions``: the same options for a ``prompt`` as it is (a string, or token ids), no chat template;
  replies are ``text_completion`` objects (``choices[0].text``), streamed as ``text_completion`` chunks.
* Errors: ``{"error": {"message", "type", "code"}}`` with the HTTP status.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

from medusa_runtime.decoding.guided import check_choices


@dataclass(frozen=True)
class ServeConfig:
    name: str  # the model id clients send and /v1/models lists
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (printed when the server starts)
    max_new_tokens: int = 128  # a reply's length at most: a request's max_tokens may ask for fewer (the judge asks 2048)
    tree: str | None = None  # the heads' tree (None: plain decoding)
    topk: int = 10
    lookup: int = 0  # prompt-lookup draft tokens beside the tree (0: none)
    gate: float = 0.0  # confidence gate on the tree's levels (DecodeConfig.gate; 0: off)
    max_batch: int = 16  # requests decoded together at most (continuous batching)
    schedule: str | None = None  # a tree.json with a schedule: the configuration follows the live batch size
    max_queue: int = 64  # requests waiting for a row at most; beyond, 503
    api_key: str | None = None  # when set, every request but /health needs "Authorization: Bearer <key>"
    max_body_bytes: int = 1 << 20  # a request body's size at most; beyond, 413

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be within 0-65535, got {self.port}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.lookup < 0:
            raise ValueError(f"lookup must be >= 0, got {self.lookup}")
        if not 0.0 <= self.gate <= 1.0:
            raise ValueError(f"gate must be within [0, 1], got {self.gate}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")


class RequestError(ValueError):
    """A request the endpoint refuses: the HTTP status and OpenAI's error type go with the message."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion (``messages``) or a text completion (``prompt``: text or token ids) to decode."""

    messages: list[dict] | None
    max_tokens: int
    temperature: float
    seed: int | None = None
    choices: tuple[str, ...] | None = None  # guided_choice: the reply is one of these
    stream: bool = False  # server-sent events, chunk by chunk
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    prompt: str | tuple[int, ...] | None = None  # /v1/completions: the prompt as it is (no chat template)

    @property
    def kind(self) -> str:
        """The reply's object: chat.completion or text_completion."""
        return "text_completion" if self.messages is None else "chat.completion"


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # stop | length
    steps: int
    tau: float


def _field(body: dict, name: str, kind: type | tuple[type, ...], default=None):
    """body[name] when it has the type (a JSON true is not an integer here), the default when absent."""
    value = body.get(name, default)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is not None and (isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds)):
        raise RequestError(f"'{name}' has the wrong type ({type(value).__name__})")
    return value


def _check_model(body: object, cfg: ServeConfig) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    model = _field(body, "model", str)
    if model is None:
        raise RequestError("'model' is required")
    if model != cfg.name:
        raise RequestError(f"the model '{model}' does not exist here (served: {cfg.name})", HTTPStatus.NOT_FOUND,
                           "model_not_found")
    return body


def _options(body: dict, cfg: ServeConfig) -> dict:
    """What chat and text completions share: length, temperature, seed, n, stream."""
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean")
    if _field(body, "n", int, 1) != 1:
        raise RequestError("only n = 1 is supported")
    max_tokens = _field(body, "max_completion_tokens", int) or _field(body, "max_tokens", int) or cfg.max_new_tokens
    if max_tokens < 1:
        raise RequestError("max_tokens must be >= 1")
    temperature = float(_field(body, "temperature", (int, float), 1.0))  # OpenAI's default is 1
    if not 0 <= temperature <= 2:
        raise RequestError("temperature must be within [0, 2]")
    return {"max_tokens": min(max_tokens, cfg.max_new_tokens), "temperature": temperature,
            "seed": _field(body, "seed", int), "stream": stream, "include_usage": stream and include_usage}


def parse_request(body: object, cfg: ServeConfig) -> ChatRequest:
    """The request a chat-completions body makes, or a RequestError."""
    body = _check_model(body, cfg)
    messages = _field(body, "messages", list)
    if not messages:
        raise RequestError("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise RequestError("each message needs a role (system, user, assistant) and a string content")
    options = _options(body, cfg)
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
                       choices=tuple(choices) if choices else None, **options)


def parse_text_request(body: object, cfg: ServeConfig, vocab_size: int) -> ChatRequest:
    """The request a (text) completions body makes: ``prompt`` a string or a list of token ids."""
    body = _check_model(body, cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                 for t in prompt):
            raise RequestError(f"'prompt' as token ids must be a non-empty list of integers in [0, {vocab_size})")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt)")
    return ChatRequest(None, prompt=prompt, **_options(body, cfg))


def completion_body(c: Completion, model: str) -> dict:
    return {"id": new_id(), "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason, "logprobs": None}],
            "usage": usage_body(c),
            "medusa": {"steps": c.steps, "tau": c.tau}}


def usage_body(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def text_completion_body(c: Completion, model: str) -> dict:
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}],
            "usage": usage_body(c), "medusa": {"steps": c.steps, "tau": c.tau}}


def chunk_body(cid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
               usage: dict | None = None, choices: bool = True, kind: str = "chat.completion") -> dict:
    """One chunk of a stream (``choices`` False: the usage chunk, whose choices are empty): a
    ``chat.completion.chunk`` with a ``delta``, or for a text completion a ``text_completion`` with the delta's
    content as ``text``."""
    if kind == "chat.completion":
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason, "logprobs": None}
    body = {"id": cid, "object": f"{kind}.chunk" if kind == "chat.completion" else kind, "created": created,
            "model": model, "choices": [choice] if choices else []}
    if usage is not None:
        body["usage"] = usage
    return body


def error_body(message: str, status: HTTPStatus, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "code": status.value}}


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class TextStream:
    """Token ids in, text out as it becomes final: each ``push`` returns the new text since the last one, and the
    pieces join into exactly ``decode(all ids)``. A piece is held back while the text so far ends in an unfinished
    character (a byte-level token that splits a UTF-8 sequence decodes to U+FFFD) or would rewrite text already
    sent."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece

    def finish(self) -> str:
        """The rest of the text (the final decode; what was held back)."""
        text = self.text()
        if not text.startswith(self.sent):  # a decode that rewrote sent text: the stream can only append
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
