"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health.

Requests are validated by pydantic models that refuse unknown fields; every error has OpenAI's body
{"error": {"message", "type", "param", "code"}}: 400 for a request that cannot be served as given, 404 for another
model's name, 503 with Retry-After when every slot and the queue are full, 500 when the model fails on a request
(the others go on). Streams are server-sent events, ended by `data: [DONE]`; a client that goes away cancels its
request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from granite_jax.errors import GenerationError
from granite_jax.sampling import SamplingConfig
from granite_jax.serving.engine import Engine, Outcome, Overloaded
from granite_jax.serving.engine import Request as EngineRequest

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.25


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The options both endpoints share (OpenAI's names and defaults; top_k as vLLM spells it)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: no limit
    seed: Annotated[int, Field(ge=0, lt=2**32)] | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    ignore_eos: bool = False  # vLLM's: generate max_tokens whatever the model says (load tests)


class CompletionRequest(_Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: Literal[False] = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # the chosen tokens' (0); more: not supported

    def top_logprobs_asked(self) -> int:
        return self.logprobs or 0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def top_logprobs_asked(self) -> int:
        return self.top_logprobs or 0


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kinds = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_overloaded"}
    body = {"error": {"message": message, "type": kinds.get(status, "server_error"), "param": param, "code": code}}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: Engine, model_name: str) -> FastAPI:
    """The API over a started `engine`, serving it as `model_name`."""
    app = FastAPI(title="granite-jax", summary="OpenAI-compatible API over a Granite 4.0 model in JAX")
    tokenizer, created = engine.generator.tokenizer, int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_body(400, f"{where or 'body'}: {first.get('msg', 'invalid')}", where, first.get("type"))

    @app.exception_handler(GenerationError)
    async def unservable(_: Request, exc: GenerationError) -> JSONResponse:
        return error_body(400, str(exc))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **engine.stats()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "granite-jax"}
        return {"object": "list", "data": [card | {"max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        if isinstance(body.prompt, str):
            ids = _encode(tokenizer, body.prompt, special=True)
        else:
            ids = list(body.prompt)
            if bad := [i for i in ids if i >= engine.cfg.vocab_size]:
                return error_body(400, f"prompt: token id {bad[0]} is outside the vocabulary", "prompt")
        return await _serve(engine, model_name, body, ids, http, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: Request):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return error_body(400, "this model's tokenizer has no chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = _encode(tokenizer, text, special=False)
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        return await _serve(engine, model_name, body, ids, http, chat=True, default_max=None)

    return app


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    if tokenizer is None:
        raise GenerationError("this model has no tokenizer: send the prompt as token ids")
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _sampling(engine: Engine, body: _Sampling, prompt_len: int, default_max: int | None) -> SamplingConfig:
    """The request's options as a SamplingConfig; those greedy decoding ignores are dropped at temperature 0."""
    room = engine.max_context - prompt_len
    if room < 1:
        raise GenerationError(f"the prompt is {prompt_len} tokens, this server's context is {engine.max_context}")
    max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max or room, room)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    options: dict[str, Any] = dict(max_new_tokens=max_tokens, stop_strings=stop, temperature=body.temperature)
    if body.ignore_eos:
        options["stop_token_ids"] = ()
    if body.temperature > 0:
        seed = body.seed if body.seed is not None else secrets.randbits(32)
        options |= dict(top_p=body.top_p, top_k=max(body.top_k, 0), seed=seed)
    return SamplingConfig(**options)


async def _serve(engine: Engine, name: str, body: _Sampling, ids: list[int], http: Request, *, chat: bool, default_max):
    if body.model is not None and body.model != name:
        return error_body(404, f"model {body.model!r} is not served here; this server serves {name!r}", "model")
    logprobs = body.logprobs is not None and body.logprobs is not False
    if body.top_logprobs_asked():
        return error_body(400, "top logprobs are not supported: ask for the chosen tokens' only (0)", "logprobs")
    if logprobs and body.stream:
        return error_body(400, "logprobs are not streamed: ask for them without stream", "logprobs")
    try:
        sampling = _sampling(engine, body, len(ids), default_max)
        engine.check(ids, sampling)
    except GenerationError as e:
        return error_body(400, str(e), "messages" if chat else "prompt", "context_length_exceeded")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    request = EngineRequest(
        ids,
        sampling,
        on_text=lambda delta: loop.call_soon_threadsafe(events.put_nowait, delta),
        on_done=lambda outcome: loop.call_soon_threadsafe(events.put_nowait, outcome),
        logprobs=logprobs,
    )
    try:
        engine.submit(request)
    except Overloaded as e:
        return error_body(503, f"the server is at capacity ({e}); retry after {RETRY_AFTER_S} s")
    shape = _Shape(chat, name, body, engine.generator.tokenizer)
    # The first event decides the status: a request the model fails on before its first token is a 500, streamed
    # or not.
    event = await _next_event(engine, request, events, http, until_done=not body.stream)
    if isinstance(event, Outcome) and event.finish_reason == "error":
        return error_body(500, f"the model failed on this request ({event.error})")
    if body.stream:
        return StreamingResponse(_stream(engine, request, events, shape, event), media_type="text/event-stream")
    return shape.response(event)


async def _next_event(engine: Engine, request: EngineRequest, events: asyncio.Queue, http: Request, until_done: bool):
    """The request's next event (its Outcome, with `until_done`), cancelling it if the client goes away."""
    while True:
        try:
            event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await http.is_disconnected():
                engine.cancel(request)
            continue
        if isinstance(event, Outcome) or not until_done:
            return event


async def _stream(
    engine: Engine, request: EngineRequest, events: asyncio.Queue, shape: _Shape, first: str | Outcome
) -> AsyncIterator[str]:
    finished, event = False, first
    try:
        if shape.chat:
            yield _event(shape.chunk(None, role=True))
        while True:
            if event is None:
                event = await events.get()
            if isinstance(event, str):
                yield _event(shape.chunk(event))
                event = None
                continue
            finished = True
            if event.finish_reason == "error":
                yield _event({"error": {"message": f"the model failed on this request ({event.error})",
                                        "type": "server_error", "param": None, "code": None}})  # fmt: skip
            else:
                yield _event(shape.chunk(None, finish=event.finish_reason))
                if shape.include_usage:
                    yield _event(shape.usage_chunk(event))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:  # the client went away (the response was cancelled): free the slot
            engine.cancel(request)


def _event(payload: dict[str, Any]) -> str:
    # ASCII JSON: a raw U+2028 or U+0085 in the text would end the line for clients that split lines as Python does
    return f"data: {json.dumps(payload)}\n\n"


class _Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, chat: bool, model: str, body: _Sampling, tokenizer):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def _base(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, *, role: bool = False, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return self._base("text_completion") | {"choices": [choice]}

    def usage_chunk(self, outcome: Outcome) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(kind) | {"choices": [], "usage": _usage(outcome)}

    def response(self, outcome: Outcome) -> dict[str, Any]:
        logprobs = None if outcome.logprobs is None else self._logprobs(outcome)
        if self.chat:
            message = {"role": "assistant", "content": outcome.text}
            choice = {"index": 0, "message": message, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
            return self._base("chat.completion") | {"choices": [choice], "usage": _usage(outcome)}
        choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": logprobs}
        return self._base("text_completion") | {"choices": [choice], "usage": _usage(outcome)}

    def _logprobs(self, outcome: Outcome) -> dict[str, Any]:
        """Each token's log-probability under the model, in OpenAI's chat or completions form."""
        decode = (lambda i: self.tokenizer.decode([i])) if self.tokenizer is not None else str
        tokens = [decode(i) for i in outcome.token_ids]
        if self.chat:
            content = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, outcome.logprobs)
            ]
            return {"content": content}
        offsets = [0]
        for t in tokens[:-1]:
            offsets.append(offsets[-1] + len(t))
        logprobs = list(outcome.logprobs)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def _usage(outcome: Outcome) -> dict[str, Any]:
    completion = len(outcome.token_ids)
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": outcome.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }
